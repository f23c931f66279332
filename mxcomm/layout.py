"""Step 0 of the EP token path: the layout exchange, where the ranks agree once per step.

Glossary: E experts, E_local experts per rank, W ranks (``comm.size``); expert ``e`` lives on rank
``e // E_local``. Given the :class:`Layout`, dispatch, permute, unpermute, combine and their
backwards make no host collective (docs/design.md, "The layout object").
"""

import numpy

from ._array import as_device_array
from .comm import Plan
from .kernels import array_module

_INT32_MAX = 2**31 - 1


class Layout(tuple):
    """Everything derived from one layout exchange; unpacks as ``(group, input_splits,
    output_splits)``. Read-only: the ranks agreed on these values.

    Attributes:
        comm: the communicator the layout was agreed on.
        num_tokens_per_expert_group: (E,) int32 device array, rank-major: entry
            ``r * E_local + j`` = rows rank r sends to my local expert j.
        input_splits, output_splits: lists of W ints: rows I send to / receive from each rank.
        counts: (W, E) int64 host array, every rank's ``num_tokens_per_expert``.
        sent: W lists of W ints, ``sent[j][i]`` rows rank j sends rank i.
        num_local_experts: E_local.
        num_rows: M = sum(input_splits), the rows this rank dispatches.
        num_received: N = sum(output_splits), the rows it receives.
        dispatch_plan, combine_plan: the exchange plans of both directions (``mxcomm.comm``).
    """

    def __new__(cls, comm, group, counts, num_local_experts):
        world, rank = comm.size, comm.rank
        per_rank = counts.reshape(world, world, num_local_experts).sum(axis=2)  # [j, i]
        sent = per_rank.tolist()
        input_splits = sent[rank]
        output_splits = [row[rank] for row in sent]
        self = super().__new__(cls, (group, list(input_splits), list(output_splits)))
        self.comm = comm
        self.num_tokens_per_expert_group = group
        self.input_splits = list(input_splits)
        self.output_splits = list(output_splits)
        self.counts = counts
        self.sent = sent
        self.num_local_experts = num_local_experts
        self.num_rows = sum(input_splits)
        self.num_received = sum(output_splits)
        self.dispatch_plan = Plan(rank, sent)
        self.combine_plan = self.dispatch_plan.transposed()
        # every rank agrees on every layout, so numbers them alike
        self.dispatch_plan.generation = self.combine_plan.generation = comm.next_layout_number()
        self._cache = {}  # per-layout results reused by the primitives (e.g. permute indices)
        return self

    def __repr__(self):
        return (f"Layout(rank={self.comm.rank}, world={self.comm.size}, "
                f"num_local_experts={self.num_local_experts}, input_splits={self.input_splits}, "
                f"output_splits={self.output_splits})")

    def permuted_rows(self, align):
        """P, the static bound of :func:`~mxcomm.permute`'s rows: round_up(N + E_local * align,
        align)."""
        return -(-(self.num_received + self.num_local_experts * align) // align) * align


def exchange_layout(num_tokens_per_expert, comm, *, stream=None):
    """Agree on the step's layout: every rank learns every rank's per-expert counts.

    Collective. Host sync: the counts are read to the host (the token path's only host
    synchronization, bounded by ``comm.timeout``); then one agreement round over the host side
    channel, plus an allgather of the counts for the communicator's first layout or a new E
    (docs/design.md, "The layout object"), so bad counts anywhere raise on every rank.

    Args:
        num_tokens_per_expert: (E,) integer array (any integer dtype holding the values; device
            array on a GPU), E a positive multiple of W: rows this rank routes to each global
            expert (its rows are sorted by expert). Read.
        comm: a communicator (``mxcomm.comm.init()``).
        stream: the stream the counts are ready on (None: CuPy's current; ignored on the host).
    Returns:
        A :class:`Layout`, unpacking as ``(num_tokens_per_expert_group, input_splits,
        output_splits)``: (E,) int32 device array (rank-major) and W host ints each.
    Raises:
        TypeError: the counts are not an integer array (on some rank: every rank raises).
        ValueError: the counts are not 1-D, their length is not a positive multiple of W or
            differs across ranks, or a count is negative or beyond 2**31 - 1 (every rank raises,
            naming the rank, the expert and the value).
        TimeoutError: a rank did not join within ``comm.timeout`` s; the communicator is aborted.
        RuntimeError: the communicator is aborted (e.g. an earlier timeout) or closed, at once.
    """
    return _exchange(num_tokens_per_expert, comm, stream, Layout, None)


def _exchange(num_tokens_per_expert, comm, stream, cls, upload):
    """:func:`exchange_layout`, the layout made as ``cls`` (e.g. ``mxcomm.torch``'s subclass), this
    rank's group counts put on the device by ``upload(host array)`` (None: the array module's)."""
    comm.check_usable()
    error, host = None, None
    try:
        host = _local_counts(num_tokens_per_expert, comm, stream, comm.rank, comm.size)
    except (TypeError, ValueError) as exc:
        error = exc
    # One agreement round of E and, at the last agreed layout's E, the counts; a new E gathers
    # the counts in a second round (docs/design.md, "The layout object").
    known = comm.layout_experts or 0
    words = numpy.zeros(1 + known, dtype=numpy.int64)
    if error is None:
        words[0] = host.shape[0]
        if host.shape[0] == known:
            words[1:] = host
    table = comm.agree("exchange_layout", error, words.tolist())
    lengths = table[:, 0].tolist()
    if len(set(lengths)) > 1:
        other = next(r for r in range(comm.size) if lengths[r] != lengths[0])
        raise ValueError(f"exchange_layout: num_tokens_per_expert has {lengths[0]} experts on "
                         f"rank 0 but {lengths[other]} on rank {other}; every rank must count "
                         f"the same E experts")
    if lengths[0] == known:
        counts = table[:, 1:].copy()  # the table is the ballot's buffer, reused
    else:
        counts = comm.allgather(host, "exchange_layout (counts)")
        comm.layout_experts = lengths[0]
    local_experts = lengths[0] // comm.size
    rank = comm.rank
    mine = counts[:, rank * local_experts:(rank + 1) * local_experts].reshape(-1)
    mine = mine.astype(numpy.int32)
    if upload is not None:
        group = upload(mine)
    else:
        with comm.on_stream(comm.stream_ptr(stream)):
            group = array_module().asarray(mine)
    return cls(comm, group, counts, local_experts)


def _local_counts(num_tokens_per_expert, comm, stream, rank, world):
    """This rank's counts on the host as (E,) int64, checked; raises the argument errors."""
    name = "num_tokens_per_expert"
    counts = as_device_array(num_tokens_per_expert, f"{name} on rank {rank}")
    if counts.dtype.kind not in "iu":
        raise TypeError(f"{name} on rank {rank}: expected an integer array, got dtype "
                        f"{counts.dtype}")
    if counts.ndim != 1:
        raise ValueError(f"{name} on rank {rank}: expected a 1-D array of E counts, got shape "
                         f"{tuple(counts.shape)}")
    num_experts = counts.shape[0]
    if num_experts == 0 or num_experts % world:
        raise ValueError(f"{name} on rank {rank}: length {num_experts} is not a positive "
                         f"multiple of the {world} ranks")
    if isinstance(counts, numpy.ndarray):
        host = counts
    else:  # bounded: the counts may come from work still running
        host = comm.to_host(counts, stream)
    # uint64 compared before the int64 conversion, which would wrap it
    if int(host.max()) > _INT32_MAX:
        e = int(numpy.flatnonzero(host > _INT32_MAX)[0])
        raise ValueError(f"{name} on rank {rank}: count {int(host[e])} for expert {e} is beyond "
                         f"2**31 - 1 rows")
    if int(host.min()) < 0:
        e = int(numpy.flatnonzero(host < 0)[0])
        raise ValueError(f"{name} on rank {rank}: count {int(host[e])} for expert {e} is "
                         f"negative")
    host = host.astype(numpy.int64)
    total = int(host.sum())
    if total > _INT32_MAX:
        raise ValueError(f"{name} on rank {rank}: the counts add up to {total} rows, beyond "
                         f"2**31 - 1")
    return host
