"""The drop-in for torch's ``all_to_all_single_autograd``.

Glossary: M rows sent by this rank, D hidden, W ranks.
"""

import torch

from .. import a2a as _a2a
from .._torch_arrays import _array, _stream, _tensor
from ._ops import _registry, _resolve_group, exchange


class _AllToAllSingle(torch.autograd.Function):
    """Forward:  x (M, D) -> (sum(output_splits), D) of x's dtype: quantize, exchange, dequantize.
    Backward: grad -> (M, D): the same with the splits swapped.
    """

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, comm, precision):
        ctx.args = (output_splits, input_splits, comm, precision)
        return exchange("all_to_all_single", x, input_splits, output_splits, comm, precision,
                        out_rows=sum(output_splits))

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits, comm, precision = ctx.args
        # the rows are named x in messages
        dx = exchange("all_to_all_single", grad, output_splits, input_splits, comm, precision,
                      out_rows=sum(input_splits))
        return dx, None, None, None, None  # None for the splits, comm and precision


def _splits(splits, name):
    """``splits`` as a list of host ints (torch's lists, tuples or 1-D tensors)."""
    try:
        return [int(s) for s in splits]
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a sequence of ints (rows per rank), got "
                        f"{splits!r}") from None


def _exact_over(comm, input, output_split_sizes, input_split_sizes):
    """torch's exact semantics over a communicator with no torch group (MPI); no autograd."""
    world = comm.size
    rows = input.shape[0]
    if output_split_sizes is None or input_split_sizes is None:
        if rows % world:
            raise ValueError(f"input on rank {comm.rank}: {rows} rows do not split evenly over "
                             f"{world} ranks (None splits)")
        output_split_sizes = input_split_sizes = [rows // world] * world
    out = comm.alltoallv(_array(input, "input"), _splits(input_split_sizes, "input_split_sizes"),
                         _splits(output_split_sizes, "output_split_sizes"),
                         stream=_stream(input))
    return _tensor(out)


def all_to_all_single(input, output_split_sizes=None, input_split_sizes=None, group=None,
                      tag="", *, precision="mxfp8"):
    """torch's ``all_to_all_single_autograd`` (same signature and result), the rows in
    ``precision`` on the wire; the backward is the same exchange, splits swapped. Integer and
    bool tensors, ``None`` (even) splits and ``"native"`` on dtypes but bf16/fp32 go to torch's
    own collective unchanged (over an MPI communicator: moved exactly, without autograd).

    Host syncs and collectives: the first call on a group builds its communicator (collective);
    each call votes on its splits (one host allgather), so bad splits raise on every rank.

    Args:
        input: (M, ...) tensor: bf16/fp32 for a low precision (a row's elements a multiple of
            the format's block, 32 for MXFP8), or any dtype torch's takes. Read.
        output_split_sizes, input_split_sizes: W ints each (rows from / to each rank; the
            latter sums to M), or both None.
        group: a ``ProcessGroup``, a 1-D ``DeviceMesh``, an mxcomm communicator, or None
            (torch.distributed's default group); :func:`communicator_for`.
        tag: passed to torch's collective where it runs.
        precision: ``"mxfp8"`` (default), ``"bf16"``, ``"native"`` (exact), or any format of
            ``mxcomm.formats``.
    Returns:
        (sum(output_split_sizes), ...) tensor of ``input``'s dtype on its device.
    Raises:
        TypeError: ``group`` of another type; a dtype the precision does not take.
        ValueError: an unknown precision; bad splits (on every rank); a row not a multiple of
            the format's block.
        TimeoutError: a peer did not arrive within the communicator's timeout.
    """
    comm, pg = _resolve_group(group)
    if not (input.is_floating_point() or input.is_complex()) or \
            output_split_sizes is None or input_split_sizes is None or \
            (precision == "native" and input.dtype not in (torch.bfloat16, torch.float32)):
        if pg is None:
            return _exact_over(comm, input, output_split_sizes, input_split_sizes)
        from torch.distributed._functional_collectives import all_to_all_single_autograd
        return all_to_all_single_autograd(input, output_split_sizes, input_split_sizes, pg, tag)
    _a2a._check_precision(precision)
    if comm is None:  # in a compiled region the op finds the group's communicator
        comm = pg if torch.compiler.is_compiling() else _registry.of_group(pg)
    output_split_sizes = _splits(output_split_sizes, "output_split_sizes")
    input_split_sizes = _splits(input_split_sizes, "input_split_sizes")
    rows = input if input.dim() == 2 else input.reshape(input.shape[0], -1)
    out = _AllToAllSingle.apply(rows, output_split_sizes, input_split_sizes, comm, precision)
    return out if input.dim() == 2 else out.reshape((out.shape[0],) + tuple(input.shape[1:]))


def all_to_all_single_fn(precision="mxfp8", group=None):
    """A function of torch's ``all_to_all_single_autograd`` signature running
    :func:`all_to_all_single` in ``precision``; a call's ``group`` wins over the bound ``group``.

    Raises:
        ValueError: an unknown precision (now, not at the first call).
    Example (torchtitan 0.2.x, in the training script before the model is parallelized)::

        import torchtitan.distributed.expert_parallel as ep
        ep.all_to_all_single_autograd = mxcomm.torch.all_to_all_single_fn("mxfp8")
    """
    _a2a._check_precision(precision)
    bound = group

    def all_to_all_single_autograd(input, output_split_sizes=None, input_split_sizes=None,
                                   group=None, tag=""):
        return all_to_all_single(input, output_split_sizes, input_split_sizes,
                                 bound if group is None else group, tag, precision=precision)

    all_to_all_single_autograd.__doc__ = (f"torch's all_to_all_single_autograd through "
                                          f"mxcomm, {precision!r} on the wire "
                                          f"(mxcomm.torch.all_to_all_single_fn)")
    all_to_all_single_autograd.precision = precision
    return all_to_all_single_autograd
