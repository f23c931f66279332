"""fp8 1x128 block quantize / dequantize kernels: e4m3fn elements, one fp32 scale per 128 elements.

DeepSeek-V3's fine-grained activation quantization (DeepEP's fp8 dispatch, DeepGEMM's SM90 fp8
GEMMs): data (M, D) e4m3fn, scales (M, D // 128) float32, D % 128 == 0, block b of a row covering
elements 128b .. 128b + 127, ``x ~= e4m3 * scale``. With amax = max |x| over the block:

    "pow2":  scale = 2^e, e = clamp(ceil(log2(amax / 448)), -126, 127)    (DeepGEMM use_ue8m0,
             DeepEP round_scale; the rowwise format's rule per block)
             element = RNE(x / scale) as e4m3fn, saturated to +-448 (exact: a power of two)
    "plain": a = max(amax, 448 * 2^-126)             (in f32; exact)
             scale = fl32(a / 448)                   (f32 division, round to nearest even)
             mult  = fl32(1 / scale)                 (f32 division)
             element = RNE_e4m3(fl32(x * mult)), saturated to +-448

Sources: "plain" is DeepGEMM's ``per_token_cast_to_fp8`` (deep_gemm/utils/math.py), bit for bit for
amax >= 1e-4 (DeepSeek-V3's ``act_quant`` has the same scale; DeepEP's ``calculate_fp8_scales``
agrees up to one ulp); "pow2" is DeepGEMM's ``ceil_to_ue8m0``. They clamp amax to at least 1e-4; we
clamp to 448 * 2^-126 (the smallest amax whose scale is a normal f32), so blocks of small values
keep their precision. NaN/Inf blocks: scale NaN, elements 0x7F. Dequantization: ``e4m3 * scale`` in
fp32, then RNE to bf16, NaN canonical.

Work split as ``kernels.mx_quantize``: units of 8 elements, 16 lanes per block meeting through
``lanes_max``, UNITS_PER_THREAD units per thread per tile, grid-stride.
"""

from numba import cuda, float32, uint32, uint64

from ._fp8 import (BF16_INF, E4M3_NAN, F32_INF, F32_NAN, bits_from_f32, f32_from_bits,
                   inv_scale_f32_bits)
from ._launch import THREADS_PER_BLOCK, kernel
from .fp8_rowwise import rowwise_scale_exp, store_word_bf16, store_word_f32
from .mx_dequantize import WORDS_PER_THREAD, flat_dequantize_kernel  # noqa: F401 (block128)
from .mx_quantize import (PAIRS_PER_THREAD, bf16_quantize_kernel, encode_bf16x4, encode_f32x2,
                          f32x2_absmax, lanes_max)

#: Elements per scale block along the last dimension.
FP8_BLOCK = 128
#: Units of 8 elements per block (lanes meeting in lanes_max).
BLOCK_UNITS = 16
BLOCK_UNITS_LOG2 = 4
#: Units each thread loads per tile (independent loads in flight; bf16: PAIRS_PER_THREAD).
UNITS_PER_THREAD = PAIRS_PER_THREAD
#: fp32 input words (uint64, 2 elements) per unit, and per thread per tile (UNITS_PER_THREAD units).
F32_UNIT_WORDS = 4
F32_TILE_WORDS = 8
#: e4m3 data words (uint64, 8 elements) per block: 16.
DATA_WORDS_PER_BLOCK_LOG2 = 4
#: Largest finite e4m3fn magnitude, and the "plain" amax floor 448 * 2^-126 (scale >= 2^-126).
E4M3_MAX_F32 = float32(448.0)
PLAIN_AMAX_MIN = float32(448.0 * 2.0 ** -126)
#: Registers per thread (ptxas -v, sm_90, numba-cuda 0.30.4, CUDA 13.0): the wrappers cap the
#: persistent grids at the blocks that stay resident.
QUANTIZE_BF16_REGISTERS = 32
QUANTIZE_F32_REGISTERS = 38
DEQUANTIZE_REGISTERS = 40
_ONE = float32(1.0)
_E4M3_NAN_X8 = uint64(E4M3_NAN * 0x0101010101010101)


@cuda.jit(device=True)
def block_scale(amax_bits, pow2):
    """(f32 bits of the scale, f32 multiplier) of a block from its finite amax (f32 bits), "pow2" or
    "plain" (module docstring)."""
    if pow2:
        s = rowwise_scale_exp(amax_bits)
        return s << uint32(23), f32_from_bits(inv_scale_f32_bits(s))
    a = max(f32_from_bits(amax_bits), PLAIN_AMAX_MIN)
    scale = a / E4M3_MAX_F32
    return bits_from_f32(scale), _ONE / scale


