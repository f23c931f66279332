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
#: The defaults of ``init``'s ``small_exchange_bytes`` and ``medium_exchange_bytes``.


def init(backend="auto", mpi_comm=None, *, group=None, timeout=300.0, validate=True,
         peer_memory=None, device=None, nccl_init=None, small_exchange_bytes=None,
         medium_exchange_bytes=None, node_size=None):
    """A communicator over the ranks of ``mpi_comm`` or of the torch.distributed ``group``.

    Collective: every rank of ``mpi_comm`` (or ``group``) must call it, with the same ``backend``.

    Where the ranks come from (the host side channel, ``_sidechannel``):
    - ``group``: a ``torch.distributed`` ``ProcessGroup`` (any backend: gloo, or NCCL on GPUs)
      or a 1-D ``DeviceMesh`` (``mesh["ep"]``): ranks are the group's ranks, so an EP group
      inside a larger world works; no MPI is needed (``torchrun``). The host side channel is a
      private gloo group over those ranks, rendezvoused through the group's store.
    - ``mpi_comm``: an mpi4py communicator (duplicated, not consumed).
    - neither: ``MPI.COMM_WORLD``; in a process launched by ``torchrun``, torch.distributed's
      default group instead (it must be initialized).

    Args:
        backend: ``"nccl"`` (:class:`NcclCommunicator`, device arrays), ``"mpi"``
            (:class:`MpiCommunicator`, host NumPy arrays, data over MPI), ``"torch"``
            (``TorchHostCommunicator``, host NumPy arrays, data over torch.distributed's
            gloo), or ``"auto"``: NCCL when every rank runs array work on a real GPU and CuPy
            with NCCL imports there (agreed over the side channel), else the host backend of
            the ranks' source (``"mpi"`` or ``"torch"``).
        mpi_comm: an mpi4py communicator, or None.
        group: a torch ``ProcessGroup`` or 1-D ``DeviceMesh``, or None. Not with ``mpi_comm``.
        timeout: seconds a collective, or a device wait for a peer, may take before the
            communicator is aborted (> 0). The default, 300 s, leaves room for first-call
            compilation on every rank.
        validate: default of the per-call ``validate`` of explicit-splits calls: check counts
            across ranks before moving data (one small host allgather per call). Calls given a
            layout never vote.
        peer_memory: transport of the staged exchanges (the low-precision ones use it): None
            (auto) pulls rows from the peers' memory where every rank is on one node (CUDA IPC
            on GPUs, an MPI shared window on the host), else one ``alltoallv``; True requires
            the pull; False never pulls. A torch group's host backend has no shared window.
        device: NCCL only: this process's CUDA device. None: from a torch group, torch's
            current device if torch has initialized CUDA, else ``LOCAL_RANK``, else the
            node-local rank; from MPI, the node-local rank (modulo the devices).
        nccl_init: NCCL only: ``"eager"`` builds NCCL's communicator in ``init``; ``"lazy"``
            at the first call that moves data over NCCL (collective like every such call; not
            inside a CUDA graph capture), so a job whose exchanges all pull from peer memory
            never builds it. None: ``MXCOMM_NCCL_INIT`` from the environment, else ``"eager"``.
        small_exchange_bytes: a quantized exchange (any direction, the drop-in) of bf16/fp32
            rows in which no rank sends more than this many bytes of them to its peers moves
            them unquantized, in one ``alltoallv``, and quantizes them on arrival: the same
            results bit for bit, fewer launches and less host time where the saved bytes take
            less time than those (docs/design.md, "Small exchanges travel unquantized"). 0
            never does. Every rank must give the same value (checked here, collectively). None:
            the backend's default where every rank is on one node (64 MiB for NCCL, measured on H100s over NVLink,
            bench/NOTES.md; 0 on the host backends), and 0 across nodes (unmeasured there, where
            the saved bytes weigh more).
        medium_exchange_bytes: an exchange of bf16/fp32 rows that is not small, whose result
            stays quantized (``a2a_dispatch``, ``a2a_combine_backward``), and in which no rank
            sends more than this many bytes of them (in their own dtype, as above) to its peers
            quantizes them on the caller's stream and moves the quantized rows in one
            ``alltoallv``, instead of staging them: the same results bit for bit, less host time
            per call (docs/design.md, "Medium exchanges travel quantized in one alltoallv"). 0
            never does. Every rank must give the same value. None: the backend's default
            where every rank is on one node (128 MiB for NCCL, bench/NOTES.md; 0 on the host
            backends), and 0 across nodes.
        node_size: None, or a positive int: emulate nodes of ``node_size`` consecutive ranks
            (the last may be smaller) inside the real ones, every rank giving the same. None:
            ``$MXCOMM_NODE_SIZE`` where set, else the nodes NCCL sees (``$NCCL_HOSTID`` where
            every rank sets it), else the real hosts. Peer memory is used only inside a node;
            across nodes the exchange takes the ``hier`` transport (docs/design.md, "EP across
            nodes"). With NCCL, an emulation sets ``NCCL_HOSTID=node<k>`` in this process
            before NCCL is built, so NCCL takes its network transport between the emulated
            nodes; it stays set, so a later ``init`` in the process sees the same split.
    Returns:
        A communicator: ``rank``, ``size``, ``timeout``, ``transport``, ``group``,
        ``alltoallv``, ``exchange``, ``check``, ``alltoall_counts``, ``wait``, ``barrier``,
        ``abort``, ``close``; usable as a context manager.
    Raises:
        ValueError: an unknown ``backend``, a non-positive ``timeout``, a bad ``peer_memory``,
            ``nccl_init``, ``small_exchange_bytes``, ``medium_exchange_bytes`` or
            ``node_size`` (or ranks giving different ones; an emulated node spanning two hosts;
            ``NCCL_HOSTID`` on some ranks only, or splitting the ranks unlike ``node_size``),
            ``mpi_comm`` and ``group`` both given, a backend that does not fit the ranks'
            source (``"mpi"`` with a group, ``"torch"`` with ``mpi_comm``), a DeviceMesh of more
            than one dimension, or this process not in ``group``.
        TypeError: ``group`` is neither a ProcessGroup nor a DeviceMesh.
        RuntimeError: ``backend="nccl"`` where CuPy's NCCL is unavailable; ``peer_memory=True``
            where some rank cannot map its peers' memory; under torchrun with neither argument,
            torch.distributed not initialized.
        TimeoutError: a rank did not join within ``timeout`` s.
    """
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
    _check_exchange_bytes(small_exchange_bytes, "small_exchange_bytes")
    _check_exchange_bytes(medium_exchange_bytes, "medium_exchange_bytes")
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
        from ._torchside import TorchSideChannel
        side = TorchSideChannel(group, timeout)
    else:
        from ._sidechannel import MpiSideChannel
        side = MpiSideChannel(mpi_comm, timeout)
    side.open_board()
    side.nodes = discover(side, node_size)
    if backend == "auto":
        # Every rank must pick the same backend: NCCL only if it works everywhere.
        votes = side.allgather_bytes(bytes([_nccl_available()]), "backend choice (vote)")
        backend = "nccl" if all(votes) else side.kind
    if backend == "nccl":
        side.nodes.export_hostid(side.rank)  # before NCCL is built
        from ._nccl import NcclCommunicator
        if device is None and side.kind == "torch":
            device = _torch_device()
        return NcclCommunicator(side, validate=validate, device=device, peer_memory=peer_memory,
                                nccl_init=nccl_init, small_exchange_bytes=small_exchange_bytes,
                                medium_exchange_bytes=medium_exchange_bytes)
    if side.kind == "torch":
        from ._torchdist import TorchHostCommunicator
        return TorchHostCommunicator(side, validate=validate, peer_memory=peer_memory,
                                     small_exchange_bytes=small_exchange_bytes,
                                     medium_exchange_bytes=medium_exchange_bytes)
    from ._mpi import MpiCommunicator
    return MpiCommunicator(side, validate=validate, peer_memory=peer_memory,
                           small_exchange_bytes=small_exchange_bytes,
                           medium_exchange_bytes=medium_exchange_bytes)


def _default_torch_group(backend):
    """torch.distributed's default group (``torchrun``, or ``backend="torch"`` without a group).

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        why = "backend 'torch' without a group" if backend == "torch" else \
            "this process was launched by torchrun"
        raise RuntimeError(f"init: {why}, but torch.distributed is not initialized: call "
                           f"torch.distributed.init_process_group() first, or pass group= "
                           f"(or mpi_comm=)")
    return dist.group.WORLD


def _torch_device():
    """The CUDA device of a process of a torch group: torch's current device once torch has
    initialized CUDA (the caller chose it), else ``LOCAL_RANK`` modulo the devices, else None
    (the node-local rank)."""
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


def _check_exchange_bytes(value, name):
    """Check ``init``'s ``value`` of ``name`` (small or medium exchange bytes): None or an int in
    [0, 2**63) (the ranks agree on it as an int64)."""
    if value is not None and (type(value) is bool or not isinstance(value, int) or
                              not 0 <= value < 2**63):
        raise ValueError(f"{name}: expected None or a non-negative int (bytes, below 2**63), "
                         f"got {value!r}")
