"""``torchrun --nproc-per-node W -m mxcomm.bench torchtitan``: torchtitan 0.3's own MoE layer,
forward + backward, with torchtitan's dispatchers and experts against mxcomm's.

The layer is torchtitan's ``MoE`` (router, routed experts with their token dispatcher, the shared
expert) built from its DeepSeek-V3 671B model config: that config's router (top-8, sigmoid scores,
normalized, scaled 2.5, node-limited to 4 of 8 expert groups where the experts divide into groups
of two or more) and shared expert count, at the benchmark's dims (on a GPU the 671B layer's own:
dim 7168, moe_inter_dim 2048), with --experts routed experts per rank (W x --experts in all; the
config's 256 do not fit a few GPUs). Every rank holds one (1, --tokens, dim) bf16 input and bf16
weights seeded per rank, the same in every variant; the output gradient is seeded too. Variants:
  torchtitan_bf16     torchtitan's AllToAllTokenDispatcher and GroupedExperts (bf16 exchanges and
                      grouped GEMMs): the reference of SQNR and speedups
  torchtitan_float8   torchtitan's float8 grouped experts (Float8GroupedExpertsConverter: torchao's
                      fp8 rowwise scaled grouped GEMMs, its padded TorchAOTokenDispatcher); needs
                      torchao and an SM90 GPU, else skipped with a note
  mxcomm              mxcomm's integration with recipe --mxcomm-recipe (default auto):
                      ``mxcomm.integrations.torchtitan.use_mxcomm(config, recipe=...)``; where
                      it refuses "auto" (a config holds one recipe), auto resolved for the
                      shape by ``mxcomm.recipes.Chooser``; where it takes no ``recipe=``, the
                      recipe's four precisions (auto: its default ones) and torchtitan's
                      GEMMs. The tables name the recipe that ran, the notes the call
each eager and compiled (``torch.compile(moe, fullgraph=True)``, as torchtitan compiles its blocks,
``capture_scalar_outputs`` on as torchtitan sets it). On a GPU both modes run by default; on a CPU
eager only (--modes picks).

Reported per shape, variant and mode: the median forward + backward time (each iteration after a
device sync and a barrier, warm-up excluded, the variants and modes interleaved, max over ranks;
CUDA events on a GPU, the host clock on a CPU, where the time says nothing about a GPU's), tokens
per second per rank, the peak of ``torch.cuda.max_memory_allocated`` in an iteration (n/a on a
CPU), and the SQNR of the output, the input gradient and the routed experts' weight gradients
(w1, w2, w3 together) against torchtitan_bf16 eager (compiled where only compiled runs; the
minimum over ranks). A run other than the reference that raises is reported, and skipped on
every rank. Exit status 1 if an mxcomm run raised or missed a target (output 28, input gradient
26, weight gradient 25 dB).
"""

import dataclasses
import inspect
import math
import textwrap

from .. import recipes as _recipes
from . import _report, _timing

#: Shapes run by default. On a GPU: these tokens per rank and experts per rank, at the 671B
#: layer's dim and moe_inter_dim read from torchtitan's config; on a CPU, (tokens per rank, dim,
#: moe_inter_dim, experts per rank) tiny, so that two gloo ranks finish in seconds.
GPU_TOKENS, GPU_EXPERTS = (4096, 16384), 8
HOST_SHAPE = (64, 256, 128, 4)
FLAVOR = "671B"
SEED = 4321
#: torchao's end-to-end thresholds (docs/design.md): output, input gradient, weight gradient.
SQNR_TARGETS = {"out": 28.0, "input_grad": 26.0, "weight_grad": 25.0}
VARIANTS = ("torchtitan_bf16", "torchtitan_float8", "mxcomm")
REFERENCE = VARIANTS[0]
MODES = ("eager", "compiled")
GB = 1e9


