"""Torch tensors as arrays and back, zero-copy (a leaf module: of this package only ``_array``
and ``_platform``). A CUDA tensor is seen as a CuPy array over its ``data_ptr`` (cheaper on the
host than DLPack: bench/NOTES.md), a CPU tensor as a NumPy array; bf16 as ml_dtypes', fp8 as
uint8 bits. Arrays become tensors through DLPack; results the engine allocates are torch tensors
(:class:`_Alloc`).
"""

import functools

import numpy
import torch

from ._array import as_device_array, bfloat16, on_stream
from ._platform import gpu_arrays

# torch dtype -> NumPy dtype of the array viewing the tensor's bytes (NumPy and CuPy have no fp8)
_ARRAY_DTYPES = {
    torch.bfloat16: bfloat16, torch.float32: numpy.dtype(numpy.float32),
    torch.float16: numpy.dtype(numpy.float16), torch.float64: numpy.dtype(numpy.float64),
    torch.float8_e4m3fn: numpy.dtype(numpy.uint8), torch.float8_e8m0fnu: numpy.dtype(numpy.uint8),
    torch.uint8: numpy.dtype(numpy.uint8), torch.int8: numpy.dtype(numpy.int8),
    torch.int16: numpy.dtype(numpy.int16), torch.int32: numpy.dtype(numpy.int32),
    torch.int64: numpy.dtype(numpy.int64), torch.bool: numpy.dtype(numpy.bool_),
}
# array dtype of a result the engine allocates -> the torch dtype it is allocated as (fp8 bits:
# torch.uint8)
_TORCH_DTYPES = {a: t for t, a in _ARRAY_DTYPES.items()
                 if t not in (torch.float8_e4m3fn, torch.float8_e8m0fnu)}
# element size -> the integer torch dtype a CPU tensor is seen through by NumPy
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: torch's raw current-stream query (``torch.cuda.current_stream`` without the Stream object),
#: where this torch has it.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(t):
    """torch's current stream on ``t``'s device (raw handle), or None for CPU tensors."""
    return _current_stream(t.device) if t.is_cuda else None


def _current_stream(device):
    """torch's current stream on the CUDA ``device`` (a torch.device), as a raw handle (int)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _record(t, stream=None):
    """``record_stream`` the memory of ``t`` (a tensor, a QuantizedTensor's data and scales, or
    None: nothing) on ``stream`` (None: torch's current stream on its device): the caching
    allocator hands its blocks out again only once that stream has done what it has enqueued so
    far. Autograd's engine records a gradient that crosses streams by the tensor's own storage,
    which a QuantizedTensor's wrapper has not, so mxcomm records the parts where it reads them.
    No-op for CPU and traced tensors, and (in the allocator) on the stream that made them."""
    if t is None:
        return
    parts = (t.qdata, t.scales) if hasattr(t, "qdata") else (t,)
    first = parts[0]
    if not first.is_cuda or type(first) is not torch.Tensor or torch.compiler.is_compiling() \
            or not _native_allocator():
        return
    if stream is None:
        stream = torch.cuda.current_stream(first.device)
    for part in parts:
        part.record_stream(stream)


@functools.cache
def _native_allocator():
    """Whether torch's CUDA caching allocator is its native one, whose ``record_stream`` skips
    memory it did not allocate and a block's own stream (``cudaMallocAsync``'s asserts on the
    one and warns on the other: there :func:`_record` records nothing)."""
    return torch.cuda.get_allocator_backend() == "native"


def _view(t, dtype):
    """The contiguous tensor ``t``'s bytes as a CuPy or NumPy array of ``dtype``, zero-copy,
    keeping ``t`` alive. No stream synchronization."""
    if t.is_cuda:
        import cupy
        memory = cupy.cuda.memory.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t,
                                                t.get_device())
        return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.memory.MemoryPointer(memory, 0))
    return t.view(_INT_OF_SIZE[t.element_size()]).numpy().view(dtype)


def _array(t, name):
    """The plain tensor ``t`` as an array (zero-copy; a contiguous copy first if needed)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    dtype = _ARRAY_DTYPES.get(t.dtype)
    if dtype is not None and t.is_cuda == gpu_arrays() and t.numel():
        return _view(t, dtype)
    if dtype is None:
        return as_device_array(t, name)  # the array module's error for what it cannot take
    return as_device_array(t.view(_INT_OF_SIZE[t.element_size()]), name).view(dtype)


def _tensor(a, dtype=None):
    """The array ``a`` as a torch tensor (zero-copy); ``dtype`` reinterprets bits (fp8 views)."""
    if a.dtype == bfloat16:
        return torch.from_dlpack(a.view(numpy.int16)).view(torch.bfloat16)
    t = torch.from_dlpack(a)
    return t if dtype is None else t.view(dtype)


class _Alloc:
    """The engine's ``alloc(shape, dtype)`` in a torch call: torch tensors on ``device`` seen as
    arrays, handed back as those tensors by :meth:`tensor` (no DLPack, memory in torch's pool:
    ordered on torch's stream, and a CUDA graph's own pool under capture, where CuPy's pool would
    grow or lend blocks that outlive the graph). Dtypes torch lacks come from the array module."""

    __slots__ = ("_device", "_made")

    def __init__(self, device):
        self._device = device
        self._made = []

    def __call__(self, shape, dtype):
        torch_dtype = _TORCH_DTYPES.get(dtype)
        if torch_dtype is None:
            if gpu_arrays():
                import cupy
                with on_stream(_current_stream(self._device)):  # from torch's stream's part
                    return cupy.empty(shape, dtype)
            return numpy.empty(shape, dtype)
        t = torch.empty(shape, dtype=torch_dtype, device=self._device)
        a = _view(t, dtype) if t.numel() else _array(t, "result")
        self._made.append((a, t))
        return a

    def tensor(self, a, dtype=None):
        """The tensor of an array made here (``dtype``: a bit view), else :func:`_tensor`'s."""
        for made, t in self._made:
            if made is a:
                return t if dtype is None else t.view(dtype)
        return _tensor(a, dtype)
