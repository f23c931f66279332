"""``mpirun -n W python -m mxcomm.bench pipeline``: the MoE EP token path, bf16 vs MXFP8.

Per rank: --tokens rows of --dim elements, routed to W x --experts experts (--experts counts the
experts of one rank, E_local). Forward: exchange_layout -> a2a_dispatch -> permute -> grouped GEMM
(bf16 weights (E_local, hidden, dim), with gradient) -> unpermute -> a2a_combine; backward through
all of it with a fixed random output gradient. Three variants in one run:
  bf16       torch.distributed all_to_all_single in bf16, mxcomm permute/unpermute, the same GEMM
  mxfp8      mxcomm, default precisions: dispatch mxfp8, combine bf16, dispatch_grad bf16,
             combine_grad mxfp8
  mxfp8_all  mxcomm, every direction mxfp8

Every run shows, from one traced forward + backward per variant:
  - bytes between ranks per direction and variant (rows a rank keeps are not counted);
  - exactness of the data movement: each mxcomm step, forward and backward, bit for bit against
    torch.distributed.all_to_all_single of the same bytes and an index-based permutation;
  - SQNR (dB) of the output, input gradient and weight gradient of each mxcomm variant vs bf16.
On a GPU it also times the whole forward and backward (CUDA events, median over --iters after
--warmup, max over ranks) and each stage run alone. On a CPU it times nothing: the host backend's
speed says nothing about a GPU's. Exit status 1 if any data movement is not exact.
"""

import math

from . import _checks, _moe, _report, _timing, _workload

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
    parser.add_argument("--no-stages", action="store_true",
                        help="skip the per-stage timings (GPU only)")
    parser.add_argument("--plot", metavar="PATH",
                        help="write a PNG: per-stage times on a GPU; bytes and SQNR on a CPU")


def validate(args):
    """Check the shape options before anything runs (every rank checks the same arguments).

    Raises:
        ValueError: a size not positive, --dim or --hidden not a multiple of 32 (MX blocks),
            or option lists of different lengths.
    """
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
        return (f"{head} on GPUs: CUDA-event timings of bf16 vs MXFP8 (whole pipeline and per "
                f"stage), SQNR, bytes on the wire, exactness of the data movement.")
    what = "host backend (vectorized NumPy)" if rt.backend == "host" else \
        "CUDA kernels in Numba's simulator"
    return (f"{head} on a CPU, {what}: exactness of the data movement, SQNR of every variant, "
            f"bytes on the wire. No timings: a CPU run says nothing about GPU speed.")


def _plain(t):
    """A bf16 tensor of ``t`` (MXFP8 tensors dequantized)."""
    return t.dequantize() if _moe.is_mxfp8(t) else t


def _sqnr(ref, out):
    """SQNR (dB) of two torch tensors, float64 sums over row chunks on their device."""
    import torch
    ref, out = _plain(ref).detach(), _plain(out).detach()
    if ref.shape != out.shape:
        raise ValueError(f"out: expected shape {tuple(ref.shape)} like ref, got {tuple(out.shape)}")
    signal = noise = 0.0
    r2, o2 = ref.reshape(ref.shape[0], -1), out.reshape(out.shape[0], -1)
    for i in range(0, r2.shape[0], 4096):
        r, o = r2[i:i + 4096].double(), o2[i:i + 4096].double()
        if not (bool(torch.isfinite(r).all()) and bool(torch.isfinite(o).all())):
            return float("nan")
        signal += float((r * r).sum())
        noise += float(((r - o) ** 2).sum())
    if signal == 0:
        return float("nan")
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


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

    def end_to_end(self, stage_list):
        """Time forward and backward of the whole pipeline; returns (fwd, bwd, total) Stats."""
        x = self.x.detach().clone().requires_grad_(True)
        w = self.w.detach().clone().requires_grad_(True)
        marks = []
        for i in range(self.args.warmup + self.args.iters):
            x.grad = w.grad = None
            state = self._state(x, w)
            self.rt.barrier()
            t0 = self.clock.mark()
            out = _moe.forward(stage_list, state)
            t1 = self.clock.mark()
            out.backward(self.grad_out)
            t2 = self.clock.mark()
            if i >= self.args.warmup:
                marks.append((t0, t1, t2))
            del state, out
        ms = [(self.clock.elapsed_ms(a, b), self.clock.elapsed_ms(b, c), self.clock.elapsed_ms(a, c))
              for a, b, c in marks]
        return tuple(_timing.max_over_ranks(_timing.Stats.of(col), self.rt.allreduce_max)
                     for col in zip(*ms))

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


