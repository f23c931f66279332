"""mxcomm in torchtitan's MoE: the expert-parallel dispatch and combine in low precision.

torchtitan 0.3: a token dispatcher, :class:`MxcommTokenDispatcher` (a subclass of torchtitan's
``AllToAllTokenDispatcher``; :class:`MxcommTorchAOTokenDispatcher` for ``TorchAOTokenDispatcher``,
the padded one of the MX/float8 grouped GEMMs), with the dispatch and combine precisions chosen
separately. Swap it in from the command line through torchtitan's overrides::

    torchrun --nproc-per-node 8 -m torchtitan.train ... --override.imports \\
        'mxcomm.integrations.torchtitan.mxcomm_token_dispatcher={"dispatch_precision": "mxfp8", "combine_precision": "bf16"}'

or in Python, on the model config before the Trainer builds the model::

    from mxcomm.integrations.torchtitan import use_mxcomm
    use_mxcomm(config.model_spec.model, dispatch_precision="mxfp8", combine_precision="bf16")

torchtitan 0.2.x (``ExpertParallel`` calls the module-level ``all_to_all_single_autograd`` for
the token exchanges; the counts keep torch's exchange): one line before the model is
parallelized, one precision for dispatch and combine::

    import torchtitan.distributed.expert_parallel as ep, mxcomm.torch
    ep.all_to_all_single_autograd = mxcomm.torch.all_to_all_single_fn("mxfp8")

(:func:`patch_expert_parallel` does the same and returns the function it replaced.)

Precisions (any format of ``mxcomm.formats``: ``"mxfp8"``, ``"bf16"``, ``"native"`` — the
activations' dtype, exactly as torchtitan sends them — and the others as they land) name what
travels in each *direction*: ``dispatch_precision`` covers the dispatch and the combine's backward
(rows going to the experts), ``combine_precision`` the combine and the dispatch's backward (rows
coming back). ``dispatch_grad_precision`` / ``combine_grad_precision`` override the backward of each
exchange alone. The defaults, ``"mxfp8"`` / ``"bf16"``, are torchao's.

What the dispatcher changes in torchtitan's ``AllToAllTokenDispatcher.dispatch``/``combine`` (its
token reorder, permute, scores and scatter-add stay torchtitan's own):
- the count exchange: ``mxcomm.torch.exchange_layout`` (one device-to-host copy of the counts, as
  torchtitan's own makes, and one host allgather over the communicator's side channel) replaces
  torch's all-to-all of the counts; dispatch and combine, given that layout, then make no host
  collective;
- the token exchanges: ``mxcomm.torch.a2a_dispatch`` / ``a2a_combine`` in the chosen precisions;
  their results come back dequantized, in the activations' dtype, so torchtitan sees what its own
  exchange returns.
It works under both spmd backends (``spmd_types``, where the EP group comes from the current SPMD
mesh, and the DTensor ones, where it is the EP mesh's group): the communicator is the one
``mxcomm.torch.communicator_for`` keeps for that group (NCCL on GPUs, torch.distributed's gloo on a
CPU; built on the first step, collectively). Under spmd_types type checking (a debugging mode:
mxcomm's results carry no SPMD type) torchtitan's own exchanges run; under torch.export's
non-strict tracing mxcomm's raise ``RuntimeError`` (they do not run there).

With a recipe of ``mxcomm.recipes`` (``use_mxcomm(config, recipe="fp8_rowwise")``, or the override
``'mxcomm.integrations.torchtitan.mxcomm_moe={"recipe": "fp8_rowwise"}'``) both the dispatcher and
the experts are mxcomm's: where the recipe permutes in the exchange (``fused``), the dispatcher's
``permute_align`` has mxcomm's dispatch deliver the rows in permuted order in the dispatch
precision (fp8 rowwise: a QuantizedTensor), and :class:`MxcommGroupedExperts` (in place of
torchtitan's ``GroupedExperts``) feeds them to one ``mxcomm.torch.grouped_mm`` over [w1 | w3]
with no bf16 pass between; the combine takes the permuted rows back. ``overlap=True``
(``use_mxcomm``; ``"overlap": true`` in the override) runs the dispatch's backward beside the
experts' weight-gradient GEMM (eager).

Under ``torch.compile`` (torchtitan compiles each block with ``fullgraph=True``) the token
exchanges are mxcomm's custom ops (docs/design.md, "torch.compile and custom ops"): a compiled
model makes mxcomm's exchanges, never torchtitan's in their place.

Importing this module with torchtitan installed registers the overrides (so an override names it
whichever of the two was imported first); ``import mxcomm.integrations.torchtitan`` works without
torchtitan, and the classes import it when first used.
"""

