"""Grid sizing for every kernel launch: one helper, no block sizes scattered around."""

from numba import cuda

from ._device import simulated

#: Threads per block on a GPU (a multiple of the 32-thread warp).
THREADS_PER_BLOCK = 256
#: Resident blocks per multiprocessor a grid-stride launch aims for.
BLOCKS_PER_SM = 8
#: Under the simulator every CUDA thread is a Python thread: keep launches tiny.
SIM_THREADS_PER_BLOCK = 32
SIM_MAX_BLOCKS = 2

_sm_count = []  # filled on first use: the current device's multiprocessor count


def _multiprocessors():
    if not _sm_count:
        _sm_count.append(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    return _sm_count[0]


def launch_1d(n, stream=0, *, threads=None):
    """Launch configuration ``(blocks, threads, stream)`` for ``n`` work items, grid-stride.

    Kernels launched with it must loop ``for i in range(start, n, stride)``: the grid is capped at
    ``BLOCKS_PER_SM`` blocks per multiprocessor (a persistent grid), and never empty.

    Args:
        n: number of work items (threads' worth of work), >= 0.
        stream: a numba stream (``cuda.external_stream(ptr)``) or 0 for the default stream.
        threads: threads per block, a multiple of 32; default ``THREADS_PER_BLOCK``.
    Returns:
        A tuple to index a kernel with: ``kernel[launch_1d(n, stream)](...)``.
    """
    if simulated():
        threads = min(threads or SIM_THREADS_PER_BLOCK, SIM_THREADS_PER_BLOCK)
        blocks = max(1, min(SIM_MAX_BLOCKS, -(-n // threads)))
        return blocks, threads, 0
    threads = threads or THREADS_PER_BLOCK
    blocks = max(1, min(-(-n // threads), BLOCKS_PER_SM * _multiprocessors()))
    return blocks, threads, stream
