"""Communicators of mxcomm (installed as ``mxcomm.comm``): all-to-all of rows over NCCL or MPI.

``import mxcomm.comm`` imports neither CuPy nor mpi4py: the backends load on first use.
"""

from ._factory import init

__all__ = ["init", "Communicator", "MpiCommunicator", "NcclCommunicator"]

_LAZY = {"Communicator": "._communicator", "MpiCommunicator": "._mpi",
         "NcclCommunicator": "._nccl"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
