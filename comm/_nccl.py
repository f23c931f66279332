"""NCCL communicator: all-to-all of rows of CuPy device arrays, one process per GPU; the only module
that imports ``cupy.cuda.nccl``. ``alltoallv`` is one NCCL group of send/recv pairs per peer and
array (zero-size ones skipped), rows as bytes (``NCCL_UINT8``). Only :meth:`NcclCommunicator.wait`
blocks the host; the watchdog (``_watchdog``) aborts NCCL on a timeout or fault."""

import math
import threading
import time
import warnings

import numpy

from mxcomm._array import as_device_array, on_stream
from mxcomm._driver import address

from ._board import EXCHANGE
from ._communicator import Communicator
from ._header import HEADER_BYTES, CallHeaders
from ._validate import check_counts_array
from ._watchdog import _WATCH_POLL_S, Watchdog, _bounded

_MEMCPY_DEVICE_TO_HOST = 2     # cudaMemcpyDeviceToHost


class NcclCommunicator(Watchdog, Communicator):
    """All-to-all of rows of CuPy device arrays over NCCL, one process per GPU.

    Args:
        side, options: as :class:`~mxcomm.comm.Communicator`; the side channel bootstraps NCCL;
            the pull runs over CUDA IPC (every pair of GPUs with peer access); ranks sharing a GPU
            need the exchange limits 0.
        device: the CUDA device; None for ``local_rank % device_count``.
        nccl_init: ``"eager"`` builds NCCL's communicator here; ``"lazy"`` in the first call that
            moves data over NCCL, on every rank (a job whose exchanges all pull never builds it,
            so ranks may share a GPU).

    Attributes:
        device: the CUDA device ordinal (made current by the constructor).
        local_rank: this process's rank among the processes of its node.

    Collective: every rank constructs it (bounded by ``timeout``, NCCL's own init included)."""

    #: Chosen on H100s over NVLink (docs/design.md, "Small exchanges travel unquantized").
    SMALL_EXCHANGE_BYTES = 64 << 20
    MEDIUM_EXCHANGE_BYTES = 128 << 20
    _headers = None  # the call headers (``_header``)
    _group_per_block = False

    def __init__(self, side, *, device=None, nccl_init="eager", **options):
        super().__init__(side, **options)
        import cupy
        from cupy.cuda import nccl
        self._cupy = cupy
        self._runtime = cupy.cuda.runtime
        self._nccl_mod = nccl
        self._uint8 = nccl.NCCL_UINT8
        self._current_stream = cupy.cuda.get_current_stream
        self.local_rank = self._side.local_rank()
        if device is None:
            device = self.local_rank % self._runtime.getDeviceCount()
        self.device = int(device)
        cupy.cuda.Device(self.device).use()
        self._nccl = self._connect() if nccl_init == "eager" else None
        self._pinned, self._pinned_bytes = None, 0  # pinned host memory of to_host
        self._captured = False   # an NCCL exchange was captured into a CUDA graph (close says so)
        self._host_since = None  # when the host entered an NCCL group call still running
        self._host_call = 0      # ... and the number of its exchange call (the board's)
        # device memory: before any CUDA graph capture of an exchange needs it
        self._headers = CallHeaders(self)
        self._start_watchdog()
        devices = self._side.allgather_bytes(self.device.to_bytes(4, "little"), "device ids")
        self._peer_devices = [int.from_bytes(devices[4 * r:4 * r + 4], "little")
                              for r in range(self.size) if r != self.rank]
        self._choose_transport()
        #: across nodes, each array of an exchange (and the call headers) in an NCCL group of its own
        self._group_per_block = self.node_count > 1

    def _as_array(self, x, name):
        return as_device_array(x, f"{name} on rank {self.rank}", device=True)

    def _empty(self, shape, dtype):
        return self._cupy.empty(shape, dtype=dtype)

    def _peer_memory_here(self):
        can = self._runtime.deviceCanAccessPeer
        return all(d == self.device or can(self.device, d) for d in self._peer_devices)

    def _new_peer_memory(self):
        from ._ipc import CudaPeerMemory
        return CudaPeerMemory(self)

    def _connect(self):
        """Build NCCL's communicator (collective): rank 0's unique id over the side channel, then
        ``ncclCommInitRank``."""
        nccl = self._nccl_mod
        # pickled as CuPy returned it: its type differs between CuPy versions
        unique_id = self._side.bcast_object(nccl.get_unique_id() if self.rank == 0 else None,
                                            "NCCL bootstrap (unique id)")
        return self._init_bounded(nccl, unique_id)

    def _connected(self, stream_ptr):
        """Build NCCL's communicator if ``nccl_init="lazy"`` has not yet: at the top of every call
        that may use it, before a rank can find it has nothing to move (so every rank joins)."""
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
        """NCCL's own communicator (``cupy.cuda.nccl.NcclCommunicator``), for probes that time NCCL
        itself, bypassing this communicator's checks and watchdog. Collective where
        ``nccl_init="lazy"`` has not built it yet.

        Raises:
            RuntimeError: inside a CUDA graph capture on ``stream`` (lazy init).
            TimeoutError: a rank did not join within ``timeout`` s."""
        self._connected(self.stream_ptr(stream))
        return self._nccl

    def _init_bounded(self, nccl, unique_id):
        """``ncclCommInitRank`` bounded by ``timeout`` (a peer dead after the unique id went out
        would hang it forever); TimeoutError."""
        def init():
            self._cupy.cuda.Device(self.device).use()
            return nccl.NcclCommunicator(self.size, unique_id, self.rank)

        done, comm = _bounded(init, self.timeout, f"mxcomm-nccl-init-{self.rank}")
        if not done:
            raise TimeoutError(f"NCCL bootstrap on rank {self.rank} of {self.size}: "
                               f"ncclCommInitRank did not complete within {self.timeout:g} s "
                               f"(a peer died or stopped after the unique id was shared)")
        return comm

    def on_stream(self, stream_ptr):
        return on_stream(stream_ptr)

    def stream_ptr(self, stream):
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
                self._drain()  # groups on other streams: ncclCommDestroy would wait, unbounded
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
        """``ncclCommDestroy`` (``clean``) or ``ncclCommAbort``, bounded by ``timeout`` (NCCL waits
        until every CUDA graph that captured this communicator's work is destroyed); past it a
        ``RuntimeWarning`` says why."""
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
        """:meth:`Communicator.to_host` as one copy into pinned memory enqueued on ``stream``, then
        the bounded wait. The pinned buffer is reused (grown) only on a usable communicator: after
        a failed wait its copy may still be queued, and CuPy's pinned pool is not stream-ordered."""
        self.check_usable()
        if not a.flags.c_contiguous:
            return super().to_host(a, stream)
        nbytes = a.nbytes
        if self._pinned is None or self._pinned_bytes < nbytes:
            self._pinned_bytes = max(nbytes, 4096)
            self._pinned = self._cupy.cuda.alloc_pinned_memory(self._pinned_bytes)
        stream_ptr = self.stream_ptr(stream)
        self._runtime.memcpyAsync(self._pinned.ptr, a.data.ptr, nbytes,
                                  _MEMCPY_DEVICE_TO_HOST, stream_ptr)
        self.wait(stream_ptr)
        return numpy.frombuffer(self._pinned, a.dtype, a.size).copy()

    def alltoallv(self, send, send_counts, recv_counts, out=None, *, send_offsets=None,
                  recv_offsets=None, stream=None, validate=None):
        """:meth:`Communicator.alltoallv` (same arguments, returns and errors), enqueued on
        ``stream`` as one NCCL group; never syncs the host. ``send``: device arrays (CuPy, DLPack or
        ``__cuda_array_interface__``) ready on ``stream``. TimeoutError also reports an earlier
        exchange the watchdog found unfinished."""
        self.check_usable()
        stream_ptr = self.stream_ptr(stream)
        self._connected(stream_ptr)
        with self.on_stream(stream_ptr):  # allocate out stream-ordered
            plan = self._plan(send, send_counts, recv_counts, out, send_offsets, recv_offsets,
                              validate)
        sends, outs, single, sc, rc, so, ro = plan
        self._move_rows(sends, outs, sc, so, rc, ro, stream_ptr)
        return outs[0] if single else outs

    def alltoallv_plan(self, sends, outs, plan, stream_ptr):
        """:meth:`Communicator.alltoallv_plan` with the call header (``_header``), compared on the
        device: a mis-paired call fills the results with 0xFF (NaN) and aborts the communicator
        (raised by the next call or :meth:`wait`); no host sync. A plan without a call number
        (hier's moves between nodes) moves without a header.

        Raises:
            TimeoutError, RuntimeError: as :meth:`alltoallv`; RuntimeError naming the peer and both
                calls where an earlier exchange was mis-paired."""
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
        """The mismatch the call headers received so far show, for a timeout's message, or None."""
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
        """:meth:`Communicator.alltoall_counts` as one NCCL group on ``stream``: read the result on
        the host only after :meth:`wait`. TimeoutError also reports an earlier unfinished
        exchange."""
        self.check_usable()
        stream_ptr = self.stream_ptr(stream)
        self._connected(stream_ptr)
        counts, k = check_counts_array(self, counts)
        call = self._board.enter(EXCHANGE)
        # the copy and the result from ``stream``'s pool, ordered with the group (as alltoallv):
        # a block of the current stream's pool may still be in use there when NCCL writes it
        with self.on_stream(stream_ptr):
            counts = self._cupy.ascontiguousarray(counts)
            out = self._cupy.empty_like(counts)
        ones = [1] * self.size
        offsets = list(range(self.size))
        if k:
            chunk = k * counts.itemsize
            self._group([(counts.data.ptr, out.data.ptr, chunk)], ones, offsets, ones, offsets,
                        stream_ptr, call)
        return out

    def _group(self, blocks, sc, so, rc, ro, stream_ptr, call, header=None):
        """Enqueue the NCCL group(s) moving the rows of each of ``blocks`` ((send ptr, recv ptr,
        row bytes)) as bytes; ``call``: the arrival board's number; ``header``: None or
        ``(CallHeaders, sends, outs, plan)``, sent to each peer moved with, before the rows.

        On one node, one group; across nodes, one group per block, the headers' first: over
        NCCL's network transport a second send to a peer in one group cost ~20 % of the bandwidth
        (docs/design.md, "One send per peer across nodes")."""
        send, recv = self._nccl.send, self._nccl.recv
        uint8 = self._uint8
        nccl = self._nccl_mod
        if header is not None:
            headers, sends, outs, plan = header
            sent, received, words = headers.begin(sends, plan, stream_ptr)
            nbytes = HEADER_BYTES
        if self._group_per_block:  # parts: (the header goes in it, its blocks)
            parts = ((True, ()),) if header is not None else ()
            parts += tuple((False, (block,)) for block in blocks)
        else:
            parts = ((header is not None, blocks),)
        # ncclGroupEnd may block the host (first connection to a peer): the watchdog watches it.
        self._host_call = call
        self._host_since = time.monotonic()
        try:
            for with_header, part in parts:
                nccl.groupStart()
                try:
                    for peer in range(self.size):
                        n_send, n_recv = sc[peer], rc[peer]
                        if with_header and peer != self.rank and (n_send or n_recv):
                            send(sent, nbytes, uint8, peer, stream_ptr)
                            recv(received + peer * nbytes, nbytes, uint8, peer, stream_ptr)
                        for send_ptr, recv_ptr, row in part:
                            if n_send:
                                send(send_ptr + so[peer] * row, n_send * row, uint8, peer,
                                     stream_ptr)
                            if n_recv:
                                recv(recv_ptr + ro[peer] * row, n_recv * row, uint8, peer,
                                     stream_ptr)
                finally:
                    nccl.groupEnd()
        except BaseException as exc:
            if isinstance(exc, Exception):  # an interrupt stays what it is
                self.check_usable()  # the watchdog's TimeoutError, if it aborted us meanwhile
            # A call that raised between groupStart and groupEnd (an NCCL error, an interrupt)
            # left groupEnd to launch the calls made so far: a part of the exchange that its
            # peers' next calls would pair with. Abort: NCCL ends it, later calls here raise.
            self._fail(RuntimeError(f"an NCCL group on rank {self.rank} failed or was cut short "
                                    f"({type(exc).__name__}: {exc})"), raised=True)
            raise
        finally:
            self._host_since = None
        if header is not None:
            headers.check(received, words, outs, stream_ptr)
        self._record(stream_ptr, call)
