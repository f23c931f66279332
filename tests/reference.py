"""Independent NumPy references for the kernels (no kernel code imported).

- MXFP8: float64 evaluation of the OCP MX v1.0 formulas in docs/design.md (np.log2 / floor / ceil),
  ml_dtypes for the e4m3fn rounding.
- Permutation: plain Python loops over (local expert, source rank) groups.
"""

import ml_dtypes
import numpy as np

MX_BLOCK = 32
E4M3_MAX = 448.0
BF16_NAN_BITS = 0x7FC0
F32_NAN_BITS = 0x7FC00000


def scale_ref(amax, scale_mode):
    """Biased e8m0 scales (int64) of finite block maxima ``amax`` (float64 array, >= 0)."""
    amax = np.asarray(amax, dtype=np.float64)
    with np.errstate(divide="ignore"):
        if scale_mode == "floor":
            e = np.floor(np.log2(amax)) - 8
        elif scale_mode == "rceil":
            e = np.ceil(np.log2(amax / E4M3_MAX))
        else:
            raise ValueError(scale_mode)
    return (np.clip(e, -127, 127) + 127).astype(np.int64)  # amax = 0: log2 = -inf -> 0


def quantize_mxfp8_ref(x, scale_mode="rceil"):
    """(data uint8 (M, D), scales uint8 (M, D // 32)) of the (M, D) bf16/fp32 array ``x``."""
    m, d = x.shape
    xf = np.asarray(x).astype(np.float64).reshape(m, d // MX_BLOCK, MX_BLOCK)
    finite = np.isfinite(xf).all(axis=-1)
    amax = np.where(finite, np.abs(np.where(np.isfinite(xf), xf, 0)).max(axis=-1, initial=0.0), 1.0)
    s = scale_ref(amax, scale_mode)
    with np.errstate(invalid="ignore"):  # NaN/Inf blocks, overwritten below
        scaled = np.clip(xf / np.exp2(s - 127.0)[..., None], -E4M3_MAX, E4M3_MAX)
        data = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    data[~finite] = 0x7F
    s[~finite] = 0xFF
    return data.reshape(m, d), s.astype(np.uint8)


def dequantize_mxfp8_ref(data, scales, dtype=ml_dtypes.bfloat16):
    """(M, D) ``dtype`` (bf16/fp32) of e4m3 ``data`` and e8m0 ``scales``; NaN is the canonical one."""
    m, d = data.shape
    e = np.asarray(data).view(ml_dtypes.float8_e4m3fn).astype(np.float64).reshape(m, d // MX_BLOCK, MX_BLOCK)
    s = np.asarray(scales).astype(np.float64)
    v = e * np.exp2(s - 127.0)[..., None]
    v[s == 0xFF] = np.nan
    with np.errstate(over="ignore"):  # e.g. 448 * 2^127 is +-Inf, as on the device
        out = v.reshape(m, d).astype(dtype)
    nan = np.isnan(v.reshape(m, d))
    if np.dtype(dtype) == np.float32:
        out.view(np.uint32)[nan] = F32_NAN_BITS
    else:
        out.view(np.uint16)[nan] = BF16_NAN_BITS
    return out


def round_up(n, k):
    return -(-n // k) * k


def permute_ref(x_rows, counts_group, num_local_experts, align):
    """Expert-major permutation of received rows, each expert's group padded to ``align`` rows.

    Args:
        x_rows: (M_recv, ...) rows in received order (source rank, then local expert).
        counts_group: (E,) ints, rank-major: entry r * E_local + e = rows from rank r for expert e.
    Returns:
        (permuted (P, ...) with zero padding rows, indices (P,) int32 source row or -1,
        group_offsets (E_local,) int32 cumulative padded group ends).
    """
    counts = [int(c) for c in np.asarray(counts_group)]
    e_local = num_local_experts
    ranks = len(counts) // e_local
    m = x_rows.shape[0]
    src_start = {}
    row = 0
    for r in range(ranks):
        for e in range(e_local):
            src_start[r, e] = row
            row += counts[r * e_local + e]
    p_total = round_up(m + e_local * align, align)
    indices = np.full(p_total, -1, dtype=np.int32)
    offsets = np.zeros(e_local, dtype=np.int32)
    pos = 0
    for e in range(e_local):
        for r in range(ranks):
            for k in range(counts[r * e_local + e]):
                indices[pos] = src_start[r, e] + k
                pos += 1
        pos = round_up(pos, align)
        offsets[e] = pos
    permuted = np.zeros((p_total,) + x_rows.shape[1:], dtype=x_rows.dtype)
    for p in range(p_total):
        if indices[p] >= 0:
            permuted[p] = x_rows[indices[p]]
    return permuted, indices, offsets


def unpermute_ref(y, indices, num_rows):
    """Rows of ``y`` back to received order: out[indices[p]] = y[p] for indices[p] >= 0."""
    out = np.zeros((num_rows,) + y.shape[1:], dtype=y.dtype)
    for p, i in enumerate(np.asarray(indices)):
        if i >= 0:
            out[i] = y[p]
    return out


def gather_ref(y, indices):
    """Rows ``y[indices[p]]``, zero where indices[p] < 0 (the backward of unpermute)."""
    out = np.zeros((len(indices),) + y.shape[1:], dtype=y.dtype)
    for p, i in enumerate(np.asarray(indices)):
        if i >= 0:
            out[p] = y[i]
    return out
