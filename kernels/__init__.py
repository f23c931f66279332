"""Numba CUDA kernels of mxcomm (installed as ``mxcomm.kernels``). Imports numba, and of ``mxcomm``
only the leaves ``_platform`` and ``_driver``."""

from ._device import array_module, simulated  # first: sets up the simulator before numba loads
from ._launch import (UNBOUNDED, Kernel, Launch, SizedLaunch, Words, address, clear_prepared,
                      kernel, launch_1d, prepared, resident_launch, words)

__all__ = ["array_module", "simulated", "Kernel", "Launch", "SizedLaunch", "UNBOUNDED", "Words",
           "address", "clear_prepared", "kernel", "launch_1d", "prepared", "resident_launch",
           "words"]
