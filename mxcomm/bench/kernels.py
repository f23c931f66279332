"""``python -m mxcomm.bench kernels``: quantize/dequantize and permute/unpermute bandwidth, per format.

Single process. Every quantized format of ``mxcomm.formats`` (``--formats``): quantize from bf16
(each scale mode), dequantize to bf16, permute and unpermute of its rows (data and scales), the
MXFP8 -> fp8 rowwise and MXFP8 -> bf16 permutes (``permute(..., out_format=...)``), and the fp8
wgrad's operand conversion of permuted fp8 rowwise rows (``fp8_rowwise_to_group_colwise``). Each
row: op, format,
shape, median ms, bytes moved (read + written, the fewest the op must touch) and GB/s (1e9 bytes). On a GPU also a device-to-device copy of the same number of bytes
timed in the same run; ratio = our GB/s / copy GB/s, against a target (quantize/dequantize >= 0.85,
permute/unpermute >= 0.80). On a CPU the host backend (vectorized NumPy) is timed with the host
clock: no copy, no ratio, nothing said about a GPU; under Numba's simulator only ms.
"""

import numpy

from . import _report, _timing, _workload

#: GPU shapes (rows, D) of quantize/dequantize and of permute/unpermute.
QUANT_SHAPES = [(16384, 7168), (131072, 7168)]
PERMUTE_SHAPES = [(131072, 7168)]
NUM_LOCAL_EXPERTS = 8
#: CPU host backend shapes, and the simulator's (every CUDA thread is a Python call there).
HOST_QUANT_SHAPES = [(4096, 1024)]
HOST_PERMUTE_SHAPES = [(4096, 1024)]
HOST_NUM_LOCAL_EXPERTS = 4
SIM_QUANT_SHAPES = [(64, 64)]
SIM_PERMUTE_SHAPES = [(64, 64)]
SIM_NUM_LOCAL_EXPERTS = 2
#: Input buffers smaller than this are rotated (two sets) so repeated runs do not hit L2.
ROTATE_BELOW_BYTES = 1 << 30
TARGETS = {"quantize": 0.85, "dequantize": 0.85, "permute": 0.80, "unpermute": 0.80,
           "colwise": 0.80}
ALIGN = 32
#: Columns shown, of those a row has (a CPU row has no copy columns, a simulator row no bandwidth).
COLUMNS = ["op", "format", "shape", "ms", "p90_ms", "GB", "GB/s", "copy_GB/s", "ratio", "target", "ok"]
OPS = ["quantize", "dequantize", "permute", "unpermute", "colwise"]
#: Formats timed by default: every quantized one.
FORMATS = ["mxfp8", "fp8_rowwise", "fp8_block128", "fp8_block128_pow2"]


def add_arguments(parser):
    """The ``kernels`` subcommand's options."""
    parser.add_argument("--rows", type=int, nargs="+", metavar="M",
                        help="rows of quantize/dequantize; permute uses the largest (default "
                             f"{' '.join(str(m) for m, _ in QUANT_SHAPES)} on a GPU, "
                             f"{HOST_QUANT_SHAPES[0][0]} on a CPU, {SIM_QUANT_SHAPES[0][0]} in the "
                             f"simulator)")
    parser.add_argument("--dim", type=int, metavar="D",
                        help=f"elements per row, a multiple of 32 (default {QUANT_SHAPES[0][1]} on "
                             f"a GPU, {HOST_QUANT_SHAPES[0][1]} on a CPU, {SIM_QUANT_SHAPES[0][1]} "
                             f"in the simulator)")
    parser.add_argument("--ops", nargs="+", default=OPS, choices=OPS,
                        help=f"what to time (default all: {' '.join(OPS)})")
    parser.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS,
                        help=f"quantized formats to time (default all: {' '.join(FORMATS)}); "
                             f"bf16 permute/unpermute always")


def validate(args):
    """Check the shape options up front.

    Raises:
        ValueError: --rows not positive, or --dim not a positive multiple of 32.
    """
    for m in args.rows or ():
        if m < 1:
            raise ValueError(f"--rows: expected positive values, got {m}")
    if args.dim is not None and (args.dim < 1 or args.dim % 32):
        raise ValueError(f"--dim: expected a positive multiple of 32 (MXFP8 blocks of 32 "
                         f"elements; the fp8_block128 formats are skipped unless it is a "
                         f"multiple of 128), got {args.dim}")


def describe(args, rt):
    """The first line printed: what this run is, and what it is not."""
    if rt.gpu:
        return ("mxcomm kernels on a GPU: time and bandwidth of quantize/dequantize/permute/"
                "unpermute against a device copy of the same bytes.")
    if rt.backend == "host":
        return ("mxcomm kernels on a CPU, host backend (vectorized NumPy): host-clock time and "
                "bandwidth of this CPU's implementation. Nothing here says anything about a GPU.")
    return ("mxcomm kernels on a CPU, CUDA kernels in Numba's simulator (tiny shapes): host-clock "
            "time of the simulation only, no bandwidth. Nothing here says anything about a GPU.")


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
            if not self.rt.gpu:
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


