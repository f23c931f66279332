"""mxcomm in torchtitan's MoE: the expert-parallel dispatch and combine in low precision.

torchtitan 0.3: :class:`MxcommTokenDispatcher` (a subclass of torchtitan's
``AllToAllTokenDispatcher``; :class:`MxcommTorchAOTokenDispatcher` of the padded
``TorchAOTokenDispatcher``), swapped in by torchtitan's overrides::

    torchrun --nproc-per-node 8 -m torchtitan.train ... --override.imports \\
        'mxcomm.integrations.torchtitan.mxcomm_token_dispatcher={"dispatch_precision": "mxfp8", "combine_precision": "bf16"}'

or on the model config before the Trainer builds the model: ``use_mxcomm(config.model_spec.model,
dispatch_precision="mxfp8", combine_precision="bf16")``. torchtitan 0.2.x (one precision, the
counts keep torch's exchange): :func:`patch_expert_parallel`.

Precisions (any ``mxcomm.formats`` name; ``"native"``: the activations' dtype) name a direction:
``dispatch_precision`` the dispatch and the combine's backward, ``combine_precision`` the combine
and the dispatch's backward; ``dispatch_grad_precision`` / ``combine_grad_precision`` override one
backward. Defaults ``"mxfp8"`` / ``"bf16"`` (torchao's).

The dispatcher replaces torchtitan's count exchange by ``exchange_layout`` (one device-to-host
copy, one host allgather), its token exchanges and permute by ``a2a_dispatch`` / ``a2a_combine``
with ``permute_align``, eager and compiled alike; the communicator is
``mxcomm.torch.communicator_for``'s of the EP group. Under spmd_types type checking torchtitan's
own exchanges run; under torch.export's non-strict tracing mxcomm's raise ``RuntimeError``. With a
recipe (``use_mxcomm(config, recipe="fp8_rowwise")``, or the override
``'mxcomm.integrations.torchtitan.mxcomm_moe={"recipe": "fp8_rowwise"}'``) the experts are
mxcomm's too (:class:`MxcommGroupedExperts`); ``"auto"`` chooses per call; the dispatch's
backward runs beside the experts' weight-gradient GEMM (eager) by default with an fp8 GEMM's
recipe or ``"auto"`` (``overlap``). docs/design.md,
"torchtitan 0.3". Importing this module registers the overrides where torchtitan is installed.
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

        Config fields beyond torchtitan's: the four precisions (:data:`PRECISION_FIELDS`);
        ``permute_align`` (0: plain rows, groups unpadded; A > 0: groups padded to A rows, rows
        kept quantized for :class:`MxcommGroupedExperts`); ``recipe`` (None, or ``"auto"``:
        chosen per call); ``dim``, ``hidden`` (the experts' widths for ``"auto"``; 0: unknown,
        eager only); ``overlap`` (where mxcomm permutes; eager only);
        ``dispatch_grad_across_nodes`` (None, or the dispatch gradient's format where the EP
        group spans nodes: a pinned recipe's ``Recipe.for_nodes``, applied at ``wire_meshes``).
        ``ValueError`` at build for an unknown precision or recipe, or ``overlap`` where mxcomm
        does not permute.
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
            dispatch_grad_across_nodes: str | None = None

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
            dispatch_grad_across_nodes: str | None = None

    from torchtitan.models.common.moe import GroupedExperts

    from mxcomm._torch_ep import grouped_experts_class

    class MxcommGroupedExperts(grouped_experts_class(GroupedExperts)):
        """torchtitan's ``GroupedExperts`` with ``mxcomm.torch.grouped_mm`` as its GEMMs.

        Config fields beyond torchtitan's: ``gemm``: ``"fp8"`` (mxcomm's GEMMs,
        :func:`mxcomm._torch_ep.grouped_experts_class`), ``"bf16"`` (torchtitan's forward) or
        ``"auto"`` (mxcomm's for quantized rows); ``wgrad``: the w1|w3 weight gradient,
        ``"fp8"`` or ``"bf16"``. ValueError at build otherwise.
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
    """The mxcomm twin of a dispatcher config, ``fields_`` set (those TorchAO's lacks, such as
    ``permute_align``, dropped). ValueError: an unknown precision; ``"auto"`` on TorchAO's."""
    from torchtitan.models.common import token_dispatcher as td
    _define_classes()
    module = sys.modules[__name__]
    target = module.MxcommTorchAOTokenDispatcher if isinstance(
        config, td.TorchAOTokenDispatcher.Config) else module.MxcommTokenDispatcher
    if fields_.get("recipe") and target is module.MxcommTorchAOTokenDispatcher:
        raise ValueError("recipe 'auto': needs torchtitan's AllToAllTokenDispatcher (the TorchAO "
                         "dispatcher pads its groups for torchao's quantized experts); pin a "
                         "recipe, or use the AllToAll dispatcher")
    new = _twin(config, target, fields_)
    precisions(new)  # an unknown precision fails here, at configuration time
    return new


def _twin(config, target, changes):
    """``target.Config`` of ``config``'s fields, ``changes`` made (fields it lacks dropped)."""
    import dataclasses
    names = {f.name for f in dataclasses.fields(target.Config) if f.init}
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.init and f.name in names}
    values.update((k, v) for k, v in changes.items() if k in names)
    return target.Config(**values)


def _recipe(recipe):
    """``(dispatcher fields, gemm, wgrad)`` of a recipe (name or Recipe). ValueError: unknown."""
    if recipe == "auto" or getattr(recipe, "name", None) == "auto":
        return dict(recipe="auto"), "auto", "fp8"
    if isinstance(recipe, str):
        from mxcomm.recipes import get_recipe
        recipe = get_recipe(recipe)
    return (dict(dispatch_precision=recipe.dispatch, combine_precision=recipe.combine,
                 dispatch_grad_precision=recipe.dispatch_grad,
                 combine_grad_precision=recipe.combine_grad,
                 permute_align=RECIPE_ALIGN if recipe.fused else 0,
                 dispatch_grad_across_nodes=getattr(recipe, "dispatch_grad_across_nodes", None)),
            recipe.gemm, getattr(recipe, "wgrad", "fp8"))


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
               overlap=None):
    """Replace every ``AllToAllTokenDispatcher.Config`` (TorchAO's too) in a torchtitan 0.3
    config tree by mxcomm's, in place; with a ``recipe``, every ``GroupedExperts.Config`` too.

    Args:
        config: a config tree with ``traverse`` (``config.model_spec.model``, a ``MoE.Config``,
            a ``RoutedExperts.Config``).
        recipe: None, or a recipe of ``mxcomm.recipes`` (name or Recipe): its formats, layout
            (``fused``: groups padded to :data:`RECIPE_ALIGN`) and GEMM replace the arguments
            below; ``"auto"``: chosen per call (the experts' widths copied to the dispatcher).
        dispatch_precision, ..., permute_align: without a recipe, the dispatcher's fields.
        overlap: the dispatch's backward beside the experts' weight-gradient GEMM (eager only;
            same bits) where mxcomm permutes; dropped on TorchAO's dispatcher. None (default):
            on with a recipe that runs the fp8 GEMM (or ``"auto"``, whose calls overlap where
            they do), as ``ExpertParallel``'s default; off otherwise.
    Returns:
        The number of dispatcher configs replaced (0 where EP uses another dispatcher).
    Raises:
        ValueError: an unknown precision or recipe; ``"auto"`` on TorchAO's dispatcher;
            ``overlap`` not None or a bool, or True where mxcomm does not permute.
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
        fields = dict(dispatch_precision=dispatch_precision, combine_precision=combine_precision,
                      dispatch_grad_precision=dispatch_grad_precision,
                      combine_grad_precision=combine_grad_precision, permute_align=permute_align)
    if overlap is None:
        overlap = gemm in ("fp8", "auto")
    if not isinstance(overlap, bool) or (overlap and not fields.get("permute_align")
                                         and fields.get("recipe") != "auto"):
        raise ValueError(f"overlap: expected None, False, or True with a recipe whose exchange "
                         f"permutes (fused, such as 'fp8_rowwise'; or 'auto') or permute_align "
                         f"> 0, got {overlap!r} with permute_align "
                         f"{fields.get('permute_align', 0)}")
    fields["overlap"] = overlap
    count = _replace(config, td.AllToAllTokenDispatcher.Config,
                     lambda node: _converted(node, fields))
    if gemm is not None:
        experts = sys.modules[__name__].MxcommGroupedExperts
        _replace(config, GroupedExperts.Config,
                 lambda node: _twin(node, experts, dict(gemm=gemm, wgrad=wgrad)))
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
    """torchtitan 0.3 override: ``cfg`` (a dispatcher config, TorchAO's included) as mxcomm's
    with these fields (the JSON object's keys); returns the new config. Recipes:
    :func:`mxcomm_moe`."""
    return _converted(cfg, dict(dispatch_precision=dispatch_precision,
                                combine_precision=combine_precision,
                                dispatch_grad_precision=dispatch_grad_precision,
                                combine_grad_precision=combine_grad_precision,
                                permute_align=permute_align))


def mxcomm_moe(cfg, *, recipe, overlap=None):
    """torchtitan 0.3 override on ``RoutedExperts.Config``: :func:`use_mxcomm` with ``recipe``
    and ``overlap``; returns ``cfg``, changed in place."""
    use_mxcomm(cfg, recipe=recipe, overlap=overlap)
    return cfg


def register():
    """Register :func:`mxcomm_token_dispatcher` and :func:`mxcomm_moe` with torchtitan's
    overrides (idempotent; done at import when torchtitan is installed)."""
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
    ``mxcomm.torch.all_to_all_single_fn(precision)`` (counts stay torch's); call it before the
    model's forward.

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


# now: a module imported before torchtitan's config is not run again for an override by name
if _torchtitan_installed():
    register()
