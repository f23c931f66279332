"""The drop-in for torch's ``all_to_all_single_autograd``.

Glossary: M rows sent by this rank, D hidden, W ranks.
"""

import torch

from .. import a2a as _a2a
from .._torch_arrays import _array, _stream, _tensor
from ._ops import _communicators, _resolve_group, exchange


class _AllToAllSingle(torch.autograd.Function):
    """The drop-in for ``all_to_all_single_autograd``.

    Forward:  x (M, D) -> (sum(output_splits), D) of x's dtype: quantize, exchange, dequantize.
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
        # the same exchange with the splits swapped (the rows are named x in messages)
        dx = exchange("all_to_all_single", grad, output_splits, input_splits, comm, precision,
                      out_rows=sum(input_splits))
        # None for: output_splits, input_splits, comm, precision
        return dx, None, None, None, None


#: The precision that keeps the input's dtype (sent as is, exactly).
_NATIVE = "native"


def _splits(splits, name):
    """``splits`` as a list of host ints (torch's lists, tuples or 1-D tensors)."""
    try:
        return [int(s) for s in splits]
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a sequence of ints (rows per rank), got "
                        f"{splits!r}") from None


def _exact_over(comm, input, output_split_sizes, input_split_sizes):
    """torch's semantics on an mxcomm communicator without a torch group (built from MPI): the
    rows' bytes moved exactly, even splits for None; no autograd (integer tensors)."""
    world = comm.size
    rows = input.shape[0]
    if output_split_sizes is None or input_split_sizes is None:
        if rows % world:
            raise ValueError(f"input on rank {comm.rank}: {rows} rows do not split evenly over "
                             f"{world} ranks (None splits)")
        output_split_sizes = input_split_sizes = [rows // world] * world
    x = input.detach().contiguous()
    out = comm.alltoallv(_array(x, "input"), _splits(input_split_sizes, "input_split_sizes"),
                         _splits(output_split_sizes, "output_split_sizes"),
                         stream=_stream(x))
    return _tensor(out)


def all_to_all_single(input, output_split_sizes=None, input_split_sizes=None, group=None,
                      tag="", *, precision="mxfp8"):
    """Drop-in for torch's ``all_to_all_single_autograd(input, output_split_sizes,
    input_split_sizes, group, tag)`` (``torch.distributed._functional_collectives``), with the
    rows in ``precision`` on the wire. Differentiable: the backward is the same exchange with
    the splits swapped, in the same precision.

    Same signature and result as torch's: rows (first-axis slices) of ``input``,
    ``input_split_sizes[r]`` of them to rank r; the result holds ``output_split_sizes[r]`` rows
    from each rank r, in rank order, in ``input``'s dtype and trailing shape. Collective over
    ``group``; with explicit splits the call is checked across ranks first (the vote: one small
    host allgather), so bad splits on any rank raise the same error on every rank.

    Passed through to torch's own collective, unchanged (same result, an
    ``AsyncCollectiveTensor`` as torch returns): integer and bool tensors (e.g. token counts),
    ``None`` splits (even splits), and ``"native"`` where mxcomm's exchange does not take the
    dtype (other than bf16/fp32). With an mxcomm communicator built from MPI (no torch group)
    those move exactly through it instead (no autograd: integer rows).

    Host syncs and collectives: the first call on a group builds its communicator (collective);
    an explicit-splits call votes (one host allgather over the side channel); the exchange itself
    is the communicator's (NCCL on the device, or blocking on the host).

    Args:
        input: (M, ...) tensor, floating point (bf16 or fp32 for a low precision; with D, the
            elements of a row, a multiple of the format's block, 32 for MXFP8) or integer. Read.
        output_split_sizes: W ints, rows received from each rank; or None (with
            ``input_split_sizes`` None) for even splits.
        input_split_sizes: W ints, rows sent to each rank (sum = M); or None.
        group: a torch.distributed ``ProcessGroup``, a 1-D ``DeviceMesh`` (mapped to a cached
            communicator over its ranks, :func:`communicator_for`), an mxcomm communicator, or
            None for torch.distributed's default group.
        tag: passed to torch's collective where it runs; otherwise unused.
        precision: wire format: ``"mxfp8"`` (default), ``"bf16"`` (fp32 rows rounded to bf16),
            ``"native"`` (the input's dtype, exact), or any format of ``mxcomm.formats``.
    Returns:
        (sum(output_split_sizes), ...) tensor of ``input``'s dtype on its device.
    Raises:
        TypeError: ``group`` of another type (the message names ProcessGroup, DeviceMesh and
            mxcomm communicator); a dtype the precision does not take.
        ValueError: an unknown precision; splits of the wrong length, negative or not adding up
            to the rows (same message on every rank); D not a multiple of the format's block.
        TimeoutError: a peer did not arrive within the communicator's timeout.
    """
    comm, pg = _resolve_group(group)
    exact = not (input.is_floating_point() or input.is_complex()) or \
        output_split_sizes is None or input_split_sizes is None or \
        (precision == _NATIVE and (_NATIVE not in _a2a.PRECISIONS or
                                   input.dtype not in (torch.bfloat16, torch.float32)))
    if exact:
        if pg is None:
            return _exact_over(comm, input, output_split_sizes, input_split_sizes)
        from torch.distributed._functional_collectives import all_to_all_single_autograd
        return all_to_all_single_autograd(input, output_split_sizes, input_split_sizes, pg, tag)
    _a2a._check_precision(precision)
    if comm is None:  # in a compiled region the op finds the group's communicator
        comm = pg if torch.compiler.is_compiling() else _communicators.get(pg)
    output_split_sizes = _splits(output_split_sizes, "output_split_sizes")
    input_split_sizes = _splits(input_split_sizes, "input_split_sizes")
    rows = input if input.dim() == 2 else input.reshape(input.shape[0], -1)
    out = _AllToAllSingle.apply(rows, output_split_sizes, input_split_sizes, comm, precision)
    return out if input.dim() == 2 else out.reshape((out.shape[0],) + tuple(input.shape[1:]))


def all_to_all_single_fn(precision="mxfp8", group=None):
    """A function with the signature of torch's ``all_to_all_single_autograd`` that runs
    :func:`all_to_all_single` in ``precision``: what a caller that takes torch's function (or
    a module that imports it, patched) is given.

    ``fn(input, output_split_sizes=None, input_split_sizes=None, group=None, tag="")``; a call's
    ``group`` wins, else the bound ``group`` (None: torch.distributed's default group).

    Args:
        precision: the wire format of every call (as :func:`all_to_all_single`).
        group: the group used when a call passes none: a ``ProcessGroup``, a 1-D
            ``DeviceMesh``, an mxcomm communicator, or None.
    Raises:
        ValueError: an unknown precision (now, not at the first call).
    Example (torchtitan 0.2.x, in the training script before the model is parallelized)::

        import torchtitan.distributed.expert_parallel as ep
        ep.all_to_all_single_autograd = mxcomm.torch.all_to_all_single_fn("mxfp8")
    """
    if precision != _NATIVE or _NATIVE in _a2a.PRECISIONS:
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