def add_arguments(parser):
    """The ``torchtitan`` subcommand's options."""
    parser.add_argument("--tokens", type=int, nargs="+", metavar="T",
                        help=f"tokens per rank, > 0, one shape each (default: "
                             f"{' '.join(map(str, GPU_TOKENS))} on a GPU, {HOST_SHAPE[0]} on a "
                             f"CPU)")
    parser.add_argument("--dim", type=int, metavar="D",
                        help=f"model dim, a multiple of 32 (default: the {FLAVOR} config's on a "
                             f"GPU, {HOST_SHAPE[1]} on a CPU)")
    parser.add_argument("--hidden", type=int, metavar="F",
                        help=f"the experts' hidden dim (moe_inter_dim), a multiple of 32 "
                             f"(default: the {FLAVOR} config's on a GPU, {HOST_SHAPE[2]} on a CPU)")
    parser.add_argument("--experts", type=int, metavar="E_LOCAL",
                        help=f"routed experts per rank, > 0; W x E_LOCAL in all (default "
                             f"{GPU_EXPERTS} on a GPU, {HOST_SHAPE[3]} on a CPU)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, metavar="NAME",
                        help=f"variants to run, of {', '.join(VARIANTS)} (default: all; "
                             f"{REFERENCE}, the reference, always runs)")
    parser.add_argument("--modes", nargs="+", choices=MODES, metavar="MODE",
                        help="eager and/or compiled (default: both on a GPU, eager on a CPU, "
                             "where compiling takes minutes)")
    parser.add_argument("--mxcomm-recipe", default="auto", metavar="RECIPE",
                        choices=_recipes.recipe_names(),
                        help=f"the mxcomm variant's recipe, of "
                             f"{', '.join(_recipes.recipe_names())} (default auto)")
    parser.add_argument("--mxcomm-overlap", choices=("default", "on", "off"), default="default",
                        help="the mxcomm variant's use_mxcomm(..., overlap=...): the dispatch's "
                             "backward beside the experts' weight-gradient GEMM (eager; a recipe "
                             "whose exchange permutes); default: use_mxcomm's (on with an fp8 "
                             "GEMM's recipe or auto)")
    parser.add_argument("--spmd-backend", choices=("spmd_types", "full_dtensor"),
                        help="torchtitan's spmd backend (default: its own, spmd_types, on a GPU; "
                             "full_dtensor on a CPU, where spmd_types' exchange of uneven splits "
                             "cannot run on gloo)")


def validate(args):
    """Check the options before anything runs (every rank checks the same arguments).

    Raises:
        ValueError: a size not positive, --dim or --hidden not a multiple of 32 (MX blocks).
    """
    for name, values, block in (("--tokens", args.tokens or (), 1), ("--dim", [args.dim], 32),
                                ("--hidden", [args.hidden], 32), ("--experts", [args.experts], 1)):
        for v in values:
            if v is None:
                continue
            if v < 1:
                raise ValueError(f"{name}: expected positive values, got {v}")
            if v % block:
                raise ValueError(f"{name}: expected a multiple of {block} (MXFP8 blocks of "
                                 f"{block} elements), got {v}")


def describe(args, rt):
    """The first line printed: what this run is, and what it is not."""
    head = f"torchtitan's MoE layer (DeepSeek-V3 {FLAVOR} config), {rt.size} rank" \
           f"{'s' if rt.size > 1 else ''}"
    if rt.gpu:
        return (f"{head} on GPUs: forward + backward of torchtitan's bf16 and float8 experts and "
                f"mxcomm's, eager and compiled: tokens/s, peak memory, SQNR vs torchtitan's bf16.")
    return (f"{head} on a CPU (gloo): SQNR vs torchtitan's bf16 and host-clock times of tiny "
            f"shapes, which say nothing about GPU speed; torchtitan_float8 needs an SM90 GPU.")


# ---- torch and torchtitan where they differ from what torchtitan 0.3 expects -------------------
def _guard_torch():
    """Stand-ins for what torchtitan 0.3 takes from torch >= 2.12, where torch lacks them (the GPU
    machines' torch 2.11); returns the names stood in for.

    ``torch.distributed.fsdp.DataParallelMeshDims``: imported (for annotations) by torchtitan's
    DeepSeek-V3 package; ``torch.compiler._is_non_strict_tracing``: asked by its dispatchers next
    to ``is_compiling()``, and outside any tracing (where it matters) its answer is False.
    """
    import torch
    import torch.distributed.fsdp as fsdp
    stood_in = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        class DataParallelMeshDims:
            """Stand-in (torch < 2.12): the benchmark shards nothing with FSDP."""
        fsdp.DataParallelMeshDims = DataParallelMeshDims
        stood_in.append("torch.distributed.fsdp.DataParallelMeshDims")
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = lambda: False
        stood_in.append("torch.compiler._is_non_strict_tracing (False)")
    return stood_in


