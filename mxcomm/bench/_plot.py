"""``--plot`` of the pipeline benchmark (matplotlib, Agg backend): horizontal bars, so that no two
labels share a line.

On a GPU: per-stage times of every variant that ran, one panel per shape. On a CPU (nothing
timed): bytes between ranks per direction, and the SQNR of each variant against its targets.
Variants are those of the tables (``--variants``), in the order of :data:`VARIANT_LABELS`.
"""

import math

#: Legend label of each pipeline variant (``_moe.VARIANTS``), in table order.
VARIANT_LABELS = {"bf16": "bf16 (torch.distributed)", "auto": "auto (mxcomm's choice)",
                  "bf16_mxcomm": "recipe bf16 (mxcomm)", "mxfp8": "recipe mxfp8",
                  "fp8_rowwise": "recipe fp8_rowwise (fused, fp8 GEMM)",
                  "mxfp8_all": "mxcomm all mxfp8", "bf16+fp8gemm": "bf16 + fp8 GEMM",
                  "fp8_rowwise_bf16grad": "fp8 rowwise wire + fp8 GEMM",
                  "mxfp8+rowwise": "mxfp8 wire -> rowwise + fp8 GEMM",
                  "fp8_rowwise_mxgrad": "fp8 rowwise wire, mxfp8 dispatch grad",
                  "fp8_rowwise_bf16wgrad": "fp8 rowwise wire, bf16 wgrad",
                  "fp8_rowwise_acc32": "fp8 rowwise wire, fp32-promoted sums"}
#: One color per variant in every panel (matplotlib's tab10 colors).
COLORS = dict(zip(VARIANT_LABELS.values(), ("tab:blue", "tab:orange", "tab:green", "tab:purple",
                                            "tab:red", "tab:brown", "tab:cyan", "tab:pink",
                                            "tab:olive", "tab:gray", "gold", "black")))


#: Entries per legend row (six variants and a target line do not fit one row).
LEGEND_COLUMNS = 4


def _label(name):
    return VARIANT_LABELS.get(name, name)


def _stage_variants(stage_rows):
    """Variant names of the ``stages`` rows (their ``<name>_ms`` keys), in table order."""
    keys = {k[:-3] for r in stage_rows for k in r if k.endswith("_ms")}
    return [n for n in VARIANT_LABELS if n in keys] + sorted(keys - set(VARIANT_LABELS))


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _title(meta):
    return (f"mxcomm EP pipeline: {meta['device']}, world size {meta['world_size']}, "
            f"commit {meta['commit']}")


def _grouped_barh(ax, groups, series, xlabel, fmt):
    """One row of bars per group (top to bottom), one bar per series ``(label, values)`` in the
    variant's color, each bar labelled with its value at its end (NaN: no bar; inf: a label
    "inf" and no bar, e.g. an SQNR of identical results)."""
    height = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        ys = [g + (i - (len(series) - 1) / 2) * height for g in range(len(groups))]
        xs = [v if math.isfinite(v) else 0.0 for v in values]
        bars = ax.barh(ys, xs, height, label=label, color=COLORS.get(label))
        ax.bar_label(bars, labels=[fmt(v) if math.isfinite(v) else "inf" if v == math.inf
                                   else "" for v in values],
                     fontsize=7, padding=2)
    ax.set_yticks(range(len(groups)))
    ax.set_yticklabels(groups, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.margins(x=0.15)


def _legend_below(fig, axes):
    """One legend for the figure, under the panels (so it covers no bar), every label once."""
    entries = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    fig.legend(entries.values(), entries.keys(), loc="outside lower center",
               ncol=min(len(entries), LEGEND_COLUMNS), fontsize=9, frameon=False)


def plot_stages(path, meta, stage_rows):
    """Write a PNG: one panel per shape, a row of bars per (stage, pass), a bar per variant.

    Args:
        path: output file (PNG).
        meta: the run's metadata (title: device, world size, commit).
        stage_rows: the ``stages`` table of the pipeline benchmark (``<variant>_ms`` columns;
            NaN: no bar).
    Returns:
        ``path``.
    """
    plt = _pyplot()
    shapes = list(dict.fromkeys(r["shape"] for r in stage_rows)) or [""]
    names = _stage_variants(stage_rows)
    per_row = 0.15 * max(len(names), 3)
    heights = [per_row * len([r for r in stage_rows if r["shape"] == s]) + 1.2 for s in shapes]
    fig, axes = plt.subplots(len(shapes), 1, figsize=(10, sum(heights) + 1.0), squeeze=False,
                             gridspec_kw={"height_ratios": heights}, layout="constrained")
    for ax, shape in zip(axes[:, 0], shapes):
        rows = [r for r in stage_rows if r["shape"] == shape]
        _grouped_barh(ax, [f"{r['stage']} ({r['pass']})" for r in rows],
                      [(_label(n), [r.get(f"{n}_ms", float("nan")) for r in rows])
                       for n in names],
                      "ms (median, each stage run alone)", lambda v: f"{v:.2f}")
        ax.set_title(f"tokens x dim x hidden x experts/rank = {shape}", fontsize=10)
    fig.suptitle(_title(meta), fontsize=11)
    _legend_below(fig, axes[:, 0])
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_wire_and_sqnr(path, meta, wire_rows, sqnr_rows, targets):
    """Write a PNG for a run without timings: MB between ranks per direction and variant (left),
    SQNR of each variant but bf16 per quantity with its target (right); the first shape only.

    Args:
        path: output file (PNG).
        meta: the run's metadata.
        wire_rows, sqnr_rows: the ``wire`` and ``sqnr`` tables of the pipeline benchmark.
        targets: ``{"out": dB, "input_grad": dB, "weight_grad": dB}``.
    Returns:
        ``path``.
    """
    plt = _pyplot()
    shape = wire_rows[0]["shape"] if wire_rows else ""
    wire = [r for r in wire_rows if r["shape"] == shape]
    directions = list(dict.fromkeys(r["direction"] for r in wire))
    present = {r["variant"] for r in wire}
    names = [n for n in VARIANT_LABELS if n in present] + sorted(present - set(VARIANT_LABELS))
    height = max(4.6, 0.22 * len(directions) * len(names) + 1.8)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, height), layout="constrained")
    series = []
    for variant in names:
        mb = {r["direction"]: r["bytes"] / 1e6 for r in wire if r["variant"] == variant}
        series.append((_label(variant), [mb.get(d, float("nan")) for d in directions]))
    _grouped_barh(left, directions, series, "MB between ranks (all ranks)", lambda v: f"{v:.1f}")
    left.set_title("bytes on the wire", fontsize=10)
    sqnr = [r for r in sqnr_rows if r["shape"] == shape]
    quantities = [("out", "output"), ("input_grad", "input grad"), ("weight_grad", "weight grad")]
    _grouped_barh(right, [q for _, q in quantities],
                  [(_label(r["variant"]), [r[f"{k}_db"] for k, _ in quantities]) for r in sqnr],
                  "SQNR vs bf16 (dB)", lambda v: f"{v:.1f}")
    for i, (k, _) in enumerate(quantities):
        right.plot([targets[k]] * 2, [i - 0.45, i + 0.45], color="black", linestyle="--",
                   linewidth=1, label="SQNR target" if i == 0 else None)
    right.set_title("SQNR of each variant against bf16", fontsize=10)
    fig.suptitle(f"{_title(meta)}\ntokens x dim x hidden x experts/rank = {shape}", fontsize=11)
    _legend_below(fig, (left, right))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
