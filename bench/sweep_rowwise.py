"""Grid share sweeps of the fp8 rowwise quantize kernel and of the MXFP8 -> rowwise permute (GPU
only): is the quantize's second read of each row (encode after amax) served by L1/L2, or does the
grid hold so many rows in flight that it goes back to HBM? Does the gather (one read) care? ``python bench/sweep_rowwise.py [--rows 131072] [--dim 7168]`` prints, per share of the
resident grid, the median ms (CUDA events, 20 after 5 warm-up, back to back) and GB/s (bf16 read +
e4m3 and scales written, once each) against a device copy of the same bytes. bench/NOTES.md says
what it found.
"""

import argparse
import statistics

import cupy
import numpy

from mxcomm._array import bfloat16
from mxcomm.fp8_formats import launch_mx_to_rowwise_permute, launch_quantize_fp8_rowwise
from mxcomm.mxfp8 import quantize_mxfp8
from mxcomm.kernels import fp8_rowwise

SHARES = [0.25, 0.375, 0.4375, 0.5, 0.5625, 0.625, 0.75, 1.0]


def median_ms(fn, iters=20, warmup=5):
    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--dim", type=int, default=7168)
    args = parser.parse_args()
    m, d = args.rows, args.dim
    x = cupy.random.default_rng(0).standard_normal((m, d), dtype=numpy.float32).astype(
        numpy.float32)
    x = (x.view(numpy.uint32) >> 16).astype(numpy.uint16).view(bfloat16)
    data = cupy.empty((m, d), numpy.uint8)
    scales = cupy.empty(m, numpy.float32)
    nbytes = m * d * 2 + m * d + m * 4
    src = cupy.empty(nbytes // 2, numpy.uint8)
    dst = cupy.empty_like(src)
    copy_ms = median_ms(lambda: dst.__setitem__(Ellipsis, src))
    copy_gbps = nbytes / copy_ms / 1e6
    stream = cupy.cuda.get_current_stream().ptr
    print(f"fp8 rowwise quantize {m}x{d} bf16; copy of {nbytes / 1e9:.3f} GB: {copy_ms:.3f} ms "
          f"({copy_gbps:.0f} GB/s)")
    built_in = fp8_rowwise.QUANTIZE_GRID_SHARE
    fp8_rowwise.QUANTIZE_GRID_SHARE = 1.0  # the sweep sets the whole share
    print(f"(the launcher's built-in share: {built_in:g})")
    print("| share | ms | GB/s | ratio to copy |\n| --- | --- | --- | --- |")
    for share in SHARES:
        ms = median_ms(lambda: launch_quantize_fp8_rowwise(x, data, scales, stream, share))
        gbps = nbytes / ms / 1e6
        print(f"| {share:g} | {ms:.3f} | {gbps:.0f} | {gbps / copy_gbps:.2f} |")
    fp8_rowwise.QUANTIZE_GRID_SHARE = built_in
    mx = quantize_mxfp8(x)
    indices = cupy.asarray(numpy.random.default_rng(1).permutation(m).astype(numpy.int32))
    nbytes = m * d + m * d // 32 + m * d + m * 4 + m * 4  # MXFP8 rows, rowwise rows, indices
    print(f"MXFP8 -> rowwise permute {m}x{d} (random order)")
    print("| share | ms | GB/s | ratio to copy |\n| --- | --- | --- | --- |")
    for share in SHARES:
        ms = median_ms(lambda: launch_mx_to_rowwise_permute(mx, indices, data, scales, stream,
                                                            share))
        gbps = nbytes / ms / 1e6
        print(f"| {share:g} | {ms:.3f} | {gbps:.0f} | {gbps / copy_gbps:.2f} |")


if __name__ == "__main__":
    main()