def flavor_layer():
    """The MoE layer config of torchtitan's DeepSeek-V3 ``FLAVOR`` model (its last layer)."""
    from torchtitan.models.deepseek_v3 import deepseekv3_configs
    model = deepseekv3_configs[FLAVOR](attn_backend="flex", moe_comm_backend="standard")
    return model.layers[-1].moe


@dataclasses.dataclass(frozen=True)
class Shape:
    """One measured shape: tokens per rank, dim, moe_inter_dim, experts per rank."""

    tokens: int
    dim: int
    hidden: int
    e_local: int

    @property
    def label(self):
        return f"{self.tokens}x{self.dim}x{self.hidden}x{self.e_local}"


def shapes_from_args(args, gpu, layer):
    """The :class:`Shape` list of this run: the options, else the defaults (on a GPU the dims of
    ``layer``, the flavor's MoE config)."""
    if gpu:
        tokens, dim = GPU_TOKENS, layer.routed_experts.inner_experts.dim
        hidden, experts = layer.routed_experts.inner_experts.hidden_dim, GPU_EXPERTS
    else:
        (t, dim, hidden, experts), tokens = HOST_SHAPE, (HOST_SHAPE[0],)
    return [Shape(t, args.dim or dim, args.hidden or hidden, args.experts or experts)
            for t in (args.tokens or tokens)]


