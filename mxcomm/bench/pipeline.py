"""``mpirun -n W python -m mxcomm.bench pipeline``: the MoE EP token path in each recipe vs bf16.

Per rank: --tokens rows of --dim elements, routed to W x --experts experts (--experts counts the
experts of one rank, E_local). Forward: exchange_layout -> a2a_dispatch -> permute -> grouped GEMM
(bf16 weights (E_local, hidden, dim), with gradient) -> unpermute -> a2a_combine; backward through
all of it with a fixed random output gradient. By default the reference and mxcomm's recipes
(``mxcomm.recipes``), ``auto`` first among mxcomm's; more on request (--variants picks; wire =
dispatch / combine / dispatch_grad / combine_grad):
  bf16           torch.distributed all_to_all_single in bf16, mxcomm permute/unpermute, bf16
                 GEMM (the reference of SQNR and speedups)
  auto           the recipe mxcomm.recipes.choose_recipe predicts fastest for the shape (the
                 tables name it: "auto (fp8_rowwise)")
  bf16_mxcomm    the recipe bf16: mxcomm's exchanges, bf16 every way, bf16 GEMM
  mxfp8          the recipe mxfp8: mxfp8 / bf16 / bf16 / mxfp8, bf16 GEMM on the rows
                 dequantized in the permute's gather
  fp8_rowwise    the recipe fp8_rowwise: fp8_rowwise / bf16 / bf16 / fp8_rowwise, dispatch +
                 permute and unpermute + combine each in one call (permute_align), the fp8
                 rowwise grouped GEMM (mxcomm.torch.grouped_mm) reading the rows as received,
                 the backward overlap on (as ExpertParallel runs it)
  mxfp8_all      (only by --variants) every direction mxfp8, bf16 GEMM
  bf16+fp8gemm   (only by --variants) the bf16 wire of bf16, then the fp8 rowwise grouped GEMM
                 quantizing its bf16 rows and gradient per call (the reference of the fp8
                 GEMM: the second speedup column)
  fp8_rowwise_bf16grad  (only by --variants) fp8_rowwise / bf16 / bf16 / fp8_rowwise, permuted
                 separately (the benchmark's fp8_rowwise before the recipes)
  mxfp8+rowwise  (only by --variants) mxfp8 / bf16 / bf16 / fp8_rowwise: MXFP8 on the wire,
                 converted to fp8 rowwise inside the permute, then the fp8 GEMM
  fp8_rowwise_mxgrad     (only by --variants) fp8_rowwise / bf16 / mxfp8 / fp8_rowwise, permuted
                 separately, no overlap
  fp8_rowwise_bf16wgrad  (only by --variants) fp8_rowwise_bf16grad with the GEMM's weight
                 gradient in bf16 (the others': fp8, grouped_mm's default)
  fp8_rowwise_acc32      (only by --variants) fp8_rowwise_bf16grad with every fp8 product's sums
                 promoted to fp32 (the others: every product fast, grouped_mm's default)
  fp8_rowwise_nocache    (only by --variants) the recipe fp8_rowwise with grouped_mm's weight
                 cache off (both weight operands quantized on every call): the crossover with
                 and without the cache side by side
  fp8_rowwise_serial     (only by --variants) the recipe fp8_rowwise without the backward
                 overlap (the dispatch gradient's exchange after the wgrad, on one stream)
  fp8_rowwise_mxdgrad    (only by --variants) fp8_rowwise with the dispatch gradient in MXFP8
                 on any topology (the recipe's format across nodes), with the overlap
  fp8_rowwise_mxcombine  (only by --variants) fp8_rowwise_mxdgrad with the combine in MXFP8
                 too: every exchange quantized (a numerics change; issue 43's lever across nodes)
The fp8 GEMM runs torch._scaled_grouped_mm on SM90 GPUs; elsewhere (CPU, other GPUs) its bf16
fallback (the report says which).

Every run shows, from one traced forward + backward per variant:
  - bytes between ranks per direction and variant (rows a rank keeps are not counted);
  - exactness of the data movement: each mxcomm step, forward and backward, bit for bit against
    torch.distributed.all_to_all_single of the same bytes and an index-based permutation;
  - SQNR (dB) of the output, input gradient and weight gradient of each variant vs bf16.
On a GPU it also times the whole forward and backward (CUDA events, median over --iters after
--warmup, max over ranks; with --interleave the variants' iterations alternate; speedups vs bf16
and vs bf16+fp8gemm) and each stage run alone. On a CPU
it times nothing: the host backend's speed says nothing about a GPU's. Exit status 1 if any data
movement is not exact. The last line printed is the verdict: every checked step exact or those that
were not, the SQNR targets met or the variants below them. On one rank no row crosses ranks, which
the first line says (expert parallelism needs 2 ranks or more).
"""

