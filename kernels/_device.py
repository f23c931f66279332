"""Where the CUDA kernels run: the GPU, or Numba's CUDA simulator on the CPU.

Applies ``mxcomm._platform``'s decision to numba, which reads ``NUMBA_ENABLE_CUDASIM`` once, at its
import: imported before numba, it turns the simulator on whenever the backend is not ``"cuda"``, so
the tests can still launch the kernels on host arrays.
"""

import os
import sys

from mxcomm._platform import backend, gpu_arrays, kernels_simulated  # the leaf that decides

if kernels_simulated() and "numba" not in sys.modules:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

from numba import config as _numba_config  # noqa: E402  (after the simulator decision)

_SIMULATED = bool(_numba_config.ENABLE_CUDASIM)

if _SIMULATED != kernels_simulated() and backend() != "host":
    # numba imported first, or NUMBA_ENABLE_CUDASIM set, against the decision (only the host
    # backend, launching no kernels, works so)
    raise RuntimeError(
        f"mxcomm backend {backend()!r} needs Numba's CUDA simulator "
        f"{'on' if kernels_simulated() else 'off'}, but numba has it "
        f"{'on' if _SIMULATED else 'off'} (NUMBA_ENABLE_CUDASIM="
        f"{os.environ.get('NUMBA_ENABLE_CUDASIM', 'unset')}); import mxcomm before numba, or "
        f"set MXCOMM_BACKEND and NUMBA_ENABLE_CUDASIM consistently")


def simulated():
    """True when the CUDA kernels run in Numba's CUDA simulator (every backend but ``"cuda"``)."""
    return _SIMULATED


def array_module():
    """The array module of device arrays: ``cupy`` on a GPU (backend ``"cuda"``), else ``numpy``."""
    if gpu_arrays():
        import cupy
        return cupy
    import numpy
    return numpy
