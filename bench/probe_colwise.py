"""Time each kernel of ``fp8_rowwise_to_group_colwise`` alone (GPU only): the amax pass, the
scales pass and the encode pass, on permuted fp8 rowwise rows of 8 groups at 131072 x 7168 and
131072 x 2048 (the fp8 wgrad's two operands in the pipeline benchmark's shapes). Median ms of 20
after 5 warm-up (CUDA events, back to back) and GB/s of the bytes each pass must touch. Two kinds
of rows: ``bytes``, uniform random e4m3 bytes under one scale (the data measured before 2026-11-24: 6 % of
the bytes subnormal or zero), and ``gaussian``, Gaussian rows whose magnitudes vary by 2^N(0, 2)
quantized by mxcomm's fp8 rowwise kernel (what a permute delivers), and ``relu``, those rows with
their negative half zeroed.
``python bench/probe_colwise.py``; bench/NOTES.md says what it found. ``--once``: each pass
once, untimed (for a profiler: ``bench/gpu_run.sh ncu1``).
"""

import sys

import cupy
import numpy

from mxcomm import colwise, rowwise
from mxcomm.bench._timing import Clock, measure
from mxcomm.kernels import fp8_colwise, fp8_colwise_encode, kernel, launch_1d


def median_ms(fn, iters=20, warmup=5):
    """Median ms of ``fn`` (CUDA events on CuPy's current stream, ``mxcomm.bench``'s timing)."""
    return measure(fn, Clock("cupy"), iters=iters, warmup=warmup).median


def rows(kind, p, d, rng):
    """(data (P, D) uint8, scales (P,) float32) fp8 rowwise rows of the given kind (module
    docstring)."""
    if kind == "bytes":
        return (cupy.asarray(rng.integers(0, 0x7E, (p, d), dtype=numpy.uint8)),
                cupy.full(p, 2.0 ** -3, dtype=numpy.float32))
    gen = cupy.random.default_rng(1)
    x = gen.standard_normal((p, d), dtype=numpy.float32)
    x *= cupy.exp2(2.0 * gen.standard_normal((p, 1), dtype=numpy.float32))
    if kind == "relu":
        cupy.maximum(x, 0, out=x)
    data, scales = rowwise.quantize_fp8_rowwise(x)
    del x
    return data, scales


def probe(p, d, kind, groups=8, once=False):
    rng = numpy.random.default_rng(0)
    sizes = rng.multinomial(p - 32 * groups, numpy.ones(groups) / groups)  # padded: <= p
    ends = cupy.asarray(numpy.cumsum(-(-sizes // 32) * 32).astype(numpy.int32))
    data, scales = rows(kind, p, d, rng)
    stream = cupy.cuda.get_current_stream().ptr
    t = colwise.group_colwise_positions(p, groups)
    data_t = cupy.empty((d, t), numpy.uint8)
    keys = cupy.zeros((groups, d), numpy.uint32)
    aligned = cupy.empty(groups, numpy.int32)
    w64, w32, rs = data.view(numpy.uint64), data.view(numpy.uint32), scales.view(numpy.uint32)
    scale = fp8_colwise.group_colwise_scales_kernel[launch_1d(groups * d, stream)]
    col_scales = colwise.fp8_rowwise_to_group_colwise(data, scales, ends)[1].view(
        numpy.uint32)  # the encode's real column scales (the timed amax and scales passes
    # leave ``keys`` as neither)
    encoders = {"encode": fp8_colwise_encode.group_colwise_encode_kernel}
    if not once:  # the encode under other launch bounds (registers per thread vs resident blocks)
        for bounds in ((256, 3), None):
            encoders[f"encode@{bounds[1] if bounds else 'unbounded'}"] = kernel(
                fp8_colwise_encode.group_colwise_encode_kernel.py_func, launch_bounds=bounds)
    amaxes = {"amax": fp8_colwise.CHUNK_ROWS}
    if not once:  # other rows per thread (fewer atomics, fewer threads)
        amaxes.update({"amax@128": 128, "amax@256": 256})
    cases = [
        *((name, (lambda c: lambda: fp8_colwise.group_colwise_amax_kernel[launch_1d(
            -(-p // c) * (d // fp8_colwise.AMAX_COLUMNS), stream)](w64, rs, ends, keys, c))(c),
           p * d + p * 4) for name, c in amaxes.items()),
        ("scales", lambda: scale(keys.reshape(-1), ends, aligned), groups * d * 8),
        *((name, (lambda k: lambda: k[launch_1d(fp8_colwise_encode.encode_items(t, d) * 256, stream)](
            w32, rs, ends, col_scales, data_t.view(numpy.uint32)))(k), p * d + p * 4 + d * t)
          for name, k in encoders.items()),
        ("all", lambda: colwise.fp8_rowwise_to_group_colwise(data, scales, ends),
         p * d + p * 4 + d * t),
    ]
    for name, fn, nbytes in cases:
        if once:
            fn()
            cupy.cuda.runtime.deviceSynchronize()
            continue
        ms = median_ms(fn)
        print(f"| {p}x{d} | {kind} | {name} | {ms:.3f} | {nbytes / ms / 1e6:.0f} |")


def main():
    once = "--once" in sys.argv[1:]
    if not once:
        print("| rows x D | rows | pass | ms | GB/s |\n| --- | --- | --- | --- | --- |")
    for kind in ("gaussian", "relu", "bytes"):
        for p, d in ((131072, 7168), (131072, 2048)):
            probe(p, d, kind, once=once)
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