import functools
import math

from .. import route
from . import _checks, _moe, _report, _timing, _workload
from ..formats import sqnr

#: (tokens, dim, hidden, experts per rank) run by default: on a GPU, on the CPU host backend (the
#: CI smoke run: 2 ranks on 2 cores in seconds), under Numba's CUDA simulator (tiny).
GPU_SHAPES = [(131072, 8192, 5120, 8), (131072, 7168, 2048, 8), (16384, 7168, 2048, 8)]
HOST_SHAPES = [(2048, 1024, 512, 4)]
SIM_SHAPES = [(64, 32, 32, 2)]
SEED = 1234
#: torchao's end-to-end thresholds (docs/design.md): output, input gradient, weight gradient.
SQNR_TARGETS = {"out": 28.0, "input_grad": 26.0, "weight_grad": 25.0}
VARIANT_NAMES = [v.name for v in _moe.VARIANTS]
MB = 1e6
#: What the first line and the notes add on one rank (zeros and "n/a" in the wire table otherwise
#: read as a result).
ONE_RANK = ("One rank: no row crosses ranks, so the bytes between ranks are 0 and their ratios "
            "n/a; expert parallelism needs 2 ranks or more (mpiexec -n 2 python -m mxcomm.bench "
            "pipeline).")


def parse_variants(text):
    """The variants ``--variants`` selects, in ``_moe.VARIANTS`` order; the reference ``bf16``
    always runs (SQNR and speedups are against it).

    Args:
        text: comma-separated variant names (empty items ignored), or None for the default set
            (the reference and the recipes; the comparisons run when --variants names them).
    Returns:
        A tuple of ``_moe.Variant``.
    Raises:
        ValueError: a name that is not a variant (the message names it and lists the accepted
            names), or no name at all.
    """
    if text is None:
        return tuple(v for v in _moe.VARIANTS if v.default)
    names = [n.strip() for n in text.split(",") if n.strip()]
    accepted = ", ".join(VARIANT_NAMES)
    if not names:
        raise ValueError(f"--variants: expected comma-separated variant names ({accepted}), "
                         f"got {text!r}")
    for name in names:
        if name not in VARIANT_NAMES:
            raise ValueError(f"--variants: unknown variant {name!r}; accepted: {accepted}")
    wanted = set(names) | {_moe.REFERENCE}
    return tuple(v for v in _moe.VARIANTS if v.name in wanted)


def default_shapes(backend):
    """The shapes run without --tokens/--dim/--hidden/--experts on ``backend``."""
    return list({"cuda": GPU_SHAPES, "host": HOST_SHAPES}.get(backend, SIM_SHAPES))


def _shape_help(i):
    """The defaults of option ``i`` of the shape tuples, for --help."""
    return ", ".join(f"{' '.join(str(s[i]) for s in shapes)} {where}" for where, shapes in
                     (("on a GPU", GPU_SHAPES), ("on a CPU", HOST_SHAPES),
                      ("in the simulator", SIM_SHAPES)))


def add_arguments(parser):
    """The ``pipeline`` subcommand's options."""
    parser.add_argument("--tokens", type=int, nargs="+", metavar="M",
                        help=f"rows per rank, > 0 (default: {_shape_help(0)})")
    parser.add_argument("--dim", type=int, nargs="+", metavar="D",
                        help=f"model dim, elements per row, a multiple of 32 (default: "
                             f"{_shape_help(1)})")
    parser.add_argument("--hidden", type=int, nargs="+", metavar="H",
                        help=f"expert GEMM output dim, a multiple of 32 (default: "
                             f"{_shape_help(2)})")
    parser.add_argument("--experts", type=int, nargs="+", metavar="E_LOCAL",
                        help=f"experts per rank, > 0; W x E_LOCAL in all (default: "
                             f"{_shape_help(3)})")
    parser.add_argument("--routing", choices=["uniform", "topk"], default="uniform",
                        help="uniform: equal rows per expert; topk: tokens/8 tokens each pick "
                             "their top 8 experts of a skewed, seeded popularity (default uniform)")
    parser.add_argument("--variants", metavar="NAMES",
                        help=f"comma-separated variants to run, of {', '.join(VARIANT_NAMES)} "
                             f"(default: all but the fp8_rowwise_* comparisons; {_moe.REFERENCE}, the "
                             f"reference, always runs)")
    parser.add_argument("--no-stages", action="store_true",
                        help="skip the per-stage timings (GPU only)")
    parser.add_argument("--interleave", action="store_true",
                        help="time the variants' iterations interleaved, every variant once per "
                             "iteration (for host-bound shapes: a drift of the host's speed "
                             "during the run then weighs on all alike); default: each variant's "
                             "iterations together, its allocator warm, as in a training job (GPU "
                             "only)")
    parser.add_argument("--plot", metavar="PATH",
                        help="write a PNG: per-stage times on a GPU; bytes and SQNR on a CPU")


