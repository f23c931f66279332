"""Kernel launches through the CUDA driver with one packed parameter buffer (GPU only),
:class:`Words`, a device array named by address without a CuPy view (docs/design.md "Arrays"), and
:class:`LaunchRows`, the rows a prepared launch quantizes into ``mxcomm.comm``'s staged exchange.
Leaf module: imports CuPy lazily, and NumPy; nothing of this package.
"""

import ctypes
import struct
import threading

import numpy

# cuLaunchKernel's ``extra`` array markers (cuda.h).
_PARAM_BUFFER_POINTER = 1
_PARAM_BUFFER_SIZE = 2
_PARAM_END = 0
# cudaMemcpyKind (cuda_runtime_api.h).
_MEMCPY_DEVICE_TO_DEVICE = 3
# CUfunction_attribute (cuda.h).
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
# CUresult (cuda.h): no context current on the calling thread.
_ERROR_INVALID_CONTEXT = 201


class PackedLaunch:
    """Launch one compiled function (a CuPy ``Function``, kept alive) with parameters packed by
    the ``struct`` codes ``fmt`` (``"QQIi"``: ``Q`` pointer or uint64, ``q`` int64, ``I``/``i``
    32-bit, ``B`` uint8/bool; native alignment). ``launch(grid, block, stream, values, shared=0)``:
    1-D grid and block, a raw stream, ints matching ``fmt``, dynamic shared bytes (above 48 KiB
    only after :meth:`allow_shared`); enqueues, no sync. Thread-safe."""

    __slots__ = ("_function", "_ptr", "_pack_into", "_buffer", "_size", "_extra", "_extra_ptr",
                 "_lock", "_launch", "_shared_cap", "fmt")

    def __init__(self, function, fmt):
        import cupy
        layout = struct.Struct("@" + fmt)
        self.fmt = fmt
        self._function = function
        self._ptr = function.ptr
        self._pack_into = layout.pack_into
        self._buffer = ctypes.create_string_buffer(max(layout.size, 8))
        self._size = ctypes.c_size_t(layout.size)
        self._extra = (ctypes.c_void_p * 5)(_PARAM_BUFFER_POINTER, ctypes.addressof(self._buffer),
                                            _PARAM_BUFFER_SIZE, ctypes.addressof(self._size),
                                            _PARAM_END)
        self._extra_ptr = ctypes.addressof(self._extra)
        self._lock = threading.Lock()
        self._launch = cupy.cuda.driver.launchKernel
        self._shared_cap = 48 * 1024

    def allow_shared(self, nbytes):
        """Let launches take up to ``nbytes`` of dynamic shared memory (default cap 48 KiB). The cap
        only grows: the function is shared by every launch of its argument kinds."""
        import cupy
        with self._lock:
            if nbytes > self._shared_cap:
                cupy.cuda.driver.funcSetAttribute(self._ptr, _MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                  nbytes)
                self._shared_cap = nbytes

    def __call__(self, grid, block, stream, values, shared=0):
        with self._lock:
            self._pack_into(self._buffer, 0, *values)
            try:
                self._launch(self._ptr, grid, 1, 1, block, 1, 1, shared, stream, 0,
                             self._extra_ptr)
            except Exception as exc:
                # no current context: autograd's device thread whose first work is this launch
                # (torch skips cudaSetDevice there, so nothing bound the primary context)
                if getattr(exc, "status", None) != _ERROR_INVALID_CONTEXT:
                    raise
                _bind_primary_context()
                self._launch(self._ptr, grid, 1, 1, block, 1, 1, shared, stream, 0,
                             self._extra_ptr)


def _bind_primary_context():
    """Make the current device's primary context current on this thread (``cudaFree(NULL)``)."""
    import cupy
    cupy.cuda.runtime.free(0)


