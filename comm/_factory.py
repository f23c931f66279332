"""``mxcomm.comm.init``: a communicator of the backend that fits this machine, over the ranks of
an mpi4py communicator or of a torch.distributed group."""

import os
import sys

from ._nodes import discover

_BACKENDS = ("auto", "nccl", "mpi", "torch")
#: Set by torchrun (torch.distributed.elastic) in every process it launches.
_TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"
#: The default of ``init``'s ``nccl_init``.
_NCCL_INIT_ENV = "MXCOMM_NCCL_INIT"


def init(backend="auto", mpi_comm=None, *, group=None, timeout=300.0, validate=True,
         peer_memory=None, device=None, nccl_init=None, small_exchange_bytes=None,
         medium_exchange_bytes=None, node_size=None):
    """A communicator over the ranks of ``mpi_comm`` or of the torch.distributed ``group``.

    Collective: every rank of ``mpi_comm`` (or ``group``) calls it, with the same ``backend``
    (and the same exchange limits and ``node_size``: checked). The ranks come from ``group`` (a
    private gloo group over its ranks: no MPI needed), from ``mpi_comm`` (duplicated), else from
    ``MPI.COMM_WORLD`` (torch's default group under torchrun).

    Args:
        backend: ``"nccl"`` (:class:`NcclCommunicator`, device arrays), ``"mpi"``
            (:class:`MpiCommunicator`, NumPy arrays over MPI), ``"torch"``
            (``TorchHostCommunicator``, NumPy arrays over gloo), or ``"auto"``: NCCL where every
            rank has a GPU and CuPy's NCCL, else the host backend of the ranks' source.
        mpi_comm: an mpi4py communicator, or None.
        group: a torch ``ProcessGroup`` (any backend) or a 1-D ``DeviceMesh`` (``mesh["ep"]``), or
            None. Not with ``mpi_comm``.
        timeout: seconds (> 0) a collective or a device wait for a peer may take before the
            communicator is aborted; 300 leaves room for first-call compilation.
        validate: default of the per-call ``validate`` of explicit-splits calls (one small host
            allgather per call). Calls given a layout never vote.
        peer_memory: transport of the staged exchanges: None (auto) pulls from peer memory where
            every rank is on one node (CUDA IPC; on the host an MPI shared window, which a torch
            group lacks), else one ``alltoallv``; True requires peer memory: the pull on one
            node, across nodes ``hier`` (the pull inside a node, one ``alltoallv`` between
            nodes; docs/design.md, "EP across nodes"); False never pulls.
        device: NCCL only: this process's CUDA device. None: over a torch group torch's current
            device if CUDA is initialized, else ``LOCAL_RANK``; else the node-local rank (modulo the
            devices).
        nccl_init: NCCL only: ``"eager"`` or ``"lazy"`` (see :class:`NcclCommunicator`). None:
            ``$MXCOMM_NCCL_INIT``, else ``"eager"``.
        small_exchange_bytes: a quantized exchange of bf16/fp32 rows in which no rank sends more
            than this many bytes moves them unquantized in one ``alltoallv`` and quantizes on
            arrival, bit for bit the same (docs/design.md, "Small exchanges travel unquantized");
            0 never. None: on one node the backend's default (64 MiB for NCCL, else 0), 0 across.
        medium_exchange_bytes: the same limit for an exchange whose result stays quantized: moved
            quantized in one ``alltoallv`` instead of staged (docs/design.md, "Medium exchanges
            travel quantized in one alltoallv"). None: 128 MiB for NCCL on one node, else 0.
        node_size: None or an int > 0: emulate nodes of ``node_size`` consecutive ranks inside the
            real ones (docs/design.md, "EP across nodes"). None: ``$MXCOMM_NODE_SIZE``, else
            ``$NCCL_HOSTID`` where every rank sets it, else the hosts. With NCCL an emulation sets
            ``NCCL_HOSTID=node<k>`` in this process before NCCL is built.
    Returns:
        A communicator (:class:`~mxcomm.comm.Communicator`); usable as a context manager.
    Raises:
        ValueError: a bad argument (or ranks giving different ones; an emulated node spanning two
            hosts; ``NCCL_HOSTID`` on some ranks only, or splitting unlike ``node_size``), both
            ``mpi_comm`` and ``group``, a backend unlike the ranks' source (``"mpi"`` with a group,
            ``"torch"`` with ``mpi_comm``), a DeviceMesh of several dimensions, or this process not
            in ``group``.
        TypeError: ``group`` is neither a ProcessGroup nor a DeviceMesh.
        RuntimeError: ``backend="nccl"`` without CuPy's NCCL; ``peer_memory=True`` where a rank
            cannot map its peers' memory; under torchrun with neither argument, torch.distributed
            not initialized.
        TimeoutError: a rank did not join within ``timeout`` s."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, _BACKENDS))}, "
                         f"got {backend!r}")
    timeout = float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout}")
    if peer_memory not in (None, True, False):
        raise ValueError(f"peer_memory: expected None (auto), True or False, got "
                         f"{peer_memory!r}")
    if nccl_init is None:
        nccl_init = os.environ.get(_NCCL_INIT_ENV, "eager")
    if nccl_init not in ("eager", "lazy"):
        raise ValueError(f"nccl_init: expected 'eager' or 'lazy' (None: ${_NCCL_INIT_ENV}, "
                         f"else 'eager'), got {nccl_init!r}")
    for name, value in (("small_exchange_bytes", small_exchange_bytes),
                        ("medium_exchange_bytes", medium_exchange_bytes)):
        if value is not None and (type(value) is bool or not isinstance(value, int) or
                                  not 0 <= value < 2**63):  # agreed as int64
            raise ValueError(f"{name}: expected None or a non-negative int (bytes, below 2**63), "
                             f"got {value!r}")
    if node_size is not None and (type(node_size) is bool or not isinstance(node_size, int) or
                                  node_size < 1):
        raise ValueError(f"node_size: expected None or a positive int (ranks per emulated "
                         f"node), got {node_size!r}")
    if mpi_comm is not None and group is not None:
        raise ValueError("init: give mpi_comm or group, not both")
    if group is None and mpi_comm is None and (backend == "torch" or
                                               os.environ.get(_TORCHRUN_ENV) is not None):
        group = _default_torch_group(backend)
    if group is not None and backend == "mpi":
        raise ValueError("backend 'mpi' moves data over MPI: give mpi_comm, not group (or "
                         "backend 'torch', 'nccl' or 'auto')")
    if mpi_comm is not None and backend == "torch":
        raise ValueError("backend 'torch' moves data over torch.distributed: give group, not "
                         "mpi_comm")

    if group is not None:
        from ._torchdist import TorchSideChannel
        side = TorchSideChannel(group, timeout)
    else:
        from ._mpi import MpiSideChannel
        side = MpiSideChannel(mpi_comm, timeout)
    side.open_board()
    side.nodes = discover(side, node_size)
    if backend == "auto":
        # Every rank must pick the same backend: NCCL only if it works everywhere.
        votes = side.allgather_bytes(bytes([_nccl_available()]), "backend choice (vote)")
        backend = "nccl" if all(votes) else side.kind
    options = dict(validate=validate, peer_memory=peer_memory,
                   small_exchange_bytes=small_exchange_bytes,
                   medium_exchange_bytes=medium_exchange_bytes)
    if backend == "nccl":
        side.nodes.export_hostid(side.rank)  # before NCCL is built
        from ._nccl import NcclCommunicator
        if device is None and side.kind == "torch":
            device = _torch_device()
        return NcclCommunicator(side, device=device, nccl_init=nccl_init, **options)
    if side.kind == "torch":
        from ._torchdist import TorchHostCommunicator
        return TorchHostCommunicator(side, **options)
    from ._mpi import MpiCommunicator
    return MpiCommunicator(side, **options)


def _default_torch_group(backend):
    """torch.distributed's default group; RuntimeError if it is not initialized."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        why = "backend 'torch' without a group" if backend == "torch" else \
            "this process was launched by torchrun"
        raise RuntimeError(f"init: {why}, but torch.distributed is not initialized: call "
                           f"torch.distributed.init_process_group() first, or pass group= "
                           f"(or mpi_comm=)")
    return dist.group.WORLD


def _torch_device():
    """A torch group's CUDA device: torch's current one once CUDA is initialized, else
    ``LOCAL_RANK`` modulo the devices, else None."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        return None
    import cupy
    return int(local_rank) % cupy.cuda.runtime.getDeviceCount()


def _nccl_available():
    """True when array work runs on a GPU and ``cupy.cuda.nccl`` imports and reports a version."""
    from mxcomm._platform import gpu_arrays  # the one place that decides where arrays live
    if not gpu_arrays():
        return False
    try:
        from cupy.cuda import nccl
        return bool(nccl.available) and nccl.get_version() > 0
    except Exception:  # no CuPy, no NCCL library, no driver: fall back to the host backend
        return False
