"""The MoE expert-parallel token path the ``pipeline`` benchmark runs, as a list of stages.

Forward, variants with the bf16 GEMM (``Variant.gemm == "bf16"``)::

    layout -> dispatch (a2a) -> permute -> dequantize -> grouped GEMM -> grad_dequantize
           -> unpermute -> combine (a2a)

``dequantize`` (forward) turns MXFP8 permuted rows into the GEMM's bf16 input; ``grad_dequantize``
(an identity forward) turns an MXFP8 gradient from unpermute's backward into bf16 once, before the
GEMM's backward. Both are no-ops on bf16 tensors (skipped in the per-stage table).

Forward, variants with the fp8 GEMM (``Variant.gemm == "fp8"``)::

    layout -> dispatch (a2a) -> permute -> grouped GEMM (fp8 rowwise) -> unpermute -> combine (a2a)

Their GEMM is ``mxcomm.torch.grouped_mm`` (mxcomm/_torch_gemm.py): on SM90 the rowwise recipe of
``torch._scaled_grouped_mm``, which takes fp8_rowwise rows (forward) and an fp8_rowwise gradient
(dgrad) as they are and quantizes anything else per call (fp8 wgrad by default); elsewhere (CPU, other GPUs)
its bf16 fallback, ``torch._grouped_mm`` on the dequantized rows, with the same autograd wiring.
They have no dequantize stages: nothing makes a bf16 pass in front of that GEMM.

Variants (:data:`VARIANTS`; wire: the formats of dispatch / combine / dispatch_grad /
combine_grad; GEMM input: what the GEMM's forward reads; its dgrad reads the gradient likewise).
Those run by default are the reference and mxcomm's recipes (``mxcomm.recipes``), ``auto``
first; the others are comparisons of one choice, run when ``--variants`` names them::

    name           exchanges  wire                                    GEMM input
    bf16           torch      bf16 / bf16 / bf16 / bf16               bf16 (the reference)
    auto           mxcomm     the recipe ``auto`` chooses for the shape (``chose``), run as
                              ExpertParallel runs it (fp8 GEMM: with the backward overlap)
    bf16_mxcomm    mxcomm     the recipe bf16: bf16 / bf16 / bf16 / bf16   bf16
    mxfp8          mxcomm     the recipe mxfp8: mxfp8 / bf16 / bf16 / mxfp8   mxfp8, dequantized
                                                                      to bf16 in the permute
    fp8_rowwise    mxcomm     the recipe fp8_rowwise: fp8_rowwise / bf16 / bf16 / fp8_rowwise,
                              the exchanges' expert side in permute's order (permute_align:
                              no permute or unpermute pass), with the backward overlap, as
                              ExpertParallel runs it                fp8 rowwise as received
    -- comparisons (--variants) --
    mxfp8_all      mxcomm     mxfp8 / mxfp8 / mxfp8 / mxfp8           mxfp8, dequantized to bf16
    bf16+fp8gemm   torch      bf16 / bf16 / bf16 / bf16               bf16, quantized by the GEMM
    fp8_rowwise_bf16grad  mxcomm  fp8_rowwise / bf16 / bf16 / fp8_rowwise, permuted separately
                                                                      fp8 rowwise as received
    mxfp8+rowwise  mxcomm     mxfp8 / bf16 / bf16 / fp8_rowwise       fp8 rowwise from the permute
                                                                      (gradient: as received)
    fp8_rowwise_mxgrad  mxcomm  fp8_rowwise / bf16 / mxfp8 / fp8_rowwise, permuted separately
    fp8_rowwise_bf16wgrad  mxcomm  as fp8_rowwise_bf16grad          bf16 wgrad
    fp8_rowwise_acc32   mxcomm  as fp8_rowwise_bf16grad               sums promoted to fp32
    fp8_rowwise_serial  mxcomm  the recipe fp8_rowwise without the backward overlap
                              (``ExpertParallel(overlap=False)``): every exchange on one stream
    fp8_rowwise_mxdgrad  mxcomm  the recipe fp8_rowwise with dispatch_grad in MXFP8 on any
                              topology (the recipe's on one node until 2026-11-28; across
                              nodes it is the recipe's), with the overlap
    fp8_rowwise_mxcombine  mxcomm  fp8_rowwise_mxdgrad with the combine in MXFP8 as well (the
                              expert outputs quantized before the exchange): the lever left
                              across nodes, where the combine is the one bf16 exchange
    fp8_rowwise_nocache  mxcomm  the recipe fp8_rowwise with the weight cache off: both fp8
                              weight operands quantized on every call

The fp8 GEMM variants' weight gradient is fp8 (``grouped_mm``'s default: both operands rescaled
per (group, column) along the tokens from the fp8 rows the forward and dgrad read), except
``fp8_rowwise_bf16wgrad``: the same run with the bf16 wgrad, to measure that choice side by
side. Their accumulation is ``grouped_mm``'s default (every product's sums fast, as torchao's
fp8 rowwise MoE GEMM), except ``fp8_rowwise_acc32`` (every product's sums promoted to fp32).
The recipe ``fp8_rowwise`` sends dispatch_grad (the dgrad's bf16 output) in bf16 on one node,
beside the wgrad: copy engines only (``fp8_rowwise_mxdgrad`` halves that exchange's bytes in
MXFP8, whose quantize and dequantize share the SMs with the wgrad; the recipe's format across
nodes, where :func:`resolve` gives the recipes' variants their formats);
``fp8_rowwise_bf16grad`` is the same formats with the permute separate and no overlap (the
benchmark's ``fp8_rowwise`` before the recipes, 2026-11-27).

``bf16`` is the reference of SQNR and speedups; ``bf16+fp8gemm`` (the same wire, the GEMM
quantizing its bf16 rows and gradient per call) is the reference of the fp8 GEMM variants.
``mxfp8+rowwise`` sends MXFP8 and converts it to fp8 rowwise in the permute's gather
(``permute(..., out_format="fp8_rowwise")``, no bf16 round trip); its combine_grad is
fp8_rowwise as well, because an ``"mxfp8"`` gradient would reach the GEMM as MXFP8, which
``grouped_mm`` dequantizes and quantizes again (a bf16 pass).

The torch-exchange variants move tokens with ``torch.distributed.all_to_all_single`` (a small
autograd Function, :class:`_TorchAllToAll`); the others use ``mxcomm.torch`` with a precision per
direction. All variants share the layout exchange and permute/unpermute (``mxcomm.torch``), so
the differences are the all-to-alls, the (de)quantization they imply, and the GEMM. Glossary: M
rows per rank, D dim, H hidden, E_local experts per rank, W ranks, P padded rows of permute.
"""

