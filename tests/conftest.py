"""Shared fixtures: device selection, per-rank seeds, the communicator under test."""

import numpy
import pytest

from mxcomm.kernels import simulated

SEED = 1234


def pytest_collection_modifyitems(config, items):
    if not simulated():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (running in Numba's CUDA simulator)")
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
