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
CPU; built on the first step, collectively). Where mxcomm's exchanges cannot run, torchtitan's own
run: while ``torch.compile`` traces, and under spmd_types type checking (a debugging mode: mxcomm's
results carry no SPMD type).

This module imports torchtitan only when one of its names is used (``import
mxcomm.integrations.torchtitan`` works without it); torchtitan imports it when an override names it.
"""

import sys

__all__ = ["MxcommTokenDispatcher", "MxcommTorchAOTokenDispatcher", "use_mxcomm",
           "mxcomm_token_dispatcher", "register", "patch_expert_parallel"]

#: The precision fields of the dispatcher configs, with their defaults.
PRECISION_FIELDS = {"dispatch_precision": "mxfp8", "combine_precision": "bf16",
                    "dispatch_grad_precision": None, "combine_grad_precision": None}
_LAZY_CLASSES = ("MxcommTokenDispatcher", "MxcommTorchAOTokenDispatcher")


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


class _MxcommExchanges:
    """The exchange hooks of torchtitan's ``AllToAllTokenDispatcher`` on mxcomm (mixed in first).

    Shapes (torchtitan's suffixes): ``x`` (N, D) routed token rows sorted by global expert,
    ``num_local_tokens_per_expert_E`` (E,) int64; the exchanges return (R, D) rows in ``x``'s
    dtype.
    """

    def __init__(self, config):
        super().__init__(config)
        for field, value in _precisions(config).items():
            setattr(self, field, value)

    @staticmethod
    def _torchtitan_path():
        """True where torchtitan's own exchanges must run: tracing, or SPMD type checking."""
        import torch
        if torch.compiler.is_compiling() or torch.compiler._is_non_strict_tracing():
            return True
        from torchtitan.distributed.utils import get_spmd_backend
        if get_spmd_backend() == "spmd_types":
            import spmd_types
            return spmd_types.is_type_checking()
        return False

    def _token_count_exchange(self, num_local_tokens_per_expert_E, pg, ep_size):
        if self._torchtitan_path():
            return super()._token_count_exchange(num_local_tokens_per_expert_E, pg, ep_size)
        from mxcomm import torch as mxt
        return mxt.exchange_layout(num_local_tokens_per_expert_E, mxt.communicator_for(pg))

    def _sync_token_count_exchange(self, num_local_tokens_per_expert_E,
                                   num_global_tokens_per_local_expert_EP_e, ep_size):
        from mxcomm.layout import Layout
        layout = num_global_tokens_per_local_expert_EP_e
        if not isinstance(layout, Layout):
            return super()._sync_token_count_exchange(
                num_local_tokens_per_expert_E, num_global_tokens_per_local_expert_EP_e, ep_size)
        group = layout.group_tensor.to(num_local_tokens_per_expert_E.dtype)
        return group, _Splits(layout.input_splits, layout), _Splits(layout.output_splits, layout)

    def _dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):
        if self._torchtitan_path():
            return super()._dispatch_token_exchange(routed_input_ND, pg, output_splits,
                                                    input_splits)
        return _through_mxcomm("a2a_dispatch", routed_input_ND, pg, input_splits, output_splits,
                               self.dispatch_precision, self.dispatch_grad_precision)

    def _combine_token_exchange(self, routed_output_RD, pg, input_splits, output_splits):
        if self._torchtitan_path():
            return super()._combine_token_exchange(routed_output_RD, pg, input_splits,
                                                   output_splits)
        return _through_mxcomm("a2a_combine", routed_output_RD, pg, input_splits, output_splits,
                               self.combine_precision, self.combine_grad_precision)


