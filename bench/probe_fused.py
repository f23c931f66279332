"""Time the quantized exchanges that land in permute's order (``permute_align``) against the
exchange and the permute called one after the other, at W ranks on GPUs.

    mpirun -n W python bench/probe_fused.py [rows] [--dims D:H ...]

Per shape (``rows`` x D token rows per rank, ``rows`` x H gradient rows; 8 experts per rank,
uniform routing, align 32, fp8_rowwise on the wire): the dispatch (bf16 -> fp8_rowwise) and the
combine gradient (``a2a_combine_backward``, the same direction at width H), each

- alone (the exchange into received order),
- followed by ``permute`` of what it received (the separate calls),
- in one call (``permute_align``: each (sender, local expert) run of rows pulled by the copy
  engines straight into its permuted rows);

and the forward combine in bf16 (width H) alone, after ``unpermute``, and in one call (each
peer's rows gathered through the inverse index into the staging it pulls from).

Median ms of 20 after 5 warm-up, iterations back to back (CUDA events on the calls' stream),
the slowest rank's. Rank 0 prints a Markdown table; bench/NOTES.md says what it found. Without a
GPU it runs the same calls on the host backend (a check that it runs; its times mean nothing).
"""

import argparse

from mxcomm import a2a
from mxcomm.bench._report import device_name
from mxcomm.bench._runtime import Runtime
from mxcomm.permutation import permute, unpermute

EXPERTS_PER_RANK = 8
ALIGN = 32


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=int, nargs="?", default=131072)
    parser.add_argument("--dims", nargs="+", default=["7168:2048", "8192:5120"],
                        help="D:H pairs (token width : gradient width)")
    args = parser.parse_args()
    rt = Runtime()
    comm, w = rt.comm, rt.size
    layout = rt.uniform_layout(args.rows, EXPERTS_PER_RANK)
    timed = rt.back_to_back_ms

    lines = [f"probe_fused: {w} ranks, {args.rows} rows per rank, {EXPERTS_PER_RANK} experts per "
             f"rank, align {ALIGN}, fp8_rowwise, transport {comm.transport}, device "
             f"{device_name()}", "",
             "| exchange | width | alone | + permute | in one call |",
             "| --- | --- | --- | --- | --- |"]
    for pair in args.dims:
        d, h = (int(v) for v in pair.split(":"))
        for name, fn, width in (("dispatch", a2a.a2a_dispatch, d),
                                ("combine backward", a2a.a2a_combine_backward, h)):
            x = rt.random_bf16((args.rows, width), seed=rt.rank)
            alone = timed(lambda: fn(x, layout, precision="fp8_rowwise"))
            separate = timed(lambda: permute(fn(x, layout, precision="fp8_rowwise"), layout,
                                             align=ALIGN))
            fused = timed(lambda: fn(x, layout, precision="fp8_rowwise", permute_align=ALIGN))
            lines.append(f"| {name} | {width} | {alone:.3f} | {separate:.3f} | {fused:.3f} |")
        # the forward combine in bf16: unpermute then the exchange (NCCL), or in one call (each
        # peer's rows gathered into the staging it pulls from)
        y = rt.random_bf16((layout.permuted_rows(ALIGN), h), seed=rt.rank)
        indices = permute(a2a.a2a_dispatch(rt.random_bf16((args.rows, d), seed=rt.rank), layout,
                                           precision="fp8_rowwise"), layout, align=ALIGN)[1]
        u = unpermute(y, indices, layout)
        alone = timed(lambda: a2a.a2a_combine(u, layout))
        separate = timed(lambda: a2a.a2a_combine(unpermute(y, indices, layout), layout))
        fused = timed(lambda: a2a.a2a_combine(y, layout, permute_align=ALIGN))
        lines.append(f"| combine (bf16) | {h} | {alone:.3f} | {separate:.3f} | {fused:.3f} |")
    rt.print("\n".join(lines))
    rt.close()


if __name__ == "__main__":
    main()
