"""Peer memory of the pull transport on GPUs: CUDA IPC among one node's processes, the only module
calling CUDA's IPC functions (docs/design.md, "Signals on the device"). Each rank ``cudaMalloc``s
a staging and a flags buffer (outside CuPy's pool: a handle names exactly that allocation) and
maps its peers'; ``_signal.cu``'s kernels write and await "ready" and "done" words, the generation
read from a device counter (so a captured CUDA graph replays). A wait past the timeout records
what it missed in pinned host memory and lets its stream go on (:meth:`CudaPeerMemory.failure`)."""

import pathlib
import warnings

import numpy

from mxcomm._driver import PackedLaunch, Words, address

from ._staged import MAX_BATCH, MAX_PIECES, describe_mismatch
from ._watchdog import _bounded

_EVENT_DISABLE_TIMING = 0x2   # cudaEventDisableTiming
_MEMCPY_DEFAULT = 4           # cudaMemcpyDefault (unified addressing picks the direction)
_HOST_ALLOC_MAPPED = 0x2      # cudaHostAllocMapped
_HANDLE_BYTES = 64            # cudaIpcMemHandle_t
_GROWTH = 1.25                # a grown buffer holds this much more than asked, to grow rarely
#: Exported buffers are whole multiples of this: small cudaMallocs can share one allocation, whose
#: handle a peer opens only once (else cudaErrorAlreadyMapped)
_IPC_GRANULE = 2 << 20


