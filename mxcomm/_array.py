"""The one acceptance of caller arrays and streams, and the checks of rows, arrays and outputs
(docs/design.md "Arrays"). Device arrays are CuPy arrays on a GPU, NumPy arrays on a CPU
(``_platform.gpu_arrays``). A leaf: NumPy, ml_dtypes and ``_platform`` only.
"""

import contextlib

import ml_dtypes
import numpy

from ._platform import gpu_arrays

#: bf16 as an array dtype (CuPy and NumPy both use ml_dtypes' type).
bfloat16 = numpy.dtype(ml_dtypes.bfloat16)
float32 = numpy.dtype(numpy.float32)


def as_device_array(x, name, *, device=None):
    """``x`` as a CuPy (device) or NumPy (host) array, zero-copy.

    Args:
        x: a CuPy/NumPy array, or any object exporting ``__cuda_array_interface__`` or DLPack
            (device), or anything NumPy can view (host).
        name: the argument's name (and rank, where it matters), for the error message.
        device: True for a CuPy array, False for NumPy, None for the platform's (``gpu_arrays``).
    Raises:
        TypeError: ``x`` is not an array of that kind.
    """
    if device is None:
        device = gpu_arrays()
    if device:
        import cupy
        if isinstance(x, cupy.ndarray):
            return x
        if hasattr(x, "__cuda_array_interface__"):
            return cupy.asarray(x)
        if hasattr(x, "__dlpack__") and not hasattr(x, "__array_interface__"):
            try:
                return cupy.from_dlpack(x)
            except Exception:  # a host tensor: the TypeError below
                pass
    elif isinstance(x, numpy.ndarray):
        return x
    elif not hasattr(x, "__cuda_array_interface__") and (
            hasattr(x, "__array__") or hasattr(x, "__array_interface__")):
        try:
            return numpy.asarray(x)
        except TypeError as e:  # e.g. a torch bf16 tensor: NumPy has no bfloat16
            raise TypeError(f"{name}: cannot view {type(x).__module__}.{type(x).__name__} of dtype "
                            f"{getattr(x, 'dtype', '?')} as a NumPy array ({e}); pass torch "
                            f"tensors to mxcomm.torch (e.g. mxcomm.torch.a2a_dispatch)") from None
    kind = "CUDA device array (cupy.ndarray, DLPack or __cuda_array_interface__)" if device \
        else "host array (numpy.ndarray)"
    raise TypeError(f"{name}: expected a {kind}, got {type(x).__name__}")


def check_rows(x, name, multiple=1, dtypes=None, *, two_d=True):
    """``x`` as a device array of rows: 2-D (M, D) (``two_d`` False: at least 1-D), dtype in
    ``dtypes`` (None: any), D % ``multiple`` == 0, C-contiguous. Raises TypeError (not an array,
    dtype), ValueError (dimensions, D, not C-contiguous)."""
    x = as_device_array(x, name)
    if two_d and x.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D (M, D) array, "
                         f"got {x.ndim}-D shape {tuple(x.shape)}")
    if x.ndim < 1:
        raise ValueError(f"{name}: expected an array of rows (at least 1-D), got a 0-D array")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, "
                        f"got {x.dtype}")
    if x.shape[-1] % multiple:
        raise ValueError(f"{name}: expected the last dimension D to be a multiple of {multiple}, "
                         f"got D = {x.shape[-1]}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {x.strides}")
    return x


def check_array(a, name, dtype, shape):
    """``a`` as a device array of exactly ``dtype`` and ``shape``, C-contiguous. Raises TypeError
    (not an array, dtype), ValueError (shape, not C-contiguous)."""
    a = as_device_array(a, name)
    if a.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {a.dtype}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {a.strides}")
    return a


def out_dtype(dtype):
    """``dtype`` as a NumPy dtype, bf16 or fp32 (a dequantize's output); TypeError otherwise."""
    try:
        dtype = numpy.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype: expected bfloat16 or float32, got {dtype!r}") from None
    if dtype not in (bfloat16, float32):
        raise TypeError(f"dtype: expected bfloat16 or float32, got {dtype}")
    return dtype


def out_array(out, shape, dtype, stream=None):
    """The ``out`` argument: a new array of ``shape`` and ``dtype`` when None (from ``stream``'s
    part of CuPy's pool: :func:`on_stream`), else checked."""
    if out is None:
        from .kernels import array_module
        with on_stream(stream):
            return array_module().empty(shape, dtype=dtype)
    return check_array(out, "out", dtype, shape)


def out_pair(out, data_shape, scales_shape, stream=None):
    """The ``out`` of an fp8 quantize: a (data uint8, scales float32) pair, new when None (as
    :func:`out_array` makes them), else checked; TypeError when not a pair."""
    if out is None:
        return (out_array(None, data_shape, numpy.uint8, stream),
                out_array(None, scales_shape, float32, stream))
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out: expected a (data, scales) pair or None, got {type(out).__name__}")
    return (check_array(out[0], "out[0] (data)", numpy.dtype(numpy.uint8), data_shape),
            check_array(out[1], "out[1] (scales)", float32, scales_shape))


def on_stream(stream):
    """A context in which CuPy's current stream is ``stream`` (a raw handle or a stream object;
    None: leave CuPy's current stream): what CuPy allocates there comes from that stream's part of
    its pool, and what it fills runs on that stream. A no-op without a GPU. CuPy's pool hands a
    freed block out again to an allocation on the stream it was allocated under: an array made
    under another stream than the one its kernels run on can be reused while they still use it."""
    if stream is None or not gpu_arrays():
        return _NO_STREAM
    import cupy
    ptr = stream_ptr(stream)
    if ptr == cupy.cuda.get_current_stream().ptr:
        return _NO_STREAM
    wrapper = _STREAMS.get(ptr)
    if wrapper is None:  # one CuPy stream over each raw handle, reused (nothing made per call)
        from ._driver import external_stream
        if len(_STREAMS) > 64:
            _STREAMS.clear()
        wrapper = _STREAMS[ptr] = external_stream(ptr)
    return wrapper


_NO_STREAM = contextlib.nullcontext()
_STREAMS = {}  # raw stream handle -> the CuPy stream over it (on_stream)


def stream_ptr(stream=None):
    """The raw CUDA stream handle (int) of ``stream``: None (CuPy's current), a CuPy stream, a torch
    stream or an int; 0 without a GPU."""
    if not gpu_arrays():
        return 0
    if stream is None:
        import cupy
        return cupy.cuda.get_current_stream().ptr
    for attr in ("ptr", "cuda_stream"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    return int(stream)
