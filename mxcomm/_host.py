"""The host backend: vectorized NumPy twins of the kernels, bit-identical to them.

Glossary: M rows, D hidden (a multiple of 32), E experts, E_local experts per rank, P permuted rows.
MXFP8 (OCP Microscaling v1.0) is computed as the kernels do, on the bits: the block amax from the
magnitude bits (Inf/NaN: scale 0xFF, elements 0x7F); scale s = clamp(exp(amax) - 8, 0, 254), +1
in "rceil" mode where the mantissa exceeds 1.75; element = e4m3 of the f32 x * 2^(127 - s),
rounded to nearest even and saturated (normal results round the f32 bits, results below 2^-6 by
an f32 addition of 2^14); dequantize through 256 x 256 tables by (scale, element byte).
"""

import functools

import ml_dtypes
import numpy

#: Elements per MX block, and the e8m0 / e4m3 codes of a non-finite block.
MX_BLOCK = 32
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F
#: Largest finite e4m3 code (448) and canonical quiet NaNs of the outputs.
E4M3_MAX_CODE = 0x7E
BF16_NAN = 0x7FC0
F32_NAN = 0x7FC00000
#: MX blocks per chunk of work (64 Ki elements: 256 KiB of f32 temporaries).
CHUNK_BLOCKS = 2048

BF16 = numpy.dtype(ml_dtypes.bfloat16)
F32 = numpy.dtype(numpy.float32)
_U32 = numpy.uint32
_BITS = {BF16: (numpy.uint16, 7), F32: (numpy.uint32, 23)}  # input: (its bits, mantissa bits)

# f32 bit patterns of the e4m3 rounding
_F32_2_POW_M6 = _U32(0x3C800000)    # 2^-6: the smallest normal e4m3
_F32_2_POW_14 = _U32(0x46800000)    # 2^14: its f32 ulp is 2^-9, the e4m3 subnormal step
_E4M3_REBIAS = _U32((127 - 7) << 3)  # f32 exponent bias - e4m3 bias, in the e4m3 code's position


def quantize_mxfp8(x, data, scales, rows=None, stream=None, *, rceil):
    """MXFP8-quantize rows [0, ``rows``) (None: all) of ``x`` (M, D) bf16/fp32 into ``data`` (M, D)
    uint8 e4m3fn bits and ``scales`` (M, D // 32) uint8 e8m0 bits, all C-contiguous and checked by
    the caller; ``rceil``: the "rceil" scale, else "floor". ``stream`` is unused: the arguments
    are those of ``Format.quantizer``'s call, which this function is. Returns ``(data, scales)``."""
    uint, mant_bits = _BITS[x.dtype]
    abs_mask = uint((1 << (8 * numpy.dtype(uint).itemsize - 1)) - 1)
    blocks = (x.shape[0] if rows is None else rows) * x.shape[1] // MX_BLOCK
    all_bits = x.reshape(-1).view(uint).reshape(-1, MX_BLOCK)
    all_codes, all_scales = data.reshape(-1, MX_BLOCK), scales.reshape(-1)
    for b in range(0, blocks, CHUNK_BLOCKS):  # cache-sized temporaries
        bits = all_bits[b:min(b + CHUNK_BLOCKS, blocks)]
        amax = (bits & abs_mask).max(axis=1)
        nonfinite = amax >= 0xFF << mant_bits
        e = (amax >> mant_bits).astype(numpy.int32)
        if rceil:  # above a mantissa of 1.75, amax / 448 needs one more exponent
            e += (amax & ((1 << mant_bits) - 1)) > 3 << (mant_bits - 2)
        s = numpy.clip(e - 8, 0, 254)
        mult = ((254 - s).astype(_U32) << 23).view(numpy.float32)  # 2^(127 - s)
        if uint is numpy.uint16:
            v = (bits.astype(_U32) << 16).view(numpy.float32)  # bf16 -> f32, exact
        else:
            v = bits.view(numpy.float32).copy()
        with numpy.errstate(over="ignore", invalid="ignore"):  # Inf/NaN blocks, overwritten below
            v *= mult[:, None]
        a = v.view(_U32)
        sign = (a >> 24) & _U32(0x80)
        a &= _U32(0x7FFFFFFF)  # v is |v| from here on
        small = a < _F32_2_POW_M6
        code = (a >> 20) & _U32(1)  # normal e4m3: round to nearest even on bit 20, rebias
        code += a
        code += _U32(0x7FFFF)
        code >>= 20
        code -= _E4M3_REBIAS  # wraps around for small values: replaced below
        numpy.minimum(code, _U32(E4M3_MAX_CODE), out=code)  # satfinite: 480 and above -> 448
        v += numpy.float32(2.0 ** 14)  # subnormal e4m3: the f32 add rounds to a multiple of 2^-9
        a -= _F32_2_POW_14
        numpy.copyto(code, a, where=small)
        code |= sign
        code[nonfinite] = E4M3_NAN
        s[nonfinite] = E8M0_NAN
        all_codes[b:b + len(bits)] = code
        all_scales[b:b + len(bits)] = s
    return data, scales


