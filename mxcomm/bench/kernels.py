"""``python -m mxcomm.bench kernels``: MXFP8 quantize/dequantize and permute/unpermute bandwidth.

Single process. Each row: op, shape, median ms, bytes moved (read + written, the fewest the op
must touch), GB/s, and a device-to-device copy of the same number of bytes timed in the same run;
``ratio`` = our GB/s / copy GB/s, against a target (quantize/dequantize >= 0.85, permute/unpermute
>= 0.80).
"""

import numpy

from . import _report, _timing, _workload

#: GPU shapes (rows, D) of quantize/dequantize and of permute/unpermute.
QUANT_SHAPES = [(16384, 7168), (131072, 7168)]
PERMUTE_SHAPES = [(131072, 7168)]
NUM_LOCAL_EXPERTS = 8
#: Simulator shapes: every CUDA thread is a Python thread there.
SIM_QUANT_SHAPES = [(64, 64)]
SIM_PERMUTE_SHAPES = [(64, 64)]
SIM_NUM_LOCAL_EXPERTS = 2
#: Input buffers smaller than this are rotated (two sets) so repeated runs do not hit L2.
ROTATE_BELOW_BYTES = 1 << 30
TARGETS = {"quantize": 0.85, "dequantize": 0.85, "permute": 0.80, "unpermute": 0.80}
ALIGN = 32
COLUMNS = ["op", "dtype", "shape", "ms", "p90_ms", "GB", "GB/s", "copy_GB/s", "ratio", "target", "ok"]


def add_arguments(parser):
    """The ``kernels`` subcommand's options."""
    parser.add_argument("--rows", type=int, nargs="+", help="rows M of quantize/dequantize "
                        "(default 16384 131072; permute uses the largest)")
    parser.add_argument("--dim", type=int, help="columns D (default 7168)")
    parser.add_argument("--ops", nargs="+", default=["quantize", "dequantize", "permute", "unpermute"],
                        choices=["quantize", "dequantize", "permute", "unpermute"])


class _Copy:
    """Device-to-device copies of ``n`` bytes, timed once per byte count and remembered."""

    def __init__(self, rt, clock, iters, warmup):
        self.rt, self.clock, self.iters, self.warmup = rt, clock, iters, warmup
        self._gbps = {}

    def gbps(self, nbytes):
        n = max(1, int(nbytes) // 2)  # a copy of n bytes reads n and writes n
        if n not in self._gbps:
            src = self.rt.random_bytes((n,), seed=7)
            dst = self.rt.xp.empty_like(src)
            if self.rt.simulated:
                def copy():
                    numpy.copyto(dst, src)
            else:
                import cupy
                def copy():
                    cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n,
                                                  cupy.cuda.runtime.memcpyDeviceToDevice,
                                                  cupy.cuda.get_current_stream().ptr)
            stats = _timing.measure(copy, self.clock, iters=self.iters, warmup=self.warmup)
            self._gbps[n] = _workload.gbps(2 * n, stats.median)
            del src, dst
        return self._gbps[n]


def _row(op, dtype, shape, stats, nbytes, copy_gbps, simulated=False):
    ours = _workload.gbps(nbytes, stats.median)
    ratio = ours / copy_gbps
    return {"op": op, "dtype": dtype, "shape": "x".join(map(str, shape)), **stats.as_dict(),
            "bytes": int(nbytes), "GB": nbytes / _workload.GB, "GB/s": ours, "copy_GB/s": copy_gbps,
            "ratio": ratio, "target": TARGETS[op],
            "ok": "n/a (sim)" if simulated else ("yes" if ratio >= TARGETS[op] else "no")}