import dataclasses

#: Rows of each expert group are padded to this (MX GEMMs need 32; SM90 fp8 grouped GEMMs 16).
ALIGN = 32


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the pipeline (module docstring's table).

    Attributes:
        name: its name in the tables and in ``--variants``.
        baseline: the reference of SQNR and speedups (``bf16``).
        torch_a2a: the exchanges are ``torch.distributed.all_to_all_single`` in bf16 (the
            precisions are then all ``"bf16"``); False: ``mxcomm.torch`` in the precisions below.
        dispatch, combine, dispatch_grad, combine_grad: wire formats (``mxcomm.formats`` names).
        permute_format: None, or the format the permute converts the received quantized rows to
            (``out_format``): ``"bf16"`` for the bf16 GEMM (dequantized in the gather, one pass),
            ``"fp8_rowwise"`` for the fp8 one.
        unpermute_grad_format: None, or the format unpermute's backward converts the quantized
            combine gradient to (``grad_format``): ``"bf16"`` for the bf16 GEMM's backward.
        gemm: ``"bf16"`` (bf16 rows, quantized ones dequantized first) or ``"fp8"``
            (``mxcomm.torch.grouped_mm``).
        wgrad: the fp8 GEMM's weight gradient, ``"fp8"`` or ``"bf16"`` (``grouped_mm``'s).
        fast_accum: the fp8 GEMM's products without fp32 promotion (``grouped_mm``'s
            ``fast_accum``).
        fused: the exchanges' expert side in permute's order (``permute_align``): dispatch and
            permute in one call, unpermute and combine in one call, forward and backward.
        default: runs without ``--variants`` (the comparisons of one choice run when named).
        recipe: the ``mxcomm.recipes`` name the variant runs (``"auto"``: chosen per shape,
            :func:`resolve`), or None for a comparison.
        chose: for ``auto`` once resolved, the recipe it chose (else None).
        overlap: the dispatch's backward on a side stream beside the GEMM's wgrad
            (``mxcomm._torch_overlap``, as ``ExpertParallel(overlap=True)``); fused variants
            only.
        weight_cache: the fp8 GEMM keeps its quantized weights while they are unchanged
            (``grouped_mm``'s ``weight_cache``); False: quantized on every call.
    """

    name: str
    baseline: bool = False
    torch_a2a: bool = False
    dispatch: str = "bf16"
    combine: str = "bf16"
    dispatch_grad: str = "bf16"
    combine_grad: str = "bf16"
    permute_format: object = None
    unpermute_grad_format: object = None
    gemm: str = "bf16"
    wgrad: str = "fp8"
    fast_accum: tuple = ("forward", "dgrad", "wgrad")
    fused: bool = False
    default: bool = True
    recipe: object = None
    chose: object = None
    overlap: bool = False
    weight_cache: bool = True

    def describe(self):
        """One line for the report's notes: the exchanges, the permute, the GEMM."""
        if self.recipe == "auto" and self.chose is None:
            return "auto = the recipe mxcomm.recipes.choose_recipe predicts fastest per shape"
        if self.torch_a2a:
            wire = "torch.distributed all_to_all_single in bf16"
        else:
            wire = (f"mxcomm, dispatch {self.dispatch}, combine {self.combine}, dispatch_grad "
                    f"{self.dispatch_grad}, combine_grad {self.combine_grad}")
        permute = f", permute to {self.permute_format}" if self.permute_format else ""
        if self.fused:
            permute += (", dispatch and permute in one call, unpermute and combine in one call "
                        "(permute_align)")
        if self.unpermute_grad_format:
            permute += f" (and its backward's gradient to {self.unpermute_grad_format})"
        fast = "/".join(self.fast_accum) or "none"
        gemm = (f"fp8 rowwise grouped GEMM (mxcomm.torch.grouped_mm, {self.wgrad} wgrad, fast "
                f"accumulation: {fast})") if self.gemm == "fp8" else "bf16 grouped GEMM"
        if self.gemm == "fp8" and not self.weight_cache:
            gemm += ", weights quantized on every call (no weight cache)"
        chose = f" (chose {self.chose})" if self.chose else ""
        overlap = (", the dispatch's backward on a side stream beside the wgrad"
                   if self.overlap else "")
        return f"{self.name}{chose} = {wire}{permute}, {gemm}{overlap}"


def from_recipe(recipe, name=None, **fields):
    """The :class:`Variant` of an ``mxcomm.recipes.Recipe`` (its formats, GEMM and layout)."""
    return Variant(name or recipe.name, dispatch=recipe.dispatch, combine=recipe.combine,
                   dispatch_grad=recipe.dispatch_grad, combine_grad=recipe.combine_grad,
                   permute_format=recipe.permute_format,
                   unpermute_grad_format=recipe.unpermute_grad_format, gemm=recipe.gemm,
                   wgrad=recipe.wgrad, fast_accum=recipe.fast_accum, fused=recipe.fused,
                   recipe=recipe.name, **fields)


def resolve(variant, layout, dim, hidden, device, table, nodes=1):
    """``variant`` as ``ExpertParallel`` runs it on a group spanning ``nodes`` nodes: a
    recipe's with ``Recipe.for_nodes``'s formats; ``auto`` as the recipe it chooses for
    ``layout`` (``mxcomm.recipes.Chooser`` of ``table`` on the agreed ``device`` class), still
    named ``auto``; a comparison (no recipe) as it is."""
    from mxcomm import recipes
    if variant.recipe == "auto":
        chosen = recipes.Chooser(dim, hidden, device=device, table=table)(layout).for_nodes(nodes)
        # as ExpertParallel runs it by default: the fp8 GEMM's recipes with the backward overlap
        return from_recipe(chosen, "auto", chose=chosen.name, overlap=chosen.gemm == "fp8")
    if variant.recipe is None or nodes == 1:
        return variant
    run = recipes.get_recipe(variant.recipe).for_nodes(nodes)
    return dataclasses.replace(variant, dispatch_grad=run.dispatch_grad)


def _recipe_variants():
    from mxcomm import recipes
    # each as ExpertParallel runs it by default: the fp8 GEMM's recipes with the backward overlap
    return (Variant("auto", recipe="auto"),
            from_recipe(recipes.get_recipe("bf16"), "bf16_mxcomm"),
            from_recipe(recipes.get_recipe("mxfp8")),
            from_recipe(recipes.get_recipe("fp8_rowwise"), overlap=True))


def _overlap_variants():
    from mxcomm import recipes
    return (dataclasses.replace(_recipe_variants()[-1], name="fp8_rowwise_serial", overlap=False,
                                recipe=None, default=False),
            dataclasses.replace(_recipe_variants()[-1], name="fp8_rowwise_mxdgrad",
                                dispatch_grad="mxfp8", recipe=None, default=False),
            dataclasses.replace(_recipe_variants()[-1], name="fp8_rowwise_mxcombine",
                                combine="mxfp8", dispatch_grad="mxfp8", recipe=None,
                                default=False))


VARIANTS = (
    Variant("bf16", baseline=True, torch_a2a=True),
    *_recipe_variants(),
    Variant("mxfp8_all", dispatch="mxfp8", combine="mxfp8", dispatch_grad="mxfp8",
            combine_grad="mxfp8", permute_format="bf16", unpermute_grad_format="bf16",
            default=False),
    Variant("bf16+fp8gemm", torch_a2a=True, gemm="fp8", default=False),
    Variant("fp8_rowwise_bf16grad", dispatch="fp8_rowwise", combine_grad="fp8_rowwise",
            gemm="fp8", default=False),
    Variant("mxfp8+rowwise", dispatch="mxfp8", combine_grad="fp8_rowwise",
            permute_format="fp8_rowwise", gemm="fp8", default=False),
    Variant("fp8_rowwise_mxgrad", dispatch="fp8_rowwise", dispatch_grad="mxfp8",
            combine_grad="fp8_rowwise", gemm="fp8", default=False),
    Variant("fp8_rowwise_bf16wgrad", dispatch="fp8_rowwise", combine_grad="fp8_rowwise",
            gemm="fp8", wgrad="bf16", default=False),
    Variant("fp8_rowwise_acc32", dispatch="fp8_rowwise", combine_grad="fp8_rowwise",
            gemm="fp8", fast_accum=(), default=False),
    *_overlap_variants(),
    dataclasses.replace(_recipe_variants()[-1], name="fp8_rowwise_nocache", recipe=None,
                        weight_cache=False, default=False),
)
#: The reference of every SQNR and the first speedup column.
REFERENCE = "bf16"
#: The reference of the fp8 GEMM: the second speedup column.
GEMM_REFERENCE = "bf16+fp8gemm"


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
        loop: True for a per-expert loop of matmuls (the CPU, where older torch versions have no
            ``torch._grouped_mm``; reads ``offs`` to the host), False for ``torch._grouped_mm``.
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
    """The pipeline of ``variant`` as a list of :class:`Stage` (module docstring).

    The state starts as ``{"x": (M, D) bf16, "w": (E_local, H, D) bf16, "counts": (E,) int32}``
    and ends with ``"out"``: (M, H) bf16. On the way: ``"h"`` (N, D) received rows (bf16, or a
    QuantizedTensor of the dispatch format), ``"p"`` (P, D) permuted rows (a QuantizedTensor of
    ``permute_format`` where given), ``"indices"`` (P,) int32, ``"offs"`` (E_local,) int32,
    ``"y_"`` (P, H) bf16 GEMM output as unpermute reads it, ``"u"`` (N, H) bf16.

    Args:
        variant: a :class:`Variant`.
        comm: the mxcomm communicator (the layout exchange; unused by torch's exchanges).
        num_local_experts: E_local.
        loop_gemm: the bf16 GEMM as a per-expert loop of matmuls (:func:`grouped_mm`); the fp8
            GEMM has no loop (its CPU fallback is ``torch._grouped_mm``).
    Raises:
        ValueError: ``auto`` not yet resolved (:func:`resolve`); ``overlap`` on a variant that
            is not fused.
    """
    if variant.recipe == "auto" and variant.chose is None:
        raise ValueError("stages: the variant auto has no stages until resolved for a shape "
                         "(_moe.resolve)")
    if variant.overlap and not variant.fused:
        raise ValueError(f"stages: variant {variant.name}: overlap needs a fused variant (its "
                         f"dispatch and permute are one stage)")
    from mxcomm import torch as mxt

    def layout(s):
        # The one point where the ranks meet; the mxcomm variants pass the layout on, so their
        # calls make no host collective (the GPUs order themselves).
        layout = mxt.exchange_layout(s["counts"], comm)
        group, input_splits, output_splits = layout
        return {"layout": layout, "group": group, "input_splits": input_splits,
                "output_splits": output_splits}

    if variant.torch_a2a:
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
        p, indices, offs = mxt.permute(h, s["layout"], align=ALIGN,
                                       out_format=variant.permute_format)
        return {"p": p, "indices": indices, "offs": offs, "rows_recv": h.shape[0]}

    def unpermute(s, y_):
        return {"u": mxt.unpermute(y_, s["indices"], s["layout"],
                                   grad_format=variant.unpermute_grad_format)}

    if variant.fused:
        overlap = None
        if variant.overlap:  # the variant's side stream, as an ExpertParallel(overlap=True)'s
            from mxcomm._torch_overlap import BackwardOverlap
            overlap = BackwardOverlap()

        def dispatch_permute(s, x):
            if overlap is not None:
                p, indices, offs = overlap.dispatch(x, s["layout"], precision=variant.dispatch,
                                                    grad_precision=variant.dispatch_grad,
                                                    align=ALIGN, fused=True)
            else:
                p, indices, offs = mxt.a2a_dispatch(x, s["layout"], precision=variant.dispatch,
                                                    grad_precision=variant.dispatch_grad,
                                                    permute_align=ALIGN)
            return {"p": p, "indices": indices, "offs": offs,
                    "rows_recv": s["layout"].num_received}

        def unpermute_combine(s, y_):
            return {"out": mxt.a2a_combine(y_, s["layout"], precision=variant.combine,
                                           grad_precision=variant.combine_grad,
                                           permute_align=ALIGN)}

    if variant.gemm == "fp8":
        def fp8_gemm(s, p, w):
            # w (E_local, H, D) as grouped_mm's (G, K, N) = (E_local, D, H): a view; the fp8
            # path quantizes from it into its own contiguous operands (kept while w is
            # unchanged: grouped_mm's weight cache). fp8 wherever it runs, bf16 rows too
            # (bf16+fp8gemm: grouped_mm's default gives plain rows the bf16 GEMM).
            return {"y_": mxt.grouped_mm(p, w.transpose(-2, -1), s["offs"],
                                         fp8=mxt.fp8_gemm_available(w.device),
                                         wgrad=variant.wgrad, fast_accum=variant.fast_accum,
                                         weight_cache=variant.weight_cache)}

        if variant.fused:  # the stages "dispatch" and "combine" hold the permute and unpermute
            return [Stage("layout", (), None, layout),
                    Stage("dispatch", ("x",), "p", dispatch_permute),
                    Stage("gemm", ("p", "w"), "y_", fp8_gemm),
                    Stage("combine", ("y_",), "out", unpermute_combine)]
        return [Stage("layout", (), None, layout),
                Stage("dispatch", ("x",), "h", dispatch),
                Stage("permute", ("h",), "p", permute),
                Stage("gemm", ("p", "w"), "y_", fp8_gemm),
                Stage("unpermute", ("y_",), "u", unpermute),
                Stage("combine", ("u",), "out", combine)]

    def dequantize(s, p):
        return {"a": _dequantize(p)}

    def gemm(s, a, w):
        return {"y": grouped_mm(a, w, s["offs"], loop=loop_gemm)}

    grad_to_bf16 = _grad_to_bf16_class()

    def grad_dequantize(s, y):
        return {"y_": grad_to_bf16.apply(y)}

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
