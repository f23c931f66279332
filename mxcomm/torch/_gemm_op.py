"""The grouped GEMM (``mxcomm.torch.grouped_mm``) as the custom ops ``mxcomm::grouped_mm`` and
``mxcomm::grouped_mm_backward``, for ``torch.compile`` (docs/design.md, "torch.compile and custom
ops"). ``w_b``: a second weight joined inside the op as eager does (``dw_b`` is (0,) without it).
A QuantizedTensor ``x`` arrives as its data with ``x_scales`` and ``x_format``. The bodies are
``_torch_gemm._GroupedMM``'s with a plain ``ctx``; ``fp8`` None is decided when the op runs; the
backward quantizes the forward's rows again for the fp8 wgrad (one pass more than eager).
Glossary: P permuted rows, K the reduction width, N the output width, G groups.
"""

import torch

from .. import _torch_gemm
from ._quantized import _GEMM_OPS, _quantized_tensor


class _Context:
    """What ``_GroupedMM.forward``/``backward`` use of an autograd context."""

    def __init__(self, needs_dx=False, needs_dw=False, weights=1):
        # _GroupedMM's inputs: x, offs, fp8, wgrad, fast, cache, *ws
        self.needs_input_grad = (needs_dx, False, False, False, False, False) + \
            (needs_dw,) * weights
        self.saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _operands(x, x_scales, x_format, w, w_b, fp8, fast_accum):
    """An op's ``(rows, weights, fp8 decided on the weights' device, fast_accum as a set of
    GEMMS names)``; the rows a QuantizedTensor of data ``x`` where ``x_scales`` is given."""
    ws = (w,) if w_b is None else (w, w_b)
    fp8 = _torch_gemm._decide_fp8(fp8, ws, x_scales is not None)
    fast = frozenset(name for name, fast in zip(_torch_gemm.GEMMS, fast_accum) if fast)
    if x_scales is not None:
        from ..formats import get_format
        x = _quantized_tensor(x, x_scales, get_format(x_format))
    return x, ws, fp8, fast


@torch.library.custom_op("mxcomm::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, fp8: bool | None,
                   wgrad: str, fast_accum: list[bool], x_scales: torch.Tensor | None = None,
                   x_format: str = "bf16", w_b: torch.Tensor | None = None) -> torch.Tensor:
    """y (P, N) bf16 = x (P, K) @ w (G, K, N) per group (``_GroupedMM.forward``), or
    @ [w | w_b]; ``x`` with ``x_scales``: quantized rows of ``x_format``."""
    x, ws, fp8, fast = _operands(x, x_scales, x_format, w, w_b, fp8, fast_accum)
    # no weight cache inside the op: a compiled graph's weight operand is made per call
    return _torch_gemm._GroupedMM.forward(_Context(), x, offs, fp8, wgrad, fast, None, *ws)


@_grouped_mm_op.register_fake
def _(x, w, offs, fp8, wgrad, fast_accum, x_scales=None, x_format="bf16", w_b=None):
    n = w.shape[2] + (0 if w_b is None else w_b.shape[2])
    return x.new_empty((x.shape[0], n), dtype=torch.bfloat16)


@torch.library.custom_op("mxcomm::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward_op(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                            offs: torch.Tensor, fp8: bool | None, wgrad: str,
                            fast_accum: list[bool], needs_dx: bool, needs_dw: bool,
                            x_scales: torch.Tensor | None = None, x_format: str = "bf16",
                            w_b: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx (P, K) bf16, dw (G, K, N) of w's dtype and layout, dw_b of w_b's)``, each (0,) where
    not needed or absent (``_GroupedMM.backward``, its saved tensors made again from ``x``)."""
    x, ws, fp8, fast = _operands(x, x_scales, x_format, w, w_b, fp8, fast_accum)
    ctx = _Context(needs_dx, needs_dw, len(ws))
    ctx.fp8, ctx.fp8_wgrad, ctx.fast = fp8, fp8 and wgrad == "fp8", fast
    ctx.cache = ctx.weights = None
    rows = _torch_gemm._fp8_operand_a(x) if ctx.fp8_wgrad else (x,)
    ctx.rows = len(rows)
    ctx.save_for_backward(*rows, offs, *ws)
    # a gradient may come expanded (a sum's backward): the GEMMs take dense rows
    dx, _, _, _, _, _, *dws = _torch_gemm._GroupedMM.backward(ctx, grad.contiguous())
    dws += [None] * (2 - len(dws))
    return (w.new_empty(0) if dx is None else dx,
            *(w.new_empty(0) if d is None else _layout_of(d, wi) for d, wi in zip(dws, (w, w_b))))


def _layout_of(d, w):
    """``d`` in ``torch.empty_like(w)``'s layout (the fake's: ``w``'s strides where ``w`` is
    dense), copied only where it is not: a weight stored (G, N, K) gets its gradient as made.
    The layout is read off a meta tensor: no weight-sized allocation where none is needed."""
    if d.stride() == torch.empty_like(w, device="meta").stride():
        return d
    return torch.empty_like(w).copy_(d)


@_grouped_mm_backward_op.register_fake
def _(grad, x, w, offs, fp8, wgrad, fast_accum, needs_dx, needs_dw, x_scales=None,
      x_format="bf16", w_b=None):
    dx = x.new_empty(x.shape, dtype=torch.bfloat16) if needs_dx else w.new_empty(0)
    dw = torch.empty_like(w) if needs_dw else w.new_empty(0)
    dw_b = torch.empty_like(w_b) if needs_dw and w_b is not None else w.new_empty(0)
    return dx, dw, dw_b


def _setup_context(ctx, inputs, output):
    # autograd sees the op above a QuantizedTensor's dispatch: x is the QuantizedTensor itself
    x, w, offs, fp8, wgrad, fast_accum = inputs[:6]
    w_b = inputs[8] if len(inputs) > 8 else None
    ctx.save_for_backward(x, w, offs, w_b)
    ctx.options = (fp8, wgrad, fast_accum)


def _backward(ctx, grad):
    x, w, offs, w_b = ctx.saved_tensors
    needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    needs_dw_b = w_b is not None and ctx.needs_input_grad[8]
    dx, dw, dw_b = torch.ops.mxcomm.grouped_mm_backward(
        grad, x, w, offs, *ctx.options, needs_dx, needs_dw or needs_dw_b, w_b=w_b)
    # None for: offs, fp8, wgrad, fast_accum, x_scales, x_format
    return (dx if needs_dx else None, dw if needs_dw else None, None, None, None, None, None,
            None, dw_b if needs_dw_b else None)


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)
_GEMM_OPS.update({torch.ops.mxcomm.grouped_mm.default: 0,
                  torch.ops.mxcomm.grouped_mm_backward.default: 1})

