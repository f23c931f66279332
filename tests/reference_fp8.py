"""Independent float64 NumPy references of the fp8 rowwise / 1x128 block formats and of the MXFP8 ->
rowwise permute (no kernel or wrapper code imported).

The formulas are evaluated in float64 with np.log2 / ceil / exp2; the fp32 operations that are part
of the "plain" block format's definition (amax / 448, 1 / scale, x * (1 / scale), each one IEEE fp32
operation) are float64 operations rounded to float32: for +, *, / of fp32 operands float64 has more
than 2 * 24 + 2 bits, so that double rounding equals one fp32 rounding. ml_dtypes rounds to e4m3fn
and bf16 (round to nearest even).
"""

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
BLOCK = 128
SCALE_EXP_MIN, SCALE_EXP_MAX = -126, 127
F32_NAN_BITS = 0x7FC00000
BF16_NAN_BITS = 0x7FC0
E4M3 = ml_dtypes.float8_e4m3fn


def _e4m3(v):
    """e4m3fn bits of the float values ``v`` (any float dtype): saturate to +-448, then RNE."""
    with np.errstate(invalid="ignore"):
        return np.clip(v, -E4M3_MAX, E4M3_MAX).astype(E4M3).view(np.uint8)


def _pow2_exponent(amax):
    """clamp(ceil(log2(amax / 448)), -126, 127) of finite maxima ``amax`` >= 0 (float64)."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax / E4M3_MAX))  # amax = 0: -inf
    return np.clip(e, SCALE_EXP_MIN, SCALE_EXP_MAX)


def _quantize_blocks_ref(x, block, mode):
    """(data uint8 (M, D), scales float32 (M, D // block)) of bf16/fp32 ``x`` (M, D)."""
    m, d = x.shape
    xf = np.asarray(x).astype(np.float64).reshape(m, d // block, block)
    finite = np.isfinite(xf).all(axis=-1)
    amax = np.where(finite, np.abs(np.where(np.isfinite(xf), xf, 0)).max(axis=-1, initial=0.0), 1.0)
    if mode == "pow2":
        scale = np.exp2(_pow2_exponent(amax))
        q = xf / scale[..., None]                      # exact: a power of two, no underflow in f64
    elif mode == "plain":
        a = np.maximum(amax, E4M3_MAX * 2.0 ** -126)
        scale = (a / E4M3_MAX).astype(np.float32).astype(np.float64)
        mult = (1.0 / scale).astype(np.float32).astype(np.float64)
        q = (xf * mult[..., None]).astype(np.float32)  # the fp32 product is part of the format
    else:
        raise ValueError(mode)
    data = _e4m3(q)
    data[~finite] = 0x7F
    scales = scale.astype(np.float32)
    scales.view(np.uint32)[~finite] = F32_NAN_BITS
    return data.reshape(m, d), scales


def quantize_fp8_rowwise_ref(x):
    """(data uint8 (M, D), scales float32 (M,)): scale 2^clamp(ceil(log2(amax/448)), -126, 127)."""
    data, scales = _quantize_blocks_ref(x, x.shape[1], "pow2")
    return data, scales.reshape(-1)


def quantize_fp8_block128_ref(x, mode="plain"):
    """(data uint8 (M, D), scales float32 (M, D // 128)) with "plain" or "pow2" scales."""
    return _quantize_blocks_ref(x, BLOCK, mode)


def dequantize_scaled_ref(data, scales, block, dtype=ml_dtypes.bfloat16):
    """(M, D) ``dtype`` of e4m3 ``data`` times the fp32 scale of each ``block`` elements of a row:
    the exact product rounded to fp32, then (bf16) to bf16; NaN is the canonical one."""
    m, d = data.shape
    e = np.asarray(data).view(E4M3).astype(np.float64).reshape(m, d // block, block)
    s = np.asarray(scales, dtype=np.float32).astype(np.float64).reshape(m, d // block, 1)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (e * s).reshape(m, d).astype(np.float32)  # exact in f64 (4 x 24 bits), one rounding
        out = v.astype(dtype)
    nan = np.isnan(v)
    if np.dtype(dtype) == np.float32:
        out.view(np.uint32)[nan] = F32_NAN_BITS
    else:
        out.view(np.uint16)[nan] = BF16_NAN_BITS
    return out


def mx_to_rowwise_ref(data, scales, indices):
    """fp8 rowwise (data (P, D) uint8, scales (P,) float32) of MXFP8 rows ``data`` (N, D) /
    ``scales`` (N, D // 32) e8m0 gathered by ``indices`` (P,) (-1 or >= N: zeros, scale 1.0).

    Row scale 2^e, e = clamp(max_b(s_b - 127), -126, 127); element = RNE_e4m3(v * 2^(s_b - 127)
    / 2^e) with v the element's e4m3 value; NaN elements kept; a row with a NaN block (0xFF) is all
    NaN.
    """
    n, d = data.shape
    p = len(indices)
    out = np.zeros((p, d), dtype=np.uint8)
    out_scales = np.ones(p, dtype=np.float32)
    for row, i in enumerate(np.asarray(indices)):
        if i < 0 or i >= n:
            continue
        s = scales[i].astype(np.int64)
        if (s == 0xFF).any():
            out[row] = 0x7F
            out_scales.view(np.uint32)[row] = F32_NAN_BITS
            continue
        e = np.clip(s.max() - 127, SCALE_EXP_MIN, SCALE_EXP_MAX)
        v = data[i].view(E4M3).astype(np.float64) * np.repeat(np.exp2(s - 127.0), 32)
        with np.errstate(invalid="ignore"):
            q = _e4m3(v / 2.0 ** e)
        nan = (data[i] & 0x7F) == 0x7F
        out[row] = np.where(nan, data[i], q)
        out_scales[row] = 2.0 ** e
    return out, out_scales


def group_colwise_ref(data, scales, group_ends):
    """fp8 per (group, column), transposed, of fp8 rowwise rows ``data`` (P, D) uint8 / ``scales``
    (P,) float32 in groups ending at ``group_ends`` (G,): (data_t (D, T) uint8, scales_t (G, D)
    float32, aligned_ends (G,)), T = 16 ceil(P / 16) + 16 G.

    Per group and column: v = e4m3 * row scale (float64), scale 2^clamp(ceil(log2(amax / 448)),
    -126, 127), element RNE_e4m3(v / scale); any non-finite v makes the column NaN (scale NaN,
    elements 0x7F). Group g's rows are followed by zeros up to max(16, a multiple of 16) positions.
    Written column by column, with its own decoder.
    """
    p, d = data.shape
    g = len(group_ends)
    t = -(-p // 16) * 16 + 16 * g
    values = np.array([_e4m3_decode(b) for b in range(256)])
    out = np.zeros((d, t), dtype=np.uint8)
    out_scales = np.zeros((g, d), dtype=np.float32)
    aligned = np.zeros(g, dtype=np.int64)
    start, position = 0, 0
    for k, end in enumerate(np.asarray(group_ends, dtype=np.int64)):
        end = min(max(int(end), start), p)
        for col in range(d):
            v = values[data[start:end, col]] * scales[start:end].astype(np.float64)
            if not np.isfinite(v).all():
                out[col, position:position + end - start] = 0x7F
                out_scales.view(np.uint32)[k, col] = F32_NAN_BITS
                continue
            e = _pow2_exponent(np.abs(v).max(initial=0.0))
            out[col, position:position + end - start] = _e4m3(v / 2.0 ** e)
            out_scales[k, col] = 2.0 ** e
        position += max(16, -(-(end - start) // 16) * 16)
        aligned[k] = position
        start = end
    return out, out_scales, aligned


def _e4m3_decode(b):
    """float64 value of the e4m3fn byte ``b`` (NaN for 0x7F / 0xFF), from its fields."""
    if b & 0x7F == 0x7F:
        return np.nan
    sign = -1.0 if b & 0x80 else 1.0
    exp, mant = (b >> 3) & 0xF, b & 0x7
    return sign * (mant * 2.0 ** -9 if exp == 0 else (1 + mant / 8) * 2.0 ** (exp - 7))
