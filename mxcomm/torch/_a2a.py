"""The dispatch and combine all-to-alls (steps 1 and 5) as differentiable torch functions.

Glossary: M rows sent by this rank, N = M_recv rows received, P permuted rows, D hidden, H GEMM
output, E experts, E_local experts per rank, W ranks.
"""

import torch

from .. import a2a as _a2a
from .. import layout as _layout
from ._ops import LayoutHandle, exchange


class _A2ADispatch(torch.autograd.Function):
    """Step 1, the dispatch all-to-all.

    Forward:  x (M, D) bf16 -> (N, D) QuantizedTensor of ``precision`` (MXFP8Tensor for
              ``"mxfp8"``) or a plain tensor (``"bf16"``, ``"native"``); sends
              ``input_splits``, receives ``output_splits``. With ``permute_align``: ``permute``'s
              triple, permuted (P, D) rows (indices and offsets not differentiable).
    Backward: grad (N, D), or (P, D) permuted -> (M, D) bf16 in ``grad_precision``.

    The arguments but ``x`` travel as one tuple ``call`` (autograd's ``apply`` spends host time
    per argument): (input_splits, output_splits, comm, precision, grad_precision, layout,
    permute_align).
    """

    @staticmethod
    def forward(ctx, x, call):
        input_splits, output_splits, comm, precision, grad_precision, layout, permute_align = call
        ctx.args = (input_splits, output_splits, comm, grad_precision, layout, permute_align,
                    x.shape[0])
        if type(layout) is LayoutHandle:  # the combine's result rows, in a compiled region
            layout.rows = x.shape[0]
        out = exchange("a2a_dispatch", x, input_splits, output_splits, comm, precision, layout,
                       permute_align)
        if type(out) is tuple:
            ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, grad, *index_grads):
        input_splits, output_splits, comm, grad_precision, layout, permute_align, rows = ctx.args
        dx = exchange("a2a_dispatch_backward", grad, input_splits, output_splits, comm,
                      grad_precision, layout, permute_align, rows)
        return dx, None  # None for the call's tuple


class _A2ACombine(torch.autograd.Function):
    """Step 5, the combine all-to-all.

    Forward:  y (N, H) bf16, or (P, H) permuted with ``permute_align`` -> (M, H) bf16 in
              ``precision``. ``call`` as :class:`_A2ADispatch`'s.
    Backward: grad (M, H) bf16 -> (N, H), or (P, H) permuted, a QuantizedTensor of a quantized
              ``grad_precision``, else a plain tensor.
    """

    @staticmethod
    def forward(ctx, y, call):
        input_splits, output_splits, comm, precision, grad_precision, layout, permute_align = call
        ctx.args = (input_splits, output_splits, comm, grad_precision, layout, permute_align,
                    y.shape[0])
        return exchange("a2a_combine", y, input_splits, output_splits, comm, precision, layout,
                        permute_align, layout.rows if type(layout) is LayoutHandle else -1)

    @staticmethod
    def backward(ctx, grad):
        input_splits, output_splits, comm, grad_precision, layout, permute_align, rows = ctx.args
        dy = exchange("a2a_combine_backward", grad, input_splits, output_splits, comm,
                      grad_precision, layout, permute_align, rows)
        if type(dy) is tuple:  # the permuted gradient (the index is the forward's)
            dy = dy[0]
        return dy, None  # None for the call's tuple


def a2a_dispatch(x, input_splits=None, output_splits=None, comm=None, precision="mxfp8",
                 grad_precision="bf16", *, layout=None, permute_align=None):
    """Step 1, differentiable: (M, D) bf16 -> (N, D) MXFP8Tensor (``"mxfp8"``) or bf16.

    Arguments, shapes and errors as :func:`mxcomm.a2a_dispatch`; ``grad_precision`` is the
    backward's wire format. With a layout, no host collective.

    ``permute_align=A`` (with the layout): bit for bit ``permute(a2a_dispatch(x, layout, ...),
    layout, align=A)``, forward and backward, in one pass: returns ``(permuted (P, D),
    permuted_indices (P,) int32, group_offsets (E_local,) int32)``; the backward takes the
    permuted gradient. For an ``out_format``, call :func:`permute` separately.

    Under ``torch.compile``: the custom op ``mxcomm::exchange``, with the :class:`LayoutHandle`
    :func:`exchange_layout` returns there (or splits and a ``comm`` that may be a ProcessGroup);
    docs/design.md, "torch.compile and custom ops".
    """
    if precision not in _a2a.PRECISIONS or grad_precision not in _a2a.PRECISIONS:
        _a2a._check_precision(precision)  # a Format, or an unknown name: ValueError
        _a2a._check_precision(grad_precision, "grad_precision")
    if isinstance(input_splits, (_layout.Layout, LayoutHandle)):
        layout, input_splits = input_splits, None
    return _A2ADispatch.apply(x, (input_splits, output_splits, comm, precision, grad_precision,
                                 layout, permute_align))


def a2a_combine(y, input_splits=None, output_splits=None, comm=None, precision="bf16",
                grad_precision="mxfp8", *, layout=None, permute_align=None):
    """Step 5, differentiable: (N, H) -> (M, H); splits (or the layout) as given to
    :func:`a2a_dispatch`.

    The gradient of ``y`` is a QuantizedTensor of a quantized ``grad_precision``.

    ``permute_align=A`` (with the layout): bit for bit ``a2a_combine(unpermute(y,
    permuted_indices, layout), layout, ...)`` in one pass: ``y`` is the permuted (P, H) rows
    (padding ignored) and its gradient comes back permuted (padding rows zero, the format's
    padding scale). For a ``grad_format``, call :func:`unpermute` separately. Under
    ``torch.compile``: as :func:`a2a_dispatch`, the quantized gradient dequantized to bf16
    (warned once).
    """
    if precision not in _a2a.PRECISIONS or grad_precision not in _a2a.PRECISIONS:
        _a2a._check_precision(precision)  # a Format, or an unknown name: ValueError
        _a2a._check_precision(grad_precision, "grad_precision")
    if isinstance(input_splits, (_layout.Layout, LayoutHandle)):
        layout, input_splits = input_splits, None
    return _A2ACombine.apply(y, (input_splits, output_splits, comm, precision, grad_precision,
                                layout, permute_align))