def _row(op, fmt, shape, stats, nbytes, copy, bandwidth=True):
    """One table row; ``copy`` is the copy timer on a GPU, None on a CPU (no ratio); no
    bandwidth at all without ``bandwidth`` (the simulator)."""
    row = {"op": op, "format": fmt, "shape": "x".join(map(str, shape)), **stats.as_dict()}
    if not bandwidth:
        return row
    ours = _workload.gbps(nbytes, stats.median)
    row.update({"bytes": int(nbytes), "GB": nbytes / _workload.GB, "GB/s": ours})
    if copy is not None:
        copy_gbps = copy.gbps(nbytes)
        ratio = ours / copy_gbps
        row.update({"copy_GB/s": copy_gbps, "ratio": ratio, "target": TARGETS[op],
                    "ok": "yes" if ratio >= TARGETS[op] else "no"})
    return row


def measure(args, rt):
    """Run the kernel benchmarks; returns ``(meta, {"kernels": rows})``."""
    from mxcomm.formats import get_format
    from mxcomm.permutation import permute, unpermute

    quant_shapes, perm_shapes, e_local = {
        "cuda": (QUANT_SHAPES, PERMUTE_SHAPES, NUM_LOCAL_EXPERTS),
        "host": (HOST_QUANT_SHAPES, HOST_PERMUTE_SHAPES, HOST_NUM_LOCAL_EXPERTS),
    }.get(rt.backend, (SIM_QUANT_SHAPES, SIM_PERMUTE_SHAPES, SIM_NUM_LOCAL_EXPERTS))
    dim = args.dim or quant_shapes[0][1]
    quant_rows = args.rows or [m for m, _ in quant_shapes]
    perm_rows = [max(args.rows)] if args.rows else [m for m, _ in perm_shapes]
    clock = _timing.Clock(rt.clock_kind)
    copy = _Copy(rt, clock, args.iters, args.warmup) if rt.gpu else None
    bw = rt.backend != "simulator"
    timed = dict(clock=clock, iters=args.iters, warmup=args.warmup)
    rows = []

    formats = [get_format(name) for name in getattr(args, "formats", FORMATS)]
    skipped = [f.name for f in formats if dim % f.d_multiple]
    formats = [f for f in formats if not dim % f.d_multiple]
    for m in quant_rows if {"quantize", "dequantize"} & set(args.ops) else []:
        shape = (m, dim)
        nbuf = 2 if m * dim * 2 < ROTATE_BELOW_BYTES else 1
        xs = [rt.random_bf16(shape, seed=s) for s in range(nbuf)]
        for fmt in formats:
            q_bytes = m * fmt.bytes_per_row(dim)
            out = fmt.quantize(xs[0])
            for mode in (fmt.scale_modes or (None,)) if "quantize" in args.ops else ():
                label = f"bf16->{fmt.name}" + (f" {mode}" if mode else "")
                rt.log(f"quantize {label} {shape}")
                stats = _timing.measure(lambda x: fmt.quantize(x, scale_mode=mode, out=out),
                                        inputs=xs, **timed)
                rows.append(_row("quantize", label, shape, stats, m * dim * 2 + q_bytes, copy,
                                 bw))
            if "dequantize" in args.ops:
                rt.log(f"dequantize {fmt.name} {shape}")
                qs = [fmt.quantize(x) for x in xs]
                dq = qs[0].dequantize()
                stats = _timing.measure(lambda q: q.dequantize(out=dq), inputs=qs, **timed)
                rows.append(_row("dequantize", f"{fmt.name}->bf16", shape, stats,
                                 q_bytes + m * dim * 2, copy, bw))
                del qs, dq
        del xs

    for m in perm_rows if {"permute", "unpermute", "colwise"} & set(args.ops) else []:
        shape = (m, dim)
        rng = numpy.random.default_rng(11)
        counts_host = numpy.array(_workload.integer_split(m, rng.uniform(0.5, 1.5, e_local)),
                                  dtype=numpy.int32)
        counts = rt.xp.asarray(counts_host)
        p = _workload.padded_rows(m, e_local, ALIGN)
        x = rt.random_bf16(shape, seed=3)
        index_bytes = p * 4 + e_local * 4
        cases = [("bf16", x, None, get_format("bf16").bytes_per_row(dim), None)]
        cases += [(fmt.name, fmt.quantize(x), None, fmt.bytes_per_row(dim), None)
                  for fmt in formats]
        if "mxfp8" in [f.name for f in formats]:
            # reads MXFP8 rows, writes bf16 rows (the permute's dequantize for a bf16 GEMM)
            cases.append(("mxfp8->bf16", cases[[c[0] for c in cases].index("mxfp8")][1], "bf16",
                          get_format("mxfp8").bytes_per_row(dim),
                          get_format("bf16").bytes_per_row(dim)))
        if "mxfp8" in [f.name for f in formats] and "fp8_rowwise" in [f.name for f in formats]:
            # reads MXFP8 rows, writes fp8 rowwise rows: the bytes of each side
            cases.append(("mxfp8->fp8_rowwise", cases[[c[0] for c in cases].index("mxfp8")][1],
                          "fp8_rowwise", get_format("mxfp8").bytes_per_row(dim),
                          get_format("fp8_rowwise").bytes_per_row(dim)))
        for label, value, out_format, row_bytes, out_row_bytes in cases:
            out_row_bytes = out_row_bytes or row_bytes
            if "permute" in args.ops:
                rt.log(f"permute {label} {shape}")
                stats = _timing.measure(lambda: permute(value, counts, e_local, ALIGN,
                                                        out_format=out_format), **timed)
                nbytes = m * row_bytes + e_local * 4 + p * out_row_bytes + index_bytes
                rows.append(_row("permute", label, shape, stats, nbytes, copy, bw))
            if "unpermute" in args.ops and out_format is None:
                rt.log(f"unpermute {label} {shape}")
                permuted, indices, _ = permute(value, counts, e_local, ALIGN)
                stats = _timing.measure(lambda: unpermute(permuted, indices, m), **timed)
                # given an int num_rows the result is zero-filled first (+ m rows written)
                nbytes = m * row_bytes + p * 4 + 2 * m * row_bytes
                rows.append(_row("unpermute", label, shape, stats, nbytes, copy, bw))
                del permuted, indices
            if "colwise" in args.ops and label == "fp8_rowwise":
                from mxcomm.colwise import fp8_rowwise_to_group_colwise, group_colwise_positions
                rt.log(f"colwise {label} {shape}")
                permuted, _, offsets = permute(value, counts, e_local, ALIGN)
                stats = _timing.measure(lambda: fp8_rowwise_to_group_colwise(
                    permuted.data, permuted.scales, offsets), **timed)
                # the fewest bytes: the rows and scales read once, the transposed rows, the
                # (group, column) scales and the group ends written once (the kernels read twice)
                t = group_colwise_positions(p, e_local)
                nbytes = p * (dim + 4) + dim * t + e_local * dim * 4 + e_local * 8
                rows.append(_row("colwise", "fp8_rowwise->group colwise", (p, dim), stats,
                                 nbytes, copy, bw))
                del permuted, offsets
        del x, cases

    notes = [f"bytes = bytes read + bytes written (GB = 1e9); median of {args.iters} after "
             f"{args.warmup} warm-up",
             f"permute/unpermute: {e_local} local experts, random counts summing to the rows, "
             f"align {ALIGN}; quantized rows move data and scales; mxfp8->fp8_rowwise permute "
             f"reads MXFP8 rows and writes fp8 rowwise rows (rescaled in the same pass); "
             f"mxfp8->bf16 writes them dequantized (bf16)",
             "unpermute given an int num_rows zero-fills its result first (rows no index names "
             "read 0): its bytes count that fill; given the layout (the EP path) it skips it",
             "colwise: permuted fp8 rowwise rows (P, D) to the fp8 wgrad's operand, (D, T) "
             "scaled per (group, column), T = P rounded to 16 + 16 per group; bytes count one "
             "read of the rows (its kernels read them twice: amax, then encode)"]
    if skipped:
        notes.append(f"skipped (D = {dim} is not a multiple of their block): {', '.join(skipped)}")
    if rt.gpu:
        notes.append("CUDA events; copy = device-to-device memcpy of the same bytes, same run; "
                     "ratio = GB/s / copy GB/s")
    else:
        notes.append(f"host clock, {rt.backend} backend on {_report.cpu_name()}: says nothing "
                     f"about a GPU")
    meta = _report.metadata("kernels", 1, {"quantize": [list(s) for s in
                                                       [(m, dim) for m in quant_rows]],
                                           "permute": [[m, dim] for m in perm_rows],
                                           "num_local_experts": e_local},
                            notes, run=describe(args, rt), iters=args.iters, warmup=args.warmup)
    return meta, {"kernels": rows}


def render(meta, tables):
    """Text report of :func:`measure`'s result."""
    (caption, rows, columns), = markdown_sections(tables)
    return _report.render_text("mxcomm kernels benchmark", meta,
                               [(caption, _report.format_table(rows, columns))])


def markdown_sections(tables):
    """``(caption, rows, columns)`` for ``--markdown``: the columns the rows have."""
    rows = tables["kernels"]
    return [("kernels", rows, [c for c in COLUMNS if not rows or c in rows[0]])]