def validate(args):
    """Check the shape options before anything runs (every rank checks the same arguments).

    Raises:
        ValueError: a size not positive, --dim or --hidden not a multiple of 32 (MX blocks),
            option lists of different lengths, or an unknown name in --variants.
    """
    parse_variants(getattr(args, "variants", None))
    for name, values, block in (("--tokens", args.tokens, 1), ("--dim", args.dim, 32),
                                ("--hidden", args.hidden, 32), ("--experts", args.experts, 1)):
        for v in values or ():
            if v < 1:
                raise ValueError(f"{name}: expected positive values, got {v}")
            if v % block:
                raise ValueError(f"{name}: expected multiples of {block} (MXFP8 blocks of "
                                 f"{block} elements), got {v}")
    lengths = [len(v) for v in (args.tokens, args.dim, args.hidden, args.experts) if v]
    if any(n not in (1, max(lengths)) for n in lengths):
        raise ValueError(f"--tokens/--dim/--hidden/--experts: expected lists of one length (or "
                         f"single values), got lengths {lengths}")


def shapes_from_args(args, backend):
    """``(tokens, dim, hidden, experts)`` tuples: the defaults of ``backend``, or the options
    zipped (a single value is used for every shape; a missing option takes the first default).

    Raises:
        ValueError: option lists of different lengths (other than 1).
    """
    given = [args.tokens, args.dim, args.hidden, args.experts]
    if not any(given):
        return default_shapes(backend)
    lists = [g or [d] for g, d in zip(given, default_shapes(backend)[0])]
    n = max(len(v) for v in lists)
    if any(len(v) not in (1, n) for v in lists):
        raise ValueError(f"--tokens/--dim/--hidden/--experts: expected lists of one length (or "
                         f"single values), got lengths {[len(v) for v in lists]}")
    return [tuple(v[i] if len(v) > 1 else v[0] for v in lists) for i in range(n)]


def describe(args, rt):
    """The first line printed: what this run is, and what it is not."""
    head = f"mxcomm EP pipeline, {rt.size} rank{'s' if rt.size > 1 else ''}"
    if rt.gpu:
        return (f"{head} on GPUs: CUDA-event timings of bf16, MXFP8 and fp8 GEMM variants (whole "
                f"pipeline and per stage), SQNR, bytes on the wire, exactness of the data "
                f"movement.{' ' + ONE_RANK if rt.size == 1 else ''}")
    what = "host backend (vectorized NumPy)" if rt.backend == "host" else \
        "CUDA kernels in Numba's simulator"
    return (f"{head} on a CPU, {what}: exactness of the data movement, SQNR of every variant, "
            f"bytes on the wire. No timings: a CPU run says nothing about GPU speed."
            f"{' ' + ONE_RANK if rt.size == 1 else ''}")


def _plain(t):
    """A bf16 tensor of ``t`` (quantized tensors of any format dequantized)."""
    return t.dequantize() if _moe.is_mxfp8(t) else t


def _sqnr(ref, out):
    """``mxcomm.sqnr`` of two torch tensors, quantized ones dequantized first."""
    return sqnr(_plain(ref).detach(), _plain(out).detach())


