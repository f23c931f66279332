"""Kernel launches through the CUDA driver with one packed parameter buffer (GPU only).

CuPy's ``Function`` call converts every argument to a C pointer object on each launch: for a
numba kernel taking a few arrays (numba's ABI spends ``5 + 2 * ndim`` parameters per array) that
is 40-60 numpy scalars packed one by one, tens of microseconds per launch, measured on an H200
host. A :class:`PackedLaunch` knows the parameter layout of its function (a ``struct`` format with
native alignment, the layout ``cuLaunchKernel`` expects of a parameter buffer), packs the values
with one ``struct.pack_into`` into a buffer it owns and launches through ``cuLaunchKernel``'s
``extra`` argument (``CU_LAUNCH_PARAM_BUFFER_POINTER``; CUDA driver API, "Execution Control").
The driver copies the parameters at launch, so the buffer is reused at once.

Leaf module: imports CuPy lazily, nothing of this package.
"""

import ctypes
import struct
import threading

# cuLaunchKernel's ``extra`` array markers (cuda.h).
_PARAM_BUFFER_POINTER = 1
_PARAM_BUFFER_SIZE = 2
_PARAM_END = 0
# CUfunction_attribute (cuda.h).
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class PackedLaunch:
    """Launch one compiled function with parameters packed by a ``struct`` format.

    Args:
        function: a CuPy ``cupy.cuda.function.Function`` (its ``ptr`` is the ``CUfunction``;
            kept alive, with its module, as long as this object).
        fmt: the parameters as ``struct`` codes, e.g. ``"QQIi"`` (``Q``: pointer or uint64,
            ``q``: int64, ``I``/``i``: 32-bit, ``B``: uint8/bool); packed with native alignment.

    Calling it, ``launch(grid, block, stream, values, shared=0)``: ``grid`` and ``block`` are
    ints (1-D), ``stream`` a raw stream handle (int), ``values`` a sequence of ints matching
    ``fmt``, ``shared`` the bytes of dynamic shared memory (above 48 KiB only after
    :meth:`allow_shared`). Enqueues the kernel on ``stream``; no synchronization. Thread-safe.
    """

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
        """Let launches take up to ``nbytes`` of dynamic shared memory (the driver's default cap
        is 48 KiB; CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES). The cap only grows: the
        function is shared by every launch of its argument kinds."""
        import cupy
        with self._lock:
            if nbytes > self._shared_cap:
                cupy.cuda.driver.funcSetAttribute(self._ptr, _MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                  nbytes)
                self._shared_cap = nbytes

    def __call__(self, grid, block, stream, values, shared=0):
        with self._lock:
            self._pack_into(self._buffer, 0, *values)
            self._launch(self._ptr, grid, 1, 1, block, 1, 1, shared, stream, 0, self._extra_ptr)