def measure(args, rt):
    """Run the pipeline benchmark; returns ``(meta, tables)``.

    ``tables``: ``wire`` (bytes per direction), ``exactness`` (one row per checked step) and
    ``sqnr`` on every machine; ``end_to_end`` and ``stages`` (timings) on a GPU only.
    """
    rt.init_torch_distributed()
    shapes = shapes_from_args(args, rt.backend)
    tables = {"wire": [], "exactness": [], "sqnr": []}
    if rt.gpu:
        tables.update(end_to_end=[], stages=[])
    for shape in shapes:
        case = _Case(args, rt, shape)
        checker = _checks.Checker(rt, case, _moe.ALIGN)
        reference = None
        stage_rows = {}
        for variant in _moe.VARIANTS:
            stage_list = _moe.stages(variant, rt.comm, case.e_local, loop_gemm=case.loop_gemm)
            if rt.gpu:
                rt.log(f"pipeline {case.label} {variant.name}: end to end")
                fwd, bwd, total = case.end_to_end(stage_list)
                tables["end_to_end"].append({
                    "tokens": case.tokens, "dim": case.dim, "hidden_dim": case.hidden,
                    "experts_per_rank": case.e_local, "variant": variant.name,
                    **fwd.as_dict("fwd_"), **bwd.as_dict("bwd_"), **total.as_dict("total_")})
            rt.log(f"pipeline {case.label} {variant.name}: forward + backward, checks")
            state, grads, results = case.trace(stage_list)
            tables["wire"] += _checks.wire_rows(variant, case, state["input_splits"],
                                                state["output_splits"], rt.rank, rt.allreduce_sum)
            tables["exactness"] += checker.run(variant, state, grads, results)
            if variant.baseline:
                reference = results
            else:
                sqnr = {k: _sqnr(reference[k], results[k]) for k in SQNR_TARGETS}
                tables["sqnr"].append({"shape": case.label, "variant": variant.name,
                                       **{f"{k}_db": v for k, v in sqnr.items()},
                                       "ok": "yes" if all(sqnr[k] >= t for k, t in
                                                          SQNR_TARGETS.items()) else "no"})
            if rt.gpu and not args.no_stages:
                rt.log(f"pipeline {case.label} {variant.name}: stages one by one")
                for key, stats in case.stage_times(stage_list, state, grads).items():
                    stage_rows.setdefault(key, {})[variant.name] = stats
            del state, grads, results
        if rt.gpu:
            tables["stages"] += _stage_rows(case.label, stage_rows)
        del case, reference
    notes = ["variants: bf16 = torch.distributed all_to_all_single (baseline); mxfp8 = mxcomm, "
             "default precisions (dispatch mxfp8, combine bf16, dispatch_grad bf16, combine_grad "
             "mxfp8); mxfp8_all = mxcomm, every direction mxfp8. All share mxcomm's layout "
             "exchange, permute and unpermute and the same GEMM",
             f"E_local experts per rank, W * E_local in all; routing: {args.routing}; "
             f"rows padded to {_moe.ALIGN} per expert group",
             "data movement: each step against an independent reference of the same bytes "
             "(torch.distributed all_to_all_single; index-based gather/scatter); rows that "
             "differ, summed over ranks"]
    if rt.gpu:
        notes += [f"fwd/bwd: the whole pipeline, each iteration after a device sync and a barrier, "
                  f"CUDA events, median of {args.iters} after {args.warmup} warm-up, max over "
                  f"ranks",
                  "stages: each stage alone on a traced run's tensors, iterations enqueued back to "
                  "back (device time, no overlap between stages)"]
    else:
        notes.append(f"CPU: mxcomm's {type(rt.comm).__name__}, torch.distributed on gloo, a "
                     f"per-expert matmul loop for the grouped GEMM; nothing is timed")
    meta = _report.metadata("pipeline", rt.size,
                            [dict(zip(("tokens", "dim", "hidden", "experts_per_rank"), s))
                             for s in shapes], notes, run=describe(args, rt), iters=args.iters,
                            warmup=args.warmup, routing=args.routing,
                            sqnr_targets_db=SQNR_TARGETS)
    return meta, tables