class _Case:
    """One shape: inputs shared by all variants, and the runs of each variant."""

    def __init__(self, args, rt, shape):
        import torch
        self.args, self.rt = args, rt
        self.tokens, self.dim, self.hidden, self.e_local = shape
        dev = rt.torch_device()
        gen = torch.Generator(device=dev).manual_seed(SEED + rt.rank)
        bf16 = torch.bfloat16
        self.x = torch.randn(self.tokens, self.dim, generator=gen, device=dev, dtype=bf16)
        self.w = (torch.randn(self.e_local, self.hidden, self.dim, generator=gen, device=dev)
                  * self.dim ** -0.5).to(bf16)
        self.grad_out = torch.randn(self.tokens, self.hidden, generator=gen, device=dev, dtype=bf16)
        counts = _workload.expert_counts(args.routing, self.tokens, rt.size * self.e_local,
                                         seed=SEED, rank=rt.rank)
        self.counts = torch.as_tensor(counts, dtype=torch.int32, device=dev)
        self.clock = _timing.Clock("torch" if rt.gpu else "host")
        self.loop_gemm = not rt.gpu

    @property
    def label(self):
        return f"{self.tokens}x{self.dim}x{self.hidden}x{self.e_local}"

    def _state(self, x, w):
        return {"x": x, "w": w, "counts": self.counts}

    def end_to_end(self, stage_lists, interleave=False):
        """Time forward and backward of the whole pipeline of every variant.

        Args:
            stage_lists: ``{variant name: stage list}``.
            interleave: run every variant once per iteration, in an order rotated by one per
                iteration (a drift of the host's or the GPU's speed weighs on every variant
                alike); else each variant's iterations one after another.
        Returns:
            ``{variant name: (fwd, bwd, total) Stats}``, the max over ranks of each median.
        """
        names = list(stage_lists)
        # One pair of leaves serves every variant: none writes them, and each run resets their
        # gradients.
        x = self.x.detach().clone().requires_grad_(True)
        w = self.w.detach().clone().requires_grad_(True)
        marks = {name: [] for name in names}
        for i, name in self._runs(names, interleave):
            x.grad = w.grad = None
            state = self._state(x, w)
            self.rt.barrier()
            t0 = self.clock.mark()
            out = _moe.forward(stage_lists[name], state)
            t1 = self.clock.mark()
            out.backward(self.grad_out)
            t2 = self.clock.mark()
            if i >= self.args.warmup:
                marks[name].append((t0, t1, t2))
            del state, out
        result = {}
        for name in names:
            ms = [(self.clock.elapsed_ms(a, b), self.clock.elapsed_ms(b, c),
                   self.clock.elapsed_ms(a, c)) for a, b, c in marks[name]]
            result[name] = tuple(_timing.max_over_ranks(_timing.Stats.of(col),
                                                        self.rt.allreduce_max)
                                 for col in zip(*ms))
        return result

    def _runs(self, names, interleave):
        """``(iteration, variant name)`` in the order :meth:`end_to_end` runs them."""
        count = self.args.warmup + self.args.iters
        if not interleave:
            return [(i, name) for name in names for i in range(count)]
        return [(i, name) for i in range(count)
                for name in names[i % len(names):] + names[:i % len(names)]]

    def trace(self, stage_list):
        """One run keeping every intermediate and the gradient each stage output received."""
        x = self.x.detach().clone().requires_grad_(True)
        w = self.w.detach().clone().requires_grad_(True)
        state, grads = self._state(x, w), {}
        out = _moe.forward(stage_list, state, hooks=grads)
        out.backward(self.grad_out)
        return state, grads, {"out": out.detach(), "input_grad": x.grad, "weight_grad": w.grad}

    def stage_times(self, stage_list, state, grads):
        """``{(stage, "fwd"|"bwd"): Stats or None}``, each stage run alone, its iterations
        enqueued back to back (the device's time; the whole passes show the exposed host time)."""
        import torch
        timed = dict(clock=self.clock, iters=self.args.iters, warmup=self.args.warmup,
                     before=self.rt.barrier)
        result = {}
        for stage in stage_list:
            # (fp8 GEMM variants have neither dequantize stage: their GEMM reads quantized rows)
            if stage.name == "dequantize" and not _moe.is_mxfp8(state["p"]):
                continue  # bf16 rows: nothing to dequantize
            if stage.name == "grad_dequantize" and not _moe.is_mxfp8(grads.get("y_")):
                continue  # bf16 gradient: nothing to dequantize
            local = dict(state)
            leaves = [local[k].detach().requires_grad_(True) for k in stage.inputs]
            if stage.name != "grad_dequantize":  # an identity forward
                stats = _timing.measure_back_to_back(lambda: stage.fn(local, *leaves), **timed)
                result[(stage.name, "fwd")] = _timing.max_over_ranks(stats, self.rt.allreduce_max)
            if stage.output is None or stage.output not in grads:
                continue
            out = stage.fn(local, *leaves)[stage.output]
            grad = grads[stage.output]
            stats = _timing.measure_back_to_back(
                lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True), **timed)
            result[(stage.name, "bwd")] = _timing.max_over_ranks(stats, self.rt.allreduce_max)
            del out
        return result


def _gemm_note(rt, fp8_gemm):
    """How the fp8 GEMM variants' GEMM ran here (SM90 fp8, or the bf16 fallback)."""
    if fp8_gemm:
        return ("fp8 GEMM (bf16+fp8gemm, fp8_rowwise*, mxfp8+rowwise): "
                "mxcomm.torch.grouped_mm, torch._scaled_grouped_mm rowwise on SM90 (weights "
                "quantized once while unchanged, grouped_mm's weight cache, per call in "
                "fp8_rowwise_nocache; e4m3 with power-of-two scales; forward, dgrad and wgrad "
                "fp8, the wgrad's operands rescaled per (group, column) along the tokens; "
                "fp8_rowwise_bf16wgrad: wgrad bf16; fast accumulation (use_fast_accum) in every product, except "
                "fp8_rowwise_acc32: sums promoted to fp32)")
    where = "this GPU is not SM90 (or torch lacks _scaled_grouped_mm)" if rt.gpu else "CPU"
    return (f"fp8 GEMM variants: {where}, so "
            f"mxcomm.torch.grouped_mm ran its bf16 fallback (torch._grouped_mm on the dequantized "
            f"rows): their SQNR shows the wire's error only, not the GEMM's")