import sys

__all__ = ["MxcommTokenDispatcher", "MxcommTorchAOTokenDispatcher", "MxcommGroupedExperts",
           "use_mxcomm", "mxcomm_token_dispatcher", "mxcomm_moe", "register",
           "patch_expert_parallel"]

#: The precision fields of the dispatcher configs, with their defaults.
PRECISION_FIELDS = {"dispatch_precision": "mxfp8", "combine_precision": "bf16",
                    "dispatch_grad_precision": None, "combine_grad_precision": None}
_LAZY_CLASSES = ("MxcommTokenDispatcher", "MxcommTorchAOTokenDispatcher", "MxcommGroupedExperts")
#: Rows each local expert's group is padded to where a recipe has mxcomm permute (its
#: ``fused``): the fp8 grouped GEMMs' and MX blocks' multiple.
RECIPE_ALIGN = 32


def __getattr__(name):
    if name in _LAZY_CLASSES:
        _define_classes()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Splits(list):
    """A split list (torchtitan keeps it in its dispatch metadata) that also carries the layout
    it came from, so the combine finds the layout again without a host collective."""

    __slots__ = ("layout",)

    def __init__(self, values, layout):
        super().__init__(values)
        self.layout = layout


def _precisions(config):
    """The four wire formats of a dispatcher config, the backward ones resolved by direction.

    Raises:
        ValueError: an unknown precision (naming the field).
    """
    from mxcomm import a2a
    dispatch = config.dispatch_precision
    combine = config.combine_precision
    values = {"dispatch_precision": dispatch, "combine_precision": combine,
              "dispatch_grad_precision": config.dispatch_grad_precision or combine,
              "combine_grad_precision": config.combine_grad_precision or dispatch}
    for field, value in values.items():
        a2a._check_precision(value, field)
    return values


class _Fused:
    """What the dispatcher hands itself between its hooks when mxcomm permutes (the dispatcher's
    ``permute_align``): the layout (a TensorLayout, or a LayoutHandle in a compiled region) in
    place of torchtitan's group counts and splits, and the group ends of the permuted rows."""

    def __init__(self, layout):
        self.layout = layout
        self.offsets = None


def _non_strict_tracing():
    """``torch.compiler._is_non_strict_tracing()`` where torch has it (2.12 on), else False
    (torch 2.11: no non-strict tracing to ask about)."""
    import torch
    if torch.compiler.is_compiling():  # dynamo, not export's non-strict tracing
        return False
    probe = getattr(torch.compiler, "_is_non_strict_tracing", None)
    return probe is not None and probe()


