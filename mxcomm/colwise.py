"""fp8 operands of the grouped GEMM's gradients: the fp8 rowwise rule along the other axis.

fp8 rowwise rows rescaled per (group, column) and transposed (the wgrad's A operand), and bf16
matrices quantized along their columns, transposed (the dgrad's B operand). Rules:
``kernels.fp8_colwise``, ``kernels.fp8_transpose``; host twins in ``mxcomm._host``. Glossary: P
rows, D hidden, G groups, T token positions, B matrices of R x C.
"""

import numpy

from .kernels import array_module, launch_1d, simulated, words  # first: decides simulator vs GPU
from . import _host
from ._array import (as_device_array, bfloat16, check_array, check_rows, float32, on_stream,
                     stream_ptr)
from ._platform import host_backend
from .kernels import fp8_colwise, fp8_transpose
from .kernels._launch import THREADS_PER_BLOCK
from .kernels.fp8_colwise import group_colwise_amax_kernel, group_colwise_scales_kernel
from .kernels.fp8_colwise_encode import ENCODE_MAX_WORDS, encode_items, group_colwise_encode_kernel
from .kernels.fp8_transpose import transpose_amax_kernel, transpose_encode_kernel
from .rowwise import ROWWISE_MULTIPLE

_U8, _U32, _U64 = (numpy.dtype(t) for t in (numpy.uint8, numpy.uint32, numpy.uint64))
#: T of :func:`fp8_rowwise_to_group_colwise` for (rows, groups): the host twin's (one definition).
group_colwise_positions = _host.group_colwise_positions


def fp8_rowwise_to_group_colwise(data, scales, group_ends, *, stream=None):
    """Rescale fp8 rowwise rows to one scale per (group, column) and transpose them, in two reads.

    The operands of dw[g] = x[g]^T @ grad[g] for ``torch._scaled_grouped_mm``'s 2d-2d case
    (A = ``data_t`` (D, T), ``offs=aligned_ends``). With v = e4m3 * row scale and amax = max |v|
    over a group's rows in a column (``kernels.fp8_colwise``; bit-identical to float64):

        scales_t[g, d] = 2^clamp(ceil(log2(amax / 448)), -126, 127)   (amax = 0: 2^-126)
        data_t[d, t]   = RNE_e4m3(v[p, d] / scales_t[g, d])

    Each group's rows are followed by zeros up to a multiple of 16 positions, at least 16 (the
    GEMM's rule). A NaN/Inf row scale or a NaN element makes its group's column NaN.

    Args:
        data: (P, D) uint8 e4m3fn bits, C-contiguous, D % 16 == 0: fp8 rowwise rows sorted by
            group (a permute's output). Read.
        scales: (P,) float32 row scales: powers of two, 0 or NaN. Read.
        group_ends: (G,) int32 device array, G >= 1: cumulative group ends (``permute``'s
            ``group_offsets``), non-decreasing, the last <= P (rows past it ignored). Read on the
            device: unsorted ends or ends past P are not detected (no host sync); rows then land
            in the wrong groups or are ignored, never written out of bounds.
        stream: the stream to launch on (None: CuPy's current); not synchronized.
    Returns:
        (data_t, scales_t, aligned_ends): (D, T) uint8 e4m3fn bits, (G, D) float32 and (G,)
        int32, T = :func:`group_colwise_positions` (P, G).
    Raises:
        TypeError: arrays of other dtypes, or not device arrays.
        ValueError: ``data`` not 2-D, D % 16 != 0 or not C-contiguous; ``scales`` of another
            shape; ``group_ends`` not 1-D or empty; an output of 2^33 bytes or more (the encode
            kernel indexes words in int32).
    """
    data = check_rows(data, "data", ROWWISE_MULTIPLE, (_U8,))
    scales = check_array(scales, "scales", float32, (data.shape[0],))
    ends = as_device_array(group_ends, "group_ends")
    if ends.ndim != 1 or ends.shape[0] == 0:
        raise ValueError(f"group_ends: expected a 1-D array of G >= 1 group ends, got shape "
                         f"{tuple(ends.shape)}")
    ends = check_array(ends, "group_ends", numpy.dtype(numpy.int32), ends.shape)
    with on_stream(stream):  # results and scratch from the stream the kernels run on
        return _to_group_colwise(data, scales, ends, stream)