def _fp8_gemm_available(device):
    """True where ``mxcomm.torch.grouped_mm`` runs fp8 on ``device`` (SM90), else its fallback."""
    from mxcomm.torch import fp8_gemm_available
    return fp8_gemm_available(device)


def measure(args, rt):
    """Run the pipeline benchmark; returns ``(meta, tables)``.

    ``tables``: ``wire`` (bytes per direction), ``exactness`` (one row per checked step) and
    ``sqnr`` on every machine; ``end_to_end`` and ``stages`` (timings) on a GPU only. Every row
    names its ``variant`` (those of ``--variants``, the reference ``bf16`` first).
    """
    rt.init_torch_distributed()
    shapes = shapes_from_args(args, rt.backend)
    variants = parse_variants(getattr(args, "variants", None))
    interleave = getattr(args, "interleave", False)
    tables = {"wire": [], "exactness": [], "sqnr": []}
    chose = {}  # shape label -> the recipe auto chose
    if rt.gpu:
        tables.update(end_to_end=[], stages=[])
    fp8_gemm = _fp8_gemm_available(rt.torch_device())
    for shape in shapes:
        case = _Case(args, rt, shape)
        checker = _checks.Checker(rt, case, _moe.ALIGN)
        reference = None
        stage_rows = {}
        shape_variants = _resolved(variants, case, rt, fp8_gemm)
        chose.update({case.label: v.chose for v in shape_variants if v.chose})
        stage_lists = {v.name: _moe.stages(v, rt.comm, case.e_local, loop_gemm=case.loop_gemm)
                       for v in shape_variants}
        if rt.gpu:
            rt.log(f"pipeline {case.label}: end to end")
            for name, (fwd, bwd, total) in case.end_to_end(stage_lists, interleave).items():
                tables["end_to_end"].append({
                    "tokens": case.tokens, "dim": case.dim, "hidden_dim": case.hidden,
                    "experts_per_rank": case.e_local, "variant": name,
                    "recipe": chose.get(case.label) if name == "auto" else None,
                    **fwd.as_dict("fwd_"), **bwd.as_dict("bwd_"), **total.as_dict("total_")})
        for variant in shape_variants:
            stage_list = stage_lists[variant.name]
            rt.log(f"pipeline {case.label} {variant.name}: forward + backward, checks")
            state, grads, results = case.trace(stage_list)
            tables["wire"] += _checks.wire_rows(variant, case, state["input_splits"],
                                                state["output_splits"], rt.rank, rt.allreduce_sum,
                                                rt.allreduce_max,
                                                functools.partial(route.small, rt.comm))
            tables["exactness"] += checker.run(variant, state, grads, results)
            if variant.baseline:
                reference = results
            else:
                sqnr = {k: _sqnr(reference[k], results[k]) for k in SQNR_TARGETS}
                tables["sqnr"].append({"shape": case.label, "variant": variant.name,
                                       "recipe": variant.chose,
                                       **{f"{k}_db": v for k, v in sqnr.items()},
                                       "ok": "yes" if all(sqnr[k] >= t for k, t in
                                                          SQNR_TARGETS.items()) else "no"})
            if rt.gpu and not args.no_stages:
                rt.log(f"pipeline {case.label} {variant.name}: stages one by one")
                for key, stats in case.stage_times(stage_list, state, grads).items():
                    stage_rows.setdefault(key, {})[variant.name] = stats
            del state, grads, results
        if rt.gpu:
            tables["stages"] += _stage_rows(case.label, stage_rows, variants)
        del case, reference
    names = [v.name for v in variants]
    notes = [ONE_RANK] if rt.size == 1 else []
    nodes = rt.comm.node_count  # the recipes' variants as they ran on these nodes
    ran = [v if v.recipe == "auto" else _moe.resolve(v, None, 0, 0, None, None, nodes)
           for v in variants]
    notes += ["variants: " + "; ".join(v.describe() for v in ran) + ". All share mxcomm's "
             "layout exchange, permute and unpermute; bf16 is the reference of SQNR and speedups",
             f"E_local experts per rank, W * E_local in all; routing: {args.routing}; "
             f"rows padded to {_moe.ALIGN} per expert group"]
    if chose:
        notes.append("auto chose: " + "; ".join(f"{k}: {v}" for k, v in chose.items()) +
                     " (mxcomm.recipes.Chooser on the agreed layout of each shape, from the "
                     "table auto finds: mxcomm.recipes.find_tables)")
    if any(v.gemm == "fp8" or v.recipe == "auto" for v in variants):
        notes.append(_gemm_note(rt, fp8_gemm))
    notes.append("data movement: each step against an independent reference of the same bytes "
                 "(torch.distributed all_to_all_single; index-based gather/scatter, padding rows "
                 "with the format's padding scale; for a permute that converts MXFP8 rows, the "
                 "rescale to fp8_rowwise or the decode to bf16 recomputed in torch); rows that "
                 "differ, summed over ranks; "
                 "exchanges of torch's own (bf16, bf16+fp8gemm) unchecked")
    skipped = sorted({f"{r['variant']} {r['step']}" for r in tables["exactness"]
                      if r["result"] == "skipped"})
    if skipped:
        notes.append(f"skipped (no reference for the step's format; not a pass): "
                     f"{', '.join(skipped)}")
    if rt.gpu:
        notes += [f"fwd/bwd: the whole pipeline, each iteration after a device sync and a barrier, "
                  f"CUDA events, median of {args.iters} after {args.warmup} warm-up, max over "
                  f"ranks; " + ("the variants interleaved (each iteration runs every variant "
                                "once, in an order rotated per iteration), so the host's drift "
                                "weighs on all alike" if interleave else
                                "each variant's iterations together"),
                  "stages: each stage alone on a traced run's tensors, iterations enqueued back to "
                  "back (device time, no overlap between stages)"]
    else:
        notes.append(f"CPU: mxcomm's {type(rt.comm).__name__}, torch.distributed on gloo, a "
                     f"per-expert matmul loop for the bf16 grouped GEMM; nothing is timed")
    meta = _report.metadata("pipeline", rt.size,
                            [dict(zip(("tokens", "dim", "hidden", "experts_per_rank"), s))
                             for s in shapes], notes, run=describe(args, rt), iters=args.iters,
                            warmup=args.warmup, routing=args.routing, variants=names,
                            auto_chose=chose,
                            fp8_gemm=fp8_gemm, sqnr_targets_db=SQNR_TARGETS)
    return meta, tables


