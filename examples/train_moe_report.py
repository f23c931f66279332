"""Summaries and output files of ``train_moe.py``: held-out loss against bf16 with its interval,
the repeat floor, SQNR, held-out loss curves.

Every variant is a wire (the precisions of dispatch, combine and their gradients, torch's bf16
all-to-all, or an ``ExpertParallel`` recipe) and a precision of the experts' GEMMs (bf16, or the
Hopper fp8 path); the tables show both, the GEMM column as it ran (an fp8 variant on the CPU ran
bf16 GEMMs: marked).

A result is ``{"meta": ..., "runs": [...], "summary": {...}}``: ``meta`` from :func:`metadata`,
``runs`` the records of ``train_moe.train_run`` and ``summary`` from :func:`summarize`. Every file
names the device, world size, shapes, date and commit.

The criterion is a run's final held-out loss (its last evaluation, on the same held-out batches in
every run). A variant is compared with ``bf16`` seed by seed (the same seed gives both the same
weights and data, so the paired difference has less noise than the difference of means): the
mean of the per-seed relative differences with its 95 % Student-t interval
(:func:`paired_interval`), against the target (:func:`meets_target`: mean within ±0.5 %,
interval inside ±1 %), beside bf16's seed-to-seed spread and its repeat floor (the spread of
bf16 runs of one seed: nondeterminism, :func:`repeat_floor`).

Several invocations (e.g. GPU calls of ``bench/gpu_run.sh converge2``, each one seed set) merge
into one report, the one a single invocation of all their runs would write (:func:`merge`)::

    python examples/train_moe_report.py converge_*.json --json all.json \
        --markdown all.md --plot all.png --note "one 2-rank job per call, at commit ..."

The files must agree on what makes their runs comparable (:data:`MATCHING`); a (variant, seed,
repeat) run finished in two files is refused, and one cut short (``--max-minutes``) gives way to
the same run finished in another. The merged ``meta`` lists every source file (its commit, date,
device, variants, seeds) under ``sources``, and ``note`` (``--note``) says how the jobs ran.
"""

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import textwrap

#: The baseline's name: torch's bf16 all-to-all, bf16 GEMMs.
BASELINE = "bf16"
#: Targets of issue 42, per variant: the mean paired difference of the final held-out loss
#: against bf16 within this many percent ...
TARGET_MEAN_PCT = 0.5
#: ... and its 95 % confidence interval inside this many percent.
TARGET_CI_PCT = 1.0

#: Two-sided 95 % quantiles of Student's t, t(0.975, df), df = 1..30 (any t table, e.g. NIST/
#: SEMATECH e-Handbook of Statistical Methods, table 1.3.6.7.2), where scipy is missing.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


# ------------------------------------------------------------------------------- numbers
def final_loss(losses, share=0.1):
    """Mean of the last ``share`` of the steps (at least one); NaN for no steps."""
    if not losses:
        return math.nan
    tail = losses[-max(1, math.ceil(share * len(losses))):]
    return sum(tail) / len(tail)