def failed(tables):
    """True when some data movement was not exact (the exit status of the run)."""
    return any(r["rows_differ"] for r in tables["exactness"])


def _stage_rows(label, stage_rows):
    order = [s.name for s in _moe.stages(_moe.VARIANTS[0], None, 1, loop_gemm=True)]
    rows = []
    for (stage, direction), by_variant in sorted(
            stage_rows.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1] == "bwd")):
        ms = {v.name: by_variant[v.name].median if v.name in by_variant else float("nan")
              for v in _moe.VARIANTS}
        same = stage == "layout"  # the same code in every variant: a ratio would be noise
        rows.append({"shape": label, "stage": stage, "pass": direction,
                     "bf16_ms": ms["bf16"], "mxfp8_ms": ms["mxfp8"], "mxfp8_all_ms": ms["mxfp8_all"],
                     "speedup": float("nan") if same else _ratio(ms["bf16"], ms["mxfp8"]),
                     "speedup_all": float("nan") if same else _ratio(ms["bf16"], ms["mxfp8_all"])})
    return rows


def _ratio(a, b):
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else float("nan")


def summary_rows(end_to_end):
    """One row per (shape, variant): fwd/bwd/total ms and each as a speedup over ``bf16``."""
    base = {(r["tokens"], r["dim"], r["hidden_dim"], r["experts_per_rank"]): r
            for r in end_to_end if r["variant"] == "bf16"}
    rows = []
    for r in end_to_end:
        b = base[(r["tokens"], r["dim"], r["hidden_dim"], r["experts_per_rank"])]
        row = {"shape": f"{r['tokens']}x{r['dim']}x{r['hidden_dim']}x{r['experts_per_rank']}",
               "variant": r["variant"]}
        for k in ("fwd", "bwd", "total"):
            row[f"{k}_ms"] = r[f"{k}_ms"]
        for k in ("fwd", "bwd", "total"):
            row[f"{k} vs bf16"] = _report.speedup(_ratio(b[f"{k}_ms"], r[f"{k}_ms"])) \
                if r["variant"] != "bf16" else ""
        rows.append(row)
    return rows


SUMMARY_COLUMNS = ["shape", "variant", "fwd_ms", "bwd_ms", "total_ms", "fwd vs bf16", "bwd vs bf16",
                   "total vs bf16"]
STAGE_COLUMNS = ["stage", "pass", "bf16_ms", "mxfp8_ms", "mxfp8_all_ms", "mxfp8 vs bf16",
                 "all vs bf16"]
SQNR_COLUMNS = ["variant", "output_dB", "input_grad_dB", "weight_grad_dB", "ok"]


