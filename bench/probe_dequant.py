"""Where the quantized exchange that returns dequantized rows spends its time, at W ranks on GPUs.

    mpirun -n W python bench/probe_dequant.py [rows] [--dims D ...] [--formats F ...]

The dispatch gradient (``a2a_dispatch_backward``: combine direction, bf16 in, bf16 out) with a
quantized wire format is the exchange whose rows are dequantized on arrival. Per width D and
format (``rows`` x D bf16 rows per rank, 8 experts per rank, uniform routing), each timed alone:

- ``quantize`` and ``dequantize``: the format's kernels on every row, on the whole GPU;
- ``bf16``: the same exchange in bf16 (NCCL);
- ``wire``: the exchange returning the rows still quantized (quantize, pull by copy engines);
- ``wire + dequantize``: that, then the dequantize of every received row;
- ``in place 1/4`` (and 1/8, 1/2): the library's call: each sender's rows dequantized where
  they are (over NVLink) by that share of the SMs beside the quantize (``mxcomm.route.beside_share``).

Median ms of 20 after 5 warm-up, iterations back to back (CUDA events on the calls' stream),
the slowest rank's. Rank 0 prints a Markdown table; bench/NOTES.md says what it found. Without a
GPU it runs the same calls on the host backend (a check that it runs; its times mean nothing).
"""

import argparse

from mxcomm import a2a, route
from mxcomm.bench._report import device_name
from mxcomm.bench._runtime import Runtime
from mxcomm.formats import get_format

EXPERTS_PER_RANK = 8
SHARES = (0.125, 0.25, 0.5)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=int, nargs="?", default=131072)
    parser.add_argument("--dims", type=int, nargs="+", default=[7168, 8192])
    parser.add_argument("--formats", nargs="+", default=["mxfp8", "fp8_rowwise"])
    args = parser.parse_args()
    rt = Runtime()
    comm, w = rt.comm, rt.size
    layout = rt.uniform_layout(args.rows, EXPERTS_PER_RANK)
    timed = rt.back_to_back_ms

    def wire(g, fmt):  # the combine direction, the rows left quantized
        return a2a._exchange(g, None, None, None, fmt, layout, function="a2a_dispatch_backward",
                             name="grad", direction="combine", dequantize=False,
                             scale_mode="rceil", stream=None, validate=None, alloc=None)

    shares = " | ".join(f"in place {s:g}" for s in SHARES)
    lines = [f"probe_dequant: {w} ranks, {args.rows} rows per rank, {EXPERTS_PER_RANK} experts "
             f"per rank, transport {comm.transport}, device {device_name()}", "",
             f"| format | D | quantize | dequantize | bf16 | wire | wire + dequantize | {shares} |",
             "| --- | --- | --- | --- | --- | --- | --- |" + " --- |" * len(SHARES)]
    for d in args.dims:
        g = rt.random_bf16((layout.num_received, d), seed=rt.rank)
        bf16 = timed(lambda: a2a.a2a_dispatch_backward(g, layout, precision="bf16"))
        for name in args.formats:
            fmt = get_format(name)
            q = fmt.quantize(g)
            cells = [timed(lambda: fmt.quantize(g)), timed(lambda: q.dequantize()), bf16,
                     timed(lambda: wire(g, fmt)), timed(lambda: wire(g, fmt).dequantize())]
            for share in SHARES:  # at any world size (both of route's shares set)
                old = route.BESIDE_SHARE, route.BESIDE_SHARE_MANY
                route.BESIDE_SHARE = route.BESIDE_SHARE_MANY = share
                try:
                    cells.append(timed(lambda: a2a.a2a_dispatch_backward(g, layout,
                                                                         precision=name)))
                finally:
                    route.BESIDE_SHARE, route.BESIDE_SHARE_MANY = old
            lines.append(f"| {name} | {d} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    rt.print("\n".join(lines))
    rt.close()


if __name__ == "__main__":
    main()