def _through_mxcomm(function, x, pg, input_splits, output_splits, precision, grad_precision):
    """One direction of the token exchange through ``mxcomm.torch.<function>``: given the layout
    that torchtitan's splits carry (no host collective), else the splits and ``pg``'s cached
    communicator. Returns a plain tensor of ``x``'s dtype (:func:`_plain`)."""
    from mxcomm import torch as mxt
    call = getattr(mxt, function)
    options = dict(precision=precision, grad_precision=grad_precision)
    layout = getattr(input_splits, "layout", None)
    if layout is not None:
        out = call(x, layout, **options)
    else:
        out = call(x, list(input_splits), list(output_splits), mxt.communicator_for(pg),
                   **options)
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
        ``dispatch_grad_precision`` / ``combine_grad_precision`` (None: by direction).
        Raises ``ValueError`` at build for an unknown precision.
        """

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(td.AllToAllTokenDispatcher.Config):
            dispatch_precision: str = PRECISION_FIELDS["dispatch_precision"]
            combine_precision: str = PRECISION_FIELDS["combine_precision"]
            dispatch_grad_precision: str | None = None
            combine_grad_precision: str | None = None

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

    for cls in (MxcommTokenDispatcher, MxcommTorchAOTokenDispatcher):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        cls.Config.__module__ = __name__
        cls.Config.__qualname__ = f"{cls.__name__}.Config"
        setattr(module, cls.__name__, cls)


def _converted(config, precisions):
    """The mxcomm twin of an ``AllToAllTokenDispatcher.Config`` (TorchAO's keeps its padding),
    every other field copied; ``precisions`` as :data:`PRECISION_FIELDS`."""
    import dataclasses

    from torchtitan.models.common import token_dispatcher as td
    _define_classes()
    module = sys.modules[__name__]
    target = module.MxcommTorchAOTokenDispatcher if isinstance(
        config, td.TorchAOTokenDispatcher.Config) else module.MxcommTokenDispatcher
    fields = {f.name for f in dataclasses.fields(target.Config) if f.init}
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.init and f.name in fields}
    values.update(precisions)
    new = target.Config(**values)
    _precisions(new)  # an unknown precision fails here, at configuration time
    return new


def use_mxcomm(config, *, dispatch_precision="mxfp8", combine_precision="bf16",
               dispatch_grad_precision=None, combine_grad_precision=None):
    """Replace every ``AllToAllTokenDispatcher.Config`` (and ``TorchAOTokenDispatcher.Config``)
    in a torchtitan 0.3 config tree by mxcomm's, in place.

    Args:
        config: a config tree with ``traverse`` (a model config: ``config.model_spec.model``,
            a ``MoE.Config``, a ``RoutedExperts.Config``).
        dispatch_precision, combine_precision, dispatch_grad_precision, combine_grad_precision:
            the wire formats (module docstring).
    Returns:
        The number of dispatcher configs replaced (0 where EP uses another dispatcher).
    Raises:
        ValueError: an unknown precision.
        TypeError: ``config`` holds no traversable config tree; or the tree's root is itself a
            dispatcher config (assign ``MxcommTokenDispatcher.Config(...)`` instead).
    """
    from torchtitan.models.common import token_dispatcher as td
    precisions = dict(dispatch_precision=dispatch_precision,
                      combine_precision=combine_precision,
                      dispatch_grad_precision=dispatch_grad_precision,
                      combine_grad_precision=combine_grad_precision)
    if not hasattr(config, "traverse"):
        raise TypeError(f"config: expected a torchtitan config tree (with traverse), got "
                        f"{type(config).__name__}")
    found = list(config.traverse(td.AllToAllTokenDispatcher.Config))
    for _, node, parent, attr in found:
        if parent is None:
            raise TypeError("config: the root is a dispatcher config; assign "
                            "MxcommTokenDispatcher.Config(...) in its place instead")
        replacement = _converted(node, precisions)
        if isinstance(parent, list):
            parent[attr] = replacement
        else:
            setattr(parent, attr, replacement)
    return len(found)


def mxcomm_token_dispatcher(cfg, *, dispatch_precision="mxfp8", combine_precision="bf16",
                            dispatch_grad_precision=None, combine_grad_precision=None):
    """torchtitan 0.3 override (``--override.imports
    'mxcomm.integrations.torchtitan.mxcomm_token_dispatcher={...}'``): every
    ``AllToAllTokenDispatcher.Config`` (TorchAO's included) becomes mxcomm's, with these
    precisions (the JSON object's keys). Returns the replacement config."""
    return _converted(cfg, dict(dispatch_precision=dispatch_precision,
                                combine_precision=combine_precision,
                                dispatch_grad_precision=dispatch_grad_precision,
                                combine_grad_precision=combine_grad_precision))


def register():
    """Register :func:`mxcomm_token_dispatcher` with torchtitan's overrides (idempotent).

    Done when this module is imported by torchtitan (its override machinery loaded); call it
    yourself only if this module was imported before torchtitan's config and an override names
    it.
    """
    import importlib

    from torchtitan.models.common import token_dispatcher as td
    # the module (``torchtitan.config.override`` the attribute may be its decorator)
    overrides = importlib.import_module("torchtitan.config.override")
    key = f"{__name__}.{mxcomm_token_dispatcher.__name__}"
    if key not in overrides._REGISTRY:
        overrides.override(target=td.AllToAllTokenDispatcher.Config,
                           description="mxcomm: EP dispatch and combine in low precision "
                                       "(mxcomm.integrations.torchtitan)")(
            mxcomm_token_dispatcher)


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


if "torchtitan.config.override" in sys.modules:  # imported by torchtitan's override machinery
    register()
