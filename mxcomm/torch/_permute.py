"""The permute and unpermute (steps 2 and 4) as differentiable torch functions.

Glossary: N = M_recv rows received, P permuted rows, D hidden, H GEMM output, E_local experts per
rank.
"""

import torch

from .. import layout as _layout
from .. import permutation as _permutation
from .._array import bfloat16
from .._torch_arrays import _Alloc, _array, _stream
from ..formats import get_format
from ._ops import _A2A
from ._tensors import _index_array, _index_tensors, _PendingGather, _rows, _wrap


def _not_compiled(name):
    """NotImplementedError while ``torch.compile`` traces: the permute has no custom op."""
    if torch.compiler.is_compiling():
        raise NotImplementedError(f"mxcomm.torch.{name} does not run under torch.compile (it "
                                  f"has no custom op); pass permute_align to a2a_dispatch and "
                                  f"a2a_combine instead (the same rows, one pass less)")


def _folds_into_dispatch(x, layout):
    """True where ``x`` is :func:`a2a_dispatch`'s output on ``layout`` with a gradient format that
    quantizes gathered rows: permute's backward then hands it a :class:`_PendingGather`."""
    node = x.grad_fn
    backward = getattr(_A2A, "_backward_cls", None)
    if layout is None or backward is None or not isinstance(node, backward):
        return False
    function, _, _, _, _, grad_precision, dispatch_layout, permute_align = node.call  # _A2A's
    fmt = get_format(grad_precision)
    return function == "a2a_dispatch" and dispatch_layout is layout and \
        permute_align is None and fmt.quantized and fmt.quantizes_gathered(bfloat16)


class _Permute(torch.autograd.Function):
    """Step 2, received order -> expert-major groups padded to ``align`` rows.

    Forward:  x (N, D) bf16 or QuantizedTensor -> permuted (P, D) of the same kind (or
              ``out_format``), permuted_indices (P,) int32, group_offsets (E_local,) int32.
    Backward: grad (P, D) -> (N, D) scattered back (padding dropped); with ``fold``, a
              :class:`_PendingGather` the dispatch's gradient reads in place.
    """

    @staticmethod
    def forward(ctx, x, num_tokens_per_expert_group, num_local_experts, align, out_format, fold):
        counts = num_tokens_per_expert_group
        layout = counts if isinstance(counts, _layout.Layout) else None
        if layout is None:
            counts = _array(counts, "num_tokens_per_expert_group")
        alloc = _Alloc(x.device)
        permuted, indices, offsets = _permutation._permute(_rows(x, "x"), counts,
                                                           num_local_experts, align, out_format,
                                                           _stream(x), alloc)
        indices, offsets = _index_tensors(layout, align, indices, offsets, alloc)
        ctx.save_for_backward(indices)
        ctx.layout = layout  # its indices name every received row once: no zero fill
        ctx.num_rows = layout if layout is not None else x.shape[0]
        ctx.inverse = _inverse_index(layout, align, _stream(x), alloc) if fold else None
        ctx.mark_non_differentiable(indices, offsets)
        return _wrap(permuted, alloc), indices, offsets

    @staticmethod
    def backward(ctx, grad, grad_indices, grad_offsets):
        (indices,) = ctx.saved_tensors
        if ctx.inverse is not None and type(grad) is torch.Tensor and grad.is_contiguous() \
                and grad.dtype == torch.bfloat16:
            dx = _PendingGather(grad, ctx.inverse)
        else:
            dx = _unpermuted(grad, "grad", indices, ctx.layout, ctx.num_rows)
        # None for: num_tokens_per_expert_group, num_local_experts, align, out_format, fold
        return dx, None, None, None, None, None


def _unpermuted(rows, name, indices, layout, num_rows):
    """(num_rows, H): the permuted ``rows`` (P, H) back in received order, padding dropped."""
    alloc = _Alloc(rows.device)
    return _wrap(_permutation._unpermute(_rows(rows, name), _index_array(indices, layout),
                                         num_rows, _stream(rows), alloc), alloc)


