"""fp8 rowwise quantize / dequantize kernels: e4m3fn elements, one fp32 power-of-two scale per row.

The A-operand layout of Hopper's ``torch._scaled_grouped_mm`` (fp8 rowwise recipe): data (M, D)
e4m3fn, D % 16 == 0, scales (M,) float32, ``x ~= e4m3 * scale``. With amax = max |x| over the row:

    scale   = 2^e,  e = clamp(ceil(log2(amax / 448)), -126, 127)   (amax = 0: e = -126)
    element = round-to-nearest-even(x / scale) as e4m3fn, saturated to +-448

MXFP8's "rceil" rounding over the whole row; the clamp keeps the scale and its reciprocal normal
(DeepGEMM's ``ceil_to_ue8m0`` clamps alike). NaN/Inf rows: scale NaN, elements 0x7F. Dequantization:
``e4m3 * scale`` in fp32 (one rounding), RNE to bf16, NaN canonical. Quantize: a warp per row, a
first pass for the amax keeping the row's first units in shared memory, a second encoding.
Dequantize: flat over the data words; its word decoders take any fp32 scale (``fp8_block`` too).
"""

from numba import cuda, float64, int64, uint32, uint64

from ._fp8 import (BF16_INF, E4M3_NAN, F32_INF, F32_NAN, bf16_bits_from_f32_bits, bits_from_f32,
                   e8m0_from_bf16_amax, e8m0_from_f32_amax, f32_from_bits, f32_from_e4m3,
                   inv_scale_f32_bits)
from ._launch import THREADS_PER_BLOCK, kernel
from ._memory import SHARED_PAIR_ALIGN, load_pair, load_pair_flat, store_pair_flat, store_word
from .mx_dequantize import bf16x4_from_e4m3x4
from .mx_quantize import WARP, bf16x4_absmax, encode_bf16x4, encode_f32x2, f32x2_absmax, lanes_max

#: Units (16 input bytes: 8 bf16 or 4 fp32) each thread loads per step, all in flight.
PASS_UNITS = 4
#: Rows (one warp each) per CUDA block of the quantize kernels.
ROWS_PER_BLOCK = 8
#: Data words (8 e4m3) each thread of the dequantize kernels loads per tile, all in flight.
WORDS_PER_THREAD = 4
#: Smallest biased fp32 exponent of a scale: 2^-126, the smallest normal fp32.
SCALE_EXP_MIN = 1
#: f32 bits of 1.0.
F32_ONE = 0x3F800000
#: Registers per thread of the quantize / dequantize kernels (ptxas -v, sm_90): the wrappers cap
#: the persistent grids at the blocks that stay resident.
QUANTIZE_REGISTERS = 72
DEQUANTIZE_REGISTERS = 40
#: Dynamic shared memory of a quantize block's ROWS_PER_BLOCK rows (three blocks per
#: multiprocessor; bench/NOTES.md, --stash-kib).
STASH_BLOCK_BYTES = 75 * 1024
#: Bytes of shared memory one unit takes in the stash (two uint64 words).
STASH_UNIT_BYTES = 16

_E4M3_NAN_X8 = uint64(E4M3_NAN * 0x0101010101010101)
_E4M3_NAN_X4 = uint32(E4M3_NAN * 0x01010101)
_LOW7_X8 = uint64(0x7F7F7F7F7F7F7F7F)
_ONES_X8 = uint64(0x0101010101010101)
_HIGH_X8 = uint64(0x8080808080808080)


@cuda.jit(device=True)
def rowwise_scale_exp(amax_f32_bits):
    """Biased exponent s >= 1 of the rowwise scale 2^(s - 127) of a finite f32 amax (bits)."""
    return max(e8m0_from_f32_amax(amax_f32_bits, True), uint32(SCALE_EXP_MIN))


@cuda.jit(device=True)
def nan_byte_mask(d):
    """0xFF in each byte of the uint64 ``d`` holding an e4m3 NaN (0x7F or 0xFF), 0x00 elsewhere."""
    high = ((d & _LOW7_X8) + _ONES_X8) & _HIGH_X8
    return (high >> uint64(7)) * uint64(0xFF)


