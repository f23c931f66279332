"""The communicator interface shared by the backends (NCCL, MPI, torch.distributed): its lifecycle
(open, aborted, closed), the calls the engine makes (the staged exchange among them), and the
backends' hooks. Counts and offsets are host ints counting rows, never bytes. Terms:
docs/design.md, "Glossary of `comm/`"."""

import abc
import contextlib

from . import _transport
from ._agreement import Agreement


class Communicator(Agreement, abc.ABC):
    """Base of the communicators: the side channel, the vote, the staged exchange and the state.

    Args:
        side: the host side channel, built by ``mxcomm.comm.init``; owned (freed on :meth:`close`),
            its timeouts abort the communicator.
        validate: default of the per-call ``validate`` flag of explicit-splits calls.
        peer_memory: None (auto), True or False: see ``_transport.choose``.
        small_exchange_bytes, medium_exchange_bytes: None (the backend's ``SMALL_EXCHANGE_BYTES`` /
            ``MEDIUM_EXCHANGE_BYTES`` on one node, else 0) or an int >= 0, equal on every rank.

    Attributes:
        rank, size: this rank in ``[0, W)``, and W.
        timeout: seconds a collective or device wait may take before the communicator is aborted.
        transport: ``"pull"``, ``"hier"`` or ``"grouped"`` (how :meth:`exchange` moves rows).
        host_collectives: host collectives made so far; a layout-path exchange adds none.
        group: the torch.distributed group built over, or None (MPI).
        layout_experts: E of the last layout agreed (set by ``mxcomm.exchange_layout``), or None.
        small_exchange_bytes, medium_exchange_bytes: limits of the small and medium routes
            (``mxcomm.route``), in bytes of plain rows the largest sender sends; 0 never.
        validate, nodes, aborted, closed: as the argument and the properties."""

    #: The limits' defaults on one node (0 across nodes): 0 on the host backends, which exist to
    #: test the transports; the NCCL backend sets its own.
    SMALL_EXCHANGE_BYTES = MEDIUM_EXCHANGE_BYTES = 0

    def __init__(self, side, *, validate=True, peer_memory=None, small_exchange_bytes=None,
                 medium_exchange_bytes=None):
        if peer_memory not in (None, True, False):
            raise ValueError(f"peer_memory: expected None (auto), True or False, got "
                             f"{peer_memory!r}")
        self.small_exchange_bytes = small_exchange_bytes  # None until _choose_transport
        self.medium_exchange_bytes = medium_exchange_bytes
        self.layout_experts = None
        self._layouts = 0             # layouts agreed on it (next_layout_number)
        self._side = side
        side.on_timeout = self._mark_aborted_by_timeout
        self.rank = side.rank
        self.size = side.size
        self.timeout = side.timeout
        self.group = side.group
        self.validate = bool(validate)
        self._ballots = {}            # words per rank -> Ballot (agree)
        self._descriptions = {}       # (dtype, row shape) per array -> text for the vote
        self._state = "open"          # "open" | "aborted" | "closed"
        self._reason = ""             # why it was aborted
        self._pending_error = None    # raised by the next call (e.g. found by a watchdog)
        self._peer_memory = peer_memory
        self._transport = None        # of exchange(), chosen by _choose_transport
        self.transport = None         # its name

    @property
    def host_collectives(self):
        return self._side.collectives

    # ----------------------------------------------------------------------------- lifecycle
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
        what = "closed" if self._state == "closed" else f"aborted ({self._reason})"
        raise RuntimeError(f"{type(self).__name__} on rank {self.rank}: communicator {what}")

    def _device_failure(self):
        """A failure a device wait of the pull transport left, or None; no sync."""
        failure = getattr(getattr(self._transport, "memory", None), "failure", None)
        return failure(self._transport.kinds) if failure is not None else None

    def _mark_aborted(self, reason):
        if self._state == "open":
            self._state = "aborted"
            self._reason = reason

    def _mark_aborted_by_timeout(self, reason):
        self._mark_aborted(reason)
        self._abort_backend()

    def _fail(self, error, raised=False):
        """Abort from any thread; keep ``error`` for the next call unless ``raised``."""
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
        self._mark_aborted("abort() called")
        self._abort_backend()

    def close(self):
        """Release the communicator's resources; idempotent; later calls raise RuntimeError.

        Does not block, except on NCCL: it waits (bounded by ``timeout``) for the operations in
        flight and for NCCL's release, which waits until every CUDA graph that captured an exchange
        is destroyed (past the timeout, a RuntimeWarning). With peer memory (``"pull"``,
        ``"hier"``) close is collective: a node's ranks meet, bounded, before any frees what
        the others map; an aborted communicator's GPU peer memory is never freed."""
        if self._state == "closed":
            return
        clean = self._state == "open" and not self._side.abandoned
        if self._transport is not None:
            if clean:
                self._transport.close()
            else:
                self._transport.abandon()
        self._close_backend(clean)
        if clean:
            self._side.free()
        self._state = "closed"

    def _abort_backend(self):
        """Backend hook: abort device-side operations (default: nothing)."""

    def _close_backend(self, clean):
        """Backend hook: release backend resources; ``clean`` is False after an abort."""

    # ------------------------------------------------------------------------ staged exchange
    @property
    def nodes(self):
        """The node of each rank (W ints, numbered by their first rank), as ``init`` agreed."""
        return self._side.nodes.of_rank

    @property
    def node_count(self):
        """How many nodes the ranks span (1 on one node), as ``init`` agreed."""
        return self._side.nodes.count

    def exchange(self, rows, plan, *, out=None, in_place=False, landing=None, stream=None):
        """Move rows a producer writes where they travel from, to a consumer (module ``_staged``).

        Collective on the devices only: no host collective or barrier (but the rare growth of the
        staging). ``plan`` must be the same on every rank; a peer at another exchange, kind or
        plan is found where the transport can (kind words, call headers), else times out.

        Args:
            rows: the rows object (``_staged``): ``arrays``, ``kind``, ``produce``; ``consume`` and
                ``keep`` for ``in_place``.
            plan: a :class:`~mxcomm.comm.Plan`, every rank's counts.
            out: one array of ``plan.rows_received`` rows per entry of ``rows.arrays`` (None:
                allocated; with ``in_place``: None). Written.
            in_place: the consumer reads each sender's rows where they are (pull: over NVLink on a
                side stream) instead of a copy into ``out``.
            landing: None (received row r is row r of ``out``), or runs ``((received row, row of
                out, rows), ...)`` sorted by received row, covering each once; needs ``out``.
            stream: a raw handle (int), or as in :meth:`alltoallv`; ignored on the host.
        Returns:
            The tuple of ``out`` arrays (complete on ``stream``), or None with ``in_place``.
        Raises:
            ValueError: ``landing`` without ``out`` or with ``in_place``.
            TimeoutError: a peer did not arrive within ``timeout`` s (on a GPU found by this or a
                later call, or :meth:`wait`); the communicator is aborted.
            RuntimeError: a peer called a different exchange; the communicator is aborted or
                closed."""
        self.check_usable()
        if landing is not None and (in_place or out is None):
            raise ValueError("landing: needs out arrays and in_place=False")
        stream = stream if type(stream) is int else self.stream_ptr(stream)
        with self.on_stream(stream):  # allocations ordered on the caller's stream
            outs = self._transport.run(rows, plan, None if out is None else tuple(out), in_place,
                                       stream, landing)
        # no watchdog event: pull's device waits time out themselves, grouped's alltoallv records
        return None if in_place else outs

    def _new_arrays(self, arrays, rows):
        """One new array of ``rows`` rows per ``(row shape, dtype)`` of ``arrays``."""
        return tuple(self._empty((rows,) + shape, dtype) for shape, dtype in arrays)

    def _choose_transport(self):
        """Pick the transport of :meth:`exchange` (``_transport.choose``); collective."""
        self._transport = _transport.choose(self, self._peer_memory)
        self.transport = self._transport.name

    # ------------------------------------------------------------------------- backend hooks
    def alltoallv(self, send, send_counts, recv_counts, out=None, *, send_offsets=None,
                  recv_offsets=None, stream=None, validate=None):
        """Send ``send_counts[r]`` rows of ``send`` to each rank ``r``. Collective.

        Args:
            send: (M, ...) C-contiguous array of any dtype, or a tuple of such arrays with equal M
                moved together (e.g. MXFP8 data (M, D) uint8 and scales (M, D/32) uint8). Device
                arrays for NCCL, NumPy for the host backends. Read.
            send_counts, recv_counts: W non-negative host ints (rows) to / from each rank.
            out: (N, ...) arrays like ``send``, or None to allocate N = sum(recv_counts) rows
                (max(recv_offsets + recv_counts) with explicit offsets). Written.
            send_offsets, recv_offsets: W host ints: rows for rank ``r`` start at row
                ``send_offsets[r]`` of ``send``, rows from rank ``r`` land at row
                ``recv_offsets[r]`` of ``out`` (one exchange can be pipelined in row ranges);
                default the exclusive cumsums of the counts (then they must add up to the rows).
            stream: NCCL: None (CuPy's current stream), a stream object or a raw handle; else
                ignored.
            validate: check counts across ranks first (one small host allgather); None: the default.
        Returns:
            ``out`` (a tuple if ``send`` was a tuple).
        Raises:
            ValueError: counts of the wrong length, negative, beyond the arrays or not adding up to
                the rows; counts inconsistent across ranks (same message on every rank).
            TypeError: an array of the wrong kind, non-integer counts, ``out`` of another dtype.
            TimeoutError: not done within ``timeout`` s; the communicator is aborted.
            RuntimeError: the communicator is aborted or closed.
        NCCL enqueues and never syncs the host; the host backends block until done."""
        self.check_usable()
        sends, outs, single, sc, rc, so, ro = self._plan(
            send, send_counts, recv_counts, out, send_offsets, recv_offsets, validate)
        self._move_rows(sends, outs, sc, so, rc, ro, None)
        return outs[0] if single else outs

    @abc.abstractmethod
    def _move_rows(self, sends, outs, sc, so, rc, ro, stream_ptr):
        """Move checked rows: ``sc[r]`` rows from row ``so[r]`` of each of ``sends`` to rank r,
        ``rc[r]`` from rank r into each of ``outs`` at row ``ro[r]`` (NCCL: enqueued; host backends:
        done)."""

    @abc.abstractmethod
    def alltoall_counts(self, counts, *, stream=None):
        """Exchange equal chunks of a counts vector: chunk ``r`` goes to rank ``r``. Collective.

        Args:
            counts: (W·k,) integer array; entries ``[r·k, (r+1)·k)`` go to rank ``r``. Read.
            stream: as in :meth:`alltoallv`.
        Returns:
            (W·k,) array of the same dtype; entries ``[r·k, (r+1)·k)`` came from rank ``r``.
        Raises:
            ValueError: length not a multiple of W, or k differing across ranks (on every rank).
            TypeError: not a 1-D integer array.
            TimeoutError: not done within ``timeout`` s; the communicator is aborted."""

    @abc.abstractmethod
    def _as_array(self, x, name):
        """``x`` as an array this backend moves, or TypeError naming ``name`` and the rank."""

    @abc.abstractmethod
    def _empty(self, shape, dtype):
        """A new uninitialised array of this backend (ordered on the current stream)."""

    def stream_ptr(self, stream):
        """The raw handle of ``stream`` (NCCL: None for CuPy's current stream, a CuPy or torch
        stream, or an int); 0 on the host backends. Local, no sync."""
        return 0

    def on_stream(self, stream_ptr):
        """A context ordering the array module's allocations and fills on the raw stream
        ``stream_ptr``; a no-op on the host backends. Local, no sync."""
        return contextlib.nullcontext()

    def _peer_memory_here(self):
        """Backend hook: can this rank map its peers' memory (all ranks on this node)?"""
        return False

    def _new_peer_memory(self):
        """Backend hook: the pull transport's peer memory (collective)."""
        raise NotImplementedError

    def barrier(self):
        """Block until every rank has called ``barrier`` (host side channel; device work not waited
        for: call :meth:`wait` first).

        Raises:
            TimeoutError: not every rank arrived within ``timeout`` s; the communicator is aborted.
            RuntimeError: the communicator is aborted or closed."""
        self.check_usable()
        self._side.barrier()

    def wait(self, stream=None):
        """Wait for this communicator's work enqueued on ``stream`` (no-op on the host backends).

        Raises:
            TimeoutError: a peer did not arrive in an exchange (found since the last call).
            RuntimeError: the communicator is aborted or closed."""
        self.check_usable()

    def to_host(self, a, stream):
        """The 1-D device array ``a`` as NumPy once ``stream``'s work is done (the layout
        exchange's one host sync); TimeoutError as :meth:`wait`."""
        self.wait(stream)
        return a.get()

    def allgather(self, mine, what):
        """Every rank's ``mine`` ((n,) NumPy, same n and dtype everywhere) as a (W, n) array, row r
        from rank r. One host collective (counted); ``what`` names it in a timeout's message.

        Raises:
            TimeoutError: a rank did not join within ``timeout`` s; the communicator is aborted."""
        return self._side.allgather_array(mine, what)

    def alltoallv_plan(self, sends, outs, plan, stream_ptr):
        """:meth:`alltoallv` of rows whose counts every rank agreed (a :class:`~mxcomm.comm.Plan`):
        no argument check, no vote. The caller has checked the arrays (C-contiguous,
        ``plan.rows_sent`` and ``plan.rows_received`` rows, equal dtypes and row shapes).

        Args:
            sends, outs: tuples of arrays moved together.
            plan: this rank sends ``plan.send_counts`` rows from ``plan.send_offsets`` and receives
                ``plan.recv_counts`` at ``plan.recv_offsets``.
            stream_ptr: the raw stream handle (NCCL; ignored by the host backends).
        Raises:
            TimeoutError, RuntimeError: as :meth:`alltoallv`."""
        self.check_usable()
        self._move_rows(sends, outs, plan.send_counts, plan.send_offsets, plan.recv_counts,
                        plan.recv_offsets, stream_ptr)
