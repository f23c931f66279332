"""Shared fixtures: device selection, per-rank seeds, the communicator under test, the backend.

The suite runs where ``mxcomm._platform`` decides (``MXCOMM_BACKEND``): on a CPU the public API runs
in the host backend, and the CUDA kernels run in Numba's CUDA simulator where a test asks for them
(:func:`use_backend`, tests/test_backends.py).
"""

import atexit
import contextlib
import os
import shutil
import sys
import tempfile

import numpy
import pytest

from mxcomm import _platform
from mxcomm.kernels import array_module, simulated

SEED = 1234

# Numba's CUDA simulator runs a block's threads as Python threads and polls them from the
# launching thread without ever blocking: every time a simulated thread wants the GIL it waits
# for that poller's switch interval (5 ms by default), so a kernel with block barriers took
# seconds to minutes per launch, at random (10 s to 8 min for the serial suite's slowest test).
# 0.1 ms: that launch (bench/NOTES.md, 2026-11-25) 2.4 s -> 0.3 s.
sys.setswitchinterval(1e-4)

# "auto" chooses from the tables a test gives it, never from this user's calibrated cache
# (python -m mxcomm.bench calibrate) or $MXCOMM_COST_TABLE: an empty cache folder per process,
# inherited by the processes a test starts.
os.environ.pop("MXCOMM_COST_TABLE", None)
os.environ["MXCOMM_CACHE_DIR"] = tempfile.mkdtemp(prefix="mxcomm-test-cache-")
atexit.register(shutil.rmtree, os.environ["MXCOMM_CACHE_DIR"], True)


def _lock_simulated_shared_arrays():
    """Make the simulator's static ``cuda.shared.array`` atomic. It finds a block's array by the
    calling line with a dict lookup, then a store if absent, and no lock: two threads of one
    block that interleave there get two arrays, and each then reads only its own writes (a
    ``lanes_max`` over garbage: rows quantized to NaN, seen in a few runs of
    tests/test_fp8_formats.py at the switch interval above; bench/NOTES.md, 2026-11-26).
    The same lookup (the caller's file and line), under a lock; dynamic arrays (shape 0) and
    the rest are the simulator's own."""
    import threading

    from numba.cuda import types
    from numba.cuda.simulator import kernelapi
    from numba.cuda.np import numpy_support
    original = kernelapi.FakeCUDAShared.array
    if getattr(original, "locked", False):
        return
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return original(self, shape, dtype, alignment)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            found = self._allocations.get(caller)
            if found is None:
                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                found = self._allocations[caller] = numpy.empty(shape, dtype)
        return found

    array.locked = True
    kernelapi.FakeCUDAShared.array = array


if _platform.kernels_simulated():
    _lock_simulated_shared_arrays()


def pytest_collection_modifyitems(config, items):
    if _platform.gpu_arrays():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU (running on the {_platform.backend()} "
                                   f"backend)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rank():
    """This process's MPI rank (0 without MPI)."""
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


@pytest.fixture
def rng(rank):
    """A NumPy generator seeded ``SEED + rank``: fresh random data on every rank."""
    return numpy.random.default_rng(SEED + rank)


@pytest.fixture
def use_backend(monkeypatch):
    """``with use_backend(name) as xp:`` runs the public API on backend ``name`` (``"host"``,
    ``"simulator"`` or ``"cuda"``) for the block, by replacing the one decision,
    ``mxcomm._platform.backend``; ``xp`` is that backend's array module."""
    @contextlib.contextmanager
    def switch(name):
        with monkeypatch.context() as m:
            m.setattr(_platform, "backend", lambda: name)
            yield array_module()
    return switch


#: What says where the nodes are (comm/_nodes.py).
_NODE_ENV = ("NCCL_HOSTID", "MXCOMM_NODE_SIZE")


@pytest.fixture(scope="module", autouse=True)
def _node_environment_kept(request):
    """Every test module leaves ``NCCL_HOSTID`` and ``MXCOMM_NODE_SIZE`` as it found them, else
    an error at its teardown names it (and the values are put back): left set, every later
    communicator of the process sees the nodes they name (``init("nccl", node_size=k)``
    exports ``NCCL_HOSTID`` for the rest of the process). tests/test_nodes.py's GPU test left
    each rank its own node, so the whole GPU suite ran the later modules across nodes
    (bench/NOTES.md, 2026-11-27)."""
    before = {name: os.environ.get(name) for name in _NODE_ENV}
    yield
    after = {name: os.environ.get(name) for name in _NODE_ENV}
    if after != before:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        changed = {name: (before[name], after[name]) for name in _NODE_ENV
                   if before[name] != after[name]}
        pytest.fail(f"{request.module.__name__} changed the node environment (before, after): "
                    f"{changed}; restored", pytrace=False)


@pytest.fixture(scope="module")
def comm():
    """The default backend's communicator for one module's tests (NCCL on GPUs, one process
    each, its GPU made torch's current device; else MPI), closed after the module. Modules that
    test communicators themselves define their own."""
    from mxcomm import comm as mxc
    c = mxc.init(timeout=60.0)
    if not simulated():
        import torch
        torch.cuda.set_device(c.device)
    yield c
    c.close()


@pytest.fixture(scope="module")
def device(comm):
    """torch's device for ``comm``'s rows: the current CUDA device, or the CPU."""
    import torch
    return torch.device("cpu") if simulated() else torch.device("cuda", torch.cuda.current_device())