@cuda.jit(device=True)
def rowwise_scale_exp_bf16(amax_bf16_bits):
    """:func:`rowwise_scale_exp` of a finite bf16 amax (bf16 bits)."""
    return max(e8m0_from_bf16_amax(amax_bf16_bits, True), uint32(SCALE_EXP_MIN))


@cuda.jit(device=True)
def encode_units_bf16(first, second, mult):
    """One uint64 of 8 e4m3 from two units of 4 bf16 each (uint64) times ``mult``."""
    return uint64(encode_bf16x4(first, mult)) | (uint64(encode_bf16x4(second, mult)) << uint64(32))


@cuda.jit(device=True)
def encode_units_f32(first, second, mult):
    """One uint32 of 4 e4m3 from two units of 2 f32 each (uint64) times ``mult``."""
    return uint32(encode_f32x2(first, mult)) | (uint32(encode_f32x2(second, mult)) << uint32(16))


@cuda.jit(device=True)
def load_units(x_words, row, start, units, first, second):
    """Units start + k * WARP (k < PASS_UNITS) of ``row`` into ``first``, ``second``, one 16-byte
    load each (zeros past ``units``)."""
    for k in range(PASS_UNITS):
        u = start + k * WARP
        if u < units:
            first[k], second[k] = load_pair(x_words, row, u)
        else:
            first[k] = uint64(0)
            second[k] = uint64(0)


def _quantize_fp8_rowwise(f32):
    """The rowwise quantize kernel of bf16 or (``f32``) fp32 rows."""
    absmax = f32x2_absmax if f32 else bf16x4_absmax
    inf = uint32(F32_INF if f32 else BF16_INF)
    scale_exp = rowwise_scale_exp if f32 else rowwise_scale_exp_bf16
    encode_units = encode_units_f32 if f32 else encode_units_bf16
    nan_word = _E4M3_NAN_X4 if f32 else _E4M3_NAN_X8

    @kernel
    def quantize_fp8_rowwise_kernel(x_words, data_words, scales, stash_units):
        """fp8-rowwise-quantize bf16 or fp32 rows (module docstring).

        Args:
            x_words: (M, D // 4) uint64 of bf16 bits (4 per word, element 0 lowest, D % 8 == 0), or
                (M, D // 2) of f32 bits (D % 4 == 0); address a multiple of 16 bytes. Read.
            data_words: (M, D // 8) uint64 of e4m3fn bits, or (M, D // 4) uint32 for f32. Written.
            scales: (M,) uint32, fp32 bits of the row scales. Written.
            stash_units: units of a row each warp keeps in shared memory between the passes (the
                rest is read again for the encode).
        Launch: launch_1d(ceil(M / R) * 32 * R, threads=32 * R), dynamic shared memory 16 * R *
            stash_units bytes: a warp per row (R rows per block), grid-stride over rows in steps
            uniform per block; lane l takes units (16 input bytes) l + 32 k, PASS_UNITS per step.
        """
        scratch = cuda.shared.array(THREADS_PER_BLOCK, uint32)  # simulator only (lanes_max)
        stash = cuda.shared.array(0, uint64, alignment=SHARED_PAIR_ALIGN)
        first = cuda.local.array(PASS_UNITS, uint64)
        second = cuda.local.array(PASS_UNITS, uint64)
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        rows_per_block = cuda.blockDim.x // WARP
        m = x_words.shape[0]
        units = data_words.shape[1]
        step = WARP * PASS_UNITS
        at = warp * stash_units  # unit u < stash_units: pair at + u of the stash (its lane's)
        for base in range(cuda.blockIdx.x * rows_per_block, m, cuda.gridDim.x * rows_per_block):
            row = base + warp
            live = row < m
            amax = uint32(0)
            if live:
                for start in range(lane, units, step):
                    load_units(x_words, row, start, units, first, second)
                    for k in range(PASS_UNITS):
                        amax = max(amax, absmax(first[k]), absmax(second[k]))
                        u = start + k * WARP
                        if u < stash_units:
                            store_pair_flat(stash, at + u, first[k], second[k])
            amax = lanes_max(amax, scratch, WARP)  # every lane of the block (the simulator syncs)
            if not live:
                continue
            if amax >= inf:
                for u in range(lane, units, WARP):
                    data_words[row, u] = nan_word
                scale_bits = uint32(F32_NAN)
            else:
                s = scale_exp(amax)
                mult = f32_from_bits(inv_scale_f32_bits(s))
                for start in range(lane, units, step):
                    for k in range(PASS_UNITS):  # all reads first
                        u = start + k * WARP
                        if u < stash_units:
                            first[k], second[k] = load_pair_flat(stash, at + u)
                        elif u < units:
                            first[k], second[k] = load_pair(x_words, row, u)
                    for k in range(PASS_UNITS):
                        u = start + k * WARP
                        if u < units:
                            store_word(data_words, row, u, encode_units(first[k], second[k],
                                                                        mult))
                scale_bits = s << uint32(23)
            if lane == 0:
                scales[row] = scale_bits

    return quantize_fp8_rowwise_kernel