def moe_config(layer, shape, world_size):
    """torchtitan's ``MoE.Config`` of ``layer`` (the flavor's) at ``shape``, for one rank of
    ``world_size``: the router, routed experts and shared experts rebuilt at the shape's dims
    with the flavor's routing settings, E = W x E_local experts of which this rank's module holds
    E_local (the dispatcher routes among all E); node-limited routing kept where E divides into
    the flavor's groups with two or more experts each, else dropped.

    Returns:
        ``(config, notes)``; notes say what differs from the flavor.
    Raises:
        ValueError: top_k larger than E.
    """
    from torchtitan.models.common.config_utils import (make_ffn_config, make_moe_config,
                                                       make_routed_experts_config,
                                                       make_router_config)
    router = layer.router
    experts = world_size * shape.e_local
    if router.top_k > experts:
        raise ValueError(f"--experts: the {FLAVOR} router picks {router.top_k} experts per token; "
                         f"W x E_LOCAL = {world_size} x {shape.e_local} = {experts} is fewer")
    notes = []
    groups, limited = router.num_expert_groups, router.num_limited_groups
    if groups is not None and (experts % groups or experts // groups < 2):
        notes.append(f"node-limited routing ({limited} of {groups} expert groups) dropped: "
                     f"{experts} experts do not form {groups} groups of two or more")
        groups = limited = None
    shared = layer.shared_experts
    n_shared = 0 if shared is None else \
        shared.w1.out_features // layer.routed_experts.inner_experts.hidden_dim
    no_init = {}  # the benchmark writes every weight itself (_fill)
    routed = make_routed_experts_config(dim=shape.dim, hidden_dim=shape.hidden,
                                        num_experts=experts, top_k=router.top_k,
                                        param_init=no_init, comm_backend="standard")
    routed.inner_experts = dataclasses.replace(routed.inner_experts, num_experts=shape.e_local)
    config = make_moe_config(
        num_experts=experts, load_balance_coeff=layer.load_balance_coeff,
        router=make_router_config(dim=shape.dim, num_experts=experts, gate_param_init=no_init,
                                  top_k=router.top_k, score_func=router.score_func,
                                  route_norm=router.route_norm, route_scale=router.route_scale,
                                  num_expert_groups=groups, num_limited_groups=limited),
        routed_experts=routed,
        shared_experts=None if not n_shared else make_ffn_config(
            dim=shape.dim, hidden_dim=shape.hidden * n_shared, w1_param_init=no_init,
            w2w3_param_init=no_init))
    return config, notes


def mxcomm_integration(recipe, config, rows, dim, hidden, device_class):
    """How the installed ``mxcomm.integrations.torchtitan`` applies ``recipe`` to ``config``.

    Where ``use_mxcomm`` takes a ``recipe`` (``inspect.signature``): that recipe, or for
    ``"auto"`` where the integration refuses it (tried on a copy of ``config``), the recipe
    ``mxcomm.recipes.Chooser`` picks for ``rows`` rows per rank (every rank routes tokens x
    top-k rows) of ``dim`` x ``hidden`` on ``device_class``. Where it takes none: the recipe's
    four wire formats as precisions (``"auto"``: the integration's defaults), torchtitan's GEMMs.

    Returns:
        ``(keywords of use_mxcomm, the recipe as shown, e.g. "auto (bf16)", the call as
        described in the report)``.
    """
    import copy
    import types

    from mxcomm.integrations import torchtitan as integration
    if "recipe" not in inspect.signature(integration.use_mxcomm).parameters:
        if recipe == _recipes.AUTO:
            return {}, "auto (defaults)", (
                "use_mxcomm(config) with its default precisions (this integration takes no "
                "recipe=): dispatch mxfp8, combine bf16, dispatch_grad bf16, combine_grad mxfp8 "
                "(the mxfp8 recipe's wire), torchtitan's bf16 grouped GEMMs")
        r = _recipes.get_recipe(recipe)
        return (dict(dispatch_precision=r.dispatch, combine_precision=r.combine,
                     dispatch_grad_precision=r.dispatch_grad,
                     combine_grad_precision=r.combine_grad),
                recipe, f"use_mxcomm(config) with the {recipe} recipe's precisions (this "
                        f"integration takes no recipe=): {r.describe()}; torchtitan's bf16 "
                        f"grouped GEMMs")
    if recipe != _recipes.AUTO:
        return {"recipe": recipe}, recipe, f'use_mxcomm(config, recipe="{recipe}")'
    try:
        integration.use_mxcomm(copy.deepcopy(config), recipe=recipe)
        return {"recipe": recipe}, recipe, 'use_mxcomm(config, recipe="auto")'
    except ValueError:
        pass
    # the chooser reads only the layout's sent table: every rank sends `rows` in all
    chosen = _recipes.Chooser(dim, hidden, device=device_class)(
        types.SimpleNamespace(sent=[[rows]])).name
    return {"recipe": chosen}, f"auto ({chosen})", (
        f'use_mxcomm(config, recipe=auto\'s choice): the integration refuses "auto" in a '
        f'config, so mxcomm.recipes.Chooser chose for T x top-k rows per rank on the '
        f'{device_class} device class (the tables name its choice)')


def device_class(device):
    """``mxcomm.recipes``' class of ``device``: ``"sm90"`` (fp8 grouped GEMMs), ``"cuda"``,
    ``"cpu"``."""
    if device.type != "cuda":
        return "cpu"
    from mxcomm.torch import fp8_gemm_available
    return "sm90" if fp8_gemm_available(device) else "cuda"


def float8_unavailable(device):
    """Why torchtitan_float8 cannot run on ``device`` (None where it can): torchao's fp8 rowwise
    scaled grouped GEMMs need an SM90 GPU and torchao."""
    import importlib.util

    import torch
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        where = "a CPU" if device.type != "cuda" else \
            f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
        return (f"torchtitan_float8 skipped: torchao's fp8 rowwise grouped GEMMs "
                f"(torch._scaled_grouped_mm) need an SM90 GPU, this is {where}")
    if importlib.util.find_spec("torchao") is None:
        return "torchtitan_float8 skipped: torchao is not installed"
    return None


def variant_config(name, base, model_compile, mxcomm_keywords):
    """The ``MoE.Config`` of variant ``name``: ``base`` (torchtitan's bf16) as it is, through
    torchtitan's float8 grouped-experts converter, or through mxcomm's integration
    (``use_mxcomm(config, **mxcomm_keywords)``)."""
    import copy
    config = copy.deepcopy(base)
    if name == "torchtitan_float8":
        from torchtitan.components.quantization import Float8GroupedExpertsConverter
        converter = Float8GroupedExpertsConverter.Config(
            model_compile_enabled=model_compile).build()
        return converter.convert(config)
    if name == "mxcomm":
        from mxcomm.integrations.torchtitan import use_mxcomm
        use_mxcomm(config, **mxcomm_keywords)
        installed = type(config.routed_experts.token_dispatcher)
        if not installed.__module__.startswith("mxcomm"):
            raise RuntimeError(f"mxcomm: use_mxcomm left torchtitan's token dispatcher "
                               f"({installed.__qualname__}) in the MoE config")
    return config


def _fill(module, rank):
    """Seeded bf16 weights (the same for every variant of a rank): N(0, 1) / sqrt(fan-in, the
    last dim) for matrices and expert stacks, zeros for vectors (biases)."""
    import torch
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(SEED + rank)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * p.shape[-1] ** -0.5)
            else:
                p.zero_()


