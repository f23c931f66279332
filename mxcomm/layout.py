"""Step 0 of the EP token path: exchange the per-expert token counts and derive the split sizes.

Glossary: E experts, E_local experts per rank, W ranks (``comm.size``); expert ``e`` lives on rank
``e // E_local``.
"""

import numpy

from ._array import as_device_array
from .a2a import _Streams
from .kernels import array_module


def exchange_layout(num_tokens_per_expert, comm, *, stream=None):
    """Tell every rank how many rows it will receive from each peer, per local expert.

    An all-to-all of ``num_tokens_per_expert`` in chunks of E_local gives the counts every rank
    sends to my experts. The split sizes are summed on the device, concatenated, and read back in
    ONE device-to-host copy: this is the only host synchronization of the whole token path. The
    wait for it is timeout-guarded (``comm.wait``), so a peer that never joins raises instead of
    hanging.

    Args:
        num_tokens_per_expert: (E,) integer device array, E a multiple of W: rows this rank routes
            to each global expert (its rows are sorted by expert). Read.
        comm: a communicator (``mxcomm.comm.init()``).
        stream: CUDA stream to enqueue on (None: CuPy's current stream; ignored on the simulator).
    Returns:
        ``(num_tokens_per_expert_group, input_splits, output_splits)``:
        num_tokens_per_expert_group: (E,) int32 device array, rank-major: entry
            ``r * E_local + j`` = rows rank r sends to my local expert j.
        input_splits: W host ints, rows I send to each rank.
        output_splits: W host ints, rows I receive from each rank.
    Raises:
        TypeError: the counts are not an integer array.
        ValueError: the counts are not 1-D, or their length is not a positive multiple of W.
        TimeoutError: the exchange did not finish within ``comm.timeout`` s.
    """
    counts = as_device_array(num_tokens_per_expert, "num_tokens_per_expert")
    if counts.ndim != 1:
        raise ValueError(f"num_tokens_per_expert: expected a 1-D array of E counts, got shape "
                         f"{tuple(counts.shape)}")
    if counts.dtype.kind not in "iu":
        raise TypeError(f"num_tokens_per_expert: expected an integer array, got dtype "
                        f"{counts.dtype}")
    world = comm.size
    num_experts = counts.shape[0]
    if num_experts == 0 or num_experts % world:
        raise ValueError(f"num_tokens_per_expert: length {num_experts} is not divisible into "
                         f"{world} ranks")
    local_experts = num_experts // world

    xp = array_module()
    streams = _Streams(stream)
    with streams.on_caller():
        counts = xp.ascontiguousarray(counts, dtype=numpy.int32)
        group = comm.alltoall_counts(counts, stream=streams.caller_ptr)
        group = xp.ascontiguousarray(group, dtype=numpy.int32)
        # Both split vectors in one buffer: one device-to-host copy.
        splits = xp.concatenate([counts.reshape(world, local_experts).sum(axis=1),
                                 group.reshape(world, local_experts).sum(axis=1)])
    comm.wait(streams.caller_ptr)
    host = [int(v) for v in streams.to_host(splits)]
    return group, host[:world], host[world:]
