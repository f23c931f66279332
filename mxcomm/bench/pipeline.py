"""``mpirun -n W python -m mxcomm.bench pipeline``: the MoE EP token path, bf16 vs MXFP8.

Per rank: ``tokens`` rows of ``dim`` routed to ``W * experts`` experts (``--experts`` counts experts
PER RANK, E_local; the seed's ``num_experts=8`` at world size 2 is read as 8 per rank). Forward =
exchange_layout -> a2a_dispatch -> permute -> grouped GEMM (bf16, weights (E_local, hidden, dim)
with grad) -> unpermute -> a2a_combine; backward through all of it with a fixed random output
gradient. Variants, in one run: ``bf16`` (torch.distributed all_to_all_single + mxcomm
permute/unpermute + the same GEMM), ``mxfp8`` (mxcomm default precisions: dispatch mxfp8, combine
bf16, dispatch_grad bf16, combine_grad mxfp8) and ``mxfp8_all`` (every direction mxfp8).

Headline numbers time the whole forward and the whole backward with CUDA events (median over
``--iters`` after ``--warmup``; max over ranks). Per-stage numbers run each stage ALONE on the
tensors of a traced pipeline run (forward; backward by ``torch.autograd.grad`` of that stage only
with the gradient the full backward delivered to it), so they include no overlap between stages.
SQNR (dB) of the output, input gradient and weight gradient of each mxcomm variant vs ``bf16``.
"""

import math

from . import _moe, _report, _timing, _workload

GPU_SHAPES = [(131072, 8192, 5120, 8), (131072, 7168, 2048, 8), (16384, 7168, 2048, 8)]
#: Simulator default: tiny, so the CI smoke run (2 ranks, 2 CPU cores) takes well under a minute.
SIM_SHAPES = [(64, 32, 32, 2)]
SEED = 1234
#: torchao's end-to-end thresholds (DESIGN.md): output, input gradient, weight gradient.
SQNR_TARGETS = {"out": 28.0, "input_grad": 26.0, "weight_grad": 25.0}
SUMMARY_COLUMNS = ["tokens", "dim", "hidden_dim", "experts_per_rank", "fwd_bf16_ms", "fwd_mxfp8_ms",
                   "fwd_speedup", "bwd_bf16_ms", "bwd_mxfp8_ms", "bwd_speedup", "total_speedup"]
STAGE_COLUMNS = ["shape", "stage", "pass", "bf16_ms", "mxfp8_ms", "mxfp8_all_ms", "speedup",
                 "speedup_all"]
SQNR_COLUMNS = ["shape", "variant", "out_db", "input_grad_db", "weight_grad_db", "ok"]


def add_arguments(parser):
    """The ``pipeline`` subcommand's options."""
    parser.add_argument("--tokens", type=int, nargs="+", help="rows per rank")
    parser.add_argument("--dim", type=int, nargs="+", help="model dim D")
    parser.add_argument("--hidden", type=int, nargs="+", help="expert hidden dim H")
    parser.add_argument("--experts", type=int, nargs="+", help="experts PER RANK (E_local)")
    parser.add_argument("--routing", choices=["uniform", "topk"], default="uniform",
                        help="uniform: equal rows per expert (the seed's); topk: tokens/8 tokens "
                             "pick top-8 experts of skewed popularity (seeded)")
    parser.add_argument("--no-stages", action="store_true", help="skip the per-stage timings")
    parser.add_argument("--plot", metavar="PATH", help="PNG of per-stage times, bf16 vs MXFP8")


def shapes_from_args(args, simulated):
    """``(tokens, dim, hidden, experts)`` tuples: defaults, or the options zipped (a single value
    is used for every shape).

    Raises:
        ValueError: option lists of different lengths (other than 1).
    """
    given = [args.tokens, args.dim, args.hidden, args.experts]
    if not any(given):
        return list(SIM_SHAPES if simulated else GPU_SHAPES)
    default = (SIM_SHAPES if simulated else GPU_SHAPES)[0]
    lists = [g or [d] for g, d in zip(given, default)]
    n = max(len(v) for v in lists)
    if any(len(v) not in (1, n) for v in lists):
        raise ValueError(f"--tokens/--dim/--hidden/--experts: expected lists of one length (or "
                         f"single values), got lengths {[len(v) for v in lists]}")
    return [tuple(v[i] if len(v) > 1 else v[0] for v in lists) for i in range(n)]


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
        self.clock = _timing.Clock("host" if rt.simulated else "torch")
        self.loop_gemm = rt.simulated

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
    """Run the pipeline benchmark; returns ``(meta, tables)``."""
    rt.init_torch_distributed()
    shapes = shapes_from_args(args, rt.simulated)
    tables = {"end_to_end": [], "stages": [], "sqnr": []}
    for shape in shapes:
        case = _Case(args, rt, shape)
        reference = None
        stage_rows = {}
        for variant in _moe.VARIANTS:
            stage_list = _moe.stages(variant, rt.comm, case.e_local, loop_gemm=case.loop_gemm)
            rt.log(f"pipeline {case.label} {variant.name}: end to end")
            fwd, bwd, total = case.end_to_end(stage_list)
            tables["end_to_end"].append({
                "tokens": case.tokens, "dim": case.dim, "hidden_dim": case.hidden,
                "experts_per_rank": case.e_local, "variant": variant.name,
                **fwd.as_dict("fwd_"), **bwd.as_dict("bwd_"), **total.as_dict("total_")})
            state, grads, results = case.trace(stage_list)
            if variant.baseline:
                reference = results
            else:
                sqnr = {k: _sqnr(reference[k], results[k]) for k in SQNR_TARGETS}
                tables["sqnr"].append({"shape": case.label, "variant": variant.name,
                                       **{f"{k}_db": v for k, v in sqnr.items()},
                                       "ok": "yes" if all(sqnr[k] >= t for k, t in
                                                          SQNR_TARGETS.items()) else "no"})
            if not args.no_stages:
                rt.log(f"pipeline {case.label} {variant.name}: stages one by one")
                for key, stats in case.stage_times(stage_list, state, grads).items():
                    stage_rows.setdefault(key, {})[variant.name] = stats
            del state, grads, results
        tables["stages"] += _stage_rows(case.label, stage_rows)
        del case, reference
    notes = ["experts_per_rank = E_local (the seed's num_experts); E = W * E_local experts in all",
             "fwd/bwd: whole pipeline, CUDA events, median over iterations, max over ranks",
             "stages: each stage run alone on a traced run's tensors, its iterations enqueued back "
             "to back (device time; no overlap between stages; fwd/bwd above start each iteration "
             "after a sync + barrier, so they include the host time exposed)",
             "bf16 = torch.distributed all_to_all_single + mxcomm permute/unpermute + same GEMM; "
             "mxfp8 = mxcomm default precisions (dispatch mxfp8, combine bf16, dispatch_grad bf16, "
             "combine_grad mxfp8); mxfp8_all = every direction mxfp8",
             "layout exchange (mxcomm.exchange_layout) is the same in every variant",
             "dequantize: MXFP8 permuted rows -> bf16 GEMM input; grad_dequantize (backward): "
             "MXFP8 gradient from unpermute's backward -> bf16, once, before the GEMM backward",
             f"routing: {args.routing}"]
    if rt.simulated:
        notes.append("CPU simulator: gloo + MPI backend, per-expert matmul loop instead of "
                     "torch._grouped_mm, host clock; the numbers say nothing about a GPU")
    meta = _report.metadata("pipeline", rt.size,
                            [dict(zip(("tokens", "dim", "hidden", "experts_per_rank"), s))
                             for s in shapes], notes, iters=args.iters, warmup=args.warmup,
                            routing=args.routing, sqnr_targets_db=SQNR_TARGETS)
    return meta, tables