def measure(args, rt):
    """Run the kernel benchmarks; returns ``(meta, {"kernels": rows})``."""
    from mxcomm.mxfp8 import dequantize_mxfp8, quantize_mxfp8
    from mxcomm.permutation import permute, unpermute

    sim = rt.simulated
    dim = args.dim or (SIM_QUANT_SHAPES[0][1] if sim else 7168)
    quant_rows = args.rows or [m for m, _ in (SIM_QUANT_SHAPES if sim else QUANT_SHAPES)]
    perm_rows = [max(args.rows)] if args.rows else [m for m, _ in (SIM_PERMUTE_SHAPES if sim
                                                                     else PERMUTE_SHAPES)]
    e_local = SIM_NUM_LOCAL_EXPERTS if sim else NUM_LOCAL_EXPERTS
    clock = _timing.Clock(rt.clock_kind)
    copy = _Copy(rt, clock, args.iters, args.warmup)
    timed = dict(clock=clock, iters=args.iters, warmup=args.warmup)
    rows = []

    for m in quant_rows if {"quantize", "dequantize"} & set(args.ops) else []:
        shape = (m, dim)
        nbuf = 2 if m * dim * 2 < ROTATE_BELOW_BYTES else 1
        xs = [rt.random_bf16(shape, seed=s) for s in range(nbuf)]
        mx_bytes = m * dim + m * dim // 32
        for mode in ("rceil", "floor"):
            if "quantize" not in args.ops:
                break
            rt.log(f"quantize {mode} {shape}")
            out = quantize_mxfp8(xs[0], mode)
            stats = _timing.measure(lambda x: quantize_mxfp8(x, mode, out=out), inputs=xs, **timed)
            nbytes = m * dim * 2 + mx_bytes
            rows.append(_row("quantize", f"bf16->mxfp8 {mode}", shape, stats, nbytes, copy.gbps(nbytes), sim))
        if "dequantize" in args.ops:
            rt.log(f"dequantize {shape}")
            mxs = [quantize_mxfp8(x) for x in xs]
            out = dequantize_mxfp8(mxs[0])
            stats = _timing.measure(lambda mx: dequantize_mxfp8(mx, out=out), inputs=mxs, **timed)
            nbytes = mx_bytes + m * dim * 2
            rows.append(_row("dequantize", "mxfp8->bf16", shape, stats, nbytes, copy.gbps(nbytes), sim))
        del xs

    for m in perm_rows if {"permute", "unpermute"} & set(args.ops) else []:
        shape = (m, dim)
        rng = numpy.random.default_rng(11)
        counts_host = numpy.array(_workload.integer_split(m, rng.uniform(0.5, 1.5, e_local)),
                                  dtype=numpy.int32)
        counts = rt.xp.asarray(counts_host)
        p = _workload.padded_rows(m, e_local, ALIGN)
        x = rt.random_bf16(shape, seed=3)
        for dtype, value, row_bytes in (("bf16", x, 2 * dim),
                                        ("mxfp8", quantize_mxfp8(x), dim + dim // 32)):
            index_bytes = p * 4 + e_local * 4
            if "permute" in args.ops:
                rt.log(f"permute {dtype} {shape}")
                stats = _timing.measure(lambda: permute(value, counts, e_local, ALIGN), **timed)
                nbytes = m * row_bytes + e_local * 4 + p * row_bytes + index_bytes
                rows.append(_row("permute", dtype, shape, stats, nbytes, copy.gbps(nbytes), sim))
            if "unpermute" in args.ops:
                rt.log(f"unpermute {dtype} {shape}")
                permuted, indices, _ = permute(value, counts, e_local, ALIGN)
                stats = _timing.measure(lambda: unpermute(permuted, indices, m), **timed)
                nbytes = m * row_bytes + p * 4 + m * row_bytes
                rows.append(_row("unpermute", dtype, shape, stats, nbytes, copy.gbps(nbytes), sim))
                del permuted, indices
        del x

    notes = ["bytes = bytes read + bytes written (GB = 1e9); copy = device-to-device memcpy of "
             "the same bytes, same run; ratio = GB/s / copy GB/s",
             f"permute/unpermute: {e_local} local experts, random counts summing to the rows, "
             f"align {ALIGN}; MXFP8 rows move data and scales"]
    if sim:
        notes.append("CPU simulator: host clock, tiny shapes; the numbers say nothing about a GPU")
    meta = _report.metadata("kernels", 1, {"quantize": [list(s) for s in
                                                       [(m, dim) for m in quant_rows]],
                                           "permute": [[m, dim] for m in perm_rows],
                                           "num_local_experts": e_local},
                            notes, iters=args.iters, warmup=args.warmup)
    return meta, {"kernels": rows}


def render(meta, tables):
    """Text report of :func:`measure`'s result."""
    table = _report.format_table(tables["kernels"], COLUMNS, fmt="grid")
    return _report.render_text("MXFP8 kernel bandwidth", meta, [("kernels", table)])


def markdown_sections(tables):
    """``(caption, rows, columns)`` for ``--markdown``."""
    return [("kernels", tables["kernels"], COLUMNS)]
