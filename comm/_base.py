"""The communicator interface shared by the NCCL and MPI backends, and :func:`init`.

Glossary: W ranks (``size``); counts and offsets are host ints counting rows (first-axis slices) of
the arrays moved, never bytes or elements.

Both backends keep a private duplicate (``Dup()``) of the caller's MPI communicator. It carries the
argument vote of every call (one small nonblocking allgather, see ``_validate``), barriers, and on
the MPI backend the data itself. Every MPI request is polled until ``timeout`` seconds have passed;
then the communicator is aborted and ``TimeoutError`` raised. A request abandoned that way is kept
alive (with its buffers) on the instance, since MPI cannot cancel a collective: the peer that was
late may still complete it and write into those buffers.
"""

import contextlib
import operator
import time

from . import _validate

_BACKENDS = ("auto", "nccl", "mpi")

# Polling of MPI requests: spin for this long (low latency for the small, frequent votes), then
# sleep between tests, doubling up to the longest sleep.
_SPIN_S = 2e-3
_MIN_SLEEP_S = 5e-5
_MAX_SLEEP_S = 5e-3


def init(backend="auto", mpi_comm=None, *, timeout=300.0, validate=True, peer_memory=None):
    """A communicator over the ranks of ``mpi_comm``.

    Collective: every rank of ``mpi_comm`` must call it, with the same ``backend``.

    Args:
        backend: ``"nccl"`` (:class:`NcclCommunicator`, device arrays), ``"mpi"``
            (:class:`MpiCommunicator`, host NumPy arrays), or ``"auto"``: NCCL when the kernels run on
            a real GPU (not Numba's simulator) and CuPy with NCCL imports on every rank, else MPI.
        mpi_comm: an mpi4py communicator; None for ``MPI.COMM_WORLD``. Duplicated, not consumed.
        timeout: seconds a collective may take before the communicator is aborted (> 0).
        validate: default of the per-call ``validate``: check counts across ranks before moving
            data (one small MPI allgather per call).
        peer_memory: transport of ``alltoallv_staged`` (the MXFP8 exchanges use it): None
            (auto) pulls rows from the peers' memory where every rank is on one node (CUDA IPC
            on GPUs, an MPI shared window on the host), else one ``alltoallv``; True requires
            the pull; False never pulls.
    Returns:
        A communicator: ``rank``, ``size``, ``timeout``, ``transport``, ``alltoallv``,
        ``alltoallv_staged``, ``alltoall_counts``, ``wait``, ``barrier``, ``abort``, ``close``;
        usable as a context manager.
    Raises:
        ValueError: an unknown ``backend``, a non-positive ``timeout`` or a bad ``peer_memory``.
        RuntimeError: ``backend="nccl"`` where CuPy's NCCL is unavailable; ``peer_memory=True``
            where some rank cannot map its peers' memory.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, _BACKENDS))}, "
                         f"got {backend!r}")
    if backend == "auto":
        from mpi4py import MPI
        parent = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        # Every rank must pick the same backend: NCCL only if it works everywhere.
        backend = "nccl" if parent.allreduce(_nccl_available(), op=MPI.LAND) else "mpi"
    if backend == "nccl":
        from ._nccl import NcclCommunicator
        return NcclCommunicator(mpi_comm, timeout=timeout, validate=validate,
                                peer_memory=peer_memory)
    from ._mpi import MpiCommunicator
    return MpiCommunicator(mpi_comm, timeout=timeout, validate=validate, peer_memory=peer_memory)


def _nccl_available():
    """True when kernels run on a GPU and ``cupy.cuda.nccl`` imports and reports a version."""
    from ..kernels import simulated  # the one place that decides GPU vs simulator
    if simulated():
        return False
    try:
        from cupy.cuda import nccl
        return bool(nccl.available) and nccl.get_version() > 0
    except Exception:  # no CuPy, no NCCL library, no driver: fall back to MPI
        return False


class Communicator:
    """Base of the communicators: MPI bootstrap, the argument vote, timeouts and state.

    Attributes:
        rank: this process's rank in ``[0, size)``.
        size: W, the number of ranks.
        timeout: seconds a collective may take before the communicator is aborted.
        validate: default of the per-call ``validate`` flag.
        transport: how :meth:`alltoallv_staged` moves rows: ``"pull"`` (from peer memory) or
            ``"grouped"`` (one ``alltoallv``); see ``_staged``.

    Subclasses implement ``alltoallv``, ``alltoall_counts`` and the hooks ``_as_array``,
    ``_empty``, ``_abort_backend`` and ``_peer_memory_here``; their constructors end with
    :meth:`_choose_transport`.
    """

    def __init__(self, mpi_comm=None, *, timeout=300.0, validate=True, peer_memory=None):
        from mpi4py import MPI
        if peer_memory not in (None, True, False):
            raise ValueError(f"peer_memory: expected None (auto), True or False, got "
                             f"{peer_memory!r}")
        timeout = float(timeout)
        if not timeout > 0:
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout}")
        parent = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self._MPI = MPI
        self._mpi = parent.Dup()
        self.rank = self._mpi.Get_rank()
        self.size = self._mpi.Get_size()
        self.timeout = timeout
        self.validate = bool(validate)
        self._ballot = _validate.Ballot(self.rank, self.size)
        self._ballot_request = self._persistent_vote(self._ballot)
        self._descriptions = {}       # (dtype, row shape) per array -> text for the vote
        self._state = "open"          # "open" | "aborted" | "closed"
        self._reason = ""             # why it was aborted
        self._pending_error = None    # raised by the next call (e.g. found by a watchdog)
        self._abandoned = []          # (requests, buffers) of timed-out MPI operations
        self._peer_memory = peer_memory
        self._transport = None        # of alltoallv_staged, chosen by _choose_transport

    # ----------------------------------------------------------------------------------- state
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
        """True once the communicator was aborted (by :meth:`abort` or a timeout)."""
        return self._state == "aborted"

    def _check_usable(self):
        """Raise what the next call must raise: a stored error once, then a state error."""
        error = self._pending_error
        if error is not None:
            self._pending_error = None
            raise error
        if self._state != "open":
            if self._state == "closed":
                raise RuntimeError(f"{type(self).__name__} on rank {self.rank}: communicator "
                                   f"closed")
            raise RuntimeError(f"{type(self).__name__} on rank {self.rank}: communicator aborted "
                               f"({self._reason})")

    def _mark_aborted(self, reason):
        if self._state == "open":
            self._state = "aborted"
            self._reason = reason

    def reject(self, error):
        """Vote this rank's local ``error`` into the argument check of the peers' ``alltoallv``.

        For layers above the communicator: a rank that finds its own arguments bad calls
        ``reject`` where its peers call ``alltoallv``, so they do not wait for it until the
        timeout; every rank then raises the same error, naming this rank. Nothing moves.

        Args:
            error: the local ``TypeError`` or ``ValueError``.
        Raises:
            TypeError, ValueError: always (``error``'s type; the same message on every rank).
            TimeoutError: a peer did not join within ``timeout`` s; the communicator is aborted.
        """
        self._check_usable()
        self._vote(_validate.OP_ALLTOALLV, error, None, None, "", True)
        raise type(error)(str(error))  # reached only if the vote found nothing to raise

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
        operations in flight. With the ``"pull"`` transport it frees memory the peers map; on the
        MPI backend that is an MPI window, whose release MPI makes collective: close every rank.
        """
        if self._state == "closed":
            return
        clean = self._state == "open" and not self._abandoned
        if self._transport is not None and clean:
            self._transport.close()
        self._close_backend(clean)
        if clean and self._ballot_request is not None:
            self._ballot_request.Free()  # inactive: every vote completed
        self._ballot_request = None
        if clean:
            # A communicator with abandoned requests is leaked on purpose: freeing it while a late
            # peer may still complete those requests would be erroneous.
            self._mpi.Free()
        self._state = "closed"

    def _persistent_vote(self, ballot):
        """A persistent allgather of ``ballot`` (MPI-4 ``MPI_Allgather_init``), or None if the
        MPI library has none (then each vote starts an ``Iallgather``). Collective: called by
        every rank from the constructor, in the same order as the other collectives."""
        try:
            return self._mpi.Allgather_init(ballot.mine, ballot.table)
        except (NotImplementedError, self._MPI.Exception):
            return None

    def _abort_backend(self):
        """Backend hook: abort device-side operations (default: nothing)."""

    def _close_backend(self, clean):
        """Backend hook: release backend resources; ``clean`` is False after an abort."""

    # ------------------------------------------------------------------------------ MPI waits
    def _wait_mpi(self, requests, what, keep=()):
        """Poll MPI ``requests`` until all complete or ``timeout`` s pass.

        Args:
            requests: a list of ``MPI.Request``.
            what: the operation, for the message.
            keep: buffers the requests use; kept alive with them if they are abandoned.
        Raises:
            TimeoutError: not complete in time; the communicator is aborted.
        """
        if len(requests) == 1:
            test = requests[0].Test
        else:
            def test(testall=self._MPI.Request.Testall):
                return testall(requests)
        if test():
            return
        start = time.monotonic()
        deadline = start + self.timeout
        sleep = _MIN_SLEEP_S
        while not test():
            now = time.monotonic()
            if now > deadline:
                self._abandoned.append((list(requests), keep))
                reason = f"{what} timed out after {self.timeout:g} s"
                self._mark_aborted(reason)
                self._abort_backend()
                raise TimeoutError(
                    f"{what}: did not finish within {self.timeout:g} s on rank {self.rank} of "
                    f"{self.size}; the communicator is aborted (a rank may have stopped calling "
                    f"it or called another collective)")
            if now - start > _SPIN_S:
                time.sleep(sleep)
                sleep = min(2 * sleep, _MAX_SLEEP_S)

    def _allgather_bytes(self, payload, what):
        """Every rank's ``payload`` (bytes of one length on all ranks), concatenated in rank
        order; bounded by the timeout."""
        import numpy
        mine = numpy.frombuffer(payload, dtype=numpy.uint8).copy()
        table = numpy.empty(self.size * mine.size, dtype=numpy.uint8)
        self._wait_mpi([self._mpi.Iallgather(mine, table)], what, keep=(mine, table))
        return table.tobytes()

    def _choose_transport(self):
        """Pick the transport of :meth:`alltoallv_staged`; collective (from the constructors).

        ``"pull"`` needs every rank on this node and the backend's peer memory
        (``_peer_memory_here``); ``peer_memory=None`` takes it where every rank can,
        ``True`` requires it (RuntimeError on every rank otherwise), ``False`` never uses it.
        """
        from . import _staged
        node = self._mpi.Split_type(self._MPI.COMM_TYPE_SHARED, key=self.rank)
        one_node = node.Get_size() == self.size
        node.Free()
        here = self._peer_memory is not False and one_node and self._peer_memory_here()
        votes = self._allgather_bytes(bytes([here]), "peer memory setup (vote)")
        everywhere = all(votes)
        if self._peer_memory and not everywhere:
            ranks = [r for r, v in enumerate(votes) if not v]
            raise RuntimeError(f"peer_memory=True: ranks {ranks} cannot map their peers' memory "
                               f"(all ranks must share one node, with peer access between GPUs)")
        if everywhere:
            self._transport = _staged.PullTransport(self, self._new_peer_memory())
        else:
            self._transport = _staged.GroupedTransport(self)

    @property
    def transport(self):
        """``"pull"`` or ``"grouped"``: how :meth:`alltoallv_staged` moves rows."""
        return self._transport.name

    def _peer_memory_here(self):
        """Backend hook: can this rank map its peers' memory? (all ranks are on this node)."""
        return False

    def _new_peer_memory(self):
        """Backend hook: the pull transport's staging memory (collective)."""
        raise NotImplementedError

    def alltoallv_staged(self, arrays, send_counts, recv_counts, fill, *, out=None, arrived=None,
                         direct=False, stream=None):
        """An all-to-all whose rows the caller writes in place and reads as they arrive.

        Collective. The caller's ``fill`` writes each peer's rows straight into memory the
        transport picked (no staging copy), and ``arrived`` is called for each sender's rows as
        soon as they can be read, so producing (e.g. quantizing) and consuming (e.g.
        dequantizing) overlap the transfer. The transport (:attr:`transport`) is ``"pull"`` where
        every rank can map its peers' memory (one node: CUDA IPC on GPUs, an MPI shared window
        on the host): receivers copy from the senders' memory with copy engines, or with
        ``direct`` read it in place; else ``"grouped"``: one :meth:`alltoallv` after all fills.
        Counts are always checked across ranks (the pull transport needs every rank's counts).

        Args:
            arrays: ``((row shape, dtype), ...)``: the arrays moved together, e.g.
                ``(((D,), uint8), ((D // 32,), uint8))`` for MXFP8 data and scales.
            send_counts: W non-negative host ints, rows sent to each rank (in the send order:
                rank 0's rows first).
            recv_counts: W non-negative host ints, rows received from each rank.
            fill: ``fill(peer, begin, end, slots)``: write rows ``[begin, end)`` of the send
                order (those for ``peer``) into ``slots``, one array per entry of ``arrays``,
                each ``(end - begin, *row shape)``; on the device, enqueue on ``stream``. Called
                for every rank, own rows last, once or (large exchanges on the pull transport)
                for consecutive pieces of its rows.
            out: arrays of ``sum(recv_counts)`` rows, one per entry of ``arrays``, or None to
                allocate them. Written. Must be None with ``direct``.
            arrived: optional ``arrived(peer, begin, end, rows, on)``: ``peer``'s rows, rows
                ``[begin, end)`` of the receive order, are readable in ``rows`` (one array per
                entry of ``arrays``) by work enqueued on the stream handle ``on``. Without
                ``direct``, ``rows`` are the slices of ``out`` and ``on`` is ``stream``. Once
                per sender, own rows first; not called for a sender of no rows.
            direct: True to skip ``out``: ``arrived`` reads each sender's rows where they are;
                they may only be read, by ``arrived`` or by the work it enqueues on ``on``
                (keep no reference past the call). On the pull transport ``rows`` are then
                the sender's mapped memory and ``on`` a side stream running beside ``stream``
                (a GPU consumer reads over NVLink while the caller's stream goes on filling);
                ``stream`` waits for it before the call returns. Requires ``arrived``; the
                same on every rank (checked with the counts).
            stream: as in :meth:`alltoallv`; fills and arrivals are ordered on it.
        Returns:
            the tuple of ``out`` arrays, complete on ``stream``; None with ``direct``.
        Raises:
            ValueError, TypeError: bad arrays or counts, here or on another rank (the same message
                on every rank, before ``fill`` is called); ``direct`` with ``out`` or without
                ``arrived``.
            TimeoutError: a peer did not join within ``timeout`` s; the communicator is aborted.
            RuntimeError: the communicator is aborted or closed.
        An exception raised by ``fill`` or ``arrived`` leaves the peers waiting until the timeout.
        """
        from . import _staged
        self._check_usable()
        stream_ptr = self._stream_ptr(stream)
        with self._on_stream(stream_ptr):  # allocations ordered on the caller's stream
            exchange = _staged.Exchange(self, arrays, send_counts, recv_counts, out, fill,
                                        arrived, stream_ptr, direct)
            self._transport.run(exchange)
        self._staged_done(stream_ptr)
        return exchange.outs

    def _stream_ptr(self, stream):
        """Backend hook: the raw stream handle of ``stream`` (0 on the host)."""
        return 0

    def _on_stream(self, stream_ptr):
        """Backend hook: a context in which allocations are ordered on ``stream_ptr``."""
        return contextlib.nullcontext()

    def _staged_done(self, stream_ptr):
        """Backend hook: a staged exchange was enqueued on ``stream_ptr``."""

    def barrier(self):
        """Block until every rank has called ``barrier`` (host-side, over MPI).

        It does not wait for device work enqueued by the NCCL backend: call :meth:`wait` first.

        Raises:
            TimeoutError: not every rank arrived within ``timeout`` s; the communicator is aborted.
            RuntimeError: the communicator is aborted or closed.
        """
        self._check_usable()
        self._wait_mpi([self._mpi.Ibarrier()], "barrier")

    def wait(self, stream=None):
        """Wait for this communicator's work enqueued on ``stream`` (no-op on MPI: it is done).

        Raises:
            RuntimeError: the communicator is aborted or closed.
        """
        self._check_usable()

    # ------------------------------------------------------------------------- argument checks
    def _vote(self, op, error, send_counts, recv_counts, description, validate, unit="rows"):
        """Agree across ranks that a call is valid; raise the same error everywhere if not.

        Args:
            op: an ``_validate.OP_*`` code.
            error: this rank's local exception, or None.
            send_counts, recv_counts: W ints (units) each, or None with ``error``.
            description: text naming this rank's rows (compared across ranks).
            validate: True to vote; False to raise ``error`` locally (if any) and skip the vote.
            unit: what the counts count, for messages.
        Raises:
            ValueError, TypeError: invalid here or on another rank (same message on every rank).
            TimeoutError: a rank did not join within ``timeout`` s.
        """
        if not validate:
            if error is not None:
                raise type(error)(f"{_validate.OP_NAMES[op]}: {error}")
            return
        ballot = self._ballot
        ballot.fill(op, error, send_counts, recv_counts, description)
        request = self._ballot_request
        if request is not None:
            request.Start()
        else:
            request = self._mpi.Iallgather(ballot.mine, ballot.table)
        # On a timeout the communicator is aborted (no later vote), the request abandoned with
        # its buffers.
        self._wait_mpi([request], _validate.OP_NAMES[op] + " (argument check)",
                       keep=(ballot.mine, ballot.table))
        if ballot.all_valid():
            return
        verdict = ballot.verdict(unit)
        if verdict is not None:
            raise verdict

    def _plan(self, send, send_counts, recv_counts, out, send_offsets, recv_offsets, validate):
        """Check an ``alltoallv`` call locally and across ranks; allocate ``out`` if None.

        Returns:
            ``(sends, outs, single, sc, rc, so, ro)``: tuples of backend arrays, whether ``send``
            was a single array, and counts and offsets in rows (W Python ints each).
        """
        rank, size = self.rank, self.size
        error = None
        sc = rc = so = ro = None
        sends = outs = ()
        single = not isinstance(send, (tuple, list))
        description = ""
        try:
            sends = (self._as_array(send, "send"),) if single else \
                tuple([self._as_array(a, "send") for a in send])
            if not sends:
                raise ValueError("send is an empty tuple; expected one or more arrays")
            rows = self._check_arrays(sends, "send")
            sc = _validate.as_counts(send_counts, "send_counts", rank, size)
            rc = _validate.as_counts(recv_counts, "recv_counts", rank, size)
            sc_default = send_offsets is None
            so = _validate.exclusive_cumsum(sc) if sc_default else \
                _validate.as_counts(send_offsets, "send_offsets", rank, size)
            ro = _validate.exclusive_cumsum(rc) if recv_offsets is None else \
                _validate.as_counts(recv_offsets, "recv_offsets", rank, size)
            _validate.check_region(sc, so, rows, "send", rank, not sc_default)
            if out is not None:
                outs = tuple(self._as_array(a, "out") for a in
                             ((out,) if not isinstance(out, (tuple, list)) else out))
                if len(outs) != len(sends):
                    raise ValueError(f"out on rank {rank} holds {len(outs)} arrays, send "
                                     f"{len(sends)}")
                out_rows = self._check_arrays(outs, "out")
                for i, (s, o) in enumerate(zip(sends, outs)):
                    at = "" if single else f"[{i}]"
                    if o.dtype != s.dtype:
                        raise TypeError(f"out{at} on rank {rank} has dtype {o.dtype}, send{at} "
                                        f"{s.dtype}")
                    if o.shape[1:] != s.shape[1:]:
                        raise ValueError(f"out{at} on rank {rank} has rows of shape "
                                         f"{o.shape[1:]}, send{at} {s.shape[1:]}")
                _validate.check_region(rc, ro, out_rows, "recv", rank, recv_offsets is not None)
            elif recv_offsets is not None:
                _validate.check_region(rc, ro, max(map(operator.add, ro, rc), default=0), "recv",
                                       rank, True)
        except (TypeError, ValueError) as exc:
            error = exc
        if validate is None:
            validate = self.validate
        if validate and error is None:
            key = tuple([(a.dtype, a.shape[1:]) for a in sends])
            description = self._descriptions.get(key)
            if description is None:
                if len(self._descriptions) > 64:
                    self._descriptions.clear()
                description = self._descriptions[key] = " + ".join(
                    f"{dtype.name} rows of shape {shape}" for dtype, shape in key)
        self._vote(_validate.OP_ALLTOALLV, error, sc, rc, description, validate)
        if not outs:
            nrows = max(map(operator.add, ro, rc), default=0) if recv_offsets is not None \
                else sum(rc)
            outs = tuple([self._empty((nrows,) + a.shape[1:], a.dtype) for a in sends])
        return sends, outs, single, sc, rc, so, ro

    def _check_arrays(self, arrays, name):
        """Check arrays moved together: at least 1-D, C-contiguous, equal rows; return the rows."""
        rows = None
        for i, a in enumerate(arrays):
            label = name if len(arrays) == 1 else f"{name}[{i}]"
            if a.ndim < 1:
                raise ValueError(f"{label} on rank {self.rank} is 0-d; expected rows along the "
                                 f"first axis")
            if not a.flags.c_contiguous:
                raise ValueError(f"{label} on rank {self.rank} must be C-contiguous")
            if rows is None:
                rows = a.shape[0]
            elif a.shape[0] != rows:
                raise ValueError(f"{label} on rank {self.rank} has {a.shape[0]} rows, "
                                 f"{name}[0] {rows}: arrays moved together need equal rows")
        return rows

    def _check_counts_array(self, counts):
        """Check an ``alltoall_counts`` input locally and across ranks.

        Returns:
            ``(counts, k)``: the backend array and its entries per rank.
        """
        error = None
        k = 0
        description = ""
        try:
            counts = self._as_array(counts, "counts")
            if counts.ndim != 1 or counts.dtype.kind not in "iu":
                raise TypeError(f"counts on rank {self.rank} must be a 1-D integer array, got "
                                f"{counts.ndim}-D {counts.dtype}")
            if counts.shape[0] % self.size:
                raise ValueError(f"counts on rank {self.rank} has {counts.shape[0]} entries, not "
                                 f"a multiple of the {self.size} ranks")
            k = counts.shape[0] // self.size
            description = f"{counts.dtype.name} counts"
        except (TypeError, ValueError) as exc:
            error = exc
        per_rank = None if error is not None else [k] * self.size
        self._vote(_validate.OP_ALLTOALL_COUNTS, error, per_rank, per_rank, description,
                   self.validate, unit="entries")
        return counts, k