def _stage_rows(label, stage_rows):
    order = [s.name for s in _moe.stages(_moe.VARIANTS[0], None, 1, loop_gemm=True)]
    rows = []
    for (stage, direction), by_variant in sorted(
            stage_rows.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1] == "bwd")):
        ms = {v.name: by_variant[v.name].median if v.name in by_variant else float("nan")
              for v in _moe.VARIANTS}
        rows.append({"shape": label, "stage": stage, "pass": direction,
                     "bf16_ms": ms["bf16"], "mxfp8_ms": ms["mxfp8"], "mxfp8_all_ms": ms["mxfp8_all"],
                     "speedup": _ratio(ms["bf16"], ms["mxfp8"]),
                     "speedup_all": _ratio(ms["bf16"], ms["mxfp8_all"])})
    return rows


def _ratio(a, b):
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else float("nan")


def summary_rows(end_to_end, variant):
    """Seed-style rows: ``variant`` against ``bf16`` for every shape."""
    base = {(r["tokens"], r["dim"], r["hidden_dim"], r["experts_per_rank"]): r
            for r in end_to_end if r["variant"] == "bf16"}
    rows = []
    for r in end_to_end:
        if r["variant"] != variant:
            continue
        b = base[(r["tokens"], r["dim"], r["hidden_dim"], r["experts_per_rank"])]
        rows.append({"tokens": r["tokens"], "dim": r["dim"], "hidden_dim": r["hidden_dim"],
                     "experts_per_rank": r["experts_per_rank"],
                     "fwd_bf16_ms": b["fwd_ms"], "fwd_mxfp8_ms": r["fwd_ms"],
                     "fwd_speedup": _report.speedup(_ratio(b["fwd_ms"], r["fwd_ms"])),
                     "bwd_bf16_ms": b["bwd_ms"], "bwd_mxfp8_ms": r["bwd_ms"],
                     "bwd_speedup": _report.speedup(_ratio(b["bwd_ms"], r["bwd_ms"])),
                     "total_speedup": _report.speedup(_ratio(b["total_ms"], r["total_ms"]))})
    return rows


def _sections(tables):
    stages = [dict(r, speedup=_report.speedup(r["speedup"]),
                   speedup_all=_report.speedup(r["speedup_all"])) for r in tables["stages"]]
    return [("vs bf16: mxcomm default precisions (dispatch mxfp8, combine bf16, dispatch_grad bf16, "
             "combine_grad mxfp8)", summary_rows(tables["end_to_end"], "mxfp8"), SUMMARY_COLUMNS),
            ("vs bf16: mxcomm all directions mxfp8", summary_rows(tables["end_to_end"], "mxfp8_all"),
             SUMMARY_COLUMNS),
            ("per stage, each run alone (ms)", stages, STAGE_COLUMNS),
            (f"SQNR vs bf16 (dB; targets: output {SQNR_TARGETS['out']}, input grad "
             f"{SQNR_TARGETS['input_grad']}, weight grad {SQNR_TARGETS['weight_grad']})",
             tables["sqnr"], SQNR_COLUMNS)]


def render(meta, tables):
    """Text report in the seed's style (tabulate "grid")."""
    sections = [(c, _report.format_table(r, cols)) for c, r, cols in _sections(tables)]
    return _report.render_text("Expert Parallelism Pipeline Benchmark Results", meta, sections)


def markdown_sections(tables):
    """``(caption, rows, columns)`` for ``--markdown``."""
    return _sections(tables)


def plot(path, meta, tables):
    """Write the per-stage PNG (``--plot``)."""
    from ._plot import plot_stages
    plot_stages(path, meta, tables["stages"])