def build_moe(config, mesh, device, rank):
    """torchtitan's module of ``config`` on ``device`` in bf16, its weights seeded, its
    dispatcher wired to the EP mesh, in training mode."""
    import torch
    with torch.device(device):
        moe = config.build()
    moe.to(dtype=torch.bfloat16)
    for name, buf in moe.named_buffers():  # the load-balancing counters stay float32
        if buf.is_floating_point():
            _set_buffer(moe, name, buf.float())
    _fill(moe, rank)
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return moe.train()


def _set_buffer(module, dotted, value):
    """Set the buffer ``dotted`` ("a.b.name") of ``module`` to ``value``."""
    *path, name = dotted.split(".")
    for part in path:
        module = getattr(module, part)
    module._buffers[name] = value


def expert_grads(moe):
    """The routed experts' weight gradients (w1, w2, w3), by parameter name."""
    return [p.grad for name, p in sorted(moe.named_parameters())
            if "routed_experts.inner_experts." in name]


def sqnr(refs, outs):
    """SQNR in dB of tensors ``outs`` against ``refs`` taken together:
    ``10 log10(sum ||ref||^2 / sum ||ref - out||^2)`` (docs/design.md's definition), float64 sums
    over row chunks on the tensors' device.

    Args:
        refs, outs: equal-length sequences of tensors, pairwise of one shape (any float dtype).
    Returns:
        The SQNR (``mxcomm.formats.sqnr_from_sums``): inf when every pair is equal, NaN when a
        value is not finite or the reference is all zero and the output is not.
    Raises:
        ValueError: the sequences or a pair's shapes differ.
    Host syncs: one per chunk (the sums are read).
    """
    from ..formats import sqnr_from_sums, squared_sums
    refs, outs = list(refs), list(outs)
    if len(refs) != len(outs):
        raise ValueError(f"outs: expected {len(refs)} tensors like refs, got {len(outs)}")
    signal = noise = 0.0
    for ref, out in zip(refs, outs):
        s, n = squared_sums(ref.detach(), out.detach())
        signal, noise = signal + s, noise + n
    return sqnr_from_sums(signal, noise)


class _Run:
    """One variant in one mode: its module and the callable that runs it (compiled or not)."""

    def __init__(self, variant, mode, moe):
        import torch
        self.variant, self.mode, self.moe = variant, mode, moe
        self.fn = torch.compile(moe, fullgraph=True) if mode == "compiled" else moe

    @property
    def name(self):
        return f"{self.variant} {self.mode}"

    def reset(self, x):
        """Drop the gradients of the module's weights and of ``x`` (a step accumulates none)."""
        self.moe.zero_grad(set_to_none=True)
        x.grad = None

    def step(self, x, grad):
        """Forward and backward once; returns the output."""
        out = self.fn(x)
        out.backward(grad)
        return out


def _auto_ran(moe):
    """The recipes mxcomm's dispatcher in ``moe`` ran for ``"auto"`` (the paths it made), by
    name; empty for any other dispatcher."""
    dispatcher = moe.routed_experts.token_dispatcher
    return set(getattr(dispatcher, "_paths", None) or ())


def _trace(run, x, grad):
    """One step of ``run``; its output, input gradient and expert weight gradients, detached."""
    run.reset(x)
    out = run.step(x, grad)
    return {"out": [out.detach().clone()], "input_grad": [x.grad.detach().clone()],
            "weight_grad": [g.detach().clone() for g in expert_grads(run.moe)]}


