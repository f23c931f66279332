"""Time the MXFP8 -> bf16 gather alone beside its neighbours (GPU only), at 131072 x 7168: the gather
with random and with in-order source rows, the flat MXFP8 dequantize of the same rows, and the
plain MXFP8 row gather (data + scales) by the same random index. Median ms of 20 after 5 warm-up
(CUDA events, back to back), GB/s of the bytes read + written. ``python bench/probe_gather.py``;
``--once``: each kernel once, untimed (for a profiler: ``bench/gpu_run.sh ncugather1``).
bench/NOTES.md says what it found.
"""

import sys

import cupy
import numpy

from mxcomm import _row_moves, mxfp8
from mxcomm._array import bfloat16
from mxcomm.bench._timing import Clock, measure_back_to_back
from mxcomm.kernels.permute import gather_rows_kernel


def median_ms(fn):
    """Median ms of ``fn`` (CUDA events on CuPy's current stream, ``mxcomm.bench``'s timing)."""
    return measure_back_to_back(fn, Clock("cupy"), iters=20, warmup=5).median


def main(rows=131072, d=7168, once=False):
    rng = numpy.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((rows, d), dtype=numpy.float32))
    mx = mxfp8.quantize_mxfp8(x)
    del x
    stream = cupy.cuda.get_current_stream().ptr
    shuffled = cupy.asarray(rng.permutation(rows).astype(numpy.int32))
    in_order = cupy.arange(rows, dtype=numpy.int32)
    out = cupy.empty((rows, d), bfloat16)
    data_out = cupy.empty_like(mx.data)
    scales_out = cupy.empty_like(mx.scales)
    cases = [
        ("gather + dequantize, random rows", 3 * d + d // 32,
         lambda: mxfp8.launch_gather_dequantize(mx, shuffled, out, stream)),
        ("gather + dequantize, rows in order", 3 * d + d // 32,
         lambda: mxfp8.launch_gather_dequantize(mx, in_order, out, stream)),
        ("dequantize (flat)", 3 * d + d // 32,
         lambda: mxfp8.launch_dequantize(mx, out, stream)),
        ("MXFP8 gather (data + scales), random rows", 2 * (d + d // 32),
         lambda: _row_moves.move_rows(gather_rows_kernel, shuffled, (mx.data, mx.scales),
                                        (data_out, scales_out), stream)),
    ]
    for name, row_bytes, fn in cases:
        if once:
            fn()
            continue
        ms = median_ms(fn)
        print(f"{name:45s} {ms:7.3f} ms  {rows * row_bytes / ms / 1e6:7.0f} GB/s")
    cupy.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    main(once="--once" in sys.argv[1:])
