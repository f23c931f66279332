"""NCCL communicator: all-to-all of rows of CuPy device arrays with grouped send/recv.

One process per GPU. The GPU is picked from the node-local rank (found by the host side channel:
an MPI shared-memory split, or host names over a torch group), unless given; the NCCL unique id is
made on rank 0 and broadcast over the host side channel (MPI or torch.distributed), and
``alltoallv`` is one NCCL group of ``send``/``recv`` calls (NCCL has no alltoallv), one pair per
peer and array, zero-size ones skipped. Rows travel as raw bytes (``NCCL_UINT8``), so every dtype
works: bf16, fp8 bits, scales.

Nothing here blocks the host except :meth:`NcclCommunicator.wait`, which polls with the timeout.
A per-instance watchdog thread (``_watchdog``) polls a CUDA event recorded after each group or
exchange; if one is not done ``timeout`` seconds after it became the oldest outstanding, the
watchdog calls ``ncclCommAbort`` and stores a ``TimeoutError`` that the next call raises. It also
polls the failure word of the pull transport's device waits (``_ipc``), so a peer that never
signals is named. Events come from a small pool on the instance and go back to it when done, so
nothing grows with the number of calls.

This is the only module that imports ``cupy.cuda.nccl``.
"""

import contextlib
import math
import threading
import time
import warnings

import numpy

from mxcomm._driver import address, external_stream

from ._board import EXCHANGE
from ._communicator import Communicator
from ._header import HEADER_BYTES, CallHeaders
from ._validate import check_counts_array
from ._watchdog import _WATCH_POLL_S, Watchdog

_MEMCPY_DEVICE_TO_HOST = 2     # cudaMemcpyDeviceToHost
_NULL_CONTEXT = contextlib.nullcontext()