def _by_variant(rows, key, cell, columns_first):
    """Pivot ``rows`` to one row per ``key`` value with a column per variant (``cell(row)``),
    keeping the first-seen order; a ``shape`` column leads when there are several shapes."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    out = {}
    for r in rows:
        k = (r["shape"], r[key])
        out.setdefault(k, {"shape": r["shape"], key: r[key]})[r["variant"]] = cell(r)
    columns = (["shape"] if len(shapes) > 1 else []) + columns_first + VARIANT_NAMES
    return list(out.values()), columns


def wire_display(rows):
    """The ``wire`` table for display: MB per direction and variant, a total and a ratio row."""
    table, columns = _by_variant(rows, "direction", lambda r: r["bytes"] / MB, ["direction"])
    totals = {}
    for r in rows:
        t = totals.setdefault(r["shape"], {"shape": r["shape"], "direction": "total"})
        t[r["variant"]] = t.get(r["variant"], 0.0) + r["bytes"] / MB
    out = []
    for shape, total in totals.items():
        out += [r for r in table if r["shape"] == shape] + [total]
        base = total.get("bf16", float("nan"))
        out.append({"shape": shape, "direction": "vs bf16",
                    **{v: _report.speedup(_ratio(total[v], base)) for v in VARIANT_NAMES}})
    return out, columns


def exactness_display(rows):
    """The ``exactness`` table for display: one row per step, a cell per variant ("exact (mxfp8)":
    the step's bytes equal the reference's; the precision the rows were in)."""
    table, columns = _by_variant(
        rows, "step", lambda r: r["result"] + (f" ({r['precision']})" if r["precision"] else ""),
        ["step"])
    order = {s: i for i, s in enumerate(_checks.STEPS)}
    shapes = {s: i for i, s in enumerate(dict.fromkeys(r["shape"] for r in rows))}
    table.sort(key=lambda r: (shapes[r["shape"]], order.get(r["step"], len(order))))
    for r in table:
        for v in VARIANT_NAMES:
            r.setdefault(v, "torch, unchecked")
    return table, columns


def _sections(tables):
    """``(caption, rows, columns)`` of every table, in print order."""
    sections = []
    if tables.get("end_to_end"):
        sections.append(("whole pipeline, forward and backward (ms; speedups over bf16)",
                         summary_rows(tables["end_to_end"]), SUMMARY_COLUMNS))
    stage_rows = tables.get("stages") or []
    for shape in dict.fromkeys(r["shape"] for r in stage_rows):
        rows = [dict(r, **{"mxfp8 vs bf16": _report.speedup(r["speedup"]),
                           "all vs bf16": _report.speedup(r["speedup_all"])})
                for r in stage_rows if r["shape"] == shape]
        sections.append((f"per stage, each run alone (ms), {shape}", rows, STAGE_COLUMNS))
    wire, wire_cols = wire_display(tables["wire"])
    sections.append(("bytes between ranks (MB = 1e6 bytes, all ranks; rows a rank keeps are not "
                     "counted)", wire, wire_cols))
    exact, exact_cols = exactness_display(tables["exactness"])
    sections.append(("data movement, bit for bit against an independent reference (torch's: the "
                     "baseline's own exchanges)", exact, exact_cols))
    sqnr = [{"shape": r["shape"], "variant": r["variant"], "output_dB": r["out_db"],
             "input_grad_dB": r["input_grad_db"], "weight_grad_dB": r["weight_grad_db"],
             "ok": r["ok"]} for r in tables["sqnr"]]
    several = len({r["shape"] for r in sqnr}) > 1
    sections.append((f"SQNR vs the bf16 variant (dB; targets: output {SQNR_TARGETS['out']}, input "
                     f"grad {SQNR_TARGETS['input_grad']}, weight grad "
                     f"{SQNR_TARGETS['weight_grad']})", sqnr,
                     (["shape"] if several else []) + SQNR_COLUMNS))
    return sections


def render(meta, tables):
    """Text report (tabulate "grid" tables, each under 120 columns)."""
    sections = [(c, _report.format_table(r, cols)) for c, r, cols in _sections(tables)]
    return _report.render_text("mxcomm EP pipeline benchmark", meta, sections)


def markdown_sections(tables):
    """``(caption, rows, columns)`` for ``--markdown``."""
    return _sections(tables)


def plot(path, meta, tables):
    """Write the ``--plot`` PNG: per-stage times on a GPU, else bytes on the wire and SQNR."""
    from . import _plot
    if tables.get("stages"):
        return _plot.plot_stages(path, meta, tables["stages"])
    return _plot.plot_wire_and_sqnr(path, meta, tables["wire"], tables["sqnr"], SQNR_TARGETS)
