"""The host backend: vectorized NumPy versions of the kernels, for arrays in host memory.

Where there is no GPU (``mxcomm._platform.backend() == "host"``, the default on a CPU) the wrappers
in ``mxcomm.mxfp8`` and ``mxcomm.permutation`` call these functions instead of launching the CUDA
kernels of ``mxcomm.kernels``. Every result is bit-identical to the kernels' (tests/test_backends.py
runs both on the same inputs), so a CPU run shows exactly what a GPU run computes.

Glossary: M rows, D hidden (a multiple of 32), E experts, E_local experts per rank, P permuted rows.

MXFP8 (OCP Microscaling v1.0), the kernels' arithmetic step by step, on the bits:
- block amax from the magnitude bits (sign cleared); a block whose amax bits are Inf/NaN gets
  scale 0xFF and elements 0x7F;
- scale s = clamp(exp(amax) - 8 (+1 in "rceil" mode where the mantissa exceeds 1.75), 0, 254);
- element = e4m3 of the f32 product x * 2^(127 - s) (the kernels' f32 multiply), rounded to
  nearest even and saturated to +-448: normal results round the f32 bits (add 0x7FFFF plus the lowest kept
  bit, drop 20 bits), results below 2^-6 round on a grid of 2^-9 by an f32 addition of 2^14;
- dequantize: e4m3 * 2^(s - 127) in f32 (exact, Inf past the f32 range), then round to nearest even
  to bf16; NaN scale or NaN element gives the canonical NaN. Both are 256 x 256 lookup tables
  (scale, element byte) built once from these formulas.

Work goes in chunks of :data:`CHUNK_BLOCKS` MX blocks so the temporaries stay in the CPU's caches.
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

# f32 bit patterns used by the e4m3 rounding (see the module docstring).
_F32_2_POW_M6 = _U32(0x3C800000)    # 2^-6: the smallest normal e4m3
_F32_2_POW_14 = _U32(0x46800000)    # 2^14: its f32 ulp is 2^-9, the e4m3 subnormal step
_E4M3_REBIAS = _U32((127 - 7) << 3)  # f32 exponent bias - e4m3 bias, in the e4m3 code's position


class _Format:
    """Bit fields of an input format: magnitude mask, mantissa bits, the mantissa of 1.75
    (rceil: above it, amax / 448 needs one more exponent), and the Inf magnitude."""

    def __init__(self, uint, mant_bits):
        self.uint = numpy.dtype(uint)
        bits = 8 * self.uint.itemsize
        self.abs_mask = self.uint.type((1 << (bits - 1)) - 1)
        self.mant_bits = mant_bits
        self.mant_mask = (1 << mant_bits) - 1
        self.mant_1_75 = 3 << (mant_bits - 2)
        self.inf = 0xFF << mant_bits


_FORMATS = {BF16: _Format(numpy.uint16, 7), F32: _Format(numpy.uint32, 23)}


def quantize_mxfp8(x, data, scales, rceil):
    """MXFP8-quantize ``x`` into ``data`` and ``scales``, bit-identical to the CUDA kernels.

    Args:
        x: (M, D) bf16 or fp32 NumPy array, C-contiguous, D % 32 == 0. Read.
        data: (M, D) uint8 C-contiguous array: e4m3fn bits. Written.
        scales: (M, D // 32) uint8 C-contiguous array: e8m0 bits. Written.
        rceil: True for the "rceil" scale (ceil(log2(amax / 448))), False for "floor"
            (floor(log2(amax)) - 8).
    Returns:
        ``(data, scales)``. The arguments are the caller's to check (``mxcomm.mxfp8``).
    """
    fmt = _FORMATS[x.dtype]
    bits = x.reshape(-1).view(fmt.uint).reshape(-1, MX_BLOCK)
    codes = data.reshape(-1, MX_BLOCK)
    block_scales = scales.reshape(-1)
    for b in range(0, bits.shape[0], CHUNK_BLOCKS):
        end = b + CHUNK_BLOCKS
        _quantize_blocks(bits[b:end], fmt, rceil, codes[b:end], block_scales[b:end])
    return data, scales


def _quantize_blocks(bits, fmt, rceil, codes, scales):
    """Quantize (n, 32) blocks of input bits into (n, 32) e4m3 codes and (n,) scales."""
    amax = (bits & fmt.abs_mask).max(axis=1)
    nonfinite = amax >= fmt.inf
    e = (amax >> fmt.mant_bits).astype(numpy.int32)
    if rceil:
        e += (amax & fmt.mant_mask) > fmt.mant_1_75
    s = numpy.clip(e - 8, 0, 254)
    mult = ((254 - s).astype(_U32) << 23).view(numpy.float32)  # 2^(127 - s)
    if fmt.uint.itemsize == 2:
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
    v += numpy.float32(2.0 ** 14)  # subnormal e4m3: the f32 add rounds |v| to a multiple of 2^-9
    a -= _F32_2_POW_14
    numpy.copyto(code, a, where=small)
    code |= sign
    codes[...] = code
    codes[nonfinite] = E4M3_NAN
    s[nonfinite] = E8M0_NAN
    scales[...] = s


@functools.cache
def _dequantize_table(dtype):
    """(256, 256) table of output bits (uint16 for bf16, uint32 for fp32) by (scale, e4m3 byte)."""
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
    """Decode MXFP8 into ``out``: x = e4m3 * 2^(s - 127), bit-identical to the CUDA kernels.

    Args:
        data: (M, D) uint8 C-contiguous array: e4m3fn bits. Read.
        scales: (M, D // 32) uint8 C-contiguous array: e8m0 bits. Read.
        out: (M, D) bf16 or fp32 C-contiguous NumPy array. Written: exact in fp32, round to
            nearest even in bf16; NaN (bf16 0x7FC0, fp32 0x7FC00000) where the scale is 0xFF
            or the element is NaN.
    Returns:
        ``out``.
    """
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
    """The permutation of received rows into expert-major, ``align``-padded groups.

    The same index as ``kernels.permute``'s layout and index kernels: rows of segment
    (rank r, local expert e) go, in order, after the rows of segments (r' < r, e) of the same
    expert; each non-empty group ends on a multiple of ``align``.

    Args:
        counts: (E,) int32 array, rank-major: entry r * E_local + e. Read.
        num_local_experts: E_local, dividing E.
        align: rows, >= 1.
        num_rows: M_recv; a source row at or beyond it gives -1.
        num_permuted: P; destinations at or beyond it are dropped.
    Returns:
        ``(indices, group_offsets)``: (P,) int32, the received row of each permuted row or -1;
        (E_local,) int32 cumulative padded group ends.
    Raises:
        ValueError: a negative count.
    """
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
    return indices, group_ends.astype(numpy.int32)


def _byte_rows(a):
    """The C-contiguous (rows, ...) array ``a`` as (rows, row bytes) uint8, zero-copy."""
    return a.reshape(a.shape[0], -1).view(numpy.uint8) if a.size else \
        numpy.empty((a.shape[0], 0), dtype=numpy.uint8)


def gather_rows(indices, srcs, dsts, fill=None):
    """``dst[p] = src[indices[p]]`` for each (src, dst) pair; where the index is negative or past
    the source's rows, zeros, and ``fill`` (a value of its dtype, None: 0) in the second dst
    (``kernels.permute.gather_rows_kernel``: the padding scale).

    Args:
        indices: (P,) int32 array. Read.
        srcs: arrays (M, ...) with C-contiguous rows. Read.
        dsts: arrays (P, ...), each of its src's dtype and row shape, C-contiguous. Written.
    Returns:
        ``dsts``.
    """
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
    """``dst[indices[p]] = src[p]`` for each (src, dst) pair where 0 <= indices[p] < dst rows;
    other rows of ``dst`` are left as they are (``kernels.permute.scatter_rows_kernel``).

    Args:
        indices: (P,) int32 array. Read.
        srcs: arrays (P, ...) with C-contiguous rows. Read.
        dsts: arrays (M, ...), each of its src's dtype and row shape, C-contiguous. Written.
    Returns:
        ``dsts``.
    """
    indices = numpy.asarray(indices)
    for src, dst in zip(srcs, dsts):
        src_b, dst_b = _byte_rows(src), _byte_rows(dst)
        if dst_b.shape[1] == 0 or dst_b.shape[0] == 0:
            continue
        valid = (indices >= 0) & (indices < dst_b.shape[0])
        dst_b[indices[valid]] = src_b[valid]
    return dsts


def zero_rows(indices, dsts, fill=None):
    """Where ``indices[p] < 0``: zeros in each array of ``dsts`` (P, ...), and ``fill`` (None:
    0) in the second; other rows are left as they are (``kernels.permute.zero_rows_kernel``).
    Returns ``dsts``."""
    pad = numpy.asarray(indices) < 0
    for k, dst in enumerate(dsts):
        _byte_rows(dst)[pad] = 0
        if k == 1 and fill:
            dst[pad] = fill
    return dsts