@functools.cache
def _dequantize_table(dtype):
    """(256, 256) table of output bits (uint16 bf16, uint32 fp32) by (scale, e4m3 byte)."""
    e4m3 = numpy.arange(256, dtype=numpy.uint8).view(ml_dtypes.float8_e4m3fn).astype(numpy.float32)
    with numpy.errstate(over="ignore", invalid="ignore"):  # 2^128 (scale 0xFF) and past f32: Inf
        mult = numpy.ldexp(numpy.float32(1), numpy.arange(-127, 129)).astype(numpy.float32)
        f32 = (mult[:, None] * e4m3[None, :]).view(_U32)  # 2^(s - 127) * e4m3: exact, or Inf
    nan = numpy.zeros((256, 256), dtype=bool)
    nan[E8M0_NAN, :] = True
    nan[:, [E4M3_NAN, E4M3_NAN | 0x80]] = True
    f32[nan] = F32_NAN
    if dtype == F32:
        return f32
    rounded = (f32 + _U32(0x7FFF) + ((f32 >> 16) & _U32(1))) >> 16  # round to nearest even
    return numpy.where(nan, BF16_NAN, rounded).astype(numpy.uint16)


def dequantize_mxfp8(data, scales, out):
    """Decode ``data`` (M, D) uint8 and ``scales`` (M, D // 32) uint8 into ``out`` (M, D) bf16/fp32,
    C-contiguous: x = e4m3 * 2^(s - 127), exact in fp32, round to nearest even in bf16, canonical
    NaN for scale 0xFF or a NaN element. Returns ``out``."""
    table = _dequantize_table(out.dtype).reshape(-1)
    codes = data.reshape(-1, MX_BLOCK)
    block_scales = scales.reshape(-1)
    words = out.reshape(-1).view(table.dtype).reshape(-1, MX_BLOCK)
    for b in range(0, codes.shape[0], CHUNK_BLOCKS):
        end = b + CHUNK_BLOCKS
        index = codes[b:end].astype(numpy.uint16)
        index |= block_scales[b:end, None].astype(numpy.uint16) << 8
        numpy.take(table, index, out=words[b:end], mode="clip")  # index < 65536: never clipped
    return out