class _MxcommExchanges:
    """The exchange hooks of torchtitan's ``AllToAllTokenDispatcher`` on mxcomm (mixed in first).

    Shapes (torchtitan's suffixes): ``x`` (N, D) routed token rows sorted by global expert,
    ``num_local_tokens_per_expert_E`` (E,) int64; the exchanges return (R, D) rows in ``x``'s
    dtype, or with ``permute_align`` A > 0 the permuted rows (P, D) as the dispatch precision
    gives them (a QuantizedTensor for a quantized one), each local expert's group padded to a
    multiple of A, and torchtitan's permute and unpermute are skipped.

    In a compiled region (``torch.compile``) the token exchanges are mxcomm's custom ops
    (docs/design.md, "torch.compile and custom ops"); without ``permute_align`` the token
    counts there go through torchtitan's own count exchange (integers, exact), which its
    permute needs as a tensor.
    """

    def __init__(self, config):
        super().__init__(config)
        for field, value in _precisions(config).items():
            setattr(self, field, value)
        self.permute_align = getattr(config, "permute_align", 0)
        overlap = getattr(config, "overlap", False)
        if not isinstance(overlap, bool) or (overlap and not self.permute_align):
            raise ValueError(f"overlap: expected False, or True with permute_align > 0 (a "
                             f"recipe whose exchange permutes: the rows must reach mxcomm's "
                             f"experts as dispatched), got {overlap!r} with permute_align "
                             f"{self.permute_align}")
        #: None, or the ``mxcomm._torch_overlap.BackwardOverlap`` of ``overlap=True`` (its
        #: ``beside`` / ``behind`` count the dispatch backwards that overlapped / waited)
        self.backward_overlap = None
        if overlap:
            from mxcomm._torch_overlap import BackwardOverlap
            self.backward_overlap = BackwardOverlap()

    @staticmethod
    def _torchtitan_path():
        """True where torchtitan's own exchanges must run: SPMD type checking (a debugging
        mode: mxcomm's results carry no SPMD type). RuntimeError under torch.export's
        non-strict tracing, where mxcomm's exchanges cannot run."""
        if _non_strict_tracing():
            raise RuntimeError("mxcomm's token exchanges do not run under torch.export's "
                               "non-strict tracing; use torch.compile, or torchtitan's own "
                               "dispatcher for export")
        from torchtitan.distributed.utils import get_spmd_backend
        if get_spmd_backend() == "spmd_types":
            import spmd_types
            return spmd_types.is_type_checking()
        return False

    def _token_count_exchange(self, num_local_tokens_per_expert_E, pg, ep_size):
        import torch
        if self._torchtitan_path() or (torch.compiler.is_compiling() and
                                       not self.permute_align):
            return super()._token_count_exchange(num_local_tokens_per_expert_E, pg, ep_size)
        from mxcomm import torch as mxt
        return mxt.exchange_layout(num_local_tokens_per_expert_E, pg)

    def _sync_token_count_exchange(self, num_local_tokens_per_expert_E,
                                   num_global_tokens_per_local_expert_EP_e, ep_size):
        from mxcomm.layout import Layout
        from mxcomm.torch._ops import LayoutHandle
        layout = num_global_tokens_per_local_expert_EP_e
        if isinstance(layout, LayoutHandle) or (self.permute_align and
                                                isinstance(layout, Layout)):
            fused = _Fused(layout)
            return fused, fused, fused
        if not isinstance(layout, Layout):
            return super()._sync_token_count_exchange(
                num_local_tokens_per_expert_E, num_global_tokens_per_local_expert_EP_e, ep_size)
        group = layout.group_tensor.to(num_local_tokens_per_expert_E.dtype)
        return group, _Splits(layout.input_splits, layout), _Splits(layout.output_splits, layout)

    def _dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):
        if type(input_splits) is _Fused:
            import torch

            from mxcomm import torch as mxt
            if self.backward_overlap is not None and not torch.compiler.is_compiling():
                # the same call, its backward beside the experts' wgrad (eager only)
                rows, _, input_splits.offsets = self.backward_overlap.dispatch(
                    routed_input_ND, input_splits.layout, precision=self.dispatch_precision,
                    grad_precision=self.dispatch_grad_precision, align=self.permute_align,
                    fused=True)
                return rows
            rows, _, input_splits.offsets = mxt.a2a_dispatch(
                routed_input_ND, input_splits.layout, precision=self.dispatch_precision,
                grad_precision=self.dispatch_grad_precision, permute_align=self.permute_align)
            return rows
        if self._torchtitan_path():
            return super()._dispatch_token_exchange(routed_input_ND, pg, output_splits,
                                                    input_splits)
        return _through_mxcomm("a2a_dispatch", routed_input_ND, pg, input_splits, output_splits,
                               self.dispatch_precision, self.dispatch_grad_precision)

    def _permute(self, routed_input_RD, num_global_tokens_per_local_expert_E):
        fused = num_global_tokens_per_local_expert_E
        if type(fused) is not _Fused:
            return super()._permute(routed_input_RD, num_global_tokens_per_local_expert_E)
        import torch
        offsets = fused.offsets  # the padded groups' ends: their sizes, as torchtitan's counts
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        return routed_input_RD.shape, routed_input_RD, None, counts

    def _unpermute(self, routed_output_RD, input_shape, permuted_indices):
        if permuted_indices is None:  # permuted by mxcomm: the combine takes the rows as they are
            return routed_output_RD
        return super()._unpermute(routed_output_RD, input_shape, permuted_indices)

    def _combine_token_exchange(self, routed_output_RD, pg, input_splits, output_splits):
        if type(input_splits) is _Fused:
            from mxcomm import torch as mxt
            out = mxt.a2a_combine(routed_output_RD, input_splits.layout,
                                  precision=self.combine_precision,
                                  grad_precision=self.combine_grad_precision,
                                  permute_align=self.permute_align)
            return _plain(out, routed_output_RD.dtype)
        if self._torchtitan_path():
            return super()._combine_token_exchange(routed_output_RD, pg, input_splits,
                                                   output_splits)
        return _through_mxcomm("a2a_combine", routed_output_RD, pg, input_splits, output_splits,
                               self.combine_precision, self.combine_grad_precision)