class Words:
    """A C-contiguous device array named by its address: all a launch or a copy needs of it (the
    GPU side of ``mxcomm.kernels.words``; a "word" is an element). ``ptr``: the first word's
    address; ``shape``: ``(size,)`` or ``(rows, words per row)``; ``dtype``: a word's; ``align``:
    bytes the address is a multiple of (the word's size, or 16 for ``_memory.load_pair``)."""

    __slots__ = ("ptr", "shape", "dtype", "align", "size", "ndim")

    def __init__(self, ptr, shape, dtype, align=None):
        self.ptr, self.shape, self.dtype = ptr, shape, dtype
        self.align = align or dtype.itemsize
        self.ndim = len(shape)
        self.size = shape[0] if self.ndim == 1 else shape[0] * shape[1]

    def abi(self):
        """Its fields in numba's kernel ABI: meminfo, parent, nitems, itemsize, data, shape,
        strides."""
        itemsize = self.dtype.itemsize
        if self.ndim == 1:
            return (0, 0, self.size, itemsize, self.ptr, self.size, itemsize)
        rows, cols = self.shape
        return (0, 0, self.size, itemsize, self.ptr, rows, cols, cols * itemsize, itemsize)


def address(a):
    """The address of the first element of a CuPy or NumPy array or :class:`Words` (NumPy arrays
    occur on the simulator and host backend, even on a GPU machine)."""
    if isinstance(a, numpy.ndarray):
        return a.__array_interface__["data"][0]
    if type(a) is Words:
        return a.ptr
    return a.data.ptr


def row_range(a, begin, end):
    """Rows ``[begin, end)`` (unchecked) of the C-contiguous 1-D or 2-D ``a``, zero-copy: a
    :class:`Words` on a GPU (cheaper on the host than a CuPy slice), a NumPy slice elsewhere."""
    if isinstance(a, numpy.ndarray):
        return a[begin:end]
    shape = a.shape
    ptr = a.ptr if type(a) is Words else a.data.ptr
    if len(shape) == 1:
        return Words(ptr + begin * a.dtype.itemsize, (end - begin,), a.dtype)
    cols = shape[1]
    return Words(ptr + begin * cols * a.dtype.itemsize, (end - begin, cols), a.dtype)


def flat(a):
    """The C-contiguous ``a`` as 1-D, zero-copy: a :class:`Words` on a GPU, a NumPy reshape."""
    if isinstance(a, numpy.ndarray):
        return a.reshape(-1)
    return Words(a.ptr if type(a) is Words else a.data.ptr, (a.size,), a.dtype)


class LaunchRows:
    """Plain rows ``x`` (M, D) that the format's prepared launch ``quantize(x, data, scales, rows,
    stream)`` (``Format.quantizer``) writes where the staged exchange moves them from: the rows
    protocol of ``comm._staged`` (``arrays``, ``kind``, ``produce``). A leaf, so a transport
    producing rows calls nothing above ``comm``. ``per_row``: one scale per row, travelling as
    (rows, 1) where the launch writes (rows,)."""

    __slots__ = ("arrays", "kind", "_x", "_quantize", "_per_row")

    def __init__(self, x, quantize, arrays, kind, per_row):
        self.arrays, self.kind = arrays, kind
        self._x, self._quantize, self._per_row = x, quantize, per_row

    def produce(self, begin, end, slots, stream):
        data, scales = slots
        if self._per_row:
            scales = flat(scales)
        self._quantize(row_range(self._x, begin, end), data, scales, end - begin, stream)


def copy_bytes(dst, src, stream):
    """Copy the bytes of C-contiguous ``src`` into C-contiguous ``dst`` (shapes may differ):
    ``cudaMemcpyAsync`` on raw stream ``stream``, or a NumPy assignment (done on return)."""
    if isinstance(dst, numpy.ndarray):
        dst.reshape(-1).view(numpy.uint8)[...] = src.reshape(-1).view(numpy.uint8)
        return
    import cupy
    cupy.cuda.runtime.memcpyAsync(address(dst), address(src), dst.size * dst.dtype.itemsize,
                                  _MEMCPY_DEVICE_TO_DEVICE, stream)


class _StreamHandle:
    """A raw stream handle speaking the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def external_stream(ptr):
    """A CuPy stream over the raw handle ``ptr`` (not owned): ``Stream.from_external`` where CuPy
    has it (CuPy 14 deprecates ``ExternalStream``)."""
    import cupy
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(_StreamHandle(ptr))
        except (TypeError, ValueError):  # a CuPy whose from_external wants another argument
            pass
    return cupy.cuda.ExternalStream(ptr)
