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
token reorder, scores and scatter-add stay torchtitan's own), eager and compiled alike:
- the count exchange: ``mxcomm.torch.exchange_layout`` (one device-to-host copy of the counts, as
  torchtitan's own makes, and one host allgather over the communicator's side channel) replaces
  torch's all-to-all of the counts; dispatch and combine, given that layout, make no host
  collective;
- the token exchanges and the permute: ``mxcomm.torch.a2a_dispatch(x, layout, permute_align=A)``
  delivers the rows in expert-major order (torchtitan's permute and unpermute are skipped; its
  counts become the groups' sizes), and ``a2a_combine(y, layout, permute_align=A)`` takes them
  back. Without a recipe that keeps them quantized the rows come dequantized, in the
  activations' dtype, groups unpadded (A = 1; TorchAO's dispatcher: its ``pad_multiple``).
It works under both spmd backends (``spmd_types``, where the EP group comes from the current SPMD
mesh, and the DTensor ones, where it is the EP mesh's group): the communicator is the one
``mxcomm.torch.communicator_for`` keeps for that group (NCCL on GPUs, torch.distributed's gloo on a
CPU; built on the first step, collectively). Under spmd_types type checking (a debugging mode:
mxcomm's results carry no SPMD type) torchtitan's own exchanges run; under torch.export's
non-strict tracing mxcomm's raise ``RuntimeError`` (they do not run there).

With a recipe of ``mxcomm.recipes`` (``use_mxcomm(config, recipe="fp8_rowwise")``, or the override
``'mxcomm.integrations.torchtitan.mxcomm_moe={"recipe": "fp8_rowwise"}'``) both the dispatcher and
the experts are mxcomm's: where the recipe's GEMM is fp8 (``fused``), the dispatcher's
``permute_align`` keeps the rows in the dispatch precision (fp8 rowwise: a QuantizedTensor) and
:class:`MxcommGroupedExperts` (in place of torchtitan's ``GroupedExperts``) feeds them to one
``mxcomm.torch.grouped_mm`` over [w1 | w3] with no bf16 pass between. ``overlap=True``
(``use_mxcomm``; ``"overlap": true`` in the override) runs the dispatch's backward beside the
experts' weight-gradient GEMM (eager).
``recipe="auto"`` (the default of ``mxcomm.torch.ExpertParallel``) chooses per call among the
recipes, as ``ExpertParallel`` does (its cost tables and agreement, built when torchtitan wires
the dispatcher to its EP mesh): from the agreed layout in eager, from the rows this rank routes
under ``torch.compile`` (a size the trace knows; torchtitan pads every rank's tokens alike).

Under ``torch.compile`` (torchtitan compiles each block with ``fullgraph=True``) the token
exchanges and the layout are mxcomm's custom ops (docs/design.md, "torch.compile and custom
ops"): a compiled model makes mxcomm's exchanges, never torchtitan's in their place, and no host
vote per exchange.

Importing this module with torchtitan installed registers the overrides (so an override names it
whichever of the two was imported first); ``import mxcomm.integrations.torchtitan`` works without
torchtitan, and the classes import it when first used.
"""

import sys

from ._titan_hooks import RECIPE_ALIGN, MxcommExchanges, precisions

__all__ = ["MxcommTokenDispatcher", "MxcommTorchAOTokenDispatcher", "MxcommGroupedExperts",
           "use_mxcomm", "mxcomm_token_dispatcher", "mxcomm_moe", "register",
           "patch_expert_parallel"]

#: The precision fields of the dispatcher configs, with their defaults.
PRECISION_FIELDS = {"dispatch_precision": "mxfp8", "combine_precision": "bf16",
                    "dispatch_grad_precision": None, "combine_grad_precision": None}
_LAZY_CLASSES = ("MxcommTokenDispatcher", "MxcommTorchAOTokenDispatcher", "MxcommGroupedExperts")


def __getattr__(name):
    if name in _LAZY_CLASSES:
        _define_classes()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _define_classes():
    """Define the dispatcher classes (imports torchtitan) into this module, once."""
    module = sys.modules[__name__]
    if "MxcommTokenDispatcher" in module.__dict__:
        return
    import dataclasses

    from torchtitan.models.common import token_dispatcher as td

    class MxcommTokenDispatcher(MxcommExchanges, td.AllToAllTokenDispatcher):
        """torchtitan's ``AllToAllTokenDispatcher`` with mxcomm's exchanges (module docstring).

        Config fields: those of ``AllToAllTokenDispatcher.Config`` (``num_experts``, ``top_k``),
        and ``dispatch_precision`` (default ``"mxfp8"``), ``combine_precision`` (``"bf16"``),
        ``dispatch_grad_precision`` / ``combine_grad_precision`` (None: by direction),
        ``permute_align`` (0: plain rows in the activations' dtype, groups unpadded; A > 0:
        groups padded to A rows, rows kept in the dispatch precision for
        :class:`MxcommGroupedExperts`); ``recipe`` (None, or ``"auto"``: the precisions above
        unused, each call's recipe chosen by ``mxcomm.recipes``), ``dim`` and ``hidden`` (the
        experts' widths, for ``"auto"``: its chooser is built outside any compiled region, and
        its prediction reads H; 0: unknown, then eager only); ``overlap`` (False; True where
        mxcomm permutes, ``permute_align`` > 0 or ``recipe="auto"``: the dispatch's backward
        beside the experts' weight-gradient GEMM for the calls whose rows reach mxcomm's experts
        as dispatched, eager only; docs/design.md, "Overlap"). Raises ``ValueError`` at build
        for an unknown precision or recipe, or ``overlap`` where mxcomm does not permute.
        """

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(td.AllToAllTokenDispatcher.Config):
            dispatch_precision: str = PRECISION_FIELDS["dispatch_precision"]
            combine_precision: str = PRECISION_FIELDS["combine_precision"]
            dispatch_grad_precision: str | None = None
            combine_grad_precision: str | None = None
            permute_align: int = 0
            recipe: str | None = None
            dim: int = 0
            hidden: int = 0
            overlap: bool = False

        def __init__(self, config):
            if config.recipe not in (None, "auto"):
                raise ValueError(f"recipe: expected None or 'auto' (a pinned recipe is written "
                                 f"as its precisions: use_mxcomm), got {config.recipe!r}")
            super().__init__(config)

    class MxcommTorchAOTokenDispatcher(MxcommExchanges, td.TorchAOTokenDispatcher):
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
        ``gemm="auto"`` (the recipe ``"auto"``, chosen per call): mxcomm's GEMMs for rows that
        arrive quantized (the fp8 recipe), torchtitan's for plain ones.

        Config fields: those of ``GroupedExperts.Config``, ``gemm`` (``"bf16"``, ``"fp8"`` or
        ``"auto"``) and ``wgrad`` (the w1|w3 GEMM's weight gradient, ``"fp8"`` or ``"bf16"``:
        the recipe's); ValueError at build otherwise.
        """

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            gemm: str = "bf16"
            wgrad: str = "fp8"

        def __init__(self, config):
            if config.gemm not in ("bf16", "fp8", "auto"):
                raise ValueError(f"gemm: expected 'bf16', 'fp8' or 'auto', got {config.gemm!r}")
            if config.wgrad not in ("fp8", "bf16"):
                raise ValueError(f"wgrad: expected 'fp8' or 'bf16', got {config.wgrad!r}")
            super().__init__(config)
            self.gemm = config.gemm
            self.mxcomm_wgrad = config.wgrad

        def _uses_mxcomm_gemm(self, x_RD):
            from mxcomm import torch as mxt
            return self.gemm == "fp8" or (self.gemm == "auto" and
                                          isinstance(x_RD, mxt.QuantizedTensor))

    for cls in (MxcommTokenDispatcher, MxcommTorchAOTokenDispatcher, MxcommGroupedExperts):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        cls.Config.__module__ = __name__
        cls.Config.__qualname__ = f"{cls.__name__}.Config"
        setattr(module, cls.__name__, cls)


def _converted(config, fields_):
    """The mxcomm twin of an ``AllToAllTokenDispatcher.Config`` (TorchAO's keeps its padding:
    ``permute_align`` is dropped there), every other field copied; ``fields_`` as
    :data:`PRECISION_FIELDS`, ``permute_align``, ``recipe``. ValueError: an unknown precision;
    ``recipe="auto"`` on TorchAO's dispatcher (it pads for torchao's own experts)."""
    import dataclasses

    from torchtitan.models.common import token_dispatcher as td
    _define_classes()
    module = sys.modules[__name__]
    target = module.MxcommTorchAOTokenDispatcher if isinstance(
        config, td.TorchAOTokenDispatcher.Config) else module.MxcommTokenDispatcher
    if fields_.get("recipe") and target is module.MxcommTorchAOTokenDispatcher:
        raise ValueError("recipe 'auto': needs torchtitan's AllToAllTokenDispatcher (the TorchAO "
                         "dispatcher pads its groups for torchao's quantized experts); pin a "
                         "recipe, or use the AllToAll dispatcher")
    fields = {f.name for f in dataclasses.fields(target.Config) if f.init}
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.init and f.name in fields}
    values.update((k, v) for k, v in fields_.items() if k in fields)
    new = target.Config(**values)
    precisions(new)  # an unknown precision fails here, at configuration time
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
    """``(dispatcher fields, gemm, wgrad)`` of a recipe of ``mxcomm.recipes`` (its name or the
    Recipe): its precisions with ``permute_align``, or for ``"auto"`` the field ``recipe``.
    ValueError: an unknown recipe (listing them)."""
    if recipe == "auto" or getattr(recipe, "name", None) == "auto":
        return dict(recipe="auto"), "auto", "fp8"
    if isinstance(recipe, str):
        from mxcomm.recipes import get_recipe
        recipe = get_recipe(recipe)
    chosen = recipe
    return (dict(dispatch_precision=chosen.dispatch, combine_precision=chosen.combine,
                 dispatch_grad_precision=chosen.dispatch_grad,
                 combine_grad_precision=chosen.combine_grad,
                 permute_align=RECIPE_ALIGN if chosen.fused else 0), chosen.gemm,
            getattr(chosen, "wgrad", "fp8"))


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
        recipe: None, or a recipe of ``mxcomm.recipes`` (name or Recipe): its four formats,
            its layout (``fused``: groups padded to :data:`RECIPE_ALIGN` rows, quantized rows
            reaching the experts as they arrive) and its GEMM (``"fp8"``:
            ``mxcomm.torch.grouped_mm``) replace the precisions below; ``"auto"``: the recipe
            chosen per call (the dispatcher's ``recipe`` field, the experts' ``gemm="auto"``;
            the experts' widths copied into the dispatcher's ``dim`` and ``hidden``).
        dispatch_precision, combine_precision, dispatch_grad_precision, combine_grad_precision:
            the wire formats (module docstring), without a recipe.
        permute_align: without a recipe, 0 (plain rows, groups unpadded) or A > 0 (groups
            padded to A rows, rows kept in the dispatch precision).
        overlap: True to run the dispatch's backward beside the experts' weight-gradient GEMM
            (``mxcomm.torch.ExpertParallel(overlap=True)``'s overlap; eager only) where mxcomm
            permutes (a ``fused`` recipe, ``"auto"``, or ``permute_align`` > 0); the same bits
            as False (default). TorchAO's dispatcher has no such field: it is dropped there.
    Returns:
        The number of dispatcher configs replaced (0 where EP uses another dispatcher).
    Raises:
        ValueError: an unknown precision or recipe; ``"auto"`` on TorchAO's dispatcher;
            ``overlap`` not a bool, or True where mxcomm does not permute.
        TypeError: ``config`` holds no traversable config tree; or the tree's root is itself a
            dispatcher (or experts) config (assign mxcomm's config instead).
    """
    from torchtitan.models.common import token_dispatcher as td
    from torchtitan.models.common.moe import GroupedExperts
    if not hasattr(config, "traverse"):
        raise TypeError(f"config: expected a torchtitan config tree (with traverse), got "
                        f"{type(config).__name__}")
    gemm, wgrad = None, "fp8"
    if recipe is not None:
        fields, gemm, wgrad = _recipe(recipe)
    else:
        fields = dict(dispatch_precision=dispatch_precision,
                          combine_precision=combine_precision,
                          dispatch_grad_precision=dispatch_grad_precision,
                          combine_grad_precision=combine_grad_precision,
                          permute_align=permute_align)
    if not isinstance(overlap, bool) or (overlap and not fields.get("permute_align")
                                         and fields.get("recipe") != "auto"):
        raise ValueError(f"overlap: expected False, or True with a recipe whose exchange "
                         f"permutes (fused, such as 'fp8_rowwise'; or 'auto') or permute_align "
                         f"> 0, got {overlap!r} with permute_align "
                         f"{fields.get('permute_align', 0)}")
    fields["overlap"] = overlap
    count = _replace(config, td.AllToAllTokenDispatcher.Config,
                     lambda node: _converted(node, fields))
    if gemm is not None:
        _replace(config, GroupedExperts.Config, lambda node: _experts(node, gemm, wgrad))
    if gemm == "auto":  # each dispatcher predicts with its experts' width
        from torchtitan.models.common.moe import RoutedExperts
        ours = sys.modules[__name__].MxcommTokenDispatcher.Config
        for _, node, _, _ in config.traverse(RoutedExperts.Config):
            if isinstance(node.token_dispatcher, ours):
                node.token_dispatcher.dim = node.inner_experts.dim
                node.token_dispatcher.hidden = node.inner_experts.hidden_dim
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
