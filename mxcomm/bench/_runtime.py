"""The process a benchmark runs in: rank and size, the device, the communicators, progress lines.

Benchmarks run one process per GPU under ``mpirun``/``mpiexec`` or ``torchrun`` (or alone). Ranks
come from MPI, or under torchrun (``TORCHELASTIC_RUN_ID`` set) from torch.distributed's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``): torch.distributed is initialized
at once (NCCL on GPUs, gloo on a CPU; a gloo group carries the host collectives) and the mxcomm
communicator is built over its default group, with no MPI. On a GPU the device is chosen from the
node-local rank before anything touches CUDA; on a CPU (the host backend, or Numba's CUDA simulator:
``mxcomm._platform``) arrays are NumPy arrays and the communicator is the host backend (MPI, or
torch.distributed under torchrun). Only rank 0 prints.
"""

import os
import socket
import sys

import numpy

from mxcomm import _platform
from mxcomm._array import bfloat16
from mxcomm.kernels import array_module


class Runtime:
    """This process's place in the run.

    Args:
        need_comm: create an mxcomm communicator (``mxcomm.comm.init``) over every rank.
        peer_memory: its ``peer_memory`` (None: pull where every rank can; False: never).
        small_exchange_bytes, medium_exchange_bytes: its ``small_exchange_bytes`` and
            ``medium_exchange_bytes`` (None: the backend's defaults).
    Attributes:
        launcher: ``"mpi"`` (mpirun, or one process alone) or ``"torchrun"``.
        rank, size: this process's rank and the world size.
        mpi_comm: ``MPI.COMM_WORLD`` (None under torchrun).
        backend: ``mxcomm._platform.backend()``: ``"cuda"``, ``"host"`` or ``"simulator"``.
        gpu: True on a GPU (backend ``"cuda"``): CuPy arrays, CUDA-event timings.
        xp: the array module (``numpy`` or ``cupy``). comm: the mxcomm communicator or None.
        clock_kind: ``"cupy"`` on a GPU, else ``"host"``.
    """

    def __init__(self, need_comm=True, peer_memory=None, small_exchange_bytes=None,
                 medium_exchange_bytes=None):
        self.launcher = "torchrun" if launched_by_torchrun() else "mpi"
        self._host_group = None  # torchrun: the gloo group of the host collectives
        if self.launcher == "torchrun":
            self._mpi = self.mpi_comm = None
            env = os.environ
            self.rank, self.size = int(env["RANK"]), int(env["WORLD_SIZE"])
            self.local_rank = int(env.get("LOCAL_RANK", 0))
            self.local_size = int(env.get("LOCAL_WORLD_SIZE", self.size))
        else:
            from mpi4py import MPI
            self._mpi = MPI
            self.mpi_comm = MPI.COMM_WORLD
            self.rank = self.mpi_comm.Get_rank()
            self.size = self.mpi_comm.Get_size()
            node = self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
            node.Free()
        self.backend = _platform.backend()
        self.gpu = _platform.gpu_arrays()
        self.xp = array_module()
        self.clock_kind = "cupy" if self.gpu else "host"
        self.torch_dist = False
        if self.gpu:
            import cupy
            cupy.cuda.Device(self.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
            torch = _torch_or_none()
            if torch is not None and torch.cuda.is_available():
                torch.cuda.set_device(cupy.cuda.Device().id)
        if self.launcher == "torchrun":
            self._init_torchrun()
        self.comm = None
        self._peer_memory = peer_memory
        self._small_exchange_bytes = small_exchange_bytes
        self._medium_exchange_bytes = medium_exchange_bytes
        if need_comm:
            self.comm = self.new_comm()

    def new_comm(self, **options):
        """A new mxcomm communicator over every rank (``mxcomm.comm.init``: MPI's world, or
        torch.distributed's default group under torchrun); ``options`` as ``init`` takes them
        (``peer_memory``, ``small_exchange_bytes`` and ``medium_exchange_bytes`` default to the
        run's)."""
        from mxcomm import comm as comm_module
        options.setdefault("peer_memory", self._peer_memory)
        options.setdefault("small_exchange_bytes", self._small_exchange_bytes)
        options.setdefault("medium_exchange_bytes", self._medium_exchange_bytes)
        if self.launcher == "torchrun":
            import torch.distributed as dist
            return comm_module.init("auto", group=dist.group.WORLD, **options)
        return comm_module.init("auto", self.mpi_comm, **options)

    def _init_torchrun(self):
        """torch.distributed from torchrun's environment (``env://``): NCCL on a GPU, gloo on a
        CPU, and a gloo group for the host collectives (the default group on a CPU)."""
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.gpu else "gloo", init_method="env://",
                                    rank=self.rank, world_size=self.size)
        self.torch_dist = True
        self._host_group = dist.new_group(backend="gloo") if self.gpu else dist.group.WORLD

    def abort(self):
        """End the whole job at once (a failure on one rank): ``MPI_Abort``, or under torchrun
        this process's exit with status 1 (torchrun then stops the others)."""
        if self.launcher == "torchrun":
            os._exit(1)
        self.mpi_comm.Abort(1)

    # ---- output -------------------------------------------------------------------------------
    def log(self, message):
        """A progress line on stderr, rank 0 only."""
        if self.rank == 0:
            print(f"[mxcomm.bench] {message}", file=sys.stderr, flush=True)

    def print(self, text):
        """Print on stdout, rank 0 only."""
        if self.rank == 0:
            print(text, flush=True)

    # ---- synchronization ----------------------------------------------------------------------
    def sync(self):
        """Wait for this process's queued device work (no-op on a CPU)."""
        if not self.gpu:
            return
        import cupy
        cupy.cuda.runtime.deviceSynchronize()

    def barrier(self):
        """Device work done here, then every rank at the same point: the start of a timed region."""
        self.sync()
        if self._host_group is not None:
            import torch.distributed as dist
            dist.barrier(group=self._host_group)
            return
        self.mpi_comm.Barrier()

    def _allreduce(self, values, op):
        """Element-wise reduction of a list of numbers over ranks, as float64 (host MPI, or the
        gloo host group under torchrun)."""
        buf = numpy.asarray(values, dtype=numpy.float64)
        if self._host_group is not None:
            import torch
            import torch.distributed as dist
            t = torch.from_numpy(buf.copy())
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=self._host_group)
            return [float(v) for v in t.tolist()]
        out = numpy.empty_like(buf)
        self.mpi_comm.Allreduce(buf, out, op=getattr(self._mpi, op))
        return [float(v) for v in out]

    def allreduce_max(self, values):
        """Element-wise maximum of a list of floats over ranks (host collective)."""
        return self._allreduce(values, "MAX")

    def back_to_back_ms(self, fn, iters=20, warmup=5):
        """The slowest rank's median ms of ``fn()`` enqueued back to back after a barrier (CUDA
        events; the host clock on a CPU, where it means nothing for a GPU): the probes' timer."""
        from . import _timing
        stats = _timing.measure_back_to_back(fn, _timing.Clock(self.clock_kind), iters=iters,
                                             warmup=warmup, before=self.barrier)
        return _timing.max_over_ranks(stats, self.allreduce_max).median

    def uniform_layout(self, rows, experts_per_rank):
        """The layout of ``rows`` token rows per rank routed uniformly to ``experts_per_rank``
        experts per rank (``mxcomm.exchange_layout``: a collective)."""
        from mxcomm.layout import exchange_layout
        from . import _workload
        counts = _workload.uniform_expert_counts(rows, self.size * experts_per_rank)
        return exchange_layout(self.xp.asarray(counts), self.comm)

    def allreduce_sum(self, values):
        """Element-wise sum of a list of numbers over ranks (host collective; float64, exact
        < 2^53)."""
        return self._allreduce(values, "SUM")

    def bcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self._host_group is not None:
            import torch.distributed as dist
            box = [obj]
            dist.broadcast_object_list(box, src=0, group=self._host_group)
            return box[0]
        return self.mpi_comm.bcast(obj, root=0)

    def allgather(self, obj):
        """Every rank's picklable ``obj``, in rank order."""
        if self._host_group is not None:
            import torch.distributed as dist
            out = [None] * self.size
            dist.all_gather_object(out, obj, group=self._host_group)
            return out
        return self.mpi_comm.allgather(obj)

    # ---- torch --------------------------------------------------------------------------------
    def init_torch_distributed(self):
        """Initialize ``torch.distributed`` on the MPI ranks: NCCL on GPUs, gloo on the CPU (under
        torchrun it already is).

        Rank 0 picks a free TCP port and broadcasts it with mpi4py; the address is 127.0.0.1 when
        all ranks share a node, else rank 0's host name.
        """
        import torch.distributed as dist
        if dist.is_initialized():
            self.torch_dist = True
            return
        port = None
        if self.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        host = "127.0.0.1" if self.local_size == self.size else socket.gethostname()
        host, port = self.bcast((host, port))
        os.environ.setdefault("MASTER_ADDR", host)
        os.environ["MASTER_PORT"] = str(port)
        backend = "nccl" if self.gpu else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.size)
        self.torch_dist = True

    def torch_device(self):
        """The current CUDA device on a GPU, else ``"cpu"``."""
        import torch
        if self.gpu:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def to_torch(self, a):
        """A torch tensor on the same memory as array ``a`` (DLPack; bf16 through an int16 view,
        as ``mxcomm.torch`` does)."""
        import torch
        if a.dtype == bfloat16:
            return torch.from_dlpack(a.view(numpy.int16)).view(torch.bfloat16)
        return torch.from_dlpack(a)

    def from_torch(self, t):
        """An array of the array module on the same memory as tensor ``t``."""
        import torch
        t = t.detach()
        if t.dtype == torch.bfloat16:
            return self.xp.from_dlpack(t.view(torch.int16)).view(bfloat16)
        return self.xp.from_dlpack(t)

    # ---- data ---------------------------------------------------------------------------------
    def random_bf16(self, shape, seed):
        """(shape) bf16 standard-normal array of the array module, seeded (never zeros)."""
        if not self.gpu:
            rng = numpy.random.default_rng(seed)
            return rng.standard_normal(shape, dtype=numpy.float32).astype(bfloat16)
        torch = _torch_or_none()
        if torch is not None:
            g = torch.Generator(device="cuda").manual_seed(seed)
            return self.from_torch(torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=g))
        import cupy
        x = cupy.random.RandomState(seed).standard_normal(shape, dtype=cupy.float32)
        return x.astype(bfloat16)

    def random_bytes(self, shape, seed):
        """(shape) uint8 array of uniformly random bytes, seeded."""
        if not self.gpu:
            return numpy.random.default_rng(seed).integers(0, 256, shape, dtype=numpy.uint8)
        import cupy
        return cupy.random.RandomState(seed).randint(0, 256, size=shape, dtype=cupy.uint8)

    def memory_used(self):
        """Bytes in use: CuPy's memory pool plus torch's allocator on a GPU; host RSS on the CPU."""
        if not self.gpu:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        import cupy
        used = cupy.get_default_memory_pool().used_bytes()
        torch = _torch_or_none()
        if torch is not None and torch.cuda.is_available():
            used += torch.cuda.memory_allocated()
        return int(used)

    def close(self):
        """Close the communicators this runtime opened."""
        if self.torch_dist:
            import torch.distributed as dist
            dist.barrier(group=self._host_group)
            dist.destroy_process_group()
            self.torch_dist = False
            self._host_group = None
        if self.comm is not None:
            self.comm.close()
            self.comm = None


def launched_by_torchrun():
    """True in a process started by ``torchrun`` (torch.distributed.elastic sets
    ``TORCHELASTIC_RUN_ID``)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def _torch_or_none():
    try:
        import torch
        return torch
    except ImportError:
        return None
