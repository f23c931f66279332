"""The lifecycle of a communicator: open, aborted (by a call, a timeout or a fault found on any
thread), closed; the error the next call raises.
"""

import contextlib


class Lifecycle:
    """The state of a communicator and its transitions; base of :class:`Communicator`.

    The subclass sets ``rank``, ``_side`` (the side channel), ``_transport`` (or None) and calls
    :meth:`_open` in its constructor; it supplies the backend hooks ``_abort_backend`` and
    ``_close_backend``.
    """

    def _open(self):
        self._state = "open"          # "open" | "aborted" | "closed"
        self._reason = ""             # why it was aborted
        self._pending_error = None    # raised by the next call (e.g. found by a watchdog)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return (f"{type(self).__name__}(rank={self.rank}, size={self.size}, "
                f"timeout={self.timeout}, state={self._state!r})")

    @property
    def aborted(self):
        """True once the communicator was aborted (by :meth:`abort`, a timeout or a fault)."""
        return self._state == "aborted"

    @property
    def closed(self):
        """True once :meth:`close` ran."""
        return self._state == "closed"

    def check_usable(self):
        """Raise what the next call must raise: a stored error once, then a state error."""
        if self._pending_error is None and self._state == "open":
            failure = self._device_failure()
            if failure is None:
                return
            self._fail(failure)
        error = self._pending_error
        if error is not None:
            self._pending_error = None
            raise error
        if self._state == "closed":
            raise RuntimeError(f"{type(self).__name__} on rank {self.rank}: communicator closed")
        raise RuntimeError(f"{type(self).__name__} on rank {self.rank}: communicator aborted "
                           f"({self._reason})")

    def _device_failure(self):
        """A failure a device-side wait left (pull transport on GPUs), or None; no sync."""
        memory = getattr(self._transport, "memory", None)
        failure = getattr(memory, "failure", None)
        return failure(self._transport.kinds) if failure is not None else None

    def _mark_aborted(self, reason):
        if self._state == "open":
            self._state = "aborted"
            self._reason = reason

    def _mark_aborted_by_timeout(self, reason):
        self._mark_aborted(reason)
        self._abort_backend()

    def _fail(self, error, raised=False):
        """Abort from any point (any thread); keep ``error`` for the next call to raise, unless
        the caller raises it itself (``raised``)."""
        with self._state_lock():
            if self._state != "open":
                return
            if not raised:
                self._pending_error = error
            self._mark_aborted(str(error))
        self._abort_backend()

    def _state_lock(self):
        """Backend hook: the lock guarding the state against a watchdog thread (default none)."""
        return contextlib.nullcontext()

    def abort(self):
        """Abort the communicator: later calls raise ``RuntimeError``. Local, never blocks.

        NCCL: ``ncclCommAbort`` ends the operations in flight. MPI: collectives cannot be
        cancelled; a pending one is abandoned (its buffers stay referenced by this object). To end
        the whole job, use ``MPI.COMM_WORLD.Abort()``.
        """
        if self._state == "open":
            self._mark_aborted("abort() called")
        self._abort_backend()

    def close(self):
        """Release the communicator's resources. Idempotent; after it, calls raise RuntimeError.

        Not blocking, except that the NCCL backend first waits (with the timeout) for its
        operations in flight, then for NCCL's release of the communicator (with the timeout
        too: NCCL holds it while a CUDA graph that captured one of its exchanges is alive, so
        destroy such graphs first; past the timeout a ``RuntimeWarning`` says so). With the
        ``"pull"`` transport it frees memory the peers map; on the MPI backend those are MPI
        windows, whose release MPI makes collective: close every rank.
        """
        if self._state == "closed":
            return
        clean = self._state == "open" and not self._side.abandoned
        if self._transport is not None and clean:
            self._transport.close()
        self._close_backend(clean)
        if clean:
            self._side.free()
        self._state = "closed"

    def _abort_backend(self):
        """Backend hook: abort device-side operations (default: nothing)."""

    def _close_backend(self, clean):
        """Backend hook: release backend resources; ``clean`` is False after an abort."""