def _first_line(exc):
    """``"Type: the message's first line"`` (at most 300 characters of it)."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def _drop_failed(rt, runs, errors, shape, tables):
    """``runs`` without those that failed on any rank (``errors``: run name -> message, this
    rank's), so every rank goes on with the same runs; each failure becomes a row of
    ``tables["failures"]`` naming the first rank it failed on. A host allgather."""
    failed_runs = {}
    for rank, found in enumerate(rt.allgather(dict(errors))):
        for name, message in found.items():
            failed_runs.setdefault(name, f"rank {rank}: {message}")
    for name, message in failed_runs.items():
        variant, mode = name.split(" ")
        tables["failures"].append({"shape": shape.label, "tokens": shape.tokens,
                                   "variant": variant, "mode": mode, "error": message})
    return [r for r in runs if r.name not in failed_runs]


def _time(args, rt, runs, x, grad, device):
    """Interleaved timing of ``runs``: each iteration runs every run once, the order rotated by
    one per iteration; before each, a device sync and a barrier; after it, a sync.

    Returns:
        ``{run name: (Stats of ms, peak GB or NaN, peak above the start GB or NaN)}``, the max
        over ranks of each.
    """
    import torch
    clock = _timing.Clock("torch" if rt.gpu else "host")
    cuda = device.type == "cuda"
    samples = {r.name: [] for r in runs}
    peaks = {r.name: [0.0, 0.0] for r in runs}
    for i in range(args.warmup + args.iters):
        k = i % len(runs)
        for run in runs[k:] + runs[:k]:
            run.reset(x)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                start_bytes = torch.cuda.memory_allocated(device)
            rt.barrier()
            t0 = clock.mark()
            run.step(x, grad)
            t1 = clock.mark()
            ms = clock.elapsed_ms(t0, t1)
            if cuda:
                torch.cuda.synchronize(device)
            if i < args.warmup:
                continue
            samples[run.name].append(ms)
            if cuda:
                peak = torch.cuda.max_memory_allocated(device)
                p = peaks[run.name]
                p[0], p[1] = max(p[0], peak / GB), max(p[1], (peak - start_bytes) / GB)
    result = {}
    for run in runs:
        stats = _timing.max_over_ranks(_timing.Stats.of(samples[run.name]), rt.allreduce_max)
        peak, above = rt.allreduce_max(peaks[run.name]) if cuda else (math.nan, math.nan)
        result[run.name] = (stats, peak, above)
    return result


def measure(args, rt):
    """Run the benchmark; returns ``(meta, tables)``.

    ``tables``: ``runs`` (one row per shape, variant and mode: times, tokens/s, peak memory),
    ``sqnr`` (one row per shape and run but the reference) and ``failures`` (runs that raised
    on some rank, the reference's excepted: every rank skips them).

    Raises:
        ValueError: --experts too few for the router's top-k (on every rank alike).
    Collectives: torch.distributed's (the MoE layers' exchanges, barriers, max over ranks).
    """
    import torch
    rt.init_torch_distributed()
    stood_in = _guard_torch()
    torch._dynamo.config.capture_scalar_outputs = True  # as torchtitan's apply_compile
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.distributed.spmd_types import set_spmd_meshes

    device = rt.torch_device()
    spmd_backend = args.spmd_backend or ("spmd_types" if rt.gpu else "full_dtensor")
    titan_utils.set_spmd_backend(spmd_backend)
    mesh = init_device_mesh(device.type, (rt.size,), mesh_dim_names=("ep",))
    set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
    layer = flavor_layer()
    shapes = shapes_from_args(args, rt.gpu, layer)
    modes = tuple(m for m in MODES if m in (args.modes or (MODES if rt.gpu else ("eager",))))
    wanted = set(args.variants or VARIANTS) | {REFERENCE}
    variants = [v for v in VARIANTS if v in wanted]
    notes = []
    skipped = float8_unavailable(device) if "torchtitan_float8" in variants else None
    if skipped:
        notes.append(skipped)
        variants.remove("torchtitan_float8")
    classed = device_class(device)
    calls = []  # how mxcomm's integration was called, per shape (deduplicated)
    tables = {"runs": [], "sqnr": [], "failures": []}
    for shape in shapes:
        if "compiled" in modes:
            torch._dynamo.reset()  # each shape's compilations from scratch, under the cache limit
        base, shape_notes = moe_config(layer, shape, rt.size)
        notes += [n for n in shape_notes if n not in notes]
        keywords, shown, call = mxcomm_integration(args.mxcomm_recipe, base,
                                                   shape.tokens * layer.router.top_k, shape.dim,
                                                   shape.hidden, classed)
        if args.mxcomm_overlap != "default":
            on = args.mxcomm_overlap == "on"
            keywords, call = dict(keywords, overlap=on), f"{call}, overlap={on}"
        calls += [call] if call not in calls else []
        gen = torch.Generator(device=device).manual_seed(SEED + 1000 + rt.rank)
        x = torch.randn(1, shape.tokens, shape.dim, generator=gen, device=device,
                        dtype=torch.bfloat16).requires_grad_()
        grad = torch.randn(1, shape.tokens, shape.dim, generator=gen, device=device,
                           dtype=torch.bfloat16)
        runs, errors = [], {}
        for variant in variants:
            try:
                moe = build_moe(variant_config(variant, base, "compiled" in modes, keywords),
                                mesh, device, rt.rank)
            except Exception as exc:  # noqa: BLE001 (agreed below, reported, not run)
                if variant == REFERENCE:
                    raise  # no reference, no comparison
                errors.update({f"{variant} {mode}": _first_line(exc) for mode in modes})
                continue
            runs += [_Run(variant, mode, moe) for mode in modes]
        # every rank runs the same runs: those built everywhere
        runs = _drop_failed(rt, runs, errors, shape, tables)
        # runs[0], torchtitan_bf16 in the first mode (eager unless only compiled runs), is the
        # reference: traced first, kept while the others are compared with it
        reference, errors, local_sqnr = None, {}, {}
        for run in runs:
            rt.log(f"torchtitan {shape.label} {run.name}: forward + backward, SQNR")
            try:
                got = _trace(run, x, grad)
            except Exception as exc:  # noqa: BLE001 (agreed below, reported, not timed)
                if run is runs[0]:
                    raise  # no reference, no comparison
                errors[run.name] = _first_line(exc)
                continue
            if reference is None:
                reference = got
            else:
                local_sqnr[run.name] = [sqnr(reference[k], got[k]) for k in SQNR_TARGETS] + [
                    sqnr([r], [g]) for r, g in zip(reference["weight_grad"], got["weight_grad"])]
            del got
        del reference
        runs = _drop_failed(rt, runs, errors, shape, tables)
        if shown == _recipes.AUTO:  # chosen inside the integration, per call: what it ran
            ran = set().union(*(_auto_ran(run.moe) for run in runs if run.variant == "mxcomm"))
            shown = f"auto ({', '.join(sorted(ran))})" if ran else shown
        for run in runs[1:]:
            # the minimum over ranks
            worst = [-v for v in rt.allreduce_max([-v for v in local_sqnr[run.name]])]
            worst, each = worst[:len(SQNR_TARGETS)], worst[len(SQNR_TARGETS):]
            row = {"shape": shape.label, "tokens": shape.tokens, "variant": run.variant,
                   "mode": run.mode, "recipe": shown if run.variant == "mxcomm" else "",
                   **{f"{k}_db": v for k, v in zip(SQNR_TARGETS, worst)},
                   # each routed expert weight's gradient alone (w1, w2, w3), in the JSON
                   "weight_grad_each_db": each}
            row["ok"] = "yes" if all(v >= t for v, t in zip(worst, SQNR_TARGETS.values())) \
                else "no"
            tables["sqnr"].append(row)
        rt.log(f"torchtitan {shape.label}: timing {len(runs)} runs interleaved")
        timed = _time(args, rt, runs, x, grad, device)
        base_ms = {m: timed[f"{REFERENCE} {m}"][0].median for m in modes
                   if f"{REFERENCE} {m}" in timed}
        for run in runs:
            stats, peak, above = timed[run.name]
            ref = base_ms.get(run.mode, math.nan)
            tables["runs"].append({
                "shape": shape.label, "tokens": shape.tokens, "dim": shape.dim,
                "hidden_dim": shape.hidden, "experts_per_rank": shape.e_local,
                "variant": run.variant, "mode": run.mode,
                "recipe": shown if run.variant == "mxcomm" else "", **stats.as_dict(),
                "tokens_per_s": shape.tokens / (stats.median * 1e-3),
                "peak_gb": peak, "peak_above_start_gb": above,
                "speedup": ref / stats.median if stats.median > 0 else math.nan})
        del runs, x, grad
    notes = [f"mxcomm (recipe {args.mxcomm_recipe}): " + "; ".join(calls),
             f"router: the {FLAVOR} config's (top-{layer.router.top_k}, "
             f"{layer.router.score_func}, route_norm {layer.router.route_norm}, route_scale "
             f"{layer.router.route_scale}), its shared expert; weights and inputs seeded per "
             f"rank, bf16; torchtitan spmd backend {spmd_backend}"] + notes
    if "compiled" in modes:
        ops = any(s.name.startswith("mxcomm::") for s in torch._C._jit_get_all_schemas())
        notes.append("compiled: torch.compile(moe, fullgraph=True) of each variant's module, "
                     "capture_scalar_outputs on; custom ops in the mxcomm:: namespace "
                     "registered: " +
                     ("yes" if ops else "no (the integration then runs torchtitan's own "
                      "exchanges while compiled)"))
    if stood_in:
        notes.append("stand-ins for torch < 2.12: " + ", ".join(stood_in))
    clock = "CUDA events" if rt.gpu else "the host clock (CPU: says nothing about a GPU)"
    notes.append(f"times: forward + backward of the layer, {clock}, each iteration after a sync "
                 f"and a barrier, the runs interleaved (order rotated per iteration), median of "
                 f"{args.iters} after {args.warmup} warm-up, max over ranks; tokens/s: tokens per "
                 f"rank / that median; speedup: torchtitan_bf16's ms in the same mode / the "
                 f"run's; peak: torch.cuda.max_memory_allocated in an iteration (all variants' "
                 f"modules resident), and above the iteration's start (GB = 1e9 bytes)")
    notes.append(f"SQNR: against torchtitan_bf16 {modes[0]}, the minimum over ranks; weight_grad: "
                 f"the routed experts' w1, w2, w3 gradients together (each alone: the JSON's "
                 f"weight_grad_each_db)")
    meta = _report.metadata("torchtitan", rt.size, [dataclasses.asdict(s) for s in shapes],
                            notes, run=describe(args, rt), iters=args.iters, warmup=args.warmup,
                            variants=variants, modes=list(modes), flavor=FLAVOR,
                            top_k=layer.router.top_k, mxcomm_recipe=args.mxcomm_recipe,
                            mxcomm_overlap=args.mxcomm_overlap,
                            mxcomm_integration=calls, device_class=classed,
                            spmd_backend=spmd_backend, sqnr_targets_db=SQNR_TARGETS)
    return meta, tables


def failed(tables):
    """True when an mxcomm run failed or missed an SQNR target (the exit status of the run)."""
    return any(r["variant"].startswith("mxcomm") and r.get("ok") != "yes"
               for r in tables["sqnr"] + tables.get("failures", []))


#: The displayed tables (under 120 columns): a shape by its tokens per rank (its dims are the
#: metadata's), SQNR columns shortened.
RUN_COLUMNS = ["tokens", "variant", "recipe", "mode", "ms", "tokens/s", "vs bf16", "peak", "step"]
SQNR_COLUMNS = ["tokens", "variant", "recipe", "mode", "output dB", "in grad dB", "w grad dB", "ok"]
FAILURE_COLUMNS = ["tokens", "variant", "mode", "error"]


def _sections(tables):
    runs = [dict(r, **{"vs bf16": "" if r["variant"] == REFERENCE else
                       _report.speedup(r["speedup"]), "tokens/s": f"{r['tokens_per_s']:.0f}",
                       "peak": r["peak_gb"], "step": r["peak_above_start_gb"]})
            for r in tables["runs"]]
    sqnr_rows = [dict(r, **{"output dB": r["out_db"], "in grad dB": r["input_grad_db"],
                            "w grad dB": r["weight_grad_db"]}) for r in tables["sqnr"]]
    return [("forward + backward of the MoE layer (ms: median, max over ranks; tokens/s per rank; "
             "vs bf16: torchtitan_bf16's ms in the same mode / the run's; peak: "
             "torch.cuda.max_memory_allocated in GB, step: its rise over the iteration's start, "
             "GB; n/a on a CPU)", runs, RUN_COLUMNS),
            (f"SQNR vs torchtitan_bf16 (eager; compiled where only compiled runs; dB, minimum "
             f"over ranks; targets: output "
             f"{SQNR_TARGETS['out']}, input grad {SQNR_TARGETS['input_grad']}, weight grad "
             f"{SQNR_TARGETS['weight_grad']}; ok: all three met)", sqnr_rows, SQNR_COLUMNS)
            ] + ([("runs that raised (on the rank named; every rank skipped them; not timed)",
                   [dict(r, error=textwrap.fill(r["error"], 70)) for r in tables["failures"]],
                   FAILURE_COLUMNS)] if tables.get("failures") else [])


def render(meta, tables):
    """Text report (tabulate "grid" tables)."""
    sections = [(c, _report.format_table(r, cols)) for c, r, cols in _sections(tables)]
    return _report.render_text("torchtitan MoE layer benchmark", meta, sections)


def markdown_sections(tables):
    """``(caption, rows, columns)`` for ``--markdown``."""
    return _sections(tables)