#: fp8 rowwise quantize of bf16 and of fp32 rows (:func:`_quantize_fp8_rowwise`).
quantize_fp8_rowwise_bf16_kernel = _quantize_fp8_rowwise(False)
quantize_fp8_rowwise_f32_kernel = _quantize_fp8_rowwise(True)


@cuda.jit(device=True)
def scaled_e4m3_f32_bits(b, scale):
    """f32 bits of the e4m3 byte ``b`` times ``scale``, rounded once; F32_NAN for a NaN byte or
    product."""
    bits = bits_from_f32(f32_from_e4m3(b) * scale)
    if (b & uint32(0x7F)) == uint32(E4M3_NAN) or (bits & uint32(0x7FFFFFFF)) > uint32(F32_INF):
        return uint32(F32_NAN)
    return bits


@cuda.jit(device=True)
def scaled_e4m3x4_bf16(d, scale):
    """4 bf16 (uint64) of the 4 e4m3 in ``d`` times ``scale``, integer arithmetic, NaN canonical."""
    b0 = bf16_bits_from_f32_bits(scaled_e4m3_f32_bits(d & uint32(0xFF), scale))
    b1 = bf16_bits_from_f32_bits(scaled_e4m3_f32_bits((d >> uint32(8)) & uint32(0xFF), scale))
    b2 = bf16_bits_from_f32_bits(scaled_e4m3_f32_bits((d >> uint32(16)) & uint32(0xFF), scale))
    b3 = bf16_bits_from_f32_bits(scaled_e4m3_f32_bits(d >> uint32(24), scale))
    return uint64(b0 | (b1 << uint32(16))) | (uint64(b2 | (b3 << uint32(16))) << uint64(32))


@cuda.jit(device=True)
def dequantize_e4m3x8_bf16(d, scale, finite):
    """Two uint64 of 4 bf16 of the 8 e4m3 in ``d`` times the f32 ``scale`` (NaN -> 0x7FC0): the
    hardware conversions for a ``finite`` scale and no NaN byte, else the integer path."""
    lo = uint32(d & uint64(0xFFFFFFFF))
    hi = uint32(d >> uint64(32))
    if finite and nan_byte_mask(d) == uint64(0):
        return bf16x4_from_e4m3x4(lo, scale), bf16x4_from_e4m3x4(hi, scale)
    return scaled_e4m3x4_bf16(lo, scale), scaled_e4m3x4_bf16(hi, scale)


@cuda.jit(device=True)
def dequantize_e4m3x2_f32(d, scale):
    """One uint64 of 2 f32 of e4m3 bytes 0 and 1 of ``d`` times ``scale``; NaN -> 0x7FC00000."""
    return uint64(scaled_e4m3_f32_bits(d & uint32(0xFF), scale)) | (
        uint64(scaled_e4m3_f32_bits((d >> uint32(8)) & uint32(0xFF), scale)) << uint64(32))