def _resolved(variants, case, rt, fp8_gemm):
    """``variants`` for ``case`` as ``ExpertParallel`` runs them on the group's nodes
    (``_moe.resolve``): ``auto`` as the recipe it chooses for the shape's layout (one layout
    exchange, collective; every rank decides alike from it)."""
    nodes = rt.comm.node_count
    layout = device = table = None
    if any(v.recipe == "auto" for v in variants):
        from mxcomm import recipes
        from mxcomm.torch import exchange_layout
        layout = exchange_layout(case.counts, rt.comm)
        device = "sm90" if fp8_gemm else ("cuda" if rt.gpu else "cpu")
        name = "cpu"
        if rt.gpu:
            import torch
            name = torch.cuda.get_device_name(rt.torch_device())
        table = recipes.find_tables(name, rt.size).table_for(case.dim, case.hidden)
    return tuple(_moe.resolve(v, layout, case.dim, case.hidden, device, table, nodes)
                 for v in variants)


def failed(tables):
    """True when some data movement was not exact (the exit status of the run)."""
    return any(r["rows_differ"] for r in tables["exactness"])


def verdict(meta, tables):
    """The last line printed: whether every checked step's data movement was exact (what
    :func:`failed` makes the exit status) and every variant met the SQNR targets, naming what
    did not; on one rank, that nothing crossed ranks."""
    several = len({r["shape"] for r in tables["exactness"]}) > 1

    def where(r):
        return f"{r['variant']} {r.get('step', '')}".strip() + (f" at {r['shape']}" if several
                                                                 else "")
    differ = [where(r) for r in tables["exactness"] if r["rows_differ"]]
    skipped = sum(r["result"] == "skipped" for r in tables["exactness"])
    low = [where(r) for r in tables["sqnr"] if r["ok"] != "yes"]
    parts = [f"data movement NOT exact: {', '.join(differ)}" if differ else
             "data movement exact on every checked step"
             + (f" ({skipped} skipped: no reference)" if skipped else ""),
             f"SQNR below target: {', '.join(low)}" if low else "SQNR targets met"]
    if meta["world_size"] == 1:
        parts.append("1 rank: nothing crossed ranks")
    return "pipeline: " + "; ".join(parts)


def _stage_rows(label, stage_rows, variants):
    """Rows of the ``stages`` table: one per (stage, pass), ``<variant>_ms`` per variant (NaN
    where the variant has no such stage), in pipeline order."""
    order = [s.name for s in _moe.stages(_moe.VARIANTS[0], None, 1, loop_gemm=True)]
    rows = []
    for (stage, direction), by_variant in sorted(
            stage_rows.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1] == "bwd")):
        row = {"shape": label, "stage": stage, "pass": direction}
        for v in variants:
            row[f"{v.name}_ms"] = by_variant[v.name].median if v.name in by_variant else \
                float("nan")
        rows.append(row)
    return rows


