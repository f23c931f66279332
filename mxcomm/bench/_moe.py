"""The MoE expert-parallel token path the ``pipeline`` benchmark runs, as a list of stages.

Forward::

    layout -> dispatch (a2a) -> permute -> dequantize -> grouped GEMM -> grad_dequantize
           -> unpermute -> combine (a2a)

``dequantize`` (forward) turns MXFP8 permuted rows into the GEMM's bf16 input; ``grad_dequantize``
(an identity forward) turns an MXFP8 gradient from unpermute's backward into bf16 once, before the
GEMM's backward. Both are no-ops on bf16 tensors (skipped in the per-stage table).

Variants (one :class:`Variant` each): the bf16 baseline moves tokens with
``torch.distributed.all_to_all_single`` (a small autograd Function, :class:`_TorchAllToAll`); the
mxcomm variants use ``mxcomm.torch`` with a precision per direction. All variants share the layout
exchange, permute/unpermute (``mxcomm.torch``) and the GEMM, so the differences are the all-to-alls
and the (de)quantization they imply. Glossary: M rows per rank, D dim, H hidden, E_local experts per
rank, W ranks, P padded rows of permute.
"""

import dataclasses

#: Rows of each expert group are padded to this (MX GEMMs need 32).
ALIGN = 32


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the pipeline: baseline (torch.distributed bf16) or mxcomm precisions."""

    name: str
    baseline: bool = False
    dispatch: str = "bf16"
    combine: str = "bf16"
    dispatch_grad: str = "bf16"
    combine_grad: str = "bf16"


VARIANTS = (
    Variant("bf16", baseline=True),
    Variant("mxfp8", dispatch="mxfp8", combine="bf16", dispatch_grad="bf16", combine_grad="mxfp8"),
    Variant("mxfp8_all", dispatch="mxfp8", combine="mxfp8", dispatch_grad="mxfp8",
            combine_grad="mxfp8"),
)


def _torch_all_to_all_class():
    import torch
    import torch.distributed as dist

    class _TorchAllToAll(torch.autograd.Function):
        """bf16 all-to-all through ``torch.distributed.all_to_all_single`` (the baseline).

        Forward: rows ``input_splits[r]`` of ``x`` go to rank r; ``output_splits[r]`` rows arrive.
        Backward: the same exchange of the gradient with the splits swapped.
        """

        @staticmethod
        def forward(ctx, x, output_splits, input_splits):
            ctx.splits = (list(output_splits), list(input_splits))
            out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
            dist.all_to_all_single(out, x.contiguous(), list(output_splits), list(input_splits))
            return out

        @staticmethod
        def backward(ctx, grad):
            output_splits, input_splits = ctx.splits
            out = grad.new_empty((sum(input_splits),) + tuple(grad.shape[1:]))
            dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits)
            # output_splits, input_splits: host lists, no gradient.
            return out, None, None

    return _TorchAllToAll


def grouped_mm(a, w, offs, *, loop):
    """``y[rows of group g] = a[rows of group g] @ w[g].T``: the experts' GEMM.

    Args:
        a: (P, D) bf16 tensor; group g holds rows ``offs[g-1]:offs[g]``; rows past ``offs[-1]``
            are ignored (their output is unspecified). Read.
        w: (E_local, H, D) bf16 weights (torchtitan's layout). Read.
        offs: (E_local,) int32 tensor of cumulative group ends.
        loop: True for a per-expert loop of matmuls (the CPU, where ``torch._grouped_mm`` is not
            supported; reads ``offs`` to the host), False for ``torch._grouped_mm``.
    Returns:
        (P, H) bf16 tensor.
    """
    import torch
    if not loop:
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    ends = [int(v) for v in offs.tolist()]
    pieces, start = [], 0
    for g, end in enumerate(ends):
        pieces.append(a[start:end] @ w[g].transpose(0, 1))
        start = end
    pieces.append(a.new_zeros((a.shape[0] - start, w.shape[1])))
    return torch.cat(pieces, dim=0)


def _grad_to_bf16_class():
    import torch

    class _GradToBF16(torch.autograd.Function):
        """Identity whose backward turns an MXFP8 gradient into bf16 once, before the GEMM's
        backward (which would otherwise dequantize it in every aten op that reads it).

        Forward:  y (P, H) bf16 -> the same tensor.
        Backward: grad (P, H) MXFP8Tensor or bf16 -> (P, H) bf16.
        """

        @staticmethod
        def forward(ctx, y):
            return y.view_as(y)

        @staticmethod
        def backward(ctx, grad):
            return grad.dequantize() if is_mxfp8(grad) else grad

    return _GradToBF16


def is_mxfp8(t):
    """True for quantized rows of any format: an ``mxcomm.torch.QuantizedTensor`` (of which
    ``MXFP8Tensor`` is the mxfp8 case)."""
    return hasattr(t, "qdata") and hasattr(t, "format")


def _dequantize(p):
    """bf16 rows for the GEMM: MXFP8 permuted rows are dequantized (differentiably); bf16 passes."""
    return p.dequantize() if is_mxfp8(p) else p


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of the pipeline.

    Attributes:
        name: the stage's name in the tables.
        inputs: keys of the state it reads and differentiates (empty: forward only).
        output: the key of the differentiable tensor it writes (None: layout).
        fn: ``fn(state, *inputs) -> dict`` of new state entries.
    """

    name: str
    inputs: tuple
    output: object
    fn: object


def stages(variant, comm, num_local_experts, *, loop_gemm):
    """The pipeline of ``variant`` as a list of :class:`Stage`.

    The state starts as ``{"x": (M, D) bf16, "w": (E_local, H, D) bf16, "counts": (E,) int32}``
    and ends with ``"out"``: (M, H) bf16.
    """
    from mxcomm import torch as mxt

    def layout(s):
        # The one point where the ranks meet; the mxcomm variants pass the layout on, so their
        # calls make no host collective (the GPUs order themselves).
        layout = mxt.exchange_layout(s["counts"], comm)
        group, input_splits, output_splits = layout
        return {"layout": layout, "group": group, "input_splits": input_splits,
                "output_splits": output_splits}

    if variant.baseline:
        a2a = _torch_all_to_all_class()

        def dispatch(s, x):
            return {"h": a2a.apply(x, s["output_splits"], s["input_splits"])}

        def combine(s, u):
            return {"out": a2a.apply(u, s["input_splits"], s["output_splits"])}
    else:
        def dispatch(s, x):
            return {"h": mxt.a2a_dispatch(x, s["layout"], precision=variant.dispatch,
                                          grad_precision=variant.dispatch_grad)}

        def combine(s, u):
            return {"out": mxt.a2a_combine(u, s["layout"], precision=variant.combine,
                                           grad_precision=variant.combine_grad)}

    def permute(s, h):
        p, indices, offs = mxt.permute(h, s["layout"], align=ALIGN)
        return {"p": p, "indices": indices, "offs": offs, "rows_recv": h.shape[0]}

    def dequantize(s, p):
        return {"a": _dequantize(p)}

    def gemm(s, a, w):
        return {"y": grouped_mm(a, w, s["offs"], loop=loop_gemm)}

    grad_to_bf16 = _grad_to_bf16_class()

    def grad_dequantize(s, y):
        return {"y_": grad_to_bf16.apply(y)}

    def unpermute(s, y_):
        return {"u": mxt.unpermute(y_, s["indices"], s["rows_recv"])}

    return [Stage("layout", (), None, layout),
            Stage("dispatch", ("x",), "h", dispatch),
            Stage("permute", ("h",), "p", permute),
            Stage("dequantize", ("p",), "a", dequantize),
            Stage("gemm", ("a", "w"), "y", gemm),
            Stage("grad_dequantize", ("y",), "y_", grad_dequantize),
            Stage("unpermute", ("y_",), "u", unpermute),
            Stage("combine", ("u",), "out", combine)]


def forward(stage_list, state, hooks=None):
    """Run every stage on ``state`` (a dict, updated in place); returns ``state["out"]``.

    Args:
        hooks: optional dict filled with the gradient of each stage output during backward
            (``retain_grad``-free: a tensor hook per output).
    """
    for stage in stage_list:
        state.update(stage.fn(state, *(state[k] for k in stage.inputs)))
        if hooks is not None and stage.output is not None:
            t = state[stage.output]
            if getattr(t, "requires_grad", False):
                t.register_hook(_store(hooks, stage.output))
    return state["out"]


def _store(hooks, key):
    def hook(grad):
        hooks[key] = grad
    return hook
