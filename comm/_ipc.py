"""Staging memory of the pull transport on GPUs: CUDA IPC between the processes of one node.

Every rank allocates one device buffer with ``cudaMalloc`` (outside CuPy's pool, so the IPC handle
names exactly this allocation) and maps every peer's with ``cudaIpcOpenMemHandle`` (peer access
enabled lazily, over NVLink where the GPUs have it). Interprocess events order the work: a sender
records ``ready[s]`` after filling its step-``s`` rows, and a receiver's side stream waits for it
before pulling them with ``cudaMemcpyAsync`` (copy engines, no SMs); each receiver records ``done``
after its pulls, and a sender waits for every peer's ``done`` before refilling its buffer.

With ``direct`` the side stream runs the caller's consumer instead of the copies: it reads a
peer's rows in place (SM loads over NVLink, through the mapping) once that peer's ``ready`` is
recorded, and the caller's stream waits for the side stream at the end.

The pulls go one peer after another on ONE side stream, in step order. One copy from one peer
already moves as much as NVLink takes (measured on 2 and 4 H200s: 362 GB/s from one peer, 361 GB/s
in all from three at once), and in sequence the first peer's rows are complete after a third of
the transfer, not all at its end, so the caller's consumer (a dequantize) overlaps the rest. The event
handles are exchanged once; the buffer's handles again whenever it grows (a collective decision:
every rank computes the same size from the voted counts).

This is the only module that calls CUDA's IPC functions.
"""

import math

import numpy

from ._staged import MAX_PIECES

_EVENT_DISABLE_TIMING = 0x2   # cudaEventDisableTiming
_EVENT_INTERPROCESS = 0x4     # cudaEventInterprocess
_MEMCPY_DEFAULT = 4           # cudaMemcpyDefault (unified addressing picks the direction)
_HANDLE_BYTES = 64            # cudaIpcMemHandle_t / cudaIpcEventHandle_t
_GROWTH = 1.25                # a grown buffer holds this much more than asked, to grow rarely