def _to_group_colwise(data, scales, ends, stream, alloc=None):
    """:func:`fp8_rowwise_to_group_colwise` of arrays of the checked dtypes and shapes (the fp8
    GEMM's own operands): only the output's size checked here. ``alloc(shape, dtype)`` makes the
    results (None: the array module's ``empty``)."""
    p, d = data.shape
    g = ends.shape[0]
    t = group_colwise_positions(p, g)
    if t * d // 4 > ENCODE_MAX_WORDS:
        raise ValueError(f"data: {p} x {d} rows in {g} groups give an output of {t} x {d} "
                         f"bytes, above the {4 * ENCODE_MAX_WORDS} the encode kernel indexes "
                         f"(int32 words); split the rows")
    if host_backend():
        return _host.fp8_rowwise_to_group_colwise(data, scales, ends)
    stream = stream_ptr(stream)
    empty = alloc or array_module().empty
    data_t = empty((d, t), _U8)
    scales_t = empty((g, d), float32)
    aligned = empty((g,), numpy.dtype(numpy.int32))
    keys = _zeroed(scales_t.view(_U32), stream)
    row_scales = scales.view(_U32)
    # the simulator: one thread per block takes whole columns (atomics serialize its threads)
    sim = simulated()
    chunk = max(p, 1) if sim else fp8_colwise.CHUNK_ROWS
    group_colwise_amax_kernel[launch_1d(-(-p // chunk) * (d // fp8_colwise.AMAX_COLUMNS), stream,
                                        threads=1 if sim else None)](
        words(data, _U64, "data", rows=True), row_scales, ends, keys, chunk)
    group_colwise_scales_kernel[launch_1d(g * d, stream)](keys.reshape(g * d), ends, aligned)
    items = encode_items(t, d)
    group_colwise_encode_kernel[launch_1d(items * THREADS_PER_BLOCK, stream)](
        words(data, _U32, "data", rows=True), row_scales, ends, keys,
        words(data_t, _U32, "data_t", rows=True))
    return data_t, scales_t, aligned


def _zeroed(keys, stream):
    """``keys`` (the amax kernels' uint32 accumulators) zeroed on raw ``stream``."""
    if simulated():
        keys[...] = 0
    elif keys.size:
        import cupy
        cupy.cuda.runtime.memsetAsync(keys.data.ptr, 0, keys.nbytes, stream)
    return keys


def quantize_fp8_rowwise_transposed(x, *, stream=None):
    """fp8-rowwise-quantize the columns of each matrix of ``x`` and write them as rows: the bits
    of ``rowwise.quantize_fp8_rowwise`` of ``x.transpose(0, 2, 1)`` made contiguous, without that
    copy (``kernels.fp8_transpose``; the fp8 dgrad's B operand from weights kept as (G, N, K)).

    Args:
        x: (B, R, C) bf16 device array, C-contiguous, R % 16 == 0 and C % 16 == 0. Read.
        stream: the stream to launch on (None: CuPy's current); not synchronized.
    Returns:
        (data, scales): (B, C, R) uint8 e4m3fn bits and (B, C) float32 scales.
    Raises:
        TypeError: ``x`` is not a device array or not bf16.
        ValueError: ``x`` not 3-D, R or C not a multiple of 16, or not C-contiguous; 2^33 or
            more elements (the encode kernel indexes words in int32).
    """
    x = as_device_array(x, "x")
    if x.ndim != 3:
        raise ValueError(f"x: expected a 3-D (B, R, C) array, got shape {tuple(x.shape)}")
    b, r, c = x.shape
    if x.dtype != bfloat16:
        raise TypeError(f"x: expected dtype bfloat16, got {x.dtype}")
    if r % ROWWISE_MULTIPLE or c % ROWWISE_MULTIPLE:
        raise ValueError(f"x: expected R and C multiples of {ROWWISE_MULTIPLE}, got shape "
                         f"{tuple(x.shape)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"x: expected a C-contiguous array, got strides {x.strides}")
    with on_stream(stream):  # results and scratch from the stream the kernels run on
        return _transposed(x, stream)


def _transposed(x, stream, alloc=None):
    """:func:`quantize_fp8_rowwise_transposed` of ``x`` of the checked dtype and shape: only its
    size checked here; ``alloc(shape, dtype)`` makes the results and the scratch (None: the
    array module's ``empty``)."""
    if x.size // 4 > fp8_transpose.ENCODE_MAX_WORDS:
        raise ValueError(f"x: {x.size} elements (shape {tuple(x.shape)}), above the "
                         f"{4 * fp8_transpose.ENCODE_MAX_WORDS} the encode kernel indexes "
                         f"(int32 words); quantize fewer matrices per call")
    if host_backend():
        return _host.quantize_fp8_rowwise_transposed(x)
    b, r, c = x.shape
    stream = stream_ptr(stream)
    empty = alloc or array_module().empty
    data = empty((b, c, r), _U8)
    scales = empty((b, c), float32)
    if data.size == 0:
        with on_stream(stream):
            scales[...] = 2.0 ** -126  # an empty column's amax is 0
        return data, scales
    keys = _zeroed(empty((b * c,), float32).view(_U32), stream)
    x_words = x.reshape(b * r, c).view(_U64)
    # the simulator: one thread per column (no atomics: they serialize its Python threads)
    sim = simulated()
    chunk = r if sim else fp8_transpose.CHUNK_ROWS
    transpose_amax_kernel[launch_1d(b * -(-r // chunk) * (c // 4), stream,
                                    threads=1 if sim else None)](x_words, r, keys, chunk)
    tiles = b * -(-r // fp8_transpose.TILE_ROWS) * -(-(c // 4) // fp8_transpose.TILE_WORDS)
    transpose_encode_kernel[launch_1d(tiles * THREADS_PER_BLOCK, stream)](
        x_words, r, keys, data.reshape(b * c, r).view(_U32), scales.reshape(b * c).view(_U32))
    return data, scales