def si(value):
    """``1.23M``-style display of a rate."""
    if not math.isfinite(value):
        return "n/a"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:.1f}"


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def _std(values):
    """Sample standard deviation (n - 1); NaN below two values."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if len(values) < 2:
        return math.nan
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def t_975(df):
    """Student's t quantile t(0.975, df): the half-width of a two-sided 95 % interval in
    standard errors. scipy's ``stats.t.ppf`` where installed (scipy is no dependency), else
    :data:`T_975`; past df 30 without scipy, df 30's value (wider than the true one by less than
    4 %: conservative).

    Raises:
        ValueError: df below 1.
    """
    if df < 1:
        raise ValueError(f"t_975: df: expected at least 1, got {df}")
    try:
        from scipy import stats
    except ImportError:
        return T_975[min(int(df), len(T_975)) - 1]
    return float(stats.t.ppf(0.975, df))


def paired_interval(differences):
    """Mean of paired differences with its two-sided 95 % Student-t confidence interval,
    ``mean ± t(0.975, n - 1) * std / sqrt(n)`` (the paired t interval; std the sample standard
    deviation, n - 1).

    Args:
        differences: the per-seed differences (any unit; non-finite values are dropped).
    Returns:
        ``{"n", "mean", "std", "t", "low", "high"}``; with fewer than 2 differences the interval
        (std, t, low, high) is NaN.
    """
    values = [v for v in differences if v is not None and math.isfinite(v)]
    n, mean, std = len(values), _mean(values), _std(values)
    t = t_975(n - 1) if n >= 2 else math.nan
    half = t * std / math.sqrt(n) if n >= 2 else math.nan
    return {"n": n, "mean": mean, "std": std, "t": t, "low": mean - half, "high": mean + half}


def meets_target(interval):
    """True when the mean is within ±:data:`TARGET_MEAN_PCT` % and the interval inside
    ±:data:`TARGET_CI_PCT` %; None without an interval."""
    if not math.isfinite(interval["low"]):
        return None
    return (abs(interval["mean"]) <= TARGET_MEAN_PCT and interval["low"] >= -TARGET_CI_PCT
            and interval["high"] <= TARGET_CI_PCT)


def flattened(evals, flat_evals, flat_pct):
    """Whether held-out loss has flattened: it changed by less than ``flat_pct`` % of its last
    value over the last ``flat_evals`` evaluations (first of them to last).

    Args:
        evals: ``[{"step", "tokens", "loss"}]`` of a run, in order.
    Returns:
        ``(flat, change_pct)``: flat None (and change NaN) with fewer than ``flat_evals``
        evaluations.
    """
    if flat_evals < 2 or len(evals) < flat_evals:
        return None, math.nan
    first, last = evals[-flat_evals]["loss"], evals[-1]["loss"]
    change = (first - last) / last * 100
    return abs(change) < flat_pct, change


def flat_text(run, shapes):
    """``"flattened: ..."`` for a run, as the progress lines and tables say it."""
    get = shapes.get if isinstance(shapes, dict) else lambda k, d: getattr(shapes, k, d)
    k, pct = get("flat_evals", 5), get("flat_pct", 0.5)
    flat, change = flattened(run.get("evals", []), k, pct)
    if flat is None:
        return f"flattened: n/a (fewer than {k} evaluations)"
    return (f"flattened: {'yes' if flat else 'no'}, {change:+.2f} % over the last {k} "
            f"evaluations (< {pct} % needed)")


def _first_repeats(runs):
    """``{(variant, seed): run}`` of the lowest repeat of each: the runs that pair."""
    chosen = {}
    for r in sorted(runs, key=lambda r: r.get("repeat", 0)):
        chosen.setdefault((r["variant"], r["seed"]), r)
    return chosen


def repeat_floor(runs):
    """The nondeterminism floor: the spread of bf16's held-out loss over repeats of one seed
    (same weights, data and code), for the seed with the most repeats.

    Returns:
        ``{"seed", "repeats", "spread_pct" (std / mean), "range_pct" ((max - min) / mean)}``, or
        None where no seed of bf16 ran twice.
    """
    by_seed = {}
    for r in runs:
        if r["variant"] == BASELINE:
            by_seed.setdefault(r["seed"], []).append(r["val_loss"])
    seed = max(by_seed, key=lambda s: (len(by_seed[s]), -s), default=None)
    if seed is None or len(by_seed[seed]) < 2:
        return None
    values = by_seed[seed]
    mean = _mean(values)
    return {"seed": seed, "repeats": len(values), "spread_pct": _std(values) / mean * 100,
            "range_pct": (max(values) - min(values)) / mean * 100}


def summarize(runs, variants, cfg=None):
    """Per-variant rows of final held-out loss, paired difference to bf16 with its 95 %
    interval, training loss and tokens/s; the repeat floor; SQNR rows.

    The criterion is a run's final held-out loss (``val_loss``: its last evaluation). A variant
    pairs with bf16 seed by seed (the lowest repeat of each); truncated runs (``--max-minutes``)
    are left out of every number.

    Args:
        runs: run records (``train_moe.train_run``). variants: :class:`train_moe.Variant` s.
        cfg: the shapes (``meta["shapes"]``), for the flattening criterion (None: 5 and 0.5 %).
    Returns:
        ``{"final": rows, "paired": {variant: {seed: difference %}}, "bf16_spread_pct": std of
        bf16's final held-out losses over seeds in % of their mean, "floor":
        :func:`repeat_floor`, "sqnr": rows}``. A ``final`` row: variant, precisions (the wire),
        gemm (``"fp8 (ran bf16)"`` where a run fell back), seeds (runs paired or, for bf16,
        run), heldout (mean over seeds), heldout_std, delta_pct, delta_std_pct, ci_low_pct,
        ci_high_pct, t (:func:`paired_interval` of the per-seed (variant - bf16) / bf16, in %),
        within_target (:func:`meets_target`), flattened (runs flattened, of runs with enough
        evaluations: ``"k/n"``), train_loss (mean of the last 10 % of steps, mean over seeds),
        tokens_per_s, speedup (vs bf16's tokens/s). A ``sqnr`` row: variant, step, mean_db
        (over seeds and layers), min_db (the worst layer and seed).
    """
    shapes = cfg or {}
    k, pct = shapes.get("flat_evals", 5), shapes.get("flat_pct", 0.5)
    done = [r for r in runs if not r["truncated"]]
    first = _first_repeats(done)
    base = {seed: r["val_loss"] for (name, seed), r in first.items() if name == BASELINE}
    spread = _std(list(base.values())) / _mean(list(base.values())) * 100 if base else math.nan
    base_rate = _mean([r["tokens_per_s"] for r in done if r["variant"] == BASELINE])
    final, sqnr, paired = [], [], {}
    for v in variants:
        mine = [r for r in done if r["variant"] == v.name]
        heldout = {seed: r["val_loss"] for (name, seed), r in first.items() if name == v.name}
        deltas = {s: (heldout[s] - base[s]) / base[s] * 100 for s in heldout if s in base}
        interval = paired_interval(list(deltas.values())) if v.name != BASELINE \
            else paired_interval([])
        if v.name != BASELINE:
            paired[v.name] = deltas
        rate = _mean([r["tokens_per_s"] for r in mine])
        gemm = getattr(v, "gemm", "bf16")
        if any(r.get("gemm_ran", gemm) != gemm for r in mine if gemm in ("bf16", "fp8")):
            gemm += " (ran bf16)"
        flats = [flattened(r.get("evals", []), k, pct) for r in mine]
        judged = [f for f, _ in flats if f is not None]
        change = _mean([c for f, c in flats if f is not None])
        final.append({"variant": v.name, "precisions": v.wire(), "gemm": gemm,
                      "seeds": len(deltas) if v.name != BASELINE else len(heldout),
                      "heldout": _mean(list(heldout.values())),
                      "heldout_std": _std(list(heldout.values())),
                      "delta_pct": interval["mean"], "delta_std_pct": interval["std"],
                      "ci_low_pct": interval["low"], "ci_high_pct": interval["high"],
                      "t": interval["t"], "within_target": meets_target(interval),
                      "flattened": (f"{sum(judged)}/{len(judged)} ({change:+.2f} %)" if judged
                                    else "n/a"),
                      "train_loss": _mean([final_loss(r["losses"]) for r in first.values()
                                           if r["variant"] == v.name]),
                      "tokens_per_s": rate, "speedup": rate / base_rate})
        steps = sorted({int(s) for r in mine for s in r["sqnr_db"]})
        for step in steps:
            per_run = [r["sqnr_db"].get(step, r["sqnr_db"].get(str(step))) for r in mine]
            layers = [x for layer_dbs in per_run if layer_dbs for x in layer_dbs]
            sqnr.append({"variant": v.name, "step": step,
                         "mean_db": _mean_db(layers), "min_db": min(layers, default=math.nan)})
    return {"final": final, "paired": paired, "bf16_spread_pct": spread,
            "floor": repeat_floor(done), "sqnr": sqnr, "trajectory": trajectory(first)}


def trajectory(first, points=(0.25, 0.5, 0.75, 1.0)):
    """The paired difference to bf16 along training: at the evaluation nearest each fraction of
    the steps, per variant, :func:`paired_interval` of the per-seed (variant - bf16) / bf16 of
    the held-out loss at that evaluation, in %. A gap that holds still over the last part of
    training says the final comparison does not hang on where training stopped.

    Args:
        first: ``{(variant, seed): run}`` (:func:`_first_repeats` of the finished runs).
    Returns:
        ``[{"variant", "step", "n", "mean", "low", "high"}]``, steps ascending per variant.
    """
    evals = {key: {e["step"]: e["loss"] for e in r.get("evals", [])}
             for key, r in first.items()}
    base = {seed: ev for (name, seed), ev in evals.items() if name == BASELINE}
    steps = sorted(set.intersection(*map(set, base.values()))) if base else []
    if not steps:
        return []
    chosen = list(dict.fromkeys(min(steps, key=lambda s: abs(s - f * steps[-1]))
                                for f in points))
    rows = []
    for name in dict.fromkeys(n for n, _ in evals if n != BASELINE):
        for step in chosen:
            deltas = [(ev[step] - base[seed][step]) / base[seed][step] * 100
                      for (n, seed), ev in evals.items()
                      if n == name and seed in base and step in ev]
            interval = paired_interval(deltas)
            rows.append({"variant": name, "step": step, "n": interval["n"],
                         "mean": interval["mean"], "low": interval["low"],
                         "high": interval["high"]})
    return rows


def _mean_db(values):
    """Mean of dB values (inf when every one is inf)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.inf if values and all(v == math.inf for v in values) else math.nan
    return sum(finite) / len(finite)


# ---------------------------------------------------------------------------- metadata
def git_commit():
    """``$MXCOMM_COMMIT`` if set (a copied tree whose ``.git`` is stale), else this checkout's
    ``git rev-parse --short HEAD`` (``+dirty`` with uncommitted changes), else ``"unknown"``."""
    if os.environ.get("MXCOMM_COMMIT"):
        return os.environ["MXCOMM_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        if head.returncode == 0 and head.stdout.strip():
            return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def metadata(device, world_size, cfg, preset, corpus, seeds, variants):
    """What every output names: device, world size, shapes, date, commit, versions, corpus."""
    import dataclasses

    import torch
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:  # where mxcomm's array work runs; the module is private and newer than 0.1.0
        from mxcomm._platform import backend
        name += f" (mxcomm {backend()} backend)"
    except ImportError:
        name += " (Numba's CUDA simulator)" if device.type == "cpu" else ""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist_name in ("mxcomm", "numba-cuda", "cupy-cuda13x", "mpi4py", "scipy"):
        try:
            versions[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"example": "train_moe", "device": name, "world_size": world_size,
            "shapes": dataclasses.asdict(cfg), "preset": preset,
            "tokens_per_step": world_size * cfg.batch * cfg.seq_len,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "versions": versions, "corpus": corpus, "seeds": seeds,
            "variants": {v.name: v.precisions for v in variants},
            "gemms": {v.name: getattr(v, "gemm", "bf16") for v in variants}}


def header_lines(meta):
    """The metadata as short lines (Markdown bullets, plot title)."""
    s = meta["shapes"]
    return [f"device: {meta['device']}, world size {meta['world_size']}",
            f"model: {s['layers']} layers, dim {s['dim']}, {s['heads']} heads, {s['experts']} "
            f"experts (top-{s['top_k']}, hidden {s['hidden']}), seq {s['seq_len']}, batch "
            f"{s['batch']}/rank = {meta['tokens_per_step']} tokens/step, {s['steps']} steps, "
            f"AdamW lr {s['lr']}",
            f"corpus: {meta['corpus']['name']}, {meta['corpus']['tokens']:,} tokens "
            f"({meta['corpus']['train_tokens']:,} train, {meta['corpus']['val_tokens']:,} "
            f"held out); a run trains on {s['steps'] * meta['tokens_per_step']:,} tokens"
            + (f" ({meta['epochs']:.3f} epochs)" if meta.get("epochs") is not None else ""),
            f"seeds: {', '.join(map(str, meta['seeds']))}"
            + (f"; repeats: {', '.join(map(str, meta['repeats']))}"
               if meta.get("repeats", [0]) != [0] else ""),
            f"date: {meta['date']}, commit: {meta['commit']}",
            "versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
            *[f"source: {src['file']}: variants {', '.join(src['variants'])}; seeds "
              f"{', '.join(map(str, src['seeds']))}; date {src['date']}, commit {src['commit']}, "
              f"{_cell(src.get('seconds'), '.1f')} s" for src in meta.get("sources", [])],
            *([f"the {len(meta['sources'])} invocations ran at overlapping times: if on the same "
               f"GPUs, their tokens/s are under contention"] if meta.get("overlapping") else []),
            *([f"note: {meta['note']}"] if meta.get("note") else [])]


# ------------------------------------------------------------------------------ outputs
def _cell(value, fmt):
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "inf"
        return format(value, fmt)
    return str(value)


def final_table(result):
    """The final held-out loss table as Markdown lines."""
    lines = [f"| variant | dispatch/combine/dispatch_grad/combine_grad | GEMMs | seeds | "
             f"held-out loss | vs bf16 (paired mean) | 95 % CI | target (±{TARGET_MEAN_PCT} %, "
             f"CI in ±{TARGET_CI_PCT:g} %) | flattened | training loss | tokens/s | vs bf16 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["summary"]["final"]:
        loss = _cell(r["heldout"], ".4f") + (
            f" ± {r['heldout_std']:.4f}" if _finite(r["heldout_std"]) else "")
        delta = f"{r['delta_pct']:+.3f} %" if _finite(r["delta_pct"]) else "n/a"
        ci = (f"{r['ci_low_pct']:+.3f} … {r['ci_high_pct']:+.3f} %"
              if _finite(r["ci_low_pct"]) else "n/a")
        speedup = _cell(r["speedup"], ".3f") + ("x" if _finite(r["speedup"]) else "")
        lines.append(f"| {r['variant']} | {r['precisions']} | {r.get('gemm', 'bf16')} | "
                     f"{r['seeds']} | {loss} | {delta} | {ci} | "
                     f"{_cell(r['within_target'], '')} | {r['flattened']} | "
                     f"{_cell(r['train_loss'], '.4f')} | {si(r['tokens_per_s'])} | {speedup} |")
    return lines


def _finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)


def paired_table(result):
    """The per-seed paired differences (variant - bf16) / bf16 of the final held-out loss, %."""
    paired = result["summary"]["paired"]
    seeds = sorted({int(s) for d in paired.values() for s in d})
    if not seeds:
        return ["(no variant paired with bf16)"]
    lines = ["| variant | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "| --- |" + " --- |" * len(seeds)]
    for name, deltas in paired.items():
        cells = [deltas.get(s, deltas.get(str(s))) for s in seeds]
        lines.append(f"| {name} | " + " | ".join(
            f"{c:+.3f}" if _finite(c) else "n/a" for c in cells) + " |")
    return lines


def floor_line(result):
    """The bf16 spreads: over seeds, and over repeats of one seed (the nondeterminism floor),
    with the interval the floor alone gives (:func:`noise_halfwidth`)."""
    summary = result["summary"]
    floor = summary.get("floor")
    text = f"bf16 seed-to-seed spread (std / mean): {_cell(summary['bf16_spread_pct'], '.3f')} %"
    if floor is None:
        return text + "; repeat floor: n/a (no seed of bf16 ran twice: --repeats)"
    seeds = _paired_seeds(summary)
    half = noise_halfwidth(floor["spread_pct"], seeds)
    noise = (f"; a variant with bf16's numerics would show a 95 % interval of about "
             f"±{half:.2f} % at {seeds} seeds from that floor alone" if _finite(half) else "")
    return (text + f"; repeat floor, seed {floor['seed']}, {floor['repeats']} runs: std / mean "
            f"{floor['spread_pct']:.3f} %, max - min {floor['range_pct']:.3f} %" + noise)


def _paired_seeds(summary):
    """The most seeds any variant paired with bf16 (0 if none)."""
    return max([r["seeds"] for r in summary["final"] if r["variant"] != BASELINE], default=0)


def noise_halfwidth(floor_pct, seeds):
    """The expected half-width of :func:`paired_interval` at ``seeds`` seeds for a variant whose
    runs differ from bf16's only by run-to-run nondeterminism: each paired difference is of two
    runs of spread ``floor_pct``, so its std is ``floor_pct * sqrt(2)``; the half-width is
    ``t(0.975, seeds - 1) * floor_pct * sqrt(2) / sqrt(seeds)`` (NaN below 2 seeds). An
    estimate: the floor itself is measured on few runs."""
    if seeds < 2:
        return math.nan
    return t_975(seeds - 1) * floor_pct * math.sqrt(2) / math.sqrt(seeds)


def readme_line(result):
    """One line for README.md: each variant's paired difference with its interval."""
    meta, summary = result["meta"], result["summary"]
    s = meta["shapes"]
    parts = [f"{r['variant']} {r['delta_pct']:+.2f} % [{r['ci_low_pct']:+.2f}, "
             f"{r['ci_high_pct']:+.2f}]" + ("" if r["within_target"] else " (target missed)")
             for r in summary["final"] if r["variant"] != BASELINE and _finite(r["ci_low_pct"])]
    if not parts:
        return "Convergence: no variant has an interval yet (at least 2 seeds paired with bf16)."
    floor = summary.get("floor")
    seeds = _paired_seeds(summary)
    return (f"Final held-out loss vs bf16 (paired, mean [95 % CI], {seeds} seeds; d {s['dim']}, "
            f"{s['experts']} experts top-{s['top_k']}, {meta['world_size']} ranks, "
            f"{s['steps'] * meta['tokens_per_step'] / 1e6:.1f} M tokens, commit "
            f"{meta['commit']}): " + "; ".join(parts) + "; bf16 repeat floor "
            + (f"{floor['spread_pct']:.2f} %" if floor else "n/a") + ".")


def _step_table(rows, header, cell):
    """Markdown lines of ``rows`` (dicts with ``variant`` and ``step``): a row per variant, a
    column per step (``header(step)``), each cell ``cell(row)`` or "n/a" where none."""
    steps = sorted({r["step"] for r in rows})
    cells = {(r["variant"], r["step"]): r for r in rows}
    lines = ["| variant | " + " | ".join(header(s) for s in steps) + " |",
             "| --- |" + " --- |" * len(steps)]
    for name in dict.fromkeys(r["variant"] for r in rows):
        row = [cells.get((name, s)) for s in steps]
        lines.append(f"| {name} | " + " | ".join(
            "n/a" if c is None else cell(c) for c in row) + " |")
    return lines


def trajectory_table(result):
    """:func:`trajectory` as Markdown lines: mean [95 % CI] per variant and step, %."""
    rows = result["summary"].get("trajectory") or []
    if not rows:
        return ["(no variant paired with bf16)"]
    return _step_table(rows, lambda s: f"step {s}", lambda c: (
        "n/a" if not _finite(c["mean"]) else
        f"{c['mean']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]" if _finite(c["low"]) else
        f"{c['mean']:+.2f}"))


def sqnr_table(result):
    """SQNR of the MoE output vs bf16 at the probed steps, as Markdown lines."""
    rows = result["summary"]["sqnr"]
    if not rows:
        return ["(only the baseline ran)"]
    return _step_table(rows, lambda s: f"step {s + 1}", lambda c: (
        f"{_cell(c['mean_db'], '.1f')} (min {_cell(c['min_db'], '.1f')})"))


CRITERION = ("criterion: final held-out loss (the last evaluation, on the same held-out batches "
             "in every run); vs bf16: per seed (same weights, same data) (variant - bf16) / bf16, "
             "mean over seeds with its 95 % Student-t interval; target: mean within "
             f"±{TARGET_MEAN_PCT} %, interval inside ±{TARGET_CI_PCT:g} %")


def render_summary(result):
    """The closing text printed by rank 0."""
    return "\n".join(["", CRITERION, *final_table(result), floor_line(result), "",
                      "paired differences per seed (%):", *paired_table(result), "",
                      "paired difference along training (%, mean [95 % CI]):",
                      *trajectory_table(result), "",
                      "README: " + readme_line(result), "",
                      "SQNR (dB) of the MoE layer output vs the bf16 baseline's layer (torch "
                      "all-to-all, bf16 GEMMs) on the same input, mean over layers and seeds "
                      "(worst layer)", *sqnr_table(result)])


def write_markdown(path, result):
    """The summary tables under a header naming device, world size, shapes, date and commit."""
    meta = result["meta"]
    s = meta["shapes"]
    lines = ["# MoE training with mxcomm EP: held-out loss vs bf16", ""]
    lines += [f"- {line}" for line in header_lines(meta)]
    total = (f"{meta.get('seconds', math.nan):.1f} s" if "sources" not in meta else
             f"{meta['seconds']:.1f} s (the sum of the {len(meta['sources'])} invocations' times)")
    lines += [f"- total time: {total}; per run: " + ", ".join(
        f"{r['variant']}/{r['seed']}" + (f"/r{r['repeat']}" if r.get("repeat") else "")
        + f" {r['seconds']:.1f} s" + (" (truncated)" if r["truncated"] else "")
        for r in result["runs"]), "",
        "## Final held-out loss", "",
        f"The {CRITERION}. Held-out loss: evaluated every {s.get('eval_every', 'n/a')} steps "
        f"and after the last on {s.get('eval_batches')} batches per rank of the held-out split. "
        f"Flattened: runs whose held-out loss changed by less than {s.get('flat_pct', 0.5)} % "
        f"over their last {s.get('flat_evals', 5)} evaluations (in brackets: the mean change "
        f"over that window). Training loss: mean of the last "
        f"10 % of steps. tokens/s: all ranks, after the first 10 steps, evaluations excluded, "
        f"SQNR probes included. Runs cut short by --max-minutes are left out.", "",
        *final_table(result), "", floor_line(result) + ".", "",
        "## Paired differences per seed (%)", "", *paired_table(result), "",
        "## The paired difference along training (%)", "",
        "At the evaluations nearest 25, 50, 75 and 100 % of the steps: per variant the mean "
        "over seeds of (variant - bf16) / bf16 of the held-out loss at that step, with its 95 % "
        "Student-t interval. A difference that holds still over the last half says the final "
        "comparison does not hang on where training stopped.", "",
        *trajectory_table(result), "",
        "## For README.md", "", readme_line(result), "",
        "## SQNR of the MoE layer output", "",
        "SQNR (dB) of each MoE layer's output against the bf16 baseline's layer (torch's bf16 "
        "all-to-all, bf16 GEMMs) with the same weights, on the same input at the same step; mean "
        "over layers and seeds (worst layer and seed). It sees the whole variant's forward "
        "(dispatch, the GEMMs, combine); the gradient directions (and the GEMMs' backward) show "
        "in the loss.", "", *sqnr_table(result)]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json(path, result):
    """The whole result as strict JSON (NaN -> null, inf -> "inf")."""
    with open(path, "w") as f:
        json.dump(_jsonable(result), f, indent=1)
        f.write("\n")
    return path


def write_plot(path, result):
    """PNG: held-out loss of every run against steps (top left) and against tokens (top right),
    and each run's held-out loss against bf16 of the same seed, in % (bottom, with the targets'
    bands)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r.get("evals") and not r["truncated"]]
    names = list(dict.fromkeys(r["variant"] for r in runs))
    others = [n for n in names if n != BASELINE]
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(others)}
    colors[BASELINE] = "black"
    styles = ["-", "--", ":", "-."]
    seeds = list(dict.fromkeys(r["seed"] for r in runs))
    labelled = set()

    def style(r):
        """Color by variant, line style by seed; bf16 black and drawn on top."""
        label = r["variant"] if r["variant"] not in labelled else None
        labelled.add(r["variant"])
        return {"color": colors[r["variant"]],
                "ls": styles[seeds.index(r["seed"]) % len(styles)],
                "lw": 1.6 if r["variant"] == BASELINE else 1.0,
                "zorder": 3 if r["variant"] == BASELINE else 2, "label": label}

    fig = plt.figure(figsize=(12, 8.5))
    by_step, by_tokens = fig.add_subplot(2, 2, 1), fig.add_subplot(2, 2, 2)
    paired = fig.add_subplot(2, 1, 2)
    first = _first_repeats([r for r in runs if not r["truncated"]])
    for r in runs:
        st = style(r)
        steps = [e["step"] for e in r["evals"]]
        losses = [e["loss"] for e in r["evals"]]
        by_step.plot(steps, losses, **st)
        by_tokens.plot([e["tokens"] for e in r["evals"]], losses, **{**st, "label": None})
        base = first.get((BASELINE, r["seed"]))
        if r["variant"] != BASELINE and base is not None:
            ref = {e["step"]: e["loss"] for e in base["evals"]}
            pairs = [(e["step"], (e["loss"] - ref[e["step"]]) / ref[e["step"]] * 100)
                     for e in r["evals"] if e["step"] in ref]
            if pairs:
                paired.plot(*zip(*pairs), **{**st, "label": None})
    tail = [e["loss"] for r in runs for e in r["evals"][len(r["evals"]) // 4:]]
    for ax in (by_step, by_tokens):
        if tail:
            ax.set_ylim(min(tail) - 0.05 * (max(tail) - min(tail) or 1), max(tail))
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.grid(alpha=0.3)
    by_step.set_xlabel("step")
    by_tokens.set_xlabel("tokens trained on")
    seed_note = ", ".join(f"{styles[i % len(styles)]} seed {s}" for i, s in enumerate(seeds))
    if runs:                             # files from before the evaluations have no curves
        by_step.legend(fontsize=7, ncol=2, title=f"line style: {seed_note}", title_fontsize=7)
    paired.axhspan(-TARGET_CI_PCT, TARGET_CI_PCT, color="green", alpha=0.06,
                   label=f"±{TARGET_CI_PCT:g} % (interval target)")
    paired.axhspan(-TARGET_MEAN_PCT, TARGET_MEAN_PCT, color="green", alpha=0.12,
                   label=f"±{TARGET_MEAN_PCT} % (mean target)")
    floor = result["summary"].get("floor")
    if floor:
        paired.axhspan(-floor["range_pct"], floor["range_pct"], color="gray", alpha=0.3,
                       label=f"bf16 repeat range ±{floor['range_pct']:.2f} % (final)")
    paired.axhline(0, color="black", lw=0.8)
    paired.set_ylabel("held-out loss vs bf16, same seed (%)")
    paired.set_xlabel("step")
    paired.legend(fontsize=7, loc="upper right")
    paired.grid(alpha=0.3)
    lines = header_lines(result["meta"])
    # the note wrapped to the figure's width, two lines at most (in full in the Markdown report)
    note = textwrap.TextWrapper(width=190, max_lines=2, placeholder=" … (in full: the report)").wrap(
        f"note: {result['meta']['note']}") if result["meta"].get("note") else []
    fig.suptitle("MoE training with mxcomm EP: held-out loss\n"
                 + "\n".join(lines[:2] + lines[4:5] + note), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------- merging
#: What the files merged into one report must agree on: ``meta`` fields, and for dicts each of
#: their fields (``shapes.steps``). ``shapes.log_every`` (progress lines only) may differ.
MATCHING = ("example", "device", "world_size", "shapes", "tokens_per_step", "corpus")


def _decoded(value):
    """The inverse of :func:`_jsonable` for numbers: ``"inf"`` / ``"-inf"`` -> floats."""
    if isinstance(value, str) and value in ("inf", "-inf"):
        return float(value)
    if isinstance(value, dict):
        return {k: _decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    return value


def _nan(value):
    """None (a NaN in strict JSON) -> NaN."""
    return math.nan if value is None else value


def read_run_file(path):
    """A result written by ``train_moe.py --json`` (or by :func:`merge`), its runs as
    ``train_moe.train_run`` returned them: NaN and inf restored, ``sqnr_db`` keyed by int steps.

    Raises:
        ValueError: not such a file (not JSON, or no ``meta`` / ``runs``).
    """
    try:
        with open(path) as f:
            data = _decoded(json.load(f))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read a train_moe JSON result: {error}") from None
    if not isinstance(data, dict) or not {"meta", "runs"} <= set(data) \
            or data["meta"].get("example") != "train_moe":
        raise ValueError(f"{path}: not a train_moe JSON result (no meta/runs, or meta.example "
                         f"is not 'train_moe')")
    for run in data["runs"]:
        run.setdefault("repeat", 0)
        run["evals"] = [{**e, "loss": _nan(e.get("loss"))} for e in run.get("evals", [])]
        for key in ("seconds", "tokens_per_s", "val_loss"):
            run[key] = _nan(run.get(key))
        for key in ("losses", "aux_losses"):
            run[key] = [_nan(v) for v in run.get(key, [])]
        run["sqnr_db"] = {int(step): [_nan(v) for v in dbs]
                          for step, dbs in run.get("sqnr_db", {}).items()}
    return data


def _differences(a, b, prefix=""):
    """Dotted names of the fields where ``a`` and ``b`` differ (dicts compared field by field)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in dict.fromkeys([*a, *b])
                for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def _span(dates):
    """ISO dates as one, two joined by `` / ``, or the first and last of more (``a … b``)."""
    distinct = sorted(set(dates))
    return distinct[0] if len(distinct) == 1 else (
        " / ".join(distinct) if len(distinct) == 2 else f"{distinct[0]} … {distinct[-1]}")


def _joined(values):
    """The one value, or the different ones joined by `` / `` (first appearance first)."""
    distinct = list(dict.fromkeys(str(v) for v in values))
    return values[0] if len(distinct) == 1 else " / ".join(distinct)


def merge(paths, note=None):
    """One result from the JSON files of several invocations: the runs of all, the summary a
    single invocation of every variant and seed would have computed.

    Variants are rebuilt with ``train_moe.parse_variant`` (as the command line would), in the
    order they first appear (file by file), seeds likewise; runs go seed-major as in
    ``train_moe.main``. A variant is compared with bf16 of the same seed from whichever file holds
    it.

    Args:
        paths: the files, as written by ``train_moe.py --json``.
        note: how the jobs ran (e.g. concurrently on the same GPUs: tokens/s under contention);
            ``meta["note"]``, printed in the Markdown and the plot.
    Returns:
        ``{"meta", "runs", "summary"}`` like ``train_moe.main``'s; ``meta`` the first file's,
        with ``seeds``, ``variants`` and ``gemms`` of all, ``date``, ``commit`` and
        ``versions`` joined where they differ, ``seconds`` the sum of the invocations' times,
        ``sources`` (per invocation: file, date, commit, device, variants, seeds, seconds,
        versions; a merged file contributes its own sources), ``overlapping`` (whether their times
        overlapped), ``merged`` (the merge's date) and ``note`` (the files' notes and ``note``).
    Raises:
        ValueError: no files; a file that is not a train_moe result; files that differ in a
            :data:`MATCHING` field (named, with both files); a (variant, seed) run in two files;
            a variant whose recorded precisions differ from what ``parse_variant`` makes of it.
    """
    import train_moe  # here: train_moe imports this module

    if not paths:
        raise ValueError("merge: no JSON files given")
    files = [(path, read_run_file(path)) for path in paths]
    first_path, first = files[0]
    for path, data in files[1:]:
        for field in MATCHING:
            diff = [d for d in _differences(first["meta"].get(field), data["meta"].get(field),
                                            field + ".")
                    if d != "shapes.log_every"]
            if diff:
                name = diff[0]
                a, b = (_lookup(m["meta"], name) for m in (first, data))
                raise ValueError(f"merge: {first_path} and {path} are not comparable: {name} "
                                 f"differs ({a!r} vs {b!r})")
    owner, runs, variants, seeds, repeats = {}, [], {}, [], []
    for path, data in files:
        for name, precisions in data["meta"].get("variants", {}).items():
            variant = train_moe.parse_variant(name)
            gemm = data["meta"].get("gemms", {}).get(name, "bf16")
            if (variant.precisions, variant.gemm) != (precisions, gemm):
                raise ValueError(f"merge: {path}: variant {name!r} ran {precisions} with {gemm} "
                                 f"GEMMs, but train_moe.parse_variant now makes it "
                                 f"{variant.precisions} with {variant.gemm} GEMMs")
            variants.setdefault(name, variant)
        for seed in data["meta"].get("seeds", []):
            if seed not in seeds:
                seeds.append(seed)
        for repeat in data["meta"].get("repeats", [0]):
            if repeat not in repeats:
                repeats.append(repeat)
        for run in data["runs"]:
            key = (run["variant"], run["seed"], run["repeat"])
            if key in owner:
                kept = runs[owner[key][1]]
                if not (kept["truncated"] or run["truncated"]):
                    raise ValueError(f"merge: variant {key[0]!r} seed {key[1]} repeat {key[2]} "
                                     f"ran in both {owner[key][0]} and {path}; merge each run "
                                     f"once (a rerun of the same seed: another --repeats index)")
                if kept["truncated"] and not run["truncated"]:  # a cut-short run, run again
                    runs[owner[key][1]] = run
                    owner[key] = (path, owner[key][1])
                continue
            owner[key] = (path, len(runs))
            variants.setdefault(run["variant"], train_moe.parse_variant(run["variant"]))
            if run["seed"] not in seeds:
                seeds.append(run["seed"])
            runs.append(run)
    order = list(variants)
    runs.sort(key=lambda r: (seeds.index(r["seed"]), r["repeat"], order.index(r["variant"])))
    metas = [data["meta"] for _, data in files]
    sources = [src for (path, _), m in zip(files, metas) for src in m.get("sources") or [
        {"file": path, "date": m["date"], "commit": m["commit"], "device": m["device"],
         "variants": list(m["variants"]), "seeds": m["seeds"],
         "seconds": _nan(m.get("seconds")), "versions": m["versions"]}]]
    meta = dict(first["meta"])
    meta.update(
        preset=_joined([m["preset"] for m in metas]),
        date=_span([m["date"] for m in metas]), commit=_joined([m["commit"] for m in metas]),
        versions={k: _joined([m["versions"].get(k, "-") for m in metas])
                  for k in dict.fromkeys(k for m in metas for k in m["versions"])},
        seeds=seeds, repeats=sorted(repeats),
        variants={v.name: v.precisions for v in variants.values()},
        gemms={v.name: v.gemm for v in variants.values()},
        seconds=sum(_nan(m.get("seconds")) for m in metas),
        sources=sources, overlapping=_overlapping(sources),
        merged=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    notes = list(dict.fromkeys(n for n in [*(m.get("note") for m in metas), note] if n))
    meta.pop("note", None)
    if notes:
        meta["note"] = "; ".join(notes)
    return {"meta": meta, "runs": runs,
            "summary": summarize(runs, list(variants.values()), cfg=meta["shapes"])}


def _overlapping(sources):
    """True when two invocations' times (``date``, their start, plus ``seconds``) overlap."""
    spans = []
    for m in sources:
        try:
            start = datetime.datetime.fromisoformat(m["date"]).timestamp()
        except (KeyError, TypeError, ValueError):
            return False
        spans.append((start, start + _nan(m.get("seconds"))))
    spans.sort()
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def _lookup(meta, dotted):
    """``meta["shapes"]["steps"]`` for ``"shapes.steps"`` (None where missing)."""
    for key in dotted.split("."):
        meta = meta.get(key) if isinstance(meta, dict) else None
    return meta


def build_parser():
    p = argparse.ArgumentParser(
        description="Merge the --json results of several train_moe.py invocations (e.g. jobs "
                    "sharing the same GPUs) into one report, as one invocation of all their runs "
                    "would write it.")
    p.add_argument("files", nargs="+", metavar="FILE", help="JSON files of train_moe.py --json")
    p.add_argument("--json", metavar="PATH", help="write every run's record")
    p.add_argument("--markdown", metavar="PATH", help="write the summary tables")
    p.add_argument("--plot", metavar="PATH",
                   help="write the held-out loss curves (PNG; needs matplotlib, else skipped "
                        "with a note)")
    p.add_argument("--note", metavar="TEXT",
                   help="how the jobs ran, printed in the report and kept in the JSON's meta "
                        "(e.g. '4 jobs of 2 ranks shared the 2 GPUs: tokens/s are under "
                        "contention')")
    return p


def main(argv=None):
    """Merge the files given on the command line; print the summary, write the outputs.

    Returns:
        The merged result; exits with status 2 and the reason when the files do not merge.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = merge(args.files, note=args.note)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(render_summary(result), flush=True)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(f"--plot: matplotlib is not installed: {args.plot} not written", flush=True)
        args.plot = None
    for path, write in ((args.json, write_json), (args.markdown, write_markdown),
                        (args.plot, write_plot)):
        if path:
            write(path, result)
            print(f"wrote {path}", flush=True)
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_moe, beside this file
    main()
