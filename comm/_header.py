"""The NCCL backend's call header (docs/design.md, "Error model"): eight 32-bit words each rank
sends every peer it moves rows with, in the NCCL group before the rows, so a mis-paired call is
found on the device without a host sync:

======  ========================================================================================
word    content
======  ========================================================================================
0       the layout's number (``Plan.generation``; 0 for a vote's plan)
1       the call's number (``Plan.calls``: of the layout, or the vote's host collective)
2       a hash of every array's dtype and row shape (data and scales of a quantized exchange)
3, 4    the first array's dtype (a hash of its name) and row elements, for the message
5, 6    the number of arrays moved together; 0
7       ``MAGIC``: a header received this call (the receive area is cleared before)
======  ========================================================================================

A mismatch is reported in pinned host memory and fills the results with 0xFF (NaN in bf16, fp32,
e4m3, e8m0). Rows of another size stall NCCL before the check: the watchdog's timeout then reads
the headers that arrived (:meth:`CallHeaders.stalled`)."""

import math
import pathlib
import zlib

import numpy

from mxcomm._driver import PackedLaunch, address

from ._validate import rows_text

HEADER_WORDS = 8
HEADER_BYTES = 4 * HEADER_WORDS
MAGIC = 0x4D584844
#: Header slots used in turn, so up to this many calls in flight on other streams keep theirs.
_SLOTS = 16
_HOST_ALLOC_MAPPED = 0x2      # cudaHostAllocMapped
_MEMCPY_DEVICE_TO_HOST = 2    # cudaMemcpyDeviceToHost
_MISMATCH = 3                 # status code of mx_header_check
#: dtypes a message can name from their hash (word 3) when this rank has not moved them
_DTYPES = ("bfloat16", "float16", "float32", "float64", "uint8", "int8", "int32", "int64",
           "uint16", "uint32", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")
_SOURCE = pathlib.Path(__file__).with_name("_signal.cu")


def _crc(text):
    return zlib.crc32(text.encode())


def describe_rows(sends):
    """Words 2 to 6 of a header for the arrays ``sends``, and the text of word 2."""
    text = rows_text(sends)
    first = sends[0]
    elements = math.prod(first.shape[1:])
    return (_crc(text), _crc(numpy.dtype(first.dtype).name), elements & 0xFFFFFFFF,
            len(sends), 0), text


class CallHeaders:
    """One NCCL communicator's call headers: device memory, kernels, and the pinned status a failed
    check writes. Not collective; made before any CUDA graph capture."""

    def __init__(self, comm):
        import cupy
        self._cupy = cupy
        self._runtime = cupy.cuda.runtime
        self._rank, self._size = comm.rank, comm.size
        # per slot: this rank's header, then one received header per rank
        self._slot_bytes = HEADER_BYTES * (self._size + 1)
        self._memory = cupy.cuda.memory.alloc(self._slot_bytes * _SLOTS)
        self._base = self._memory.ptr
        # cleared: a pool block may hold an earlier communicator's headers, which ``stalled``
        # would read as this one's
        self._runtime.memset(self._base, 0, self._slot_bytes * _SLOTS)
        self._next = 0
        nbytes = 4 * (2 + 2 * (HEADER_WORDS - 1))
        status = cupy.cuda.PinnedMemoryPointer(cupy.cuda.PinnedMemory(nbytes, _HOST_ALLOC_MAPPED),
                                               0)
        self._status_memory = status
        self._status = numpy.frombuffer(status, dtype=numpy.uint32, count=nbytes // 4)
        self._status[:] = 0
        self._status_ptr = status.ptr
        module = cupy.RawModule(code=_SOURCE.read_text(), options=("-std=c++14",))
        words = f"{HEADER_WORDS - 1}I"  # Header by value
        self._put = PackedLaunch(module.get_function("mx_header_put").kernel, f"QQi{words}")
        self._check = PackedLaunch(module.get_function("mx_header_check").kernel,
                                   f"Qi{words}Q4Q4Qi")
        # for ``stalled``: filled in place of the host, read while NCCL's kernel stalls
        self._host = cupy.cuda.alloc_pinned_memory(self._slot_bytes * _SLOTS)
        self._copies = cupy.cuda.Stream(non_blocking=True)
        self._rows = {}   # (dtype, row shape) per array -> words 2 to 6
        self.texts = {}   # word 2 -> text, for messages
        self._dtypes = {_crc(name): name for name in _DTYPES}

    def begin(self, sends, plan, stream):
        """Enqueue this call's header on ``stream`` before its NCCL group: ``(sent, received,
        words)``, the addresses of this rank's header and of the received ones (rank r's at
        ``received + HEADER_BYTES * r``), and this rank's words but the last."""
        key = tuple([(a.dtype, a.shape[1:]) for a in sends])
        rows = self._rows.get(key)
        if rows is None:
            if len(self._rows) > 64:
                self._rows.clear()
            rows, text = describe_rows(sends)
            self._rows[key] = rows
            self.texts[rows[0]] = text
            self._dtypes[rows[1]] = numpy.dtype(sends[0].dtype).name
        words = ((plan.generation or 0) & 0xFFFFFFFF, plan.calls & 0xFFFFFFFF) + rows
        slot = self._next
        self._next = (slot + 1) % _SLOTS
        sent = self._base + slot * self._slot_bytes
        self._put(1, 64, stream, (sent, sent + HEADER_BYTES, self._size, *words))
        return sent, sent + HEADER_BYTES, words

    def check(self, received, words, outs, stream):
        """After the group, on ``stream``: compare the received headers with ``words``; on a
        difference report it and fill ``outs`` with 0xFF bytes."""
        sizes = [o.size * numpy.dtype(o.dtype).itemsize for o in outs]
        grid = min(64, max(1, -(-sum(sizes) // (256 * 256))))
        for i in range(0, max(1, len(outs)), 4):
            ptrs = [address(o) for o in outs[i:i + 4]]
            nbytes = sizes[i:i + 4]
            count = len(ptrs)
            pad = [0] * (4 - count)
            self._check(grid, 256, stream, (received, self._size, *words, self._status_ptr,
                                            *ptrs, *pad, *nbytes, *pad, count))

    def failure(self):
        """The RuntimeError a failed check left (naming the peer and what each has), or None; no
        sync."""
        if int(self._status[0]) != _MISMATCH:
            return None
        values = [int(v) for v in self._status]
        n = HEADER_WORDS - 1
        return self._error(values[1], tuple(values[2:2 + n]), tuple(values[2 + n:2 + 2 * n]),
                           "its results were filled with 0xFF bytes (NaN) on the device")

    def stalled(self):
        """The mismatch the headers received so far show, or None, for the watchdog's timeout of a
        stalled NCCL group: copies them on a stream of its own and compares each slot as the device
        holds it (the host may have enqueued later calls of a slot behind the stalled one)."""
        total = self._slot_bytes * _SLOTS
        self._runtime.memcpyAsync(self._host.ptr, self._base, total, _MEMCPY_DEVICE_TO_HOST,
                                  self._copies.ptr)
        self._copies.synchronize()
        table = numpy.frombuffer(self._host, numpy.uint32, total // 4).reshape(
            _SLOTS, -1, HEADER_WORDS)
        for slot in table:  # this rank's header as the slot's last put left it, then the peers'
            if int(slot[0, -1]) != MAGIC:
                continue
            words = tuple(int(v) for v in slot[0, :-1])
            for peer, header in enumerate(slot[1:]):
                theirs = tuple(int(v) for v in header[:-1])
                if int(header[-1]) == MAGIC and theirs != words:
                    return self._error(peer, theirs, words, "its NCCL group stalled on rows "
                                       "of another size")
        return None

    def _error(self, peer, theirs, mine, what):
        def call(words):
            layout, calls, rows, dtype, elements, arrays, _ = words
            at = f"call {calls} of layout {layout}" if layout else \
                f"the exchange of host collective {calls} (explicit splits)"
            text = self.texts.get(rows)
            if text is None:
                text = f"{self._dtypes.get(dtype, 'unknown dtype')} rows of {elements} " \
                       f"elements" + (f" (and {arrays - 1} more arrays)" if arrays > 1 else "")
            return f"{at} with {text}"
        return RuntimeError(f"alltoallv on rank {self._rank}: rank {peer} is at {call(theirs)} "
                            f"where this rank is at {call(mine)}: the exchange is mis-paired "
                            f"({what}); the communicator is aborted")