def _inverse_index(layout, align, stream, alloc):
    """(N,) int32 tensor: the permuted row of each received row, the inverse of the layout's
    permute index for ``align`` (made beside it by the same launch), cached on the layout."""
    key = ("torch permute inverse", align)
    cached = layout._cache.get(key)
    if cached is None:
        inverse = _permutation._layout_index(layout, align, stream, alloc)[2]
        cached = layout._cache[key] = alloc.tensor(inverse)
    return cached


class _Unpermute(torch.autograd.Function):
    """Step 4, expert-major rows -> received order.

    Forward:  y (P, H) bf16 -> (N, H) bf16; padding rows dropped.
    Backward: grad (N, H) bf16 or QuantizedTensor -> (P, H) of the same kind (or
              ``grad_format``), a gather; padding rows zero with the format's padding scale.
    """

    @staticmethod
    def forward(ctx, y, permuted_indices, num_rows, grad_format):
        ctx.save_for_backward(permuted_indices)
        ctx.grad_format = grad_format
        ctx.layout = num_rows if isinstance(num_rows, _layout.Layout) else None
        return _unpermuted(y, "y", permuted_indices, ctx.layout, num_rows)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        alloc = _Alloc(grad.device)
        dy = _permutation._unpermute_backward(_rows(grad, "grad"),
                                              _index_array(indices, ctx.layout),
                                              _stream(grad), alloc, ctx.grad_format)
        # None for: permuted_indices, num_rows, grad_format
        return _wrap(dy, alloc), None, None, None


def permute(x, num_tokens_per_expert_group, num_local_experts=None, align=32, *,
            out_format=None):
    """Step 2, differentiable: received rows -> expert-major, ``align``-padded groups.

    Args:
        x: (N, D) bf16 tensor or QuantizedTensor; its gradient is bf16.
        num_tokens_per_expert_group: (E,) int32 tensor (``exchange_layout``), or the layout
            itself (then ``num_local_experts`` is the layout's, and N is checked against it).
        num_local_experts: E_local (not needed with a layout).
        align: rows each group is padded to a multiple of.
        out_format: None, or a format to convert quantized rows to in the same pass
            (:func:`mxcomm.permute`; ``"bf16"``: dequantized in the gather).
    Returns:
        ``(permuted (P, D) like x, permuted_indices (P,) int32, group_offsets (E_local,) int32)``
        (``group_offsets``: ``torch._grouped_mm``'s ``offs``). Where ``x`` is
        :func:`a2a_dispatch`'s output on the layout, the backward hands the dispatch its
        permuted gradient to quantize in place (same bits).
    Raises:
        ValueError: with a layout, ``x`` has another number of rows than it receives; an
            unknown ``out_format``.
        TypeError: no layout and no ``num_local_experts``.
    """
    _not_compiled("permute")
    layout = num_tokens_per_expert_group
    if not isinstance(layout, _layout.Layout):
        layout = None
        if num_local_experts is None:
            raise TypeError("permute: num_local_experts is required without a layout")
    elif x.shape[0] != layout.num_received:  # here too: before autograd records anything
        raise ValueError(f"permute: x on rank {layout.comm.rank} has {x.shape[0]} rows, but "
                         f"the layout receives {layout.num_received}")
    if out_format is not None:
        get_format(out_format, "out_format")
    return _Permute.apply(x, num_tokens_per_expert_group, num_local_experts, align, out_format,
                          _folds_into_dispatch(x, layout))


def unpermute(y, permuted_indices, num_rows, *, grad_format=None):
    """Step 4, differentiable: (P, H) -> (num_rows, H) in received order.

    ``num_rows``: N, or the layout whose permute made ``permuted_indices`` (no zero fill then).
    ``grad_format``: None, or a format the backward converts a quantized gradient to in its
    gather, as :func:`permute`'s ``out_format``. Raises ValueError: ``grad_format`` is not a
    format.
    """
    _not_compiled("unpermute")
    if grad_format is not None:
        get_format(grad_format, "grad_format")
    return _Unpermute.apply(y, permuted_indices, num_rows, grad_format)