class CudaPeerMemory:
    """Staging buffers of all ranks of one node, each mapped into every process.

    Args:
        comm: the NCCL communicator (its device is current; its MPI communicator exchanges the
            handles and its ``wait``/``barrier`` bound every wait by the timeout).
    """

    def __init__(self, comm):
        import cupy
        self._cupy = cupy
        self._rt = rt = cupy.cuda.runtime
        self._comm = comm
        rank, size = comm.rank, comm.size
        shared = _EVENT_DISABLE_TIMING | _EVENT_INTERPROCESS
        n_ready = size * MAX_PIECES  # ready[step * MAX_PIECES + piece]; step 0 unused
        self._ready = [rt.eventCreateWithFlags(shared) for _ in range(n_ready)]
        self._done = rt.eventCreateWithFlags(shared)
        own = b"".join(rt.ipcGetEventHandle(e) for e in self._ready + [self._done])
        table = comm._allgather_bytes(own, "peer memory setup (event handles)")
        per_rank = (n_ready + 1) * _HANDLE_BYTES
        self._peer_ready, self._peer_done = {}, {}
        for peer in range(size):
            if peer == rank:
                continue
            row = table[peer * per_rank:(peer + 1) * per_rank]
            handles = [row[i * _HANDLE_BYTES:(i + 1) * _HANDLE_BYTES] for i in range(n_ready + 1)]
            self._peer_ready[peer] = [rt.ipcOpenEventHandle(h) for h in handles[:n_ready]]
            self._peer_done[peer] = rt.ipcOpenEventHandle(handles[n_ready])
        self._side = cupy.cuda.Stream(non_blocking=True)
        self._copied = [rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING) for _ in range(size)]
        self._start = rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING)
        self._memory = None
        self._capacity = 0
        self._peer_ptr = {}

    @property
    def capacity(self):
        """Bytes of this rank's staging buffer."""
        return self._capacity

    def reserve(self, nbytes, stream):
        """Make every rank's buffer hold ``nbytes`` (the same value on every rank: collective).

        Growing waits (bounded by the timeout) for this rank's side stream and ``stream`` (the
        caller's, which filled the old buffer), so once every rank has passed the barrier no pull
        from an old buffer is in flight; then every rank allocates anew and maps the peers'.
        """
        if nbytes <= self._capacity:
            return
        comm = self._comm
        if self._memory is not None:
            comm.wait(self._side)
            comm.wait(stream)
            comm.barrier()
            self._unmap()
        capacity = int(nbytes * _GROWTH)
        self._memory = self._cupy.cuda.memory.Memory(capacity)
        handle = self._rt.ipcGetMemHandle(self._memory.ptr)
        table = comm._allgather_bytes(handle, "peer memory setup (buffer handles)")
        for peer in range(comm.size):
            if peer != comm.rank:
                h = table[peer * _HANDLE_BYTES:(peer + 1) * _HANDLE_BYTES]
                self._peer_ptr[peer] = self._rt.ipcOpenMemHandle(h)
        self._capacity = capacity

    def local(self, offset, shape, dtype):
        """A CuPy view of this rank's buffer: ``shape`` of ``dtype`` from byte ``offset``."""
        pointer = self._cupy.cuda.memory.MemoryPointer(self._memory, offset)
        return self._cupy.ndarray(shape, dtype=dtype, memptr=pointer)

    def peer_view(self, peer, offset, shape, dtype):
        """A CuPy view of ``peer``'s buffer (mapped here): ``shape`` of ``dtype`` from byte
        ``offset``; valid until the buffer grows."""
        cupy = self._cupy
        nbytes = math.prod(shape) * numpy.dtype(dtype).itemsize
        memory = cupy.cuda.memory.UnownedMemory(self._peer_ptr[peer] + offset, nbytes, self,
                                                cupy.cuda.Device().id)
        return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.memory.MemoryPointer(memory, 0))

    def begin(self, stream):
        """Order the side stream after the caller's work so far (the outputs were allocated on
        ``stream``), then ``stream`` after every peer's pulls of the previous call (their
        ``done``), before it refills this rank's buffer."""
        rt = self._rt
        rt.eventRecord(self._start, stream)
        rt.streamWaitEvent(self._side.ptr, self._start, 0)
        for event in self._peer_done.values():
            rt.streamWaitEvent(stream, event, 0)

    def ready(self, step, piece, stream):
        """Mark this rank's rows of ``step``, ``piece`` filled (on ``stream``)."""
        self._rt.eventRecord(self._ready[step * MAX_PIECES + piece], stream)

    def fetch(self, step, peer, pieces, stream):
        """Pull ``peer``'s rows of ``step`` on a side stream, each piece once it is ready there.

        Args:
            pieces: per piece, ``[(byte offset in the peer's buffer, destination array), ...]``.
            stream: the caller's stream (the side stream waits for its work up to :meth:`begin`).
        """
        rt = self._rt
        base = self._peer_ptr[peer]
        for piece, copies in enumerate(pieces):
            side = self.await_peer(step, piece, peer, stream)
            for offset, out in copies:
                if out.nbytes:
                    rt.memcpyAsync(out.data.ptr, base + offset, out.nbytes, _MEMCPY_DEFAULT,
                                   side)
        rt.eventRecord(self._copied[step], self._side.ptr)

    def await_peer(self, step, piece, peer, stream):
        """Order the side stream after ``peer``'s rows of ``step``, ``piece`` are ready; return
        its handle (work enqueued there next may read them)."""
        side = self._side.ptr
        self._rt.streamWaitEvent(side, self._peer_ready[peer][step * MAX_PIECES + piece], 0)
        return side

    def finish(self, stream):
        """Record ``done`` once every pull of this call is complete."""
        self._rt.eventRecord(self._done, self._side.ptr)

    def join(self, stream):
        """Order ``stream`` after everything on the side stream (after :meth:`finish`)."""
        self._rt.streamWaitEvent(stream, self._done, 0)

    def arrived(self, step, stream):
        """Order ``stream`` after the pull of ``step``."""
        self._rt.streamWaitEvent(stream, self._copied[step], 0)

    def _unmap(self):
        for ptr in self._peer_ptr.values():
            self._rt.ipcCloseMemHandle(ptr)
        self._peer_ptr.clear()
        self._memory = None
        self._capacity = 0

    def close(self):
        """Unmap the peers' buffers and free this rank's (after its streams are done)."""
        if self._memory is not None:
            self._side.synchronize()
            self._unmap()
        rt = self._rt
        opened = [e for events in self._peer_ready.values() for e in events]
        opened += list(self._peer_done.values())
        for event in self._ready + self._copied + [self._done, self._start] + opened:
            rt.eventDestroy(event)
        self._ready = self._copied = []
        self._peer_ready, self._peer_done = {}, {}
