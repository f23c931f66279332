"""Communicators of mxcomm (installed as ``mxcomm.comm``): all-to-all of rows over NCCL, MPI or
torch.distributed, among the ranks of an mpi4py communicator or of a torch.distributed group.

``import mxcomm.comm`` imports neither CuPy, mpi4py nor torch: the backends load on first use.
"""

from ._factory import init

__all__ = ["init", "Communicator", "MpiCommunicator", "NcclCommunicator",
           "TorchHostCommunicator", "Plan"]

_LAZY = {"Communicator": "._communicator", "MpiCommunicator": "._mpi",
         "NcclCommunicator": "._nccl", "TorchHostCommunicator": "._torchdist",
         "Plan": "._staged"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
