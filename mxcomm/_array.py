"""Arrays in, arrays out: conversion of caller arrays and streams for the kernels and communicators.

Device arrays are CuPy arrays on a GPU and NumPy arrays on a CPU (the host backend, or Numba's CUDA
simulator); which one is decided once, in ``mxcomm._platform`` (``gpu_arrays``), and
``mxcomm.kernels.array_module`` names the module. On a GPU anything exporting
``__cuda_array_interface__`` or DLPack is accepted zero-copy; on a CPU anything NumPy can view.
"""

import ml_dtypes
import numpy

from .kernels import array_module
from ._platform import gpu_arrays

#: bf16 as an array dtype (CuPy and NumPy both use ml_dtypes' type).
bfloat16 = numpy.dtype(ml_dtypes.bfloat16)
float32 = numpy.dtype(numpy.float32)


def as_device_array(x, name):
    """``x`` as an array of the array module, zero-copy.

    Args:
        x: a CuPy/NumPy array, or any object exporting ``__cuda_array_interface__`` or DLPack.
        name: the argument's name, for the error message.
    Raises:
        TypeError: ``x`` is not an array the current device can use.
    """
    xp = array_module()
    if isinstance(x, xp.ndarray):
        return x
    if gpu_arrays():
        if hasattr(x, "__cuda_array_interface__"):
            return xp.asarray(x)
        if hasattr(x, "__dlpack__"):
            return xp.from_dlpack(x)
    elif hasattr(x, "__array__") or hasattr(x, "__array_interface__"):
        try:
            return numpy.asarray(x)
        except TypeError as e:  # e.g. a torch bf16 tensor: NumPy has no bfloat16
            raise TypeError(f"{name}: cannot view {type(x).__module__}.{type(x).__name__} of dtype "
                            f"{getattr(x, 'dtype', '?')} as a NumPy array ({e}); pass torch "
                            f"tensors to mxcomm.torch (e.g. mxcomm.torch.a2a_dispatch)") from None
    where = "CUDA device" if gpu_arrays() else "host"
    raise TypeError(f"{name}: expected a {where} array ({xp.__name__}.ndarray, DLPack or "
                    f"__cuda_array_interface__), got {type(x).__name__}")


def check_rows(x, name, multiple, dtypes, convert=as_device_array):
    """``x`` as an array of rows (``convert``: a device array by default), validated: 2-D (M, D),
    dtype in ``dtypes``, D % ``multiple`` == 0, C-contiguous.

    Raises:
        TypeError: not an array (``convert``), or another dtype.
        ValueError: not 2-D, D not a multiple of ``multiple``, or not C-contiguous.
    """
    x = convert(x, name)
    if x.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D (M, D) array, "
                         f"got {x.ndim}-D shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, "
                        f"got {x.dtype}")
    if x.shape[1] % multiple:
        raise ValueError(f"{name}: expected the last dimension D to be a multiple of {multiple}, "
                         f"got D = {x.shape[1]}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {x.strides}")
    return x


def stream_ptr(stream=None):
    """The raw CUDA stream handle of ``stream`` (0 without a GPU).

    Args:
        stream: None for CuPy's current stream, a CuPy stream (``.ptr``), a torch stream
            (``.cuda_stream``), or an int handle.
    """
    if not gpu_arrays():
        return 0
    if stream is None:
        import cupy
        return cupy.cuda.get_current_stream().ptr
    for attr in ("ptr", "cuda_stream"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    return int(stream)
