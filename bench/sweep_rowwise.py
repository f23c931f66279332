"""Sweeps of the fp8 rowwise quantize kernel and of the MXFP8 -> rowwise permute (GPU only): per
share of the resident grid at one width (how much memory in flight each needs), then per width at
the full grid. Run from this tree on another one (``PYTHONPATH=TREE``) to compare kernels. ``python bench/sweep_rowwise.py [--rows 131072]
[--dim 7168] [--shares ...] [--dims 2048 4096 5120 7168 8192]`` prints the median ms (CUDA events, 20 after 5
warm-up, back to back) and GB/s (read + written, once each) against a device copy of the same
bytes. bench/NOTES.md says what it found.
"""

import argparse

import cupy
import numpy

from mxcomm._array import bfloat16
from mxcomm.bench import _timing
from mxcomm.rowwise import FP8_ROWWISE, launch_mx_to_rowwise_permute, launch_quantize_fp8_rowwise
from mxcomm.mxfp8 import quantize_mxfp8

SHARES = [0.25, 0.5, 0.75, 1.0]


def median_ms(fn, iters=20, warmup=5):
    """Median ms of ``fn`` (CUDA events on CuPy's current stream, ``mxcomm.bench``'s timing)."""
    return _timing.measure(fn, _timing.Clock("cupy"), iters=iters, warmup=warmup).median


def rows(m, d):
    """(m, d) bf16 rows of standard normal values, on the GPU."""
    x = cupy.random.default_rng(0).standard_normal((m, d), dtype=numpy.float32)
    return (x.view(numpy.uint32) >> 16).astype(numpy.uint16).view(bfloat16)


def copy_gbps(nbytes):
    """GB/s of a device-to-device copy moving ``nbytes`` (read + written)."""
    src = cupy.empty(nbytes // 2, numpy.uint8)
    dst = cupy.empty_like(src)
    return nbytes / median_ms(lambda: dst.__setitem__(Ellipsis, src)) / 1e6


def measure(m, d, shares):
    """Rows of (share, quantize ms, ratio, permute ms, ratio) at (m, d), random permute order."""
    x = rows(m, d)
    data = cupy.empty((m, d), numpy.uint8)
    scales = cupy.empty(m, numpy.float32)
    stream = cupy.cuda.get_current_stream().ptr
    mx = quantize_mxfp8(x)
    indices = cupy.asarray(numpy.random.default_rng(1).permutation(m).astype(numpy.int32))
    q_bytes = m * d * 2 + m * d + m * 4
    p_bytes = m * d + m * d // 32 + m * d + m * 4 + m * 4  # MXFP8 rows, rowwise rows, indices
    q_copy, p_copy = copy_gbps(q_bytes), copy_gbps(p_bytes)
    out = []
    for share in shares:
        q_ms = median_ms(lambda: launch_quantize_fp8_rowwise(x, FP8_ROWWISE.view(data, scales),
                                                             stream, share))
        p_ms = median_ms(lambda: launch_mx_to_rowwise_permute(mx, indices, data, scales, stream,
                                                              share))
        out.append((share, q_ms, q_bytes / q_ms / 1e6 / q_copy, p_ms,
                    p_bytes / p_ms / 1e6 / p_copy))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--dim", type=int, default=7168)
    parser.add_argument("--dims", type=int, nargs="*", default=[2048, 4096, 5120, 7168, 8192])
    parser.add_argument("--shares", type=float, nargs="*", default=SHARES)
    parser.add_argument("--stash-kib", type=int, nargs="*", default=[],
                        help="also time the quantize with each of these shared-memory stashes per "
                             "CUDA block (fp8_rowwise.STASH_BLOCK_BYTES, KiB)")
    args = parser.parse_args()
    m = args.rows
    header = ("| {} | quantize ms | ratio to copy | MXFP8 -> rowwise permute ms | ratio to copy |\n"
              "| --- | --- | --- | --- | --- |")
    print(f"{m} x {args.dim} bf16 rows, per share of the resident grid")
    print(header.format("share"))
    for share, q_ms, q, p_ms, p in measure(m, args.dim, args.shares):
        print(f"| {share:g} | {q_ms:.3f} | {q:.2f} | {p_ms:.3f} | {p:.2f} |")
    print(f"{m} rows per width, the full grid")
    print(header.format("D"))
    for d in args.dims:
        (_, q_ms, q, p_ms, p), = measure(m, d, [1.0])
        print(f"| {d} | {q_ms:.3f} | {q:.2f} | {p_ms:.3f} | {p:.2f} |")
    if args.stash_kib:
        from mxcomm.kernels import clear_prepared, fp8_rowwise
        built_in = fp8_rowwise.STASH_BLOCK_BYTES
        print(f"quantize per stash per CUDA block, the full grid (built in: {built_in // 1024} KiB)")
        print("| stash KiB | D | quantize ms | ratio to copy |\n| --- | --- | --- | --- |")
        for kib in args.stash_kib:
            fp8_rowwise.STASH_BLOCK_BYTES = kib * 1024
            clear_prepared()
            for d in args.dims:
                (_, q_ms, q, _, _), = measure(m, d, [1.0])
                print(f"| {kib} | {d} | {q_ms:.3f} | {q:.2f} |")
        fp8_rowwise.STASH_BLOCK_BYTES = built_in
        clear_prepared()


if __name__ == "__main__":
    main()
