"""A communicator's lifecycle: open, aborted (by a call, a timeout or a fault on any thread),
closed; and the error the next call raises."""

import contextlib


class Lifecycle:
    """The state of a communicator; base of :class:`Communicator`. The subclass sets ``rank``,
    ``_side``, ``_transport``, calls :meth:`_open`, and supplies ``_abort_backend`` and
    ``_close_backend``."""

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
        """True once aborted (by :meth:`abort`, a timeout or a fault)."""
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
        """A failure a device wait of the pull transport left, or None; no sync."""
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
        """Abort from any thread; keep ``error`` for the next call unless the caller raises it
        (``raised``)."""
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
        """Abort the communicator: later calls raise RuntimeError. Local, never blocks.

        NCCL: ``ncclCommAbort`` ends the operations in flight. MPI cannot cancel a collective: a
        pending one is abandoned (its buffers stay referenced); ``MPI.COMM_WORLD.Abort()`` ends the
        job."""
        if self._state == "open":
            self._mark_aborted("abort() called")
        self._abort_backend()

    def close(self):
        """Release the communicator's resources; idempotent; later calls raise RuntimeError.

        Does not block, except on NCCL: it waits (bounded by ``timeout``) for the operations in
        flight and for NCCL's release, which waits until every CUDA graph that captured an exchange
        is destroyed (past the timeout, a RuntimeWarning). With the ``"pull"`` transport on MPI,
        freeing the shared windows is collective: close on every rank."""
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