def _through_mxcomm(function, x, pg, input_splits, output_splits, precision, grad_precision):
    """One direction of the token exchange through ``mxcomm.torch.<function>``: given the layout
    that torchtitan's splits carry (no host collective), else the splits and ``pg`` (its
    cached communicator; in a compiled region the op finds it). Returns a plain tensor of
    ``x``'s dtype (:func:`_plain`)."""
    from mxcomm import torch as mxt
    call = getattr(mxt, function)
    options = dict(precision=precision, grad_precision=grad_precision)
    layout = getattr(input_splits, "layout", None)
    if layout is not None:
        out = call(x, layout, **options)
    else:
        out = call(x, list(input_splits), list(output_splits), pg, **options)
    return _plain(out, x.dtype)


def _plain(t, dtype):
    """``t`` as a plain tensor of ``dtype``: a quantized result dequantized (differentiable,
    straight-through), then cast if needed."""
    from mxcomm import torch as mxt
    if isinstance(t, mxt.QuantizedTensor):
        t = t.dequantize()
    return t if t.dtype == dtype else t.to(dtype)


def _define_classes():
    """Define the dispatcher classes (imports torchtitan) into this module, once."""
    module = sys.modules[__name__]
    if "MxcommTokenDispatcher" in module.__dict__:
        return
    import dataclasses

    from torchtitan.models.common import token_dispatcher as td

    class MxcommTokenDispatcher(_MxcommExchanges, td.AllToAllTokenDispatcher):
        """torchtitan's ``AllToAllTokenDispatcher`` with mxcomm's exchanges (module docstring).

        Config fields: those of ``AllToAllTokenDispatcher.Config`` (``num_experts``, ``top_k``),
        and ``dispatch_precision`` (default ``"mxfp8"``), ``combine_precision`` (``"bf16"``),
        ``dispatch_grad_precision`` / ``combine_grad_precision`` (None: by direction),
        ``permute_align`` (0: torchtitan's permute; A > 0: mxcomm's exchange permutes, groups
        padded to A rows, rows kept in the dispatch precision for :class:`MxcommGroupedExperts`),
        ``overlap`` (False; True with ``permute_align`` > 0: the dispatch's backward beside the
        experts' weight-gradient GEMM, eager only; docs/design.md, "Overlap"). Raises
        ``ValueError`` at build for an unknown precision, or ``overlap`` without
        ``permute_align``.
        """

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(td.AllToAllTokenDispatcher.Config):
            dispatch_precision: str = PRECISION_FIELDS["dispatch_precision"]
            combine_precision: str = PRECISION_FIELDS["combine_precision"]
            dispatch_grad_precision: str | None = None
            combine_grad_precision: str | None = None
            permute_align: int = 0
            overlap: bool = False

    class MxcommTorchAOTokenDispatcher(_MxcommExchanges, td.TorchAOTokenDispatcher):
        """torchtitan's ``TorchAOTokenDispatcher`` (groups padded to ``pad_multiple`` for the
        quantized grouped GEMMs) with mxcomm's exchanges; fields as
        :class:`MxcommTokenDispatcher`'s plus ``pad_multiple``."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(td.TorchAOTokenDispatcher.Config):
            dispatch_precision: str = PRECISION_FIELDS["dispatch_precision"]
            combine_precision: str = PRECISION_FIELDS["combine_precision"]
            dispatch_grad_precision: str | None = None
            combine_grad_precision: str | None = None

    from torchtitan.models.common.moe import GroupedExperts

    from mxcomm._torch_ep import grouped_experts_class

    class MxcommGroupedExperts(grouped_experts_class(GroupedExperts)):
        """torchtitan's ``GroupedExperts`` whose grouped GEMMs are ``mxcomm.torch.grouped_mm``
        where ``gemm`` is ``"fp8"`` (``mxcomm._torch_ep.grouped_experts_class``): the fp8
        rowwise rows the dispatcher delivers (a QuantizedTensor) feed one SM90 fp8 grouped GEMM
        over [w1 | w3] as they are, no bf16 pass between; the w2 GEMM reads the SwiGLU's bf16
        product (``grouped_mm``'s bf16 GEMM for plain rows); where fp8 GEMMs are unavailable (a
        CPU, pre-Hopper) its documented bf16 fallback. ``gemm="bf16"``: torchtitan's own
        forward (``torch._grouped_mm``, on a QuantizedTensor's dequantized values).

        Config fields: those of ``GroupedExperts.Config``, ``gemm`` (``"bf16"`` or ``"fp8"``)
        and ``wgrad`` (the w1|w3 GEMM's weight gradient, ``"fp8"`` or ``"bf16"``: the recipe's);
        ValueError at build otherwise.
        """

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            gemm: str = "bf16"
            wgrad: str = "fp8"

        def __init__(self, config):
            if config.gemm not in ("bf16", "fp8"):
                raise ValueError(f"gemm: expected 'bf16' or 'fp8', got {config.gemm!r}")
            if config.wgrad not in ("fp8", "bf16"):
                raise ValueError(f"wgrad: expected 'fp8' or 'bf16', got {config.wgrad!r}")
            super().__init__(config)
            self.gemm = config.gemm
            self.mxcomm_wgrad = config.wgrad

        def _uses_mxcomm_gemm(self, x_RD):
            return self.gemm == "fp8"

    for cls in (MxcommTokenDispatcher, MxcommTorchAOTokenDispatcher, MxcommGroupedExperts):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        cls.Config.__module__ = __name__
        cls.Config.__qualname__ = f"{cls.__name__}.Config"
        setattr(module, cls.__name__, cls)


def _converted(config, precisions):
    """The mxcomm twin of an ``AllToAllTokenDispatcher.Config`` (TorchAO's keeps its padding and
    its permute: ``permute_align`` is dropped there), every other field copied; ``precisions``
    as :data:`PRECISION_FIELDS`, and ``permute_align``."""
    import dataclasses

    from torchtitan.models.common import token_dispatcher as td
    _define_classes()
    module = sys.modules[__name__]
    target = module.MxcommTorchAOTokenDispatcher if isinstance(
        config, td.TorchAOTokenDispatcher.Config) else module.MxcommTokenDispatcher
    fields = {f.name for f in dataclasses.fields(target.Config) if f.init}
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.init and f.name in fields}
    values.update((k, v) for k, v in precisions.items() if k in fields)
    new = target.Config(**values)
    _precisions(new)  # an unknown precision fails here, at configuration time
    return new


def _experts(config, gemm, wgrad="fp8"):
    """The :class:`MxcommGroupedExperts` twin of a ``GroupedExperts.Config``."""
    import dataclasses
    _define_classes()
    target = sys.modules[__name__].MxcommGroupedExperts
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    values.update(gemm=gemm, wgrad=wgrad)
    return target.Config(**values)


def _recipe(recipe):
    """``(precision fields with permute_align, gemm)`` of a recipe of ``mxcomm.recipes`` (its
    name or the Recipe). ValueError: an unknown recipe (listing them), or ``"auto"``, which
    chooses per layout and so cannot be written into a config."""
    if isinstance(recipe, str):
        from mxcomm.recipes import get_recipe
        recipe = get_recipe(recipe)
    chosen = recipe
    if chosen.name == "auto":
        raise ValueError("recipe: 'auto' chooses per layout, which a torchtitan config cannot "
                         "hold yet; pin one of the recipes ('bf16', 'mxfp8', 'fp8_rowwise')")
    return (dict(dispatch_precision=chosen.dispatch, combine_precision=chosen.combine,
                 dispatch_grad_precision=chosen.dispatch_grad,
                 combine_grad_precision=chosen.combine_grad,
                 permute_align=RECIPE_ALIGN if chosen.fused else 0), chosen.gemm)


def _replace(config, cls, make):
    """Replace every ``cls`` config under the tree ``config`` by ``make(node)``; their number.
    TypeError where the root itself is one."""
    found = list(config.traverse(cls))
    for _, node, parent, attr in found:
        if parent is None:
            raise TypeError(f"config: the root is a {cls.__qualname__}; assign mxcomm's config "
                            f"in its place instead")
        if isinstance(parent, list):
            parent[attr] = make(node)
        else:
            setattr(parent, attr, make(node))
    return len(found)


def use_mxcomm(config, *, recipe=None, dispatch_precision="mxfp8", combine_precision="bf16",
               dispatch_grad_precision=None, combine_grad_precision=None, permute_align=0,
               overlap=False):
    """Replace every ``AllToAllTokenDispatcher.Config`` (and ``TorchAOTokenDispatcher.Config``)
    in a torchtitan 0.3 config tree by mxcomm's, in place; with a ``recipe``, every
    ``GroupedExperts.Config`` too, by :class:`MxcommGroupedExperts`'s.

    Args:
        config: a config tree with ``traverse`` (a model config: ``config.model_spec.model``,
            a ``MoE.Config``, a ``RoutedExperts.Config``).
        recipe: None, or a recipe of ``mxcomm.recipes`` (name or Recipe; not ``"auto"``): its
            four formats, its permute (``fused``: mxcomm permutes, groups padded to
            :data:`RECIPE_ALIGN` rows, so quantized rows reach the experts as they arrive) and
            its GEMM (``"fp8"``: ``mxcomm.torch.grouped_mm``) replace the precisions below.
        dispatch_precision, combine_precision, dispatch_grad_precision, combine_grad_precision:
            the wire formats (module docstring), without a recipe.
        permute_align: without a recipe, 0 (torchtitan's permute) or A > 0 (mxcomm's).
        overlap: True to run the dispatch's backward beside the experts' weight-gradient GEMM
            (``mxcomm.torch.ExpertParallel(overlap=True)``'s overlap; eager only), where mxcomm
            permutes (a ``fused`` recipe, or ``permute_align`` > 0); the same bits as False
            (default). TorchAO's dispatcher has no such field: it is dropped there.
    Returns:
        The number of dispatcher configs replaced (0 where EP uses another dispatcher).
    Raises:
        ValueError: an unknown precision or recipe, or ``recipe="auto"``; ``overlap`` not a
            bool, or True where mxcomm does not permute.
        TypeError: ``config`` holds no traversable config tree; or the tree's root is itself a
            dispatcher (or experts) config (assign mxcomm's config instead).
    """
    from torchtitan.models.common import token_dispatcher as td
    from torchtitan.models.common.moe import GroupedExperts
    if not hasattr(config, "traverse"):
        raise TypeError(f"config: expected a torchtitan config tree (with traverse), got "
                        f"{type(config).__name__}")
    gemm = None
    if recipe is not None:
        precisions, gemm = _recipe(recipe)
        if isinstance(recipe, str):
            from mxcomm.recipes import get_recipe
            recipe = get_recipe(recipe)
        wgrad = getattr(recipe, "wgrad", "fp8")
    else:
        precisions = dict(dispatch_precision=dispatch_precision,
                          combine_precision=combine_precision,
                          dispatch_grad_precision=dispatch_grad_precision,
                          combine_grad_precision=combine_grad_precision,
                          permute_align=permute_align)
    if not isinstance(overlap, bool) or (overlap and not precisions["permute_align"]):
        raise ValueError(f"overlap: expected False, or True with a recipe whose exchange "
                         f"permutes (fused, such as 'fp8_rowwise') or permute_align > 0, got "
                         f"{overlap!r} with permute_align {precisions['permute_align']}")
    precisions["overlap"] = overlap
    count = _replace(config, td.AllToAllTokenDispatcher.Config,
                     lambda node: _converted(node, precisions))
    if gemm is not None:
        _replace(config, GroupedExperts.Config, lambda node: _experts(node, gemm, wgrad))
    return count


def mxcomm_token_dispatcher(cfg, *, dispatch_precision="mxfp8", combine_precision="bf16",
                            dispatch_grad_precision=None, combine_grad_precision=None,
                            permute_align=0):
    """torchtitan 0.3 override (``--override.imports
    'mxcomm.integrations.torchtitan.mxcomm_token_dispatcher={...}'``): every
    ``AllToAllTokenDispatcher.Config`` (TorchAO's included) becomes mxcomm's, with these
    precisions (the JSON object's keys). Returns the replacement config. For a recipe (the
    experts too) use :func:`mxcomm_moe`."""
    return _converted(cfg, dict(dispatch_precision=dispatch_precision,
                                combine_precision=combine_precision,
                                dispatch_grad_precision=dispatch_grad_precision,
                                combine_grad_precision=combine_grad_precision,
                                permute_align=permute_align))


def mxcomm_moe(cfg, *, recipe, overlap=False):
    """torchtitan 0.3 override (``--override.imports
    'mxcomm.integrations.torchtitan.mxcomm_moe={"recipe": "fp8_rowwise"}'``, with
    ``"overlap": true`` for the backward overlap): every ``RoutedExperts.Config`` gets mxcomm's
    dispatcher and experts for ``recipe`` (:func:`use_mxcomm`). Returns the config, changed in
    place."""
    use_mxcomm(cfg, recipe=recipe, overlap=overlap)
    return cfg


def register():
    """Register :func:`mxcomm_token_dispatcher` and :func:`mxcomm_moe` with torchtitan's
    overrides (idempotent). Done when this module is imported with torchtitan installed, in
    either order of imports."""
    import importlib

    from torchtitan.models.common import token_dispatcher as td
    from torchtitan.models.common.moe import RoutedExperts
    # the module (``torchtitan.config.override`` the attribute may be its decorator)
    overrides = importlib.import_module("torchtitan.config.override")
    for factory, target, description in (
            (mxcomm_token_dispatcher, td.AllToAllTokenDispatcher.Config,
             "mxcomm: EP dispatch and combine in low precision"),
            (mxcomm_moe, RoutedExperts.Config,
             "mxcomm: EP dispatch, combine and grouped GEMMs by recipe")):
        if f"{__name__}.{factory.__name__}" not in overrides._REGISTRY:
            overrides.override(target=target, description=f"{description} "
                               f"(mxcomm.integrations.torchtitan)")(factory)


def patch_expert_parallel(precision="mxfp8"):
    """torchtitan 0.2.x: route ``ExpertParallel``'s token exchanges through mxcomm.

    Sets ``torchtitan.distributed.expert_parallel.all_to_all_single_autograd`` to
    ``mxcomm.torch.all_to_all_single_fn(precision)`` (the token counts keep torch's own
    ``all_to_all_single``). Call it before the model's forward.

    Returns:
        The function it replaced (assign it back to undo).
    Raises:
        ImportError: no torchtitan 0.2.x (``torchtitan.distributed.expert_parallel``).
        ValueError: an unknown precision.
    """
    import torchtitan.distributed.expert_parallel as ep

    from mxcomm import torch as mxt
    previous = ep.all_to_all_single_autograd
    ep.all_to_all_single_autograd = mxt.all_to_all_single_fn(precision)
    return previous


def _torchtitan_installed():
    import importlib.util
    try:
        return importlib.util.find_spec("torchtitan.config.override") is not None
    except ImportError:  # no torchtitan
        return False


# Registered now, whichever was imported first: torchtitan imports this module by name for an
# override that names it, and a module imported earlier (before torchtitan's config) is not run
# again then.
if _torchtitan_installed():
    register()
