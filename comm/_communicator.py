"""The communicator interface shared by the backends (NCCL, MPI, torch.distributed): lifecycle,
checks, exchanges.

Glossary: W ranks (``size``); counts and offsets are host ints counting rows (first-axis slices) of
the arrays moved, never bytes or elements.

A communicator talks to its peers two ways: its backend moves data (NCCL on the devices, MPI or
torch.distributed on host arrays), and its host side channel (``_sidechannel``: over MPI, or over a
torch.distributed group, ``_torchside``) carries the bootstrap, the layout exchange and, for calls
with explicit splits, the *vote*: one small allgather in which every rank shows its local verdict
and counts, so that bad arguments anywhere raise the same error on every rank before any data moves
(``_validate``). Exchanges given a plan agreed earlier (a layout) skip the vote and make no host
collective at all.
"""

import abc
import contextlib
import operator

import numpy

from . import _validate
from ._board import EXCHANGE
from ._staged import Plan


class Communicator(abc.ABC):
    """Base of the communicators: the side channel, the vote, the staged exchange and the state.

    Args:
        side: the host side channel (``_sidechannel``), built by ``mxcomm.comm.init`` from an
            mpi4py communicator or a torch.distributed group; the communicator owns it (frees
            it on :meth:`close`) and binds its abort to the channel's timeouts.
        validate: default of the per-call ``validate`` flag of explicit-splits calls.
        peer_memory: None (auto), True or False: see :meth:`_choose_transport`.
        small_exchange_bytes: None (the backend's ``SMALL_EXCHANGE_BYTES`` where every rank is
            on one node, else 0) or a non-negative int, the same on every rank (checked in
            :meth:`_choose_transport`).
        medium_exchange_bytes: the same for ``medium_exchange_bytes`` (``MEDIUM_EXCHANGE_BYTES``).

    Attributes:
        rank: this process's rank in ``[0, size)``.
        size: W, the number of ranks.
        timeout: seconds a collective (or a device wait) may take before the communicator is
            aborted.
        validate: default of the per-call ``validate`` flag of explicit-splits calls.
        transport: how :meth:`exchange` moves rows: ``"pull"`` (from peer memory) or
            ``"grouped"`` (one :meth:`alltoallv`).
        host_collectives: host collectives made so far (bootstrap, layouts, votes, growth of the
            staging); a layout-path exchange adds none.
        group: the torch.distributed process group the communicator was built over, or None
            (built from MPI).
        small_exchange_bytes: a quantized exchange of plain rows in which no rank sends more
            than this many bytes of them to its peers moves them as they are and quantizes
            them on arrival, with the same results (docs/design.md, "Small exchanges travel
            unquantized"); 0 never does.
        medium_exchange_bytes: a quantized exchange of plain rows, not small, whose result stays
            quantized and in which no rank sends more than this many bytes of them to its peers
            quantizes them on the caller's stream and moves them in one :meth:`alltoallv` instead
            of staging them, with the same results (docs/design.md, "Medium exchanges travel
            quantized in one alltoallv"); 0 never does.
    """

    #: The default of ``small_exchange_bytes`` where every rank is on one node: 0 on the host
    #: backends, which exist to develop and test the transports; the NCCL backend sets what its
    #: GPUs measured over NVLink. Across nodes the default is 0: the links are slower, so the
    #: bytes a quantized exchange saves weigh more, and no limit was measured there.
    SMALL_EXCHANGE_BYTES = 0
    #: The default of ``medium_exchange_bytes`` where every rank is on one node (0 elsewhere), as
    #: ``SMALL_EXCHANGE_BYTES``.
    MEDIUM_EXCHANGE_BYTES = 0

    def __init__(self, side, *, validate=True, peer_memory=None, small_exchange_bytes=None,
                 medium_exchange_bytes=None):
        if peer_memory not in (None, True, False):
            raise ValueError(f"peer_memory: expected None (auto), True or False, got "
                             f"{peer_memory!r}")
        #: checked by ``init``; None until :meth:`_choose_transport` resolves the default
        self.small_exchange_bytes = small_exchange_bytes
        self.medium_exchange_bytes = medium_exchange_bytes
        #: E of the last layout agreed on this communicator (the same on every rank), or None:
        #: ``mxcomm.layout`` exchanges the next layout of that E in one round
        self._layout_experts = None
        #: layouts agreed on this communicator (``mxcomm.layout`` numbers its plans by it)
        self._layouts = 0
        self._side = side
        side.on_timeout = self._mark_aborted_by_timeout
        self.rank = side.rank
        self.size = side.size
        self.timeout = side.timeout
        self.group = side.group
        self.validate = bool(validate)
        self._ballot = _validate.Ballot(self.rank, self.size)
        self._descriptions = {}       # (dtype, row shape) per array -> text for the vote
        self._state = "open"          # "open" | "aborted" | "closed"
        self._reason = ""             # why it was aborted
        self._pending_error = None    # raised by the next call (e.g. found by a watchdog)
        self._peer_memory = peer_memory
        self._transport = None        # of exchange(), chosen by _choose_transport

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
        """True once the communicator was aborted (by :meth:`abort`, a timeout or a fault)."""
        return self._state == "aborted"

    @property
    def host_collectives(self):
        return self._side.collectives

    @property
    def transport(self):
        """``"pull"`` or ``"grouped"``: how :meth:`exchange` moves rows."""
        return self._transport.name

    def small_exchange(self, rows, row_bytes):
        """Whether a quantized exchange whose largest sender sends ``rows`` plain rows of
        ``row_bytes`` bytes each to its peers (``Plan.largest_peer_rows``: the same on every
        rank) moves them unquantized (``small_exchange_bytes``; docs/design.md, "Small exchanges
        travel unquantized"). Local; no collective."""
        return rows * row_bytes <= self.small_exchange_bytes

    def medium_exchange(self, rows, row_bytes):
        """Whether such an exchange, not small, whose result stays quantized, travels quantized
        in one :meth:`alltoallv` (``medium_exchange_bytes``; docs/design.md, "Medium exchanges
        travel quantized in one alltoallv"). Local; no collective."""
        return rows * row_bytes <= self.medium_exchange_bytes

    def _check_usable(self):
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

    # ------------------------------------------------------------------------- backend hooks
    @abc.abstractmethod
    def alltoallv(self, send, send_counts, recv_counts, out=None, *, send_offsets=None,
                  recv_offsets=None, stream=None, validate=None):
        """Send rows to every rank: ``send_counts[r]`` rows of ``send`` go to rank ``r``.

        Rows are first-axis slices. Rows for rank ``r`` start at row ``send_offsets[r]`` of
        ``send``; rows from rank ``r`` land at row ``recv_offsets[r]`` of ``out``. Collective.
        Offsets let a caller pipeline one exchange in chunks by calling it on row ranges of the
        same full arrays.

        Args:
            send: (M, ...) C-contiguous array of any dtype (bf16 as ``ml_dtypes.bfloat16``, uint8
                fp8 bits, int32, ...), or a tuple of such arrays with equal M moved together
                (e.g. MXFP8 data (M, D) and scales (M, D/32)). Device arrays for NCCL, NumPy for
                MPI. Read.
            send_counts, recv_counts: W non-negative host ints, rows sent to / received from
                each rank.
            out: (N, ...) arrays like ``send`` (same dtypes, row shapes and tuple structure), or
                None to allocate N = sum(recv_counts) rows (max(recv_offsets + recv_counts)
                with explicit offsets). Written.
            send_offsets, recv_offsets: W host ints, the first row sent to / received from each
                rank; default the exclusive cumulative sums of the counts (then the counts must
                add up to the rows).
            stream: the stream to enqueue on (NCCL: None for CuPy's current stream, a stream
                object or a raw handle; MPI: ignored).
            validate: check counts across ranks first (the vote: one small host allgather);
                None for the communicator's default.
        Returns:
            ``out`` (an array, or a tuple if ``send`` was a tuple).
        Raises:
            ValueError: counts of the wrong length, negative, beyond the arrays or not adding up
                to the rows; counts inconsistent across ranks (same message on every rank).
            TypeError: an array of the wrong kind, non-integer counts, ``out`` of another dtype.
            TimeoutError: not done within ``timeout`` s; the communicator is aborted.
            RuntimeError: the communicator is aborted or closed.
        NCCL enqueues and never syncs the host; the host backends block until it is done.
        """

    @abc.abstractmethod
    def _move_rows(self, sends, outs, sc, so, rc, ro, stream_ptr):
        """Move checked rows: ``sc[r]`` rows of each of ``sends`` from row ``so[r]`` to rank r,
        ``rc[r]`` rows from rank r into each of ``outs`` at row ``ro[r]`` (W host ints each);
        the data movement of :meth:`alltoallv` after its checks (NCCL: enqueued on
        ``stream_ptr``; the host backends: done on return)."""

    @abc.abstractmethod
    def alltoall_counts(self, counts, *, stream=None):
        """Exchange equal-size chunks of a counts vector: chunk ``r`` goes to rank ``r``.

        Args:
            counts: (W·k,) integer array; entries ``[r·k, (r+1)·k)`` go to rank ``r``. Read.
            stream: as in :meth:`alltoallv`.
        Returns:
            (W·k,) array of the same dtype: entries ``[r·k, (r+1)·k)`` came from rank ``r``.
        Raises:
            ValueError: a length not a multiple of W, or a different k across ranks (same
                message on every rank).
            TypeError: not a 1-D integer array.
            TimeoutError: not done within ``timeout`` s; the communicator is aborted.
        """

    @abc.abstractmethod
    def _as_array(self, x, name):
        """``x`` as an array this backend moves, or TypeError naming ``name`` and the rank."""

    @abc.abstractmethod
    def _empty(self, shape, dtype):
        """A new uninitialised array of this backend (ordered on the current stream)."""

    def _abort_backend(self):
        """Backend hook: abort device-side operations (default: nothing)."""

    def _close_backend(self, clean):
        """Backend hook: release backend resources; ``clean`` is False after an abort."""

    def _stream_ptr(self, stream):
        """Backend hook: the raw stream handle of ``stream`` (0 on the host)."""
        return 0

    def _on_stream(self, stream_ptr):
        """Backend hook: a context in which allocations are ordered on ``stream_ptr``."""
        return contextlib.nullcontext()

    def _peer_memory_here(self):
        """Backend hook: can this rank map its peers' memory? (all ranks are on this node)."""
        return False

    def _new_peer_memory(self):
        """Backend hook: the pull transport's peer memory (collective)."""
        raise NotImplementedError

    def barrier(self):
        """Block until every rank has called ``barrier`` (host-side, over the side channel).

        It does not wait for device work: call :meth:`wait` first for that.

        Raises:
            TimeoutError: not every rank arrived within ``timeout`` s; the communicator is aborted.
            RuntimeError: the communicator is aborted or closed.
        """
        self._check_usable()
        self._side.barrier()

    def wait(self, stream=None):
        """Wait for this communicator's work enqueued on ``stream`` (no-op on MPI: it is done).

        Raises:
            TimeoutError: a peer did not arrive in an exchange (found since the last call).
            RuntimeError: the communicator is aborted or closed.
        """
        self._check_usable()

    def _to_host(self, a, stream):
        """The values of the 1-D device array ``a`` as a new NumPy array, read once the work
        enqueued on ``stream`` so far is done (bounded, as :meth:`wait`): the layout exchange's
        one host read."""
        self.wait(stream)
        return a.get()

    # ---------------------------------------------------------------------- staged exchange
    def _choose_transport(self):
        """Pick the transport of :meth:`exchange`; collective (from the constructors).

        ``"pull"`` needs every rank on this node and the backend's peer memory (CUDA IPC on
        GPUs; on the host, MPI shared windows, so a torch side channel takes ``"grouped"``);
        ``peer_memory`` None takes it where every rank can, True requires it (RuntimeError on
        every rank otherwise), False never uses it. The same vote checks that every rank has
        the same ``small_exchange_bytes`` and ``medium_exchange_bytes`` (ValueError on every
        rank otherwise).
        """
        from ._grouped import GroupedTransport
        from ._pull import PullTransport
        _, one_node = self._side.node_info()
        if self.small_exchange_bytes is None:
            self.small_exchange_bytes = self.SMALL_EXCHANGE_BYTES if one_node else 0
        if self.medium_exchange_bytes is None:
            self.medium_exchange_bytes = self.MEDIUM_EXCHANGE_BYTES if one_node else 0
        here = self._peer_memory is not False and one_node and self._peer_memory_here()
        table = self._side.allgather_array(
            numpy.array([here, self.small_exchange_bytes, self.medium_exchange_bytes],
                        numpy.int64), "peer memory setup (vote)")
        votes = table[:, 0].tolist()
        for column, name in ((1, "small_exchange_bytes"), (2, "medium_exchange_bytes")):
            limits = table[:, column].tolist()
            if len(set(limits)) > 1:
                raise ValueError(f"{name} on rank {self.rank}: the ranks must agree, but they "
                                 f"gave {dict(enumerate(limits))} (rank: bytes)")
        if self._peer_memory and not all(votes):
            ranks = [r for r, v in enumerate(votes) if not v]
            raise RuntimeError(f"peer_memory=True: ranks {ranks} cannot map their peers' memory "
                               f"(all ranks must share one node, with peer access between GPUs; "
                               f"on the host, an MPI communicator)")
        if all(votes):
            self._transport = PullTransport(self, self._new_peer_memory())
        else:
            self._transport = GroupedTransport(self)

    def exchange(self, rows, plan, *, out=None, in_place=False, landing=None, stream=None):
        """Move rows a producer writes where they travel from, to a consumer (``_staged``).

        Collective, on the devices only: no host collective and no host barrier (the staging
        grows collectively in the rare call that needs more). The plan must be the same on
        every rank (a layout's, or one from :meth:`check`); a peer calling another exchange,
        another kind of rows or another plan is detected where the transport can (the pull
        transport compares a kind word) and ends in an error, else in a timeout.

        Args:
            rows: the producer/consumer (``_staged`` docstring): ``arrays``, ``kind``,
                ``produce``, and ``consume`` for ``in_place``.
            plan: a :class:`~mxcomm.comm._staged.Plan`, every rank's counts.
            out: arrays of ``plan.rows_received`` rows, one per entry of ``rows.arrays``, or
                None to allocate them. Written. Must be None with ``in_place``.
            in_place: the consumer reads each sender's rows where they are (pull: over NVLink on
                a side stream beside the producer) instead of them being copied into ``out``.
            landing: None (received row r is row r of ``out``), or ``((received row, row of
                out, rows), ...)``, runs of at least one row sorted by received row, covering
                every received row once:
                where each run of received rows lands in ``out`` (``out`` may have more rows,
                which stay as they are). Not with ``in_place``. The pull transport copies each
                run straight into place; the grouped one receives, then copies the runs.
            stream: the caller's stream (NCCL: as in :meth:`alltoallv`; MPI: ignored).
        Returns:
            The tuple of ``out`` arrays (complete on ``stream``), or None with ``in_place``.
        Raises:
            TimeoutError: a peer did not arrive within ``timeout`` s (on the GPU: found by this
                or a later call, or :meth:`wait`); the communicator is aborted.
            RuntimeError: a peer called a different exchange (as above); the communicator is
                aborted or closed.
        """
        self._check_usable()
        if landing is not None and (in_place or out is None):
            raise ValueError("landing: needs out arrays and in_place=False")
        stream_ptr = self._stream_ptr(stream)
        with self._on_stream(stream_ptr):  # allocations ordered on the caller's stream
            outs = self._transport.run(rows, plan, None if out is None else tuple(out), in_place,
                                       stream_ptr, landing)
        # No watchdog event here: the pull transport's device waits give up on their own after
        # ``timeout`` (the watchdog reads their status), and the grouped one's alltoallv
        # records its own.
        return None if in_place else outs

    def _new_arrays(self, arrays, rows):
        """One new array of ``rows`` rows per ``(row shape, dtype)`` of ``arrays``."""
        return tuple(self._empty((rows,) + shape, dtype) for shape, dtype in arrays)

    def alltoallv_plan(self, sends, outs, plan, stream_ptr):
        """:meth:`alltoallv` of rows whose counts every rank agreed: a
        :class:`~mxcomm.comm._staged.Plan` (a layout's, or a vote's), no argument check and no
        vote. The EP engine's bf16 exchanges and the grouped transport take it; the caller has
        checked the arrays (C-contiguous, ``plan.rows_sent`` and ``plan.rows_received`` rows,
        equal dtypes and row shapes).

        Args:
            sends, outs: tuples of arrays moved together (``alltoallv``'s ``send`` and ``out``).
            plan: every rank's counts; this rank sends ``plan.send_counts`` rows from
                ``plan.send_offsets`` and receives ``plan.recv_counts`` at ``plan.recv_offsets``.
            stream_ptr: the raw stream handle (NCCL; ignored by the host backends).
        Raises:
            TimeoutError, RuntimeError: as :meth:`alltoallv`.
        """
        self._check_usable()
        self._move_rows(sends, outs, plan.send_counts, plan.send_offsets, plan.recv_counts,
                        plan.recv_offsets, stream_ptr)

    # ------------------------------------------------------------------------- argument checks
    def check(self, send_counts, recv_counts, description, *, error=None, validate=None,
              what="alltoallv"):
        """The vote of an explicit-splits call: agree that it is valid, and on every rank's counts.

        Collective over the host side channel (one small allgather), unless validation is off.
        Every rank raises the same exception if any rank's call is invalid: a local ``error``,
        counts not matching the peers', or a ``description`` of the rows differing.

        Args:
            send_counts, recv_counts: W ints each (rows), or None with ``error``.
            description: text naming this rank's rows in the user's terms (precision, dtype, D);
                compared across ranks.
            error: this rank's local ``TypeError``/``ValueError``, or None.
            validate: False to skip the vote (then ``error`` is raised locally, and the plan is
                built from this rank's counts only: transports that need every rank's counts
                cannot use it). None: the communicator's default.
            what: the call, prefixed to messages.
        Returns:
            The :class:`~mxcomm.comm._staged.Plan` of every rank's counts (None without a vote).
        Raises:
            ValueError, TypeError: invalid here or on another rank (same message everywhere).
            TimeoutError: a rank did not join within ``timeout`` s; the communicator is aborted.
        """
        self._check_usable()
        if validate is None:
            validate = self.validate
        if not validate:
            if error is not None:
                raise error
            return None
        self._vote(_validate.OP_ALLTOALLV, error, send_counts, recv_counts, description,
                   what=what)
        return Plan(self.rank, self._ballot.sent_counts())

    def _vote(self, op, error, send_counts, recv_counts, description, unit="rows", what=None):
        """One vote (``check``): fill the ballot, allgather it, raise its verdict if any."""
        ballot = self._ballot
        ballot.fill(op, error, send_counts, recv_counts, description)
        self._side.allgather_into(ballot.mine, ballot.table,
                                  (what or _validate.OP_NAMES[op]) + " (argument check)")
        if ballot.all_valid():
            return
        verdict = ballot.verdict(unit, what)
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
        if validate:
            if error is None:
                key = tuple([(a.dtype, a.shape[1:]) for a in sends])
                description = self._descriptions.get(key)
                if description is None:
                    if len(self._descriptions) > 64:
                        self._descriptions.clear()
                    description = self._descriptions[key] = " + ".join(
                        f"{dtype.name} rows of shape {shape}" for dtype, shape in key)
            self._vote(_validate.OP_ALLTOALLV, error, sc, rc, description)
        elif error is not None:
            raise type(error)(f"alltoallv: {error}")
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

    def _host_alltoall_counts(self, counts, move, what="alltoall_counts"):
        """:meth:`alltoall_counts` of the host backends: check ``counts`` (locally and across
        ranks), then ``move(counts, out, nbytes)`` returns the pending requests that exchange
        ``nbytes`` per rank; waited for with the timeout."""
        import numpy
        self._check_usable()
        counts, k = self._check_counts_array(counts)
        counts = numpy.ascontiguousarray(counts)
        out = numpy.empty_like(counts)
        nbytes = k * counts.dtype.itemsize
        if nbytes:
            self._side.wait(move(counts, out, nbytes), what, keep=(counts, out))
        return out

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
        if self.validate:
            per_rank = None if error is not None else [k] * self.size
            self._vote(_validate.OP_ALLTOALL_COUNTS, error, per_rank, per_rank, description,
                       unit="entries")
        elif error is not None:
            raise error
        return counts, k