@cuda.jit(device=True)
def row_of(i, words_per_row):
    """(row, column) of flat word ``i`` in rows of ``words_per_row``, without an integer division
    (an fp64 product corrected by one step; exact for i < 2^52)."""
    row = int64(float64(i) * (1.0 / float64(words_per_row)))
    col = i - row * words_per_row
    if col < 0:
        row -= 1
        col += words_per_row
    elif col >= words_per_row:
        row += 1
        col -= words_per_row
    return row, col


@cuda.jit(device=True)
def store_word_bf16(out_words, i, d, sbits):
    """Decode data word ``i`` (``d``) under scale bits ``sbits`` into ``out_words[2i:2i + 2]``."""
    finite = (sbits & uint32(0x7FFFFFFF)) < uint32(F32_INF)
    w0, w1 = dequantize_e4m3x8_bf16(d, f32_from_bits(sbits), finite)
    out_words[2 * i] = w0
    out_words[2 * i + 1] = w1


@cuda.jit(device=True)
def store_word_f32(out_words, i, d, sbits):
    """Decode data word ``i`` (``d``) under scale bits ``sbits`` into ``out_words[4i:4i + 4]``."""
    scale = f32_from_bits(sbits)
    lo = uint32(d & uint64(0xFFFFFFFF))
    hi = uint32(d >> uint64(32))
    out_words[4 * i] = dequantize_e4m3x2_f32(lo, scale)
    out_words[4 * i + 1] = dequantize_e4m3x2_f32(lo >> uint32(16), scale)
    out_words[4 * i + 2] = dequantize_e4m3x2_f32(hi, scale)
    out_words[4 * i + 3] = dequantize_e4m3x2_f32(hi >> uint32(16), scale)


def _dequantize_fp8_rowwise(store):
    """The rowwise dequantize kernel whose device function ``store`` decodes a word (into bf16 or
    fp32)."""

    @kernel
    def dequantize_fp8_rowwise_kernel(data_words, scales, out_words, words_per_row):
        """fp8 rowwise -> bf16 or fp32: x = e4m3 * scale in f32 (one rounding), then RNE for bf16; a
        NaN scale or element gives the canonical NaN.

        Args:
            data_words: (N // 8,) uint64, e4m3fn bits of the (M, D) rows, 8 per word. Read.
            scales: (M,) uint32, fp32 bits of the row scales. Read.
            out_words: (N // 4,) uint64 of bf16 bits, or (N // 2,) of f32 bits. Written.
            words_per_row: D // 8.
        Launch: launch_1d(ceil(N / 8 / WORDS_PER_THREAD)): words t + k * blockDim.x of each tile per
            thread (loads first), grid-stride; a word's row found once per tile, then stepped.
        """
        words = cuda.local.array(WORDS_PER_THREAD, uint64)
        sbits = cuda.local.array(WORDS_PER_THREAD, uint32)
        n = data_words.shape[0]
        nthreads = cuda.blockDim.x
        tile = nthreads * WORDS_PER_THREAD
        for base in range(cuda.blockIdx.x * tile + cuda.threadIdx.x, n, cuda.gridDim.x * tile):
            row, col = row_of(base, words_per_row)
            for k in range(WORDS_PER_THREAD):  # all loads first
                i = base + k * nthreads
                if i < n:
                    words[k] = data_words[i]
                    sbits[k] = scales[row]
                col += nthreads
                while col >= words_per_row:
                    col -= words_per_row
                    row += 1
            for k in range(WORDS_PER_THREAD):
                i = base + k * nthreads
                if i < n:
                    store(out_words, i, words[k], sbits[k])

    return dequantize_fp8_rowwise_kernel


#: fp8 rowwise -> bf16 and -> fp32 (:func:`_dequantize_fp8_rowwise`).
dequantize_fp8_rowwise_bf16_kernel = _dequantize_fp8_rowwise(store_word_bf16)
dequantize_fp8_rowwise_f32_kernel = _dequantize_fp8_rowwise(store_word_f32)