def _exported_bytes(nbytes):
    """``nbytes`` rounded up to whole :data:`_IPC_GRANULE` s (at least one)."""
    return max(1, -(-nbytes // _IPC_GRANULE)) * _IPC_GRANULE


_SOURCE = pathlib.Path(__file__).with_name("_signal.cu")
#: Buffers of closes whose meeting timed out: a peer may still map them, so they are never freed.
_KEPT = []
#: What a rank meets its node's ranks for (one byte each): growth and release must not pair.
_GROW, _RELEASE = 1, 2


def _batch(values):
    """``values`` padded with zeros to ``MAX_BATCH`` (a ``PeerWords`` field of _signal.cu)."""
    return values + [0] * (MAX_BATCH - len(values))


class CudaPeerMemory:
    """Staging buffers and flags of all ranks of one node, each mapped into every process.

    ``comm``: the NCCL communicator (device current, side channel for the handles, timeout for every
    wait); ``generation``: the first exchange's minus one (tests start near 2^32). A rank's flags,
    64-bit words: ``ready[W * MAX_PIECES]`` (sender j, piece k at ``j * MAX_PIECES + k``),
    ``done[W]``, then the local 32-bit generation counter."""

    def __init__(self, comm, generation=0):
        import cupy
        self._cupy = cupy
        self._rt = rt = cupy.cuda.runtime
        self._comm = comm
        self._rank, self._size = rank, size = comm.rank, comm.size
        self._world_rank = getattr(comm, "world_rank", rank)  # hier: comm is one node's view
        self._ready_words = size * MAX_PIECES
        words = self._ready_words + size + 1
        self._flags = cupy.cuda.memory.Memory(_exported_bytes(8 * words))
        init = numpy.full(words, numpy.uint64((generation & 0xFFFFFFFF) << 32))
        init[-1] = generation & 0xFFFFFFFF
        rt.memcpy(self._flags.ptr, init.ctypes.data, init.nbytes, 1)  # host to device
        self._gen_ptr = self._flags.ptr + 8 * (words - 1)
        status = cupy.cuda.PinnedMemoryPointer(cupy.cuda.PinnedMemory(16, _HOST_ALLOC_MAPPED), 0)
        self._status_memory = status
        self._status = numpy.frombuffer(status, dtype=numpy.uint32, count=4)
        self._status[:] = 0
        self._status_ptr = status.ptr
        module = cupy.RawModule(code=_SOURCE.read_text(), options=("-std=c++14",))
        # launched through the driver on a raw stream, parameters packed (_signal.cu's signatures)
        self._begin_k = PackedLaunch(module.get_function("mx_begin").kernel, "QQiiQQ")
        self._end_k = PackedLaunch(module.get_function("mx_end").kernel, "QQiQ4Q4Qi")
        # PeerWords by value: MAX_BATCH addresses, kinds and peers
        words = f"{MAX_BATCH}Q{MAX_BATCH}I{MAX_BATCH}I"
        self._signal_k = PackedLaunch(module.get_function("mx_signal").kernel, f"Q{words}i")
        self._wait_k = PackedLaunch(module.get_function("mx_wait").kernel, f"Q{words}iQQ")
        self._threads = max(32, -(-size // 32) * 32)
        self._timeout_ns = int(comm.timeout * 1e9)
        self._side = cupy.cuda.Stream(non_blocking=True)
        self._side_ptr = self._side.ptr
        self._done_base = self._flags.ptr + 8 * self._ready_words
        self._forked = rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING)
        self._joined = rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING)
        self._memory = None
        self._capacity = 0
        self._peer_ptr = {}
        #: Counts the staging allocations: views of the staging are valid while it stays.
        self.epoch = 0
        # Last, once nothing local can fail: the flags' handle goes out and the peers map it. A
        # failure from here on keeps the flags, never freed (a peer may map them already).
        self._peer_flags = {}
        try:
            table = comm._side.allgather_bytes(rt.ipcGetMemHandle(self._flags.ptr),
                                               "peer memory setup (flag handles)")
            for peer in range(size):
                if peer != rank:
                    handle = table[peer * _HANDLE_BYTES:(peer + 1) * _HANDLE_BYTES]
                    self._peer_flags[peer] = rt.ipcOpenMemHandle(handle)
            # "done" words of this rank in every peer's flags, for the one-launch done signal.
            done_at = [self._peer_flags[p] + 8 * (self._ready_words + rank) for p in range(size)
                       if p != rank]
            self._done_addresses = cupy.asarray(numpy.array(done_at, dtype=numpy.uint64))
        except BaseException:
            _KEPT.append((self._flags,))  # first: unmapping may raise too
            self._flags = None
            self._close_peers(self._peer_flags)
            raise

    @property
    def capacity(self):
        """Bytes of this rank's staging buffer."""
        return self._capacity

    # ------------------------------------------------------------------------------- staging
    def reserve(self, nbytes, stream):
        """Make every rank's buffer hold ``nbytes`` (equal on every rank). Growing is collective: it
        waits (bounded) for this rank's streams, meets the peers (no exchange reads an old buffer),
        then every rank allocates anew and maps the peers'."""
        if nbytes <= self._capacity:
            return
        comm = self._comm
        if self._memory is not None:
            comm.wait(self._side)
            comm.wait(stream)
            self._close_peers(self._peer_ptr)
            self._meet(_GROW, "peer memory growth")  # no rank maps the old buffers any more
            self._memory = None
            self._capacity = 0
        capacity = _exported_bytes(int(nbytes * _GROWTH))
        self.epoch += 1
        self._memory = self._cupy.cuda.memory.Memory(capacity)
        handle = self._rt.ipcGetMemHandle(self._memory.ptr)
        table = comm._side.allgather_bytes(handle, "peer memory setup (buffer handles)")
        for peer in range(comm.size):
            if peer != comm.rank:
                h = table[peer * _HANDLE_BYTES:(peer + 1) * _HANDLE_BYTES]
                self._peer_ptr[peer] = self._rt.ipcOpenMemHandle(h)
        self._capacity = capacity

    def local(self, offset, shape, dtype):
        """This rank's buffer as ``shape`` (1-D or 2-D) of ``dtype`` from byte ``offset``: a
        :class:`~mxcomm._driver.Words`, valid until the buffer grows."""
        return Words(self._memory.ptr + offset, shape, numpy.dtype(dtype))

    def peer_view(self, peer, offset, shape, dtype):
        """``peer``'s mapped buffer as :meth:`local` views this rank's."""
        return Words(self._peer_ptr[peer] + offset, shape, numpy.dtype(dtype))

    def copy_all(self, copies, outs, side):
        """On ``side``, one ``cudaMemcpyAsync`` per ``(peer, offset, array index, out_offset,
        nbytes)`` of ``copies``: from ``peer``'s buffer into the C-contiguous ``outs[array
        index]``."""
        memcpy, peer_ptr = self._rt.memcpyAsync, self._peer_ptr
        bases = [address(o) for o in outs]
        for peer, offset, index, out_offset, nbytes in copies:
            memcpy(bases[index] + out_offset, peer_ptr[peer] + offset, nbytes, _MEMCPY_DEFAULT,
                   side)

    # --------------------------------------------------------------------------------- flags
    def begin(self, stream):
        """Open the next generation on ``stream``: wait on the device until every peer is done
        reading this rank's staging; order the side stream after it."""
        self._begin_k(1, self._threads, stream,
                      (self._gen_ptr, self._done_base, self._size, self._rank, self._timeout_ns,
                       self._status_ptr))
        self._rt.eventRecord(self._forked, stream)
        self._rt.streamWaitEvent(self._side_ptr, self._forked, 0)

    def signal_ready(self, signals, tag, stream):
        """In one launch on ``stream``, signal each ``(peer, piece, kind)`` of ``signals`` (at most
        ``MAX_BATCH``; the call's ``tag`` OR-ed into each kind) that its rows of ``piece`` are in
        this rank's staging."""
        me = self._rank * MAX_PIECES
        self._signal_k(1, 32, stream, (
            self._gen_ptr, *_batch([self._peer_flags[p] + 8 * (me + k) for p, k, _ in signals]),
            *_batch([kind | tag for _, _, kind in signals]), *_batch([0] * len(signals)),
            len(signals)))

    def await_ready(self, awaits, tag):
        """In one launch, order the side stream after each ``(peer, piece, kind)`` of ``awaits`` (at
        most ``MAX_BATCH``, each kind checked, the call's ``tag`` OR-ed in); returns the side
        stream's handle."""
        base = self._flags.ptr
        self._wait_k(1, 32, self._side_ptr, (
            self._gen_ptr, *_batch([base + 8 * (p * MAX_PIECES + k) for p, k, _ in awaits]),
            *_batch([kind | tag for _, _, kind in awaits]), *_batch([p for p, _, _ in awaits]),
            len(awaits), self._timeout_ns, self._status_ptr))
        return self._side_ptr

    def end(self, stream, outs=()):
        """On the side stream, signal every peer "done"; order ``stream`` after it. Where a wait
        failed (a peer late, or at another call or kind), the same launch fills ``outs`` (up to 4
        arrays) with 0xFF bytes, as they hold another call's rows."""
        if self._size > 1:
            outs = outs[:4]
            pad = [0] * (4 - len(outs))
            self._end_k(16 if outs else 1, max(128, self._threads), self._side_ptr, (
                self._gen_ptr, self._done_addresses.data.ptr, self._size - 1, self._status_ptr,
                *[address(o) for o in outs], *pad,
                *[o.size * o.dtype.itemsize for o in outs], *pad, len(outs)))
        self._rt.eventRecord(self._joined, self._side_ptr)
        self._rt.streamWaitEvent(stream, self._joined, 0)

    def failure(self, kinds):
        """The error a failed device wait left (TimeoutError naming the rank, RuntimeError for a
        mismatch), or None. Reads pinned host memory: no sync."""
        code = int(self._status[0])
        if code in (0, 0xFFFFFFFF):
            return None
        _, peer, expected, seen = (int(v) for v in self._status)
        if code == 1:
            return TimeoutError(
                f"exchange on rank {self._rank}: rank {peer} did not arrive within "
                f"{self._comm.timeout:g} s (a device wait for its signal of generation "
                f"{expected} saw {seen}); the communicator is aborted")
        return RuntimeError(f"exchange on rank {self._rank}: "
                            + describe_mismatch(peer, expected, seen, kinds)
                            + "; the communicator is aborted")

    def _close_peers(self, mapped):
        """Close this rank's mappings of the peers' buffers in ``mapped`` (peer: address)."""
        for ptr in mapped.values():
            self._rt.ipcCloseMemHandle(ptr)
        mapped.clear()

    def abandon(self):
        """After an abort (the communicator closes without meeting its peers): keep this rank's
        buffers, never freed. A peer may still map them, and a late one still signal into the flags
        or copy from the staging; the pinned status and the "done" addresses stay for this rank's
        device waits and signals still queued (a pool block reused under ``mx_end`` would have it
        write to whatever addresses it then holds). Dropping them would free them once the
        communicator is collected."""
        if self._memory is not None or self._flags is not None:
            self._keep()
        self._memory = self._flags = None
        self._capacity = 0

    def close(self):
        """Wait for this rank's device work (its signals into the peers' flags run on the callers'
        streams), unmap the peers' buffers, meet the node's ranks, then free this rank's: a buffer
        freed before every importer closed its mapping is undefined behaviour (CUDA's
        ``cudaIpcOpenMemHandle``). The wait and the meeting are each bounded by the timeout; past
        either, or if the meeting fails or pairs with a peer's growth, this rank's buffers are
        kept, never freed, and a RuntimeWarning says so."""
        try:
            if not self._device_idle():
                raise TimeoutError(f"its device work did not finish within "
                                   f"{self._comm.timeout:g} s")
            self._close_peers(self._peer_ptr)
            self._close_peers(self._peer_flags)
            for event in (self._forked, self._joined):
                self._rt.eventDestroy(event)
            self._forked = self._joined = None
            self._meet(_RELEASE, "peer memory release")
        except Exception as exc:  # a late or dead peer, a growing one, a CUDA error
            self._keep()
            warnings.warn(f"peer memory on rank {self._world_rank}: {exc}; its buffers stay "
                          f"allocated", RuntimeWarning, stacklevel=2)
        except BaseException:
            self._keep()
            raise
        self._memory = self._flags = None
        self._capacity = 0

    def _device_idle(self):
        """Wait, at most the timeout, until this process's work on the device is done (every
        stream: an exchange's signals run on its caller's); False past it. All of it: a
        collective of another library still waiting for a peer holds this wait too."""
        def sync():
            self._cupy.cuda.Device(self._comm.device).use()  # a new thread: no device current
            self._rt.deviceSynchronize()
        done, _ = _bounded(sync, self._comm.timeout, f"mxcomm-peer-memory-close-{self._rank}")
        return done

    def _meet(self, why, what):
        """Meet every rank (bounded; under ``hier`` the other nodes too, which meet alike), each
        saying ``why`` (:data:`_GROW` or :data:`_RELEASE`); RuntimeError naming the ranks that
        met for something else (a peer closing while this rank grows, or the reverse), and on
        growth the communicator is aborted."""
        side = self._comm._side
        table = getattr(side, "allgather_world", side.allgather_bytes)(bytes([why]), what)
        odd = {r: b for r, b in enumerate(table) if b != why}
        if odd:  # the communicator's ranks
            said = {_GROW: "grow their peer memory", _RELEASE: "release their peer memory"}
            error = RuntimeError(f"{what} on rank {self._world_rank}: " + "; ".join(
                f"rank {r} met to {said.get(b, f'do something else (byte {b})')}"
                for r, b in odd.items()) + " (one rank closed the communicator while another "
                "still exchanged)")
            if why == _GROW:
                getattr(self._comm, "world", self._comm)._fail(error, raised=True)
            raise error

    def _keep(self):
        """Keep this rank's buffers, never freed: a peer may still map them, and work still
        queued may read the "done" addresses or write the pinned status (as :meth:`abandon`)."""
        _KEPT.append((self._memory, self._flags, self._status_memory, self._done_addresses))
