"""``--plot``: grouped bars of per-stage times, bf16 vs MXFP8 (matplotlib, Agg backend)."""

import math

VARIANT_KEYS = (("bf16_ms", "bf16 (torch.distributed)"), ("mxfp8_ms", "mxcomm default"),
                ("mxfp8_all_ms", "mxcomm all mxfp8"))


def plot_stages(path, meta, stage_rows):
    """Write a PNG: one panel per shape, one group of bars per (stage, pass), one bar per variant.

    Args:
        path: output file (PNG).
        meta: the run's metadata (title: device, world size, commit).
        stage_rows: the ``stages`` table of the pipeline benchmark.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in stage_rows))
    fig, axes = plt.subplots(max(1, len(shapes)), 1, figsize=(12, 3.6 * max(1, len(shapes))),
                             squeeze=False)
    width = 0.8 / len(VARIANT_KEYS)
    for ax, shape in zip(axes[:, 0], shapes or [""]):
        rows = [r for r in stage_rows if r["shape"] == shape]
        labels = [f"{r['stage']}\n{r['pass']}" for r in rows]
        for i, (key, name) in enumerate(VARIANT_KEYS):
            values = [r[key] if math.isfinite(r[key]) else 0.0 for r in rows]
            ax.bar([j + (i - 1) * width for j in range(len(rows))], values, width, label=name)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("ms (median)")
        ax.set_title(f"tokens x dim x hidden x experts/rank = {shape}", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"mxcomm EP pipeline stages: {meta['device']}, world size {meta['world_size']}, "
                 f"commit {meta['commit']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
