"""``mxcomm.comm.init``: a communicator of the backend that fits this machine."""

_BACKENDS = ("auto", "nccl", "mpi")


def init(backend="auto", mpi_comm=None, *, timeout=300.0, validate=True, peer_memory=None):
    """A communicator over the ranks of ``mpi_comm``.

    Collective: every rank of ``mpi_comm`` must call it, with the same ``backend``.

    Args:
        backend: ``"nccl"`` (:class:`NcclCommunicator`, device arrays), ``"mpi"``
            (:class:`MpiCommunicator`, host NumPy arrays), or ``"auto"``: NCCL when this process
            runs array work on a real GPU and CuPy with NCCL imports on every rank, else MPI.
        mpi_comm: an mpi4py communicator; None for ``MPI.COMM_WORLD``. Duplicated, not consumed.
        timeout: seconds a collective, or a device wait for a peer, may take before the
            communicator is aborted (> 0). The default, 300 s, leaves room for first-call
            compilation on every rank.
        validate: default of the per-call ``validate`` of explicit-splits calls: check counts
            across ranks before moving data (one small host allgather per call). Calls given a
            layout never vote.
        peer_memory: transport of the staged exchanges (the low-precision ones use it): None
            (auto) pulls rows from the peers' memory where every rank is on one node (CUDA IPC
            on GPUs, an MPI shared window on the host), else one ``alltoallv``; True requires
            the pull; False never pulls.
    Returns:
        A communicator: ``rank``, ``size``, ``timeout``, ``transport``, ``alltoallv``,
        ``exchange``, ``check``, ``alltoall_counts``, ``wait``, ``barrier``, ``abort``,
        ``close``; usable as a context manager.
    Raises:
        ValueError: an unknown ``backend``, a non-positive ``timeout`` or a bad ``peer_memory``.
        RuntimeError: ``backend="nccl"`` where CuPy's NCCL is unavailable; ``peer_memory=True``
            where some rank cannot map its peers' memory.
        TimeoutError: a rank did not join within ``timeout`` s.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, _BACKENDS))}, "
                         f"got {backend!r}")
    if backend == "auto":
        from mpi4py import MPI
        parent = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        # Every rank must pick the same backend: NCCL only if it works everywhere.
        backend = "nccl" if parent.allreduce(_nccl_available(), op=MPI.LAND) else "mpi"
    if backend == "nccl":
        from ._nccl import NcclCommunicator
        return NcclCommunicator(mpi_comm, timeout=timeout, validate=validate,
                                peer_memory=peer_memory)
    from ._mpi import MpiCommunicator
    return MpiCommunicator(mpi_comm, timeout=timeout, validate=validate, peer_memory=peer_memory)


def _nccl_available():
    """True when array work runs on a GPU and ``cupy.cuda.nccl`` imports and reports a version."""
    from mxcomm._platform import gpu_arrays  # the one place that decides where arrays live
    if not gpu_arrays():
        return False
    try:
        from cupy.cuda import nccl
        return bool(nccl.available) and nccl.get_version() > 0
    except Exception:  # no CuPy, no NCCL library, no driver: fall back to MPI
        return False
