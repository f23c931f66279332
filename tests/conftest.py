"""Shared fixtures: device selection, per-rank seeds, the communicator under test, the backend.

The suite runs where ``mxcomm._platform`` decides (``MXCOMM_BACKEND``): on a CPU the public API runs
in the host backend, and the CUDA kernels run in Numba's CUDA simulator where a test asks for them
(:func:`use_backend`, tests/test_backends.py).
"""

import contextlib
import sys

import numpy
import pytest

from mxcomm import _platform
from mxcomm.kernels import array_module

SEED = 1234

# Numba's CUDA simulator runs a block's threads as Python threads and polls them from the
# launching thread without ever blocking: every time a simulated thread wants the GIL it waits
# for that poller's switch interval (5 ms by default), so a kernel with block barriers took
# seconds to minutes per launch, at random (10 s to 8 min for the serial suite's slowest test).
# 0.1 ms: that launch (bench/NOTES.md, thirteenth session) 2.4 s -> 0.3 s.
sys.setswitchinterval(1e-4)


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