def _bounded(fn, seconds, name):
    """``fn()`` on a daemon helper thread named ``name``, waited for at most ``seconds``:
    ``(True, its result)``, or ``(False, None)`` if it has not returned by then (the thread stays
    blocked; a daemon does not keep the process alive). An exception ``fn`` raised in time is
    raised here, on the caller's thread. For NCCL calls that block until the peers take part."""
    outcome = []

    def run():
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 (raised on the caller's thread)
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        return False, None
    ok, value = outcome[0]
    if not ok:
        raise value
    return True, value


class NcclCommunicator(Watchdog, Communicator):
    """All-to-all of rows of CuPy device arrays over NCCL, one process per GPU.

    Args:
        side: the host side channel over the processes (one per GPU), built by
            ``mxcomm.comm.init`` from an mpi4py communicator or a torch.distributed group; it
            bootstraps NCCL and carries the argument checks (host ints).
        validate: default of the per-call ``validate`` flag (cross-rank count checks).
        device: the CUDA device of this process; None for ``local_rank % device_count``, where
            ``local_rank`` is the rank among the processes of this node (``init(group=...)``
            passes torch's current device, or LOCAL_RANK's).
        peer_memory: transport of :meth:`exchange`: None (auto) pulls over CUDA IPC
            where every rank is on this node and every pair of GPUs has peer access; True
            requires that; False uses one NCCL group.
        nccl_init: ``"eager"``: NCCL's communicator is built here; ``"lazy"``: by the first
            call that moves data over NCCL (:meth:`alltoallv`, :meth:`alltoall_counts`, bf16 and
            native exchanges, the grouped transport), on every rank, since those calls are
            collective. A job whose exchanges all take the pull transport then never builds it
            (no NCCL setup time or memory; and ranks may share a GPU, which NCCL refuses).
        small_exchange_bytes: see ``mxcomm.comm.init``; None: ``SMALL_EXCHANGE_BYTES`` where
            every rank is on this node, else 0. Small exchanges move over NCCL: ranks sharing a
            GPU need 0.
        medium_exchange_bytes: the same with ``MEDIUM_EXCHANGE_BYTES``; medium exchanges move
            over NCCL too.

    Attributes:
        device: the CUDA device ordinal used (made current by the constructor).
        local_rank: this process's rank among the processes of its node.

    Collective: every rank constructs it (blocking, bounded by ``timeout`` up to NCCL's own
    initialization).
    """

    #: Measured on H100s (bench/NOTES.md, 2026-11-26): at 4096 bf16 rows x 7168 per
    #: rank (42 MiB to the peers at 4 ranks, 28 at 2) the MXFP8 exchange took 0.202 ms on the
    #: device against the bf16 one's 0.172 at 4 ranks (0.167 / 0.133 at 2), and 3.6x its host
    #: time; at 8192 rows (84 / 56 MiB) it was the faster on the device, but in the synced
    #: pipeline at 2 ranks, 8192 rows, a 64 MiB limit (the dispatch moved unquantized) measured
    #: 0.97x / 0.96x over bf16 against 0.92x / 0.91x with 48 MiB (two alternations, one job).
    SMALL_EXCHANGE_BYTES = 64 << 20
    #: Measured on H100s (docs/design.md, "Medium exchanges travel quantized in one
    #: alltoallv"; bench/NOTES.md, 2026-11-27): up to 16384 bf16 rows x 7168 per rank
    #: at 2 ranks (117 MB to the peer), where the staged exchange's host time holds up the step:
    #: the synced pipeline +0.00 to +0.05 over staging; at 32768 rows it lost 0.02.
    MEDIUM_EXCHANGE_BYTES = 128 << 20
    _headers = None  # the call headers (``_header``)

    def __init__(self, side, *, validate=True, device=None, peer_memory=None,
                 nccl_init="eager", small_exchange_bytes=None, medium_exchange_bytes=None):
        super().__init__(side, validate=validate, peer_memory=peer_memory,
                         small_exchange_bytes=small_exchange_bytes,
                         medium_exchange_bytes=medium_exchange_bytes)
        import cupy
        from cupy.cuda import nccl
        self._cupy = cupy
        self._runtime = cupy.cuda.runtime
        self._nccl_mod = nccl
        self._uint8 = nccl.NCCL_UINT8
        self._current_stream = cupy.cuda.get_current_stream
        self._external = {}  # raw handle -> ExternalStream, reused
        self.local_rank, _ = self._side.node_info()
        if device is None:
            device = self.local_rank % self._runtime.getDeviceCount()
        self.device = int(device)
        cupy.cuda.Device(self.device).use()
        self._nccl = self._connect() if nccl_init == "eager" else None
        self._pinned, self._pinned_bytes = None, 0  # pinned host memory of to_host
        self._captured = False   # an NCCL exchange was captured into a CUDA graph (close says so)
        self._host_since = None  # when the host entered an NCCL group call still running
        self._host_call = 0      # ... and the number of its exchange call (the board's)
        # before any capture of an exchange into a CUDA graph can need it (device memory)
        self._headers = CallHeaders(self)
        self._start_watchdog()
        devices = self._side.allgather_bytes(self.device.to_bytes(4, "little"), "device ids")
        self._peer_devices = [int.from_bytes(devices[4 * r:4 * r + 4], "little")
                              for r in range(self.size) if r != self.rank]
        self._choose_transport()

    # --------------------------------------------------------------------------------- hooks
    def _as_array(self, x, name):
        cupy = self._cupy
        if isinstance(x, cupy.ndarray):
            return x
        if hasattr(x, "__cuda_array_interface__"):
            return cupy.asarray(x)
        if hasattr(x, "__dlpack__") and not hasattr(x, "__array_interface__"):
            try:
                return cupy.from_dlpack(x)
            except Exception:
                pass
        raise TypeError(f"{name} on rank {self.rank}: NcclCommunicator moves device arrays "
                        f"(CuPy, DLPack or __cuda_array_interface__), got {type(x).__name__}")

    def _empty(self, shape, dtype):
        return self._cupy.empty(shape, dtype=dtype)

    def _peer_memory_here(self):
        can = self._runtime.deviceCanAccessPeer
        return all(d == self.device or can(self.device, d) for d in self._peer_devices)

    def _new_peer_memory(self):
        from ._ipc import CudaPeerMemory
        return CudaPeerMemory(self)

    def _connect(self):
        """Build NCCL's communicator (collective): rank 0's unique id over the side channel,
        then ``ncclCommInitRank`` bounded by the timeout."""
        nccl = self._nccl_mod
        # The unique id is broadcast as CuPy returned it (its spelling differs between CuPy
        # versions: a tuple of ints, or of bytes under Cython 3), pickled, so it is rebuilt as is.
        unique_id = self._side.bcast_object(nccl.get_unique_id() if self.rank == 0 else None,
                                            "NCCL bootstrap (unique id)")
        return self._init_bounded(nccl, unique_id)

    def _connected(self, stream_ptr):
        """Make sure NCCL's communicator exists (``nccl_init="lazy"``: built here, by the first
        NCCL call, collectively), at the top of every call that may use it, before any rank
        can decide it has nothing to move.

        Raises:
            RuntimeError: the first NCCL call is being captured into a CUDA graph (the bootstrap
                cannot be captured: make one NCCL call before capturing).
            TimeoutError: a rank did not join the bootstrap within ``timeout`` s; the
                communicator is aborted.
        """
        if self._nccl is not None:
            return
        if self._runtime.streamIsCapturing(stream_ptr):
            raise RuntimeError(f"NcclCommunicator on rank {self.rank}: NCCL is initialized "
                               f"lazily (nccl_init='lazy') and its first use is inside a CUDA "
                               f"graph capture; make one NCCL exchange before capturing")
        try:
            comm = self._connect()
        except Exception as exc:
            self._fail(exc, raised=True)
            raise
        with self._lock:
            self._nccl = comm

    def nccl_comm(self, stream=None):
        """NCCL's own communicator (``cupy.cuda.nccl.NcclCommunicator``), for probes that time
        NCCL's calls themselves (``bench/probe_self.py``, ``bench/probe_host.py``); what is
        enqueued on it bypasses this communicator's checks and watchdog. Built first where
        ``nccl_init="lazy"`` has not yet (then collective: every rank calls it).

        Raises:
            RuntimeError, TimeoutError: as the bootstrap (a graph capture on ``stream``, a rank
                that did not join within ``timeout`` s).
        """
        self._connected(self.stream_ptr(stream))
        return self._nccl

    def _init_bounded(self, nccl, unique_id):
        """``ncclCommInitRank``, bounded by ``timeout``: it blocks until every rank has joined,
        so a peer that dies after the unique id went out would hang this rank forever. It runs
        on a helper thread (the communicator's device current there); past the timeout this
        raises and the helper thread stays blocked in NCCL (a daemon: it does not keep the
        process alive).

        Raises:
            TimeoutError: not every rank joined within ``timeout`` s.
        """
        def init():
            self._cupy.cuda.Device(self.device).use()
            return nccl.NcclCommunicator(self.size, unique_id, self.rank)

        done, comm = _bounded(init, self.timeout, f"mxcomm-nccl-init-{self.rank}")
        if not done:
            raise TimeoutError(f"NCCL bootstrap on rank {self.rank} of {self.size}: "
                               f"ncclCommInitRank did not complete within {self.timeout:g} s "
                               f"(a peer died or stopped after the unique id was shared)")
        return comm

    def stream_ptr(self, stream):
        return self._stream(stream)

    def on_stream(self, stream_ptr):
        if stream_ptr == self._current_stream().ptr:
            return _NULL_CONTEXT
        stream = self._external.get(stream_ptr)
        if stream is None:  # one wrapper per stream, reused (nothing built per call)
            if len(self._external) > 64:
                self._external.clear()
            stream = self._external[stream_ptr] = external_stream(stream_ptr)
        return stream

    def _stream(self, stream):
        """The raw handle of ``stream``: None for CuPy's current stream, ``.ptr``,
        ``.cuda_stream`` (torch), or an int."""
        if type(stream) is int:
            return stream
        if stream is None:
            return self._current_stream().ptr
        ptr = getattr(stream, "ptr", None)
        if ptr is None:
            ptr = getattr(stream, "cuda_stream", stream)
        return int(ptr)

    def _state_lock(self):
        return self._lock

    def _abort_backend(self):
        if self._nccl is None:  # lazy, never built
            return
        try:
            self._nccl.abort()  # ncclCommAbort; a no-op once aborted or destroyed
        except Exception:  # NCCL without abort support: nothing more we can do
            pass

    def _close_backend(self, clean):
        if clean:
            try:
                self.wait()
            except (TimeoutError, RuntimeError):
                clean = False
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=max(1.0, 10 * _WATCH_POLL_S))
        if self._nccl is not None:
            self._release_nccl(clean)
        with self._lock:
            events = self._free_events + ([e for e, *_ in self._in_flight] if clean else [])
            self._free_events = []
            self._in_flight.clear()
            self._mixed = False
        for event in events:
            self._runtime.eventDestroy(event)

    def _release_nccl(self, clean):
        """``ncclCommDestroy`` (``clean``) or ``ncclCommAbort``, bounded by ``timeout``: NCCL
        waits in both until every CUDA graph that captured one of this communicator's
        operations has been destroyed, so a graph still alive would hang ``close`` forever.
        Past the timeout the helper thread is left blocked (a daemon) and a ``RuntimeWarning``
        says why; the process can go on and exit. An error NCCL raises in time is raised here.
        """
        release = self._nccl.destroy if clean else self._abort_backend
        done, _ = _bounded(release, self.timeout, f"mxcomm-nccl-close-{self.rank}")
        if not done:
            why = ("a CUDA graph that captured an exchange of this communicator is still alive "
                   "(NCCL waits until every such graph is destroyed: destroy the graphs, e.g. "
                   "``del graph``, before closing)" if self._captured else
                   "NCCL operations are still in flight")
            warnings.warn(f"NcclCommunicator.close on rank {self.rank}: "
                          f"{'ncclCommDestroy' if clean else 'ncclCommAbort'} did not return "
                          f"within {self.timeout:g} s: {why}; its resources are left to the "
                          f"process's exit", RuntimeWarning, stacklevel=3)

    def to_host(self, a, stream):
        """:meth:`Communicator.to_host` as one copy into pinned memory, enqueued on ``stream``
        after the work that makes ``a``, then the bounded wait: no pageable copy and no second
        synchronization after the wait (a CuPy ``get`` cost ~60-80 us more per layout on an
        H100 host, bench/NOTES.md)."""
        if not a.flags.c_contiguous:
            return super().to_host(a, stream)
        nbytes = a.nbytes
        if self._pinned is None or self._pinned_bytes < nbytes:
            self._pinned_bytes = max(nbytes, 4096)
            self._pinned = self._cupy.cuda.alloc_pinned_memory(self._pinned_bytes)
        stream_ptr = self._stream(stream)
        self._runtime.memcpyAsync(self._pinned.ptr, a.data.ptr, nbytes,
                                  _MEMCPY_DEVICE_TO_HOST, stream_ptr)
        self.wait(stream_ptr)
        return numpy.frombuffer(self._pinned, a.dtype, a.size).copy()

    # ----------------------------------------------------------------------------- collectives
    def alltoallv(self, send, send_counts, recv_counts, out=None, *, send_offsets=None,
                  recv_offsets=None, stream=None, validate=None):
        """Send rows to every rank: ``send_counts[r]`` rows of ``send`` go to rank ``r``.

        Rows are first-axis slices. Rows for rank ``r`` start at row ``send_offsets[r]`` of
        ``send``; rows from rank ``r`` land at row ``recv_offsets[r]`` of ``out``. Collective,
        asynchronous: enqueued on ``stream`` as ONE NCCL group (all arrays of a tuple included);
        it never syncs the host. Offsets let a caller pipeline one exchange in chunks by calling
        it on slices (row ranges) of the same full arrays.

        Args:
            send: (M, ...) C-contiguous CuPy array (or DLPack / ``__cuda_array_interface__``
                exporter) of any dtype: bf16 (``ml_dtypes.bfloat16``), uint8 fp8 bits, int32...;
                or a tuple of such arrays with equal M moved together (e.g. MXFP8 data (M, D) and
                scales (M, D/32) uint8). Read.
            send_counts: W non-negative host ints, rows sent to each rank.
            recv_counts: W non-negative host ints, rows received from each rank.
            out: (N, ...) arrays like ``send`` (same dtypes, row shapes and tuple structure), or
                None to allocate N = sum(recv_counts) rows (max(recv_offsets + recv_counts)
                with explicit offsets). Written.
            send_offsets: W host ints, first row sent to each rank; default the exclusive
                cumulative sum of ``send_counts`` (then sum(send_counts) must equal M).
            recv_offsets: W host ints, first row of ``out`` received from each rank; default the
                exclusive cumulative sum of ``recv_counts`` (then sum(recv_counts) must equal N).
            stream: None for CuPy's current stream, a stream object (``.ptr``/``.cuda_stream``)
                or a raw handle. ``send`` must be ready on it; ``out`` is ready on it after.
            validate: check counts across ranks first (one small host allgather of ints);
                None for the communicator's default.
        Returns:
            ``out`` (an array, or a tuple if ``send`` was a tuple).
        Raises:
            ValueError: counts of the wrong length, negative, beyond the arrays or not adding up
                to the rows; counts inconsistent across ranks (same message on every rank).
            TypeError: a non-device array, non-integer counts, or ``out`` of another dtype.
            TimeoutError: the argument check did not finish in ``timeout`` s, or an earlier
                exchange did not (found by the watchdog); the communicator is aborted.
            RuntimeError: the communicator is aborted or closed.
        """
        self.check_usable()
        stream_ptr = self._stream(stream)
        self._connected(stream_ptr)
        with self.on_stream(stream_ptr):  # allocate out stream-ordered
            plan = self._plan(send, send_counts, recv_counts, out, send_offsets, recv_offsets,
                              validate)
        sends, outs, single, sc, rc, so, ro = plan
        self._move_rows(sends, outs, sc, so, rc, ro, stream_ptr)
        return outs[0] if single else outs

    def alltoallv_plan(self, sends, outs, plan, stream_ptr):
        """:meth:`Communicator.alltoallv_plan` with the call header (``_header``): each peer
        receives, in the same NCCL group and before the rows, this call's layout and call
        numbers and its rows' dtypes and row shapes, compared on the device after the group. A
        difference (a rank at another call, with a stale layout, or rows of another dtype or
        width, e.g. ``precision="native"`` of fp32 and bf16) fills the results with 0xFF
        bytes (NaN) on the stream and aborts the communicator (found by the watchdog within its
        poll, raised by the next call or :meth:`wait`); no host sync. A plan without a call
        number (the hier transport's moves between nodes) moves without a header.

        Raises:
            TimeoutError, RuntimeError: as :meth:`alltoallv`; RuntimeError naming the peer and
                both calls where an earlier exchange was mis-paired.
        """
        self.check_usable()
        self._move_rows(sends, outs, plan.send_counts, plan.send_offsets, plan.recv_counts,
                        plan.recv_offsets, stream_ptr,
                        plan if getattr(plan, "calls", None) is not None else None)

    def _device_failure(self):
        failure = super()._device_failure()
        if failure is None and self._headers is not None:
            failure = self._headers.failure()
        return failure

    def _stalled(self):
        """The mismatch the call headers received so far show, for a timeout's message (rows
        of another size stall NCCL before the check), or None; never raises."""
        try:
            return self._headers.stalled()
        except Exception:  # noqa: BLE001 (read on the way to raising the timeout)
            return None

    def _move_rows(self, sends, outs, sc, so, rc, ro, stream_ptr, plan=None):
        self._connected(stream_ptr)
        call = self._board.enter(EXCHANGE)  # checked: this rank has arrived
        blocks = []  # (send ptr, recv ptr, row bytes) per array
        for s, o in zip(sends, outs):
            row_bytes = s.dtype.itemsize * math.prod(s.shape[1:])
            if row_bytes:
                blocks.append((address(s), address(o), row_bytes))
        # Nothing to move (zero-byte rows, or no rows at all): no NCCL group and no event.
        if blocks and (any(sc) or any(rc)):
            header = None if plan is None else (self._headers, sends, outs, plan)
            self._group(blocks, sc, so, rc, ro, stream_ptr, call, header)

    def alltoall_counts(self, counts, *, stream=None):
        """Exchange equal-size chunks of a counts vector: chunk ``r`` goes to rank ``r``.

        Collective, asynchronous on ``stream`` (one NCCL group). The host reading the result
        must first call :meth:`wait` (a bounded wait) or otherwise synchronize ``stream``.

        Args:
            counts: (W·k,) integer device array (int32 or int64); entries ``[r·k, (r+1)·k)``
                go to rank ``r``. Read.
            stream: as in :meth:`alltoallv`.
        Returns:
            (W·k,) device array of the same dtype: entries ``[r·k, (r+1)·k)`` came from rank r.
        Raises:
            ValueError: a length not a multiple of W, or a different k across ranks (same
                message on every rank).
            TypeError: not a 1-D integer device array.
            TimeoutError: the check did not finish in ``timeout`` s, or an earlier exchange did
                not; the communicator is aborted.
        """
        self.check_usable()
        self._connected(self._stream(stream))
        counts, k = check_counts_array(self, counts)
        call = self._board.enter(EXCHANGE)
        counts = self._cupy.ascontiguousarray(counts)
        out = self._cupy.empty_like(counts)
        ones = [1] * self.size
        offsets = list(range(self.size))
        if k:
            chunk = k * counts.itemsize
            self._group([(counts.data.ptr, out.data.ptr, chunk)], ones, offsets, ones, offsets,
                        self._stream(stream), call)
        return out

    def _group(self, blocks, sc, so, rc, ro, stream_ptr, call, header=None):
        """Enqueue one NCCL group: for each peer and block, send and receive rows as bytes.

        Args:
            blocks: (send ptr, recv ptr, row bytes) per array.
            sc, so, rc, ro: W host ints each: rows and first rows to send / receive per peer.
            stream_ptr: raw CUDA stream handle.
            call: the number of the exchange call it belongs to (the arrival board's).
            header: None, or ``(CallHeaders, sends, outs, plan)``: each peer this rank moves
                rows with (either way) gets the call's header first, checked after the group.
        """
        send, recv = self._nccl.send, self._nccl.recv
        uint8 = self._uint8
        nccl = self._nccl_mod
        if header is not None:
            headers, sends, outs, plan = header
            sent, received, words = headers.begin(sends, plan, stream_ptr)
            nbytes = HEADER_BYTES
        # ncclGroupEnd may block the host (first connection to a peer): the watchdog watches it.
        self._host_call = call
        self._host_since = time.monotonic()
        try:
            nccl.groupStart()
            try:
                for peer in range(self.size):
                    n_send, n_recv = sc[peer], rc[peer]
                    if header is not None and peer != self.rank and (n_send or n_recv):
                        send(sent, nbytes, uint8, peer, stream_ptr)
                        recv(received + peer * nbytes, nbytes, uint8, peer, stream_ptr)
                    for send_ptr, recv_ptr, row in blocks:
                        if n_send:
                            send(send_ptr + so[peer] * row, n_send * row, uint8, peer,
                                 stream_ptr)
                        if n_recv:
                            recv(recv_ptr + ro[peer] * row, n_recv * row, uint8, peer,
                                 stream_ptr)
            finally:
                nccl.groupEnd()
        except Exception:
            self.check_usable()  # the watchdog's TimeoutError, if it aborted us meanwhile
            raise
        finally:
            self._host_since = None
        if header is not None:
            headers.check(received, words, outs, stream_ptr)
        self._record(stream_ptr, call)