def permute_layout(counts, num_local_experts, align, num_rows, num_permuted):
    """``(indices (P,) int32, group_offsets (E_local,) int32, inverse (num_rows,) int32)`` of
    ``mxcomm.permutation.permute``, the same as ``kernels.permute``'s layout and index kernels
    (``inverse``: the permuted row of each received row that lands, -1 for others). ``counts``
    (E,) rank-major; source rows >= ``num_rows`` give -1; destinations >= ``num_permuted`` are
    dropped. Raises ValueError for a negative count."""
    counts = numpy.asarray(counts, dtype=numpy.int64)
    if (counts < 0).any():
        raise ValueError(f"num_tokens_per_expert_group: expected non-negative counts, got "
                         f"{counts.tolist()}")
    by_rank = counts.reshape(-1, num_local_experts)                   # [r, e]
    src_start = (numpy.cumsum(counts) - counts).reshape(by_rank.shape)
    padded = -(-by_rank.sum(axis=0) // align) * align                 # rows of each group
    group_ends = numpy.cumsum(padded)
    group_starts = group_ends - padded
    dst_start = group_starts[None, :] + numpy.cumsum(by_rank, axis=0) - by_rank
    # Segments in expert-major order: every row's (destination, source) by repetition.
    seg_counts = by_rank.T.reshape(-1)
    first = numpy.cumsum(seg_counts) - seg_counts
    within = numpy.arange(int(seg_counts.sum())) - numpy.repeat(first, seg_counts)
    dst = numpy.repeat(dst_start.T.reshape(-1), seg_counts) + within
    src = numpy.repeat(src_start.T.reshape(-1), seg_counts) + within
    src[src >= num_rows] = -1
    keep = dst < num_permuted
    indices = numpy.full(num_permuted, -1, dtype=numpy.int32)
    indices[dst[keep]] = src[keep]
    inverse = numpy.full(num_rows, -1, dtype=numpy.int32)
    lands = keep & (src >= 0)
    inverse[src[lands]] = dst[lands]
    return indices, group_ends.astype(numpy.int32), inverse


def _byte_rows(a):
    """The C-contiguous (rows, ...) array ``a`` as (rows, row bytes) uint8, zero-copy."""
    return a.reshape(a.shape[0], -1).view(numpy.uint8) if a.size else \
        numpy.empty((a.shape[0], 0), dtype=numpy.uint8)


def gather_rows(indices, srcs, dsts, fill=None):
    """``dst[p] = src[indices[p]]`` for each (src, dst) pair; an index < 0 or past the source gives
    zeros, and ``fill`` (None: 0) in the second dst (the padding scale). ``gather_rows_kernel``'s
    twin. Returns ``dsts``."""
    indices = numpy.asarray(indices)
    for k, (src, dst) in enumerate(zip(srcs, dsts)):
        src_b, dst_b = _byte_rows(src), _byte_rows(dst)
        if dst_b.shape[1] == 0 or indices.shape[0] == 0:
            continue
        invalid = (indices < 0) | (indices >= src_b.shape[0])
        if src_b.shape[0]:
            numpy.take(src_b, numpy.where(invalid, 0, indices), axis=0, out=dst_b, mode="clip")
        dst_b[invalid] = 0
        if k == 1 and fill:
            dst[invalid] = fill
    return dsts


def scatter_rows(indices, srcs, dsts):
    """``dst[indices[p]] = src[p]`` for each pair where 0 <= indices[p] < dst rows; other rows
    untouched. ``scatter_rows_kernel``'s twin. Returns ``dsts``."""
    indices = numpy.asarray(indices)
    for src, dst in zip(srcs, dsts):
        src_b, dst_b = _byte_rows(src), _byte_rows(dst)
        if dst_b.shape[1] == 0 or dst_b.shape[0] == 0:
            continue
        valid = (indices >= 0) & (indices < dst_b.shape[0])
        dst_b[indices[valid]] = src_b[valid]
    return dsts


def zero_rows(indices, dsts, fill=None):
    """Where ``indices[p] < 0``: zeros in each of ``dsts``, and ``fill`` (None: 0) in the second.
    ``zero_rows_kernel``'s twin. Returns ``dsts``."""
    pad = numpy.asarray(indices) < 0
    for k, dst in enumerate(dsts):
        _byte_rows(dst)[pad] = 0
        if k == 1 and fill:
            dst[pad] = fill
    return dsts


# ---- fp8 rowwise, 1x128 block, MXFP8 -> rowwise, group colwise: the kernels' operations (integer
# scale exponents, float32 products, ml_dtypes' round-to-nearest-even to e4m3fn and bf16).
#: Elements per fp8 block (``kernels.fp8_block.FP8_BLOCK``); token positions a colwise group is
#: padded to (``kernels.fp8_colwise.GROUP_ALIGN``); fp8 block scale modes; a padding row's scale.
FP8_BLOCK = 128
GROUP_ALIGN = 16
BLOCK_SCALE_MODES = ("plain", "pow2")
PADDING_SCALE = 1.0

_E4M3 = numpy.dtype(ml_dtypes.float8_e4m3fn)
_F32_INF_BITS = 0x7F800000
_PLAIN_AMAX_MIN = numpy.float32(448.0 * 2.0 ** -126)


def _e4m3(y):
    """e4m3fn bits (uint8) of the float32 ``y``: round to nearest even, saturated to +-448."""
    return numpy.clip(y, -448.0, 448.0).astype(_E4M3).view(numpy.uint8)


def _quantize_scaled(x, block, pow2):
    """(data (M, D) uint8, scales (M, D // block) float32) of ``x`` (M, D) bf16/fp32, pow2 or plain
    scales per ``block`` elements of a row."""
    m, d = x.shape
    nb = d // block if block else 0
    xb = x.reshape(m, nb, block)
    bits = xb.view(numpy.uint16).astype(_U32) << 16 if x.dtype == BF16 else xb.view(_U32)
    amax = (bits & _U32(0x7FFFFFFF)).max(axis=-1, initial=0)  # as fp32 bits, bf16 widened exactly
    nonfinite = amax >= _F32_INF_BITS
    with numpy.errstate(invalid="ignore", over="ignore"):  # non-finite blocks, overwritten below
        if pow2:  # the e8m0 "rceil" exponent: exp - 8, plus 1 above a mantissa of 1.75
            e = (amax >> numpy.uint32(23)).astype(numpy.int64) - 8 + (
                (amax & numpy.uint32(0x7FFFFF)) > numpy.uint32(0x600000))
            s = numpy.clip(e, 1, 254).astype(_U32)
            scale_bits = s << numpy.uint32(23)
            mult = ((numpy.uint32(254) - s) << numpy.uint32(23)).view(F32)
        else:
            a = numpy.maximum(numpy.where(nonfinite, 0, amax).astype(_U32).view(F32),
                              _PLAIN_AMAX_MIN)
            scale = a / numpy.float32(448.0)
            mult = numpy.float32(1.0) / scale
            scale_bits = scale.view(_U32)
        data = _e4m3(xb.astype(F32) * mult[..., None])
    data[nonfinite] = E4M3_NAN
    scale_bits = numpy.where(nonfinite, numpy.uint32(F32_NAN), scale_bits).astype(_U32)
    return data.reshape(m, d), scale_bits.view(F32)


def _write(out, data, scales):
    """Copy (data, scales) into the pair ``out`` (if given); return what holds the result."""
    if out is None:
        return data, scales
    out[0][...] = data
    out[1][...] = scales
    return out[0], out[1]


def quantize_fp8_rowwise(x, *, out=None):
    """``rowwise.quantize_fp8_rowwise``'s twin: (data (M, D) uint8, scales (M,) float32)."""
    x = numpy.asarray(x)
    m, d = x.shape
    if d == 0:
        data, scales = numpy.zeros((m, 0), numpy.uint8), numpy.full(m, 2.0 ** -126, F32)
    else:
        data, scales = _quantize_scaled(x, d, True)
    return _write(out, data, scales.reshape(m))


def quantize_fp8_rowwise_transposed(x):
    """``colwise.quantize_fp8_rowwise_transposed``'s twin: ``x`` (B, R, C) bf16 -> (data (B, C, R)
    uint8, scales (B, C) float32)."""
    x = numpy.asarray(x)
    b, r, c = x.shape
    data, scales = quantize_fp8_rowwise(
        numpy.ascontiguousarray(x.transpose(0, 2, 1)).reshape(b * c, r))
    return data.reshape(b, c, r), scales.reshape(b, c)


def quantize_fp8_block128(x, scale_mode="plain", *, out=None):
    """``block128.quantize_fp8_block128``'s twin: (data (M, D) uint8, scales (M, D // 128)
    float32)."""
    return _write(out, *_quantize_scaled(numpy.asarray(x), FP8_BLOCK, scale_mode == "pow2"))


def _dequantize_scaled(data, scales, block, dtype, out):
    """``data`` (M, D) e4m3 bits times ``scales`` (M, D // block) in fp32 (one rounding), as
    ``dtype`` (bf16: round to nearest even), canonical NaN."""
    m, d = data.shape
    dtype = numpy.dtype(dtype)
    nb = d // block if d else 0
    v = numpy.ascontiguousarray(data).view(_E4M3).astype(F32).reshape(m, nb, block)
    with numpy.errstate(invalid="ignore", over="ignore"):  # NaN scales, 0 * Inf; overflow to Inf
        v = (v * numpy.asarray(scales, dtype=F32).reshape(m, nb, 1)).reshape(m, d)
        result = v.astype(dtype)
    nan = numpy.isnan(v)
    if dtype == F32:
        result.view(_U32)[nan] = F32_NAN
    else:
        result.view(numpy.uint16)[nan] = BF16_NAN
    if out is None:
        return result
    out[...] = result
    return out


def dequantize_fp8_rowwise(data, scales, dtype=BF16, *, out=None):
    """``rowwise.dequantize_fp8_rowwise``'s twin: (M, D) ``dtype``."""
    data = numpy.asarray(data)
    return _dequantize_scaled(data, scales, data.shape[1], dtype, out)


def dequantize_fp8_block128(data, scales, dtype=BF16, *, out=None):
    """``block128.dequantize_fp8_block128``'s twin: (M, D) ``dtype``."""
    data = numpy.asarray(data)
    return _dequantize_scaled(data, scales, FP8_BLOCK, dtype, out)


def fp8_rowwise_to_group_colwise(data, scales, group_ends):
    """``colwise.fp8_rowwise_to_group_colwise``'s twin: (data_t (D, T) uint8, scales_t (G, D)
    float32, aligned_ends (G,) int32). v = e4m3 * scale is exact in float64; column scales come from
    its amax."""
    data, scales = numpy.asarray(data), numpy.asarray(scales, dtype=F32)
    ends = numpy.asarray(group_ends).astype(numpy.int64)
    p, d = data.shape
    g = ends.shape[0]
    data_t = numpy.zeros((d, group_colwise_positions(p, g)), numpy.uint8)
    scales_t = numpy.empty((g, d), F32)
    aligned = numpy.empty(g, numpy.int32)
    with numpy.errstate(invalid="ignore", over="ignore"):
        v = data.view(_E4M3).astype(numpy.float64) * scales.astype(numpy.float64)[:, None]
    start = position = 0
    for k in range(g):
        end = min(max(int(ends[k]), start), p)
        rows = v[start:end]
        finite = numpy.isfinite(rows).all(axis=0)
        amax = numpy.abs(numpy.where(numpy.isfinite(rows), rows, 0)).max(axis=0, initial=0.0)
        with numpy.errstate(divide="ignore"):
            e = numpy.clip(numpy.ceil(numpy.log2(amax / 448.0)), -126, 127)
        scale = numpy.exp2(e)
        with numpy.errstate(invalid="ignore"):
            q = _e4m3(rows / scale)
        q[:, ~finite] = E4M3_NAN
        scales_t[k] = scale
        scales_t[k].view(_U32)[~finite] = F32_NAN
        data_t[:, position:position + end - start] = q.T
        position += max(GROUP_ALIGN, -(-(end - start) // GROUP_ALIGN) * GROUP_ALIGN)
        aligned[k] = position
        start = end
    return data_t, scales_t, aligned


def mx_to_rowwise_permute(mx, permuted_indices, *, out=None):
    """``rowwise.mx_to_rowwise_permute``'s twin: (data (P, D) uint8, scales (P,) float32)."""
    src_data, src_scales = numpy.asarray(mx.data), numpy.asarray(mx.scales)
    n, d = src_data.shape
    idx = numpy.asarray(permuted_indices).astype(numpy.int64)
    p = idx.shape[0]
    valid = (idx >= 0) & (idx < n)
    rows = numpy.where(valid, idx, 0)
    if n == 0:
        src_data, src_scales = numpy.zeros((1, d), numpy.uint8), numpy.zeros((1, d // 32), numpy.uint8)
    d8 = src_data[rows]                                    # (P, D) e4m3 bits
    s = src_scales[rows].astype(numpy.int64)               # (P, D / 32) biased exponents
    smax = s.max(axis=1, initial=0)
    r = numpy.maximum(smax, 1)
    k = numpy.maximum(s - r[:, None], -32)                 # <= 0; below -19 everything is 0
    mult = ((127 + k).astype(_U32) << numpy.uint32(23)).view(F32)
    with numpy.errstate(invalid="ignore"):
        v = d8.view(_E4M3).astype(F32).reshape(p, d // 32, 32) * mult[..., None]
        conv = v.astype(_E4M3).view(numpy.uint8).reshape(p, d)
    data = numpy.where((d8 & 0x7F) == E4M3_NAN, d8, conv)
    scale_bits = (r.astype(_U32) << numpy.uint32(23))
    nan_row = smax == 0xFF
    data[nan_row] = E4M3_NAN
    scale_bits[nan_row] = F32_NAN
    data[~valid] = 0
    scales = scale_bits.view(F32).copy()
    scales[~valid] = PADDING_SCALE
    return _write(out, data, scales)


def group_colwise_positions(rows, groups):
    """T, the token positions of ``fp8_rowwise_to_group_colwise``'s output:
    16 * ceil(rows / 16) + 16 * groups (each group padded to a multiple of 16, at least 16)."""
    return -(-rows // GROUP_ALIGN) * GROUP_ALIGN + GROUP_ALIGN * groups