def _ratio(a, b):
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else float("nan")


def _shown(r):
    """A row's variant as shown: ``auto`` with the recipe it chose, ``"auto (mxfp8)"``."""
    return f"{r['variant']} ({r['recipe']})" if r.get("recipe") else r["variant"]


def summary_rows(end_to_end):
    """One row per (shape, variant): fwd/bwd/total ms; fwd, bwd and total as speedups over
    ``bf16`` (``"fwd vs bf16"``, ``"bwd vs bf16"``, ``"vs bf16"``: the reference's ms / the
    variant's), and the total over ``bf16+fp8gemm`` (``"vs bf16+fp8gemm"``, "n/a" where it did
    not run). A reference's own cell is empty."""
    def by_shape(name):
        return {(r["tokens"], r["dim"], r["hidden_dim"], r["experts_per_rank"]): r
                for r in end_to_end if r["variant"] == name}
    base, gemm_base = by_shape(_moe.REFERENCE), by_shape(_moe.GEMM_REFERENCE)
    rows = []
    for r in end_to_end:
        key = (r["tokens"], r["dim"], r["hidden_dim"], r["experts_per_rank"])
        b, g = base.get(key), gemm_base.get(key)
        row = {"shape": "x".join(str(k) for k in key), "variant": _shown(r)}
        for k in ("fwd", "bwd", "total"):
            row[f"{k}_ms"] = r[f"{k}_ms"]
        for k, column in (("fwd", "fwd vs bf16"), ("bwd", "bwd vs bf16"), ("total", "vs bf16")):
            row[column] = "" if r["variant"] == _moe.REFERENCE else \
                _report.speedup(_ratio(b[f"{k}_ms"] if b else math.nan, r[f"{k}_ms"]))
        row["vs bf16+fp8gemm"] = "" if r["variant"] == _moe.GEMM_REFERENCE else \
            _report.speedup(_ratio(g["total_ms"] if g else math.nan, r["total_ms"]))
        rows.append(row)
    return rows


#: The whole-pipeline table: the speedups are of the total (fwd + bwd); Markdown adds fwd, bwd.
SUMMARY_COLUMNS = ["shape", "variant", "fwd_ms", "bwd_ms", "total_ms", "vs bf16", "vs bf16+fp8gemm"]
SUMMARY_COLUMNS_MD = SUMMARY_COLUMNS[:5] + ["fwd vs bf16", "bwd vs bf16"] + SUMMARY_COLUMNS[5:]
SQNR_COLUMNS = ["variant", "output_dB", "input_grad_dB", "weight_grad_dB", "ok"]


def _names(rows):
    """The variants of ``rows``, in ``_moe.VARIANTS`` order."""
    present = {r["variant"] for r in rows}
    return [n for n in VARIANT_NAMES if n in present]