@cuda.jit(device=True)
def quantize_bf16_unit(data_words, scales, p, w0, w1, amax, lead, pow2):
    """Write unit ``p``'s 8 e4m3 bytes (input words ``w0``, ``w1``) from its block's bf16 amax,
    and the block's scale bits when ``lead``."""
    if amax >= uint32(BF16_INF):
        data_words[p] = _E4M3_NAN_X8
        scale_bits = uint32(F32_NAN)
    else:
        scale_bits, mult = block_scale(amax << uint32(16), pow2)
        data_words[p] = uint64(encode_bf16x4(w0, mult)) | (uint64(encode_bf16x4(w1, mult))
                                                          << uint64(32))
    if lead:
        scales[p >> BLOCK_UNITS_LOG2] = scale_bits


#: 1x128-block fp8 quantize of bf16 input (formulas in the module docstring;
#: :func:`~kernels.mx_quantize.bf16_quantize_kernel`, a unit one pair of input words). x_words
#: (N // 4,) uint64, bf16 bits, 4 per word (element 0 lowest), N % 128 == 0; data_words (N // 8,)
#: uint64, e4m3fn bits, 8 per word; scales (N // 128,) uint32, fp32 bits of the block scales; flag
#: ``pow2``: True for "pow2" scales, False for "plain".
quantize_fp8_block128_bf16_kernel = bf16_quantize_kernel("quantize_fp8_block128_bf16_kernel",
                                                         BLOCK_UNITS, quantize_bf16_unit)


@kernel
def quantize_fp8_block128_f32_kernel(x_words, data_words, scales, pow2):
    """As :data:`quantize_fp8_block128_bf16_kernel`, of fp32 input: ``x_words`` (N // 2,) uint64, 2
    f32 per word; a unit is 4 input words."""
    scratch = cuda.shared.array(THREADS_PER_BLOCK, uint32)  # simulator only (lanes_max)
    words = cuda.local.array(F32_TILE_WORDS, uint64)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    n = data_words.shape[0]
    tile = nthreads * UNITS_PER_THREAD
    lead = tid % BLOCK_UNITS == 0
    for base in range(cuda.blockIdx.x * tile + tid, n + tid, cuda.gridDim.x * tile):
        for k in range(UNITS_PER_THREAD):  # all loads first
            p = base + k * nthreads
            for j in range(F32_UNIT_WORDS):
                words[k * F32_UNIT_WORDS + j] = x_words[4 * p + j] if p < n else uint64(0)
        for k in range(UNITS_PER_THREAD):  # uniform per CUDA block: every lane meets lanes_max
            w0 = words[k * F32_UNIT_WORDS]
            w1 = words[k * F32_UNIT_WORDS + 1]
            w2 = words[k * F32_UNIT_WORDS + 2]
            w3 = words[k * F32_UNIT_WORDS + 3]
            amax = lanes_max(max(max(f32x2_absmax(w0), f32x2_absmax(w1)),
                                 max(f32x2_absmax(w2), f32x2_absmax(w3))), scratch, BLOCK_UNITS)
            p = base + k * nthreads
            if p < n:
                if amax >= uint32(F32_INF):
                    data_words[p] = _E4M3_NAN_X8
                    scale_bits = uint32(F32_NAN)
                else:
                    scale_bits, mult = block_scale(amax, pow2)
                    data_words[p] = (uint64(encode_f32x2(w0, mult))
                                     | (uint64(encode_f32x2(w1, mult)) << uint64(16))
                                     | (uint64(encode_f32x2(w2, mult)) << uint64(32))
                                     | (uint64(encode_f32x2(w3, mult)) << uint64(48)))
                if lead:
                    scales[p >> BLOCK_UNITS_LOG2] = scale_bits


#: 1x128 block fp8 -> bf16 and -> fp32 (:func:`~kernels.mx_dequantize.flat_dequantize_kernel`):
#: x = e4m3 * scale in f32 (one rounding), then RNE for bf16; a NaN scale or element gives the
#: canonical NaN. data_words (N // 8,) uint64, e4m3fn bits, 8 per word (element 0 lowest); scales
#: (N // 128,) uint32, fp32 bits of the block scales; out_words (N // 4,) uint64 of bf16 bits, or
#: (N // 2,) of f32 bits.
dequantize_fp8_block128_bf16_kernel = flat_dequantize_kernel(
    "dequantize_fp8_block128_bf16_kernel", DATA_WORDS_PER_BLOCK_LOG2, store_word_bf16)
dequantize_fp8_block128_f32_kernel = flat_dequantize_kernel(
    "dequantize_fp8_block128_f32_kernel", DATA_WORDS_PER_BLOCK_LOG2, store_word_f32)