class HostCommunicator(Communicator):
    """A communicator whose rows are host arrays (NumPy): the MPI and torch.distributed (gloo)
    backends. Holds the array hooks they share."""

    def _as_array(self, x, name):
        if isinstance(x, numpy.ndarray):
            return x
        if hasattr(x, "__cuda_array_interface__") or not (
                hasattr(x, "__array__") or hasattr(x, "__array_interface__")):
            raise TypeError(f"{name} on rank {self.rank}: {type(self).__name__} moves host "
                            f"arrays (NumPy), got {type(x).__name__}")
        return numpy.asarray(x)

    def _empty(self, shape, dtype):
        return numpy.empty(shape, dtype=dtype)

    def alltoallv_plan(self, sends, outs, plan, stream_ptr):
        """:meth:`Communicator.alltoallv_plan`; a layout's plan (``plan.generation`` set) is
        first checked across ranks, since nothing else would stop an MPI or gloo alltoallv whose
        ranks disagree (MPI moves garbage, gloo aborts the process): one small allgather of the
        vote's ballot, travelling with the rows (not counted in ``host_collectives``), in which
        every rank shows the layout it uses, its call number with it (``plan.calls``), its rows'
        dtypes and row shapes, and its counts. Every rank raises the same error before any data
        moves where they differ.

        Raises:
            ValueError: the ranks use different layouts (a stale one), rows of other dtypes or
                row shapes (e.g. ``precision="native"`` of fp32 and bf16), or a rank is at
                another call of the layout (one failed a call alone, or skipped one after
                a failure); the message names the ranks and what each has.
            TimeoutError, RuntimeError: as :meth:`alltoallv`.
        """
        self._check_usable()
        if plan.generation is not None:
            plan.calls += 1
            key = (plan.generation, plan.calls, tuple([(a.dtype, a.shape[1:]) for a in sends]))
            description = f"layout {key[0]}, call {key[1]} of it, " + " + ".join(
                f"{dtype.name} rows of shape {shape}" for dtype, shape in key[2])
            ballot = self._ballot
            ballot.fill(_validate.OP_ALLTOALLV, None, plan.send_counts, plan.recv_counts,
                        description)
            self._side.allgather_into(ballot.mine, ballot.table, "alltoallv (layout check)",
                                      counted=False)
            if not ballot.all_valid():
                verdict = ballot.verdict("rows", "alltoallv of a layout")
                if verdict is not None:
                    raise verdict
        self._move_rows(sends, outs, plan.send_counts, plan.send_offsets, plan.recv_counts,
                        plan.recv_offsets, stream_ptr)

    def _enter_exchange(self):
        """Count this rank into the next exchange call on the arrival board; its number (0
        without a board)."""
        board = self._side.board
        return board.enter(EXCHANGE) if board is not None else 0

    def _wait_moved(self, requests, keep, call):
        """Wait (bounded) for the data movement of exchange call number ``call``; a timeout
        names, by the arrival board, this node's ranks that had not entered the call (a
        collective ``alltoallv`` cannot say which peer it waits for)."""
        try:
            self._side.wait(requests, "alltoallv", keep=keep)
        except TimeoutError as exc:
            board = self._side.board
            if board is None:
                raise
            raise TimeoutError(f"{exc}; {board.describe(EXCHANGE, call)}") from None
