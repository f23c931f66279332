"""Where array work runs, decided once per process from ``MXCOMM_BACKEND`` (a leaf: stdlib only).

``auto`` (unset) is ``"cuda"`` where a CUDA device is present (CuPy arrays, the CUDA kernels),
else ``"host"`` (NumPy arrays, the vectorized NumPy twins of ``mxcomm._host``, bit-identical);
``simulator`` runs the CUDA kernels in Numba's CUDA simulator on NumPy arrays (tiny shapes only),
which ``mxcomm.kernels`` turns on before numba loads whenever the backend is not ``"cuda"``.
Nobody else reads the environment; ``import mxcomm`` asks first, so a bad value fails there.
"""

import ctypes
import functools
import os

#: The environment variable read (once) by :func:`backend`.
ENV_VAR = "MXCOMM_BACKEND"
#: Its accepted values.
CHOICES = ("auto", "cuda", "host", "simulator")


@functools.cache
def gpu_present():
    """True when the CUDA driver loads (ctypes) and reports at least one device; cached."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        return driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0 \
            and count.value > 0
    return False


@functools.cache
def backend():
    """``"cuda"``, ``"host"`` or ``"simulator"``, read once from ``MXCOMM_BACKEND``. Raises
    ValueError for a value not in :data:`CHOICES`, RuntimeError for ``cuda`` without a device."""
    choice = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR}: expected one of {', '.join(CHOICES)}, "
                         f"got {os.environ[ENV_VAR]!r}")
    if choice == "auto":
        return "cuda" if gpu_present() else "host"
    if choice == "cuda" and not gpu_present():
        raise RuntimeError(f"{ENV_VAR}=cuda, but no CUDA device is present (the driver reports "
                           f"none); unset it to use the host backend")
    return choice


def gpu_arrays():
    """True when arrays are CuPy arrays on a GPU (backend ``"cuda"``); else NumPy arrays."""
    return backend() == "cuda"


def host_backend():
    """True when MXFP8 and permute work runs in the host backend (vectorized NumPy)."""
    return backend() == "host"


def kernels_simulated():
    """True when launched kernels must run in Numba's CUDA simulator: every backend but "cuda"."""
    return backend() != "cuda"


def describe():
    """The backend's name and what it means, for logs and benchmark headers."""
    return {"cuda": "cuda (the CUDA kernels, on the GPU)",
            "host": "host (vectorized NumPy, on the CPU)",
            "simulator": "simulator (the CUDA kernels in Numba's CUDA simulator, on the CPU)"
            }[backend()]