def _by_variant(rows, key, cell, columns_first):
    """Pivot ``rows`` to one row per ``key`` value with a column per variant (``cell(row)``),
    keeping the first-seen order; a ``shape`` column leads when there are several shapes."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    out = {}
    for r in rows:
        k = (r["shape"], r[key])
        out.setdefault(k, {"shape": r["shape"], key: r[key]})[r["variant"]] = cell(r)
    columns = (["shape"] if len(shapes) > 1 else []) + columns_first + _names(rows)
    return list(out.values()), columns


def wire_display(rows):
    """The ``wire`` table for display: MB per direction and variant, a total and a ratio row."""
    table, columns = _by_variant(rows, "direction", lambda r: r["bytes"] / MB, ["direction"])
    names = _names(rows)
    totals = {}
    for r in rows:
        t = totals.setdefault(r["shape"], {"shape": r["shape"], "direction": "total"})
        t[r["variant"]] = t.get(r["variant"], 0.0) + r["bytes"] / MB
    out = []
    for shape, total in totals.items():
        out += [r for r in table if r["shape"] == shape] + [total]
        base = total.get(_moe.REFERENCE, float("nan"))
        out.append({"shape": shape, "direction": "vs bf16",
                    **{v: _report.speedup(_ratio(total.get(v, math.nan), base)) for v in names}})
    return out, columns


def _exact_cell(r, sep):
    """One cell of the exactness table: the verdict, then ``(precision)``, joined by ``sep``
    (a newline in the text tables, which keeps six variants under 120 columns)."""
    if r["result"] == "skipped":
        verdict = "skipped"
    elif r["rows_differ"]:
        verdict = f"{r['rows_differ']}/{r['rows']}{sep}rows differ"
    else:
        verdict = r["result"]
    return verdict + (f"{sep}({r['precision']})" if r["precision"] else "")


def exactness_display(rows, sep=" "):
    """The ``exactness`` table for display: one row per step, a cell per variant ("exact
    (mxfp8)": the step's bytes equal the reference's; the precision the rows were in; "torch,
    unchecked": an exchange of torch's own; "skipped": no reference, see the notes); ``sep``
    joins the parts of a cell."""
    table, columns = _by_variant(rows, "step", lambda r: _exact_cell(r, sep), ["step"])
    order = {s: i for i, s in enumerate(_checks.STEPS)}
    shapes = {s: i for i, s in enumerate(dict.fromkeys(r["shape"] for r in rows))}
    table.sort(key=lambda r: (shapes[r["shape"]], order.get(r["step"], len(order))))
    for r in table:
        for v in _names(rows):
            r.setdefault(v, f"torch,{sep}unchecked")
    return table, columns


def _sections(tables, markdown=False):
    """``(caption, rows, columns)`` of every table, in print order (``markdown``: one-line
    cells, the whole-pipeline table with fwd and bwd speedups too)."""
    sections = []
    sep = " " if markdown else "\n"
    if tables.get("end_to_end"):
        rows = summary_rows(tables["end_to_end"])
        columns = SUMMARY_COLUMNS_MD if markdown else SUMMARY_COLUMNS
        if not any(r["variant"] == _moe.GEMM_REFERENCE for r in rows):
            columns = [c for c in columns if c != "vs bf16+fp8gemm"]
        sections.append(("whole pipeline, forward and backward (ms; speedups: the reference's "
                         "total ms / the variant's, vs bf16 and vs bf16+fp8gemm)", rows, columns))
    stage_rows = tables.get("stages") or []
    for shape in dict.fromkeys(r["shape"] for r in stage_rows):
        rows = [r for r in stage_rows if r["shape"] == shape]
        names = [n for n in VARIANT_NAMES if f"{n}_ms" in rows[0]]
        display = [{"stage": r["stage"], "pass": r["pass"], **{n: r[f"{n}_ms"] for n in names}}
                   for r in rows]
        sections.append((f"per stage, each run alone (ms; n/a: the variant has no such stage), "
                         f"{shape}", display, ["stage", "pass"] + names))
    # One table per shape: six variants and a shape column would not fit 120 columns.
    shapes = list(dict.fromkeys(r["shape"] for r in tables["wire"] + tables["exactness"]))
    for shape in shapes:
        suffix = f", {shape}" if len(shapes) > 1 else ""
        wire, wire_cols = wire_display([r for r in tables["wire"] if r["shape"] == shape])
        sections.append((f"bytes between ranks (MB = 1e6 bytes, all ranks; rows a rank keeps are "
                         f"not counted){suffix}", wire, wire_cols))
    for shape in shapes:
        suffix = f", {shape}" if len(shapes) > 1 else ""
        exact, exact_cols = exactness_display(
            [r for r in tables["exactness"] if r["shape"] == shape], sep)
        sections.append((f"data movement, bit for bit against an independent reference (torch's: "
                         f"the own exchanges of bf16 and bf16+fp8gemm){suffix}", exact, exact_cols))
    sqnr = [{"shape": r["shape"], "variant": _shown(r), "output_dB": r["out_db"],
             "input_grad_dB": r["input_grad_db"], "weight_grad_dB": r["weight_grad_db"],
             "ok": r["ok"]} for r in tables["sqnr"]]
    several = len({r["shape"] for r in sqnr}) > 1
    sections.append((f"SQNR vs the bf16 variant (dB; targets: output {SQNR_TARGETS['out']}, input "
                     f"grad {SQNR_TARGETS['input_grad']}, weight grad "
                     f"{SQNR_TARGETS['weight_grad']}; ok: all three met)", sqnr,
                     (["shape"] if several else []) + SQNR_COLUMNS))
    return sections


def render(meta, tables):
    """Text report (tabulate "grid" tables, each under 120 columns)."""
    sections = [(c, _report.format_table(r, cols)) for c, r, cols in _sections(tables)]
    return _report.render_text("mxcomm EP pipeline benchmark", meta, sections)


def markdown_sections(tables):
    """``(caption, rows, columns)`` for ``--markdown``."""
    return _sections(tables, markdown=True)


def plot(path, meta, tables):
    """Write the ``--plot`` PNG: per-stage times on a GPU, else bytes on the wire and SQNR."""
    from . import _plot
    if tables.get("stages"):
        return _plot.plot_stages(path, meta, tables["stages"])
    return _plot.plot_wire_and_sqnr(path, meta, tables["wire"], tables["sqnr"], SQNR_TARGETS)
