"""Where the kernels run: a CUDA GPU, or Numba's CUDA simulator on the CPU.

This is the one place that decides. Importing it before numba selects the simulator by itself when
no CUDA device is present (``NUMBA_ENABLE_CUDASIM=1``, which numba reads once, at its own import);
an explicit ``NUMBA_ENABLE_CUDASIM`` in the environment always wins. Everything else asks
:func:`simulated` or :func:`array_module` and never branches on the environment itself.
"""

import ctypes
import os
import sys


def _cuda_device_present():
    """True when the CUDA driver loads and reports at least one device (no numba, no CuPy)."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        return driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0 \
            and count.value > 0
    return False


if "numba" not in sys.modules and "NUMBA_ENABLE_CUDASIM" not in os.environ \
        and not _cuda_device_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

from numba import config as _numba_config  # noqa: E402  (after the simulator decision)

_SIMULATED = bool(_numba_config.ENABLE_CUDASIM)


def simulated():
    """True when kernels run in Numba's CUDA simulator (NumPy arrays on the host)."""
    return _SIMULATED


def array_module():
    """The array module of device arrays: ``numpy`` under the simulator, else ``cupy``."""
    if _SIMULATED:
        import numpy
        return numpy
    import cupy
    return cupy
