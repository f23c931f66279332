"""MXFP8 quantize kernels (OCP Microscaling v1.0, e4m3fn elements, e8m0 scales) and the block max,
encode and lane helpers the other fp8 kernels share.

Layout of an (M, D) tensor of N = M * D elements, D % 32 == 0, flat, C order: MX block b covers
elements 32b .. 32b + 31 (never straddling rows), its scale ``scales[b]``. Consecutive threads load
consecutive 8-byte words; a block's lanes meet their partial max-abs (integer arithmetic on the
bits) through ``lanes_max``, in a grid-stride loop uniform per CUDA block so every lane reaches it.
"""

from numba import cuda, int32, uint8, uint16, uint32, uint64

from ._device import simulated

from ._fp8 import (BF16_INF, E4M3_NAN, E8M0_NAN, F32_INF, cvt_e4m3x2, e8m0_from_bf16_amax,
                   e8m0_from_f32_amax, f32_from_bits, inv_scale_f32_bits)
from ._launch import THREADS_PER_BLOCK, kernel
from ._memory import load_item, load_pair

#: All 32 lanes of a warp, for warp shuffles.
FULL_WARP = 0xFFFFFFFF
#: Input words each thread loads per tile (independent loads in flight).
WORDS_PER_THREAD = 4
#: bf16 quantize: pairs of input words (8 elements) per thread per tile, and pairs per MX block.
PAIRS_PER_THREAD = 2
BF16_PAIRS_PER_BLOCK = 4
BF16_PAIRS_PER_BLOCK_LOG2 = 2
#: 8-byte words per MX block of fp32 (2 per word), and its log2 (indices are never negative).
F32_WORDS_PER_BLOCK = 16
F32_WORDS_PER_BLOCK_LOG2 = 4
#: Lanes of a warp.
WARP = 32

_HIGH16 = uint32(0xFFFF0000)
_E4M3_NAN_X8 = uint64(E4M3_NAN * 0x0101010101010101)


@cuda.jit(device=True)
def bf16x4_absmax(w):
    """Max of the |x| bits (sign cleared) of the 4 bf16 packed in the uint64 ``w``, as uint32."""
    m = w & uint64(0x7FFF7FFF7FFF7FFF)
    a = max(uint32(m & uint64(0xFFFF)), uint32((m >> uint64(16)) & uint64(0xFFFF)))
    b = max(uint32((m >> uint64(32)) & uint64(0xFFFF)), uint32(m >> uint64(48)))
    return max(a, b)


@cuda.jit(device=True)
def f32x2_absmax(w):
    """Max of the |x| bits of the 2 f32 packed in the uint64 ``w``, as uint32."""
    lo = uint32(w & uint64(0x7FFFFFFF))
    hi = uint32(w >> uint64(32)) & uint32(0x7FFFFFFF)
    return max(lo, hi)


if simulated():
    @cuda.jit(device=True)
    def lanes_max(v, scratch, width):
        """Max of ``v`` over each aligned group of ``width`` threads, met in the shared ``scratch``
        (one uint32 per thread; the simulator has no shuffles). Every thread of the block must call
        it."""
        tid = cuda.threadIdx.x
        scratch[tid] = v
        cuda.syncthreads()
        first = tid - tid % width
        m = scratch[first]
        for j in range(1, width):
            m = max(m, scratch[first + j])
        cuda.syncthreads()
        return m
else:
    @cuda.jit(device=True)
    def lanes_max(v, scratch, width):
        """Max of ``v`` (uint32 < 2^31) over each aligned group of ``width`` (a power of two <= 32)
        lanes: a butterfly of warp shuffles. Every lane of the warp must call it."""
        m = int32(v)
        lane = 1
        while lane < width:
            m = max(m, cuda.shfl_xor_sync(FULL_WARP, m, lane))
            lane *= 2
        return uint32(m)


@cuda.jit(device=True)
def pairs_amax(first, second, k, scratch, width):
    """:func:`lanes_max` over ``width`` lanes of the max-abs bits of the 8 bf16 in ``first[k]``,
    ``second[k]``."""
    return lanes_max(max(bf16x4_absmax(first[k]), bf16x4_absmax(second[k])), scratch, width)


@cuda.jit(device=True)
def load_pairs(x_words, base, nthreads, n, first, second):
    """Pairs of words p = base + k * nthreads (k < PAIRS_PER_THREAD) of the flat ``x_words`` into
    ``first[k]``, ``second[k]``, zeros from ``n`` on; all loads first."""
    for k in range(PAIRS_PER_THREAD):
        p = base + k * nthreads
        first[k] = x_words[2 * p] if p < n else uint64(0)
        second[k] = x_words[2 * p + 1] if p < n else uint64(0)


@cuda.jit(device=True)
def gather_pairs(rows, x_words, base, nthreads, n, first, second):
    """:func:`load_pairs` of output pair p, taken from row ``rows[r]`` of the 2-D ``x_words``
    (output row r of p)."""
    per_row = x_words.shape[1] >> 1
    for k in range(PAIRS_PER_THREAD):
        p = base + k * nthreads
        if p < n:
            r = p // per_row
            first[k], second[k] = load_pair(x_words, load_item(rows, r), p - r * per_row)
        else:
            first[k] = uint64(0)
            second[k] = uint64(0)


@cuda.jit(device=True)
def encode_bf16x4(w, mult):
    """4 e4m3 bytes (in a uint32, element 0 lowest) of the 4 bf16 in ``w`` times ``mult``."""
    lo = uint32(w & uint64(0xFFFFFFFF))
    hi = uint32(w >> uint64(32))
    p01 = cvt_e4m3x2(f32_from_bits(lo & _HIGH16) * mult, f32_from_bits(lo << uint32(16)) * mult)
    p23 = cvt_e4m3x2(f32_from_bits(hi & _HIGH16) * mult, f32_from_bits(hi << uint32(16)) * mult)
    return uint32(p01) | (uint32(p23) << uint32(16))


@cuda.jit(device=True)
def encode_f32x2(w, mult):
    """2 e4m3 bytes (in a uint16, element 0 lowest) of the 2 f32 in ``w`` times ``mult``."""
    lo = uint32(w & uint64(0xFFFFFFFF))
    hi = uint32(w >> uint64(32))
    return cvt_e4m3x2(f32_from_bits(hi) * mult, f32_from_bits(lo) * mult)


@cuda.jit(device=True)
def encode_bf16_pair(w0, w1, amax, rceil):
    """The 8 e4m3 bytes (one uint64) of input words ``w0``, ``w1`` (8 bf16) and their block's e8m0
    scale, from the block amax (NaN bytes and scale for a NaN/Inf block)."""
    if amax >= uint32(BF16_INF):
        return _E4M3_NAN_X8, uint32(E8M0_NAN)
    s = e8m0_from_bf16_amax(amax, rceil)
    mult = f32_from_bits(inv_scale_f32_bits(s))
    return uint64(encode_bf16x4(w0, mult)) | (uint64(encode_bf16x4(w1, mult)) << uint64(32)), s


@cuda.jit(device=True)
def quantize_bf16_pair(data_words, scales, p, w0, w1, amax, lead, rceil):
    """Write pair ``p``'s 8 e4m3 bytes as one uint64, and its block's scale when ``lead``."""
    d, s = encode_bf16_pair(w0, w1, amax, rceil)
    data_words[p] = d
    if lead:
        scales[p >> BF16_PAIRS_PER_BLOCK_LOG2] = uint8(s)


def bf16_quantize_kernel(name, width, emit):
    """The quantize kernel ``name(x_words, data_words, scales, flag)`` of bf16 input whose scale
    blocks are ``width`` pairs of input words (8 bf16 each) on consecutive lanes: a block's amax met
    in :func:`lanes_max`, the device function ``emit(data_words, scales, p, w0, w1, amax, lead,
    flag)`` writes pair p (``lead``: the lane of its block's first pair). Launch:
    launch_1d(ceil(N / 8 / PAIRS_PER_THREAD)), blockDim.x a multiple of 32: pairs t + k *
    blockDim.x, k < PAIRS_PER_THREAD, of each tile per thread, grid-stride over tiles."""

    def quantize_kernel(x_words, data_words, scales, flag):
        scratch = cuda.shared.array(THREADS_PER_BLOCK, uint32)  # simulator only (lanes_max)
        first = cuda.local.array(PAIRS_PER_THREAD, uint64)
        second = cuda.local.array(PAIRS_PER_THREAD, uint64)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        n = x_words.shape[0] >> 1
        tile = nthreads * PAIRS_PER_THREAD
        lead = tid % width == 0
        for base in range(cuda.blockIdx.x * tile + tid, n + tid, cuda.gridDim.x * tile):
            load_pairs(x_words, base, nthreads, n, first, second)
            for k in range(PAIRS_PER_THREAD):  # uniform per CUDA block: all lanes meet lanes_max
                amax = pairs_amax(first, second, k, scratch, width)
                p = base + k * nthreads
                if p < n:
                    emit(data_words, scales, p, first[k], second[k], amax, lead, flag)

    quantize_kernel.__name__ = quantize_kernel.__qualname__ = name  # the PTX entry's name
    return kernel(quantize_kernel)


#: MXFP8-quantize bf16 input, 32-element blocks (OCP MX v1.0), bit-exact to the float64 formulas
#: (:func:`bf16_quantize_kernel`): scale s (e8m0) from the block's max |x| (floor:
#: floor(log2 amax) - 8; rceil: ceil(log2(amax / 448)); clamped to [-127, 127], biased by 127);
#: element = RNE(x * 2^(127 - s)) saturated to +-448; a NaN/Inf block gets s = 0xFF and elements
#: 0x7F. x_words (N // 4,) uint64, bf16 bits, 4 per word (element 0 lowest); data_words (N // 8,)
#: uint64, e4m3fn bits, 8 per word; scales (N // 32,) uint8, e8m0 bits; flag ``rceil``: True for
#: the rceil scale, False for floor.
quantize_mxfp8_bf16_kernel = bf16_quantize_kernel("quantize_mxfp8_bf16_kernel",
                                                  BF16_PAIRS_PER_BLOCK, quantize_bf16_pair)


@kernel
def gather_quantize_mxfp8_bf16_kernel(rows, x_words, data_words, scales, rceil):
    """:data:`quantize_mxfp8_bf16_kernel` of rows picked by an index: output row r is input row
    ``rows[r]`` quantized, bit for bit.

    Args:
        rows: (R,) int32, 0 <= rows[r] < M, not checked. Read.
        x_words: (M, D // 4) uint64, bf16 bits; rows 16-byte aligned. Read.
        data_words: (R * D // 8,) uint64, e4m3fn bits, output row-major. Written.
        scales: (R * D // 32,) uint8, e8m0 bits. Written.
        rceil: bool; True for the rceil scale, False for floor.
    Launch: as :data:`quantize_mxfp8_bf16_kernel`, over the output's pairs.
    """
    scratch = cuda.shared.array(THREADS_PER_BLOCK, uint32)  # simulator only (lanes_max)
    first = cuda.local.array(PAIRS_PER_THREAD, uint64)
    second = cuda.local.array(PAIRS_PER_THREAD, uint64)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    n = data_words.shape[0]
    tile = nthreads * PAIRS_PER_THREAD
    lead = tid % BF16_PAIRS_PER_BLOCK == 0
    for base in range(cuda.blockIdx.x * tile + tid, n + tid, cuda.gridDim.x * tile):
        gather_pairs(rows, x_words, base, nthreads, n, first, second)
        for k in range(PAIRS_PER_THREAD):  # uniform per CUDA block: every lane meets lanes_max
            amax = pairs_amax(first, second, k, scratch, BF16_PAIRS_PER_BLOCK)
            p = base + k * nthreads
            if p < n:
                quantize_bf16_pair(data_words, scales, p, first[k], second[k], amax, lead, rceil)


@cuda.jit(device=True)
def quantize_f32_word(data_half, scales, i, w, amax, lead, rceil):
    """Write word ``i``'s 2 e4m3 bytes, and its block's scale when ``lead``, from the block amax."""
    if amax >= uint32(F32_INF):
        data_half[i] = uint16(E4M3_NAN * 0x0101)
        s = uint32(E8M0_NAN)
    else:
        s = e8m0_from_f32_amax(amax, rceil)
        data_half[i] = encode_f32x2(w, f32_from_bits(inv_scale_f32_bits(s)))
    if lead:
        scales[i >> F32_WORDS_PER_BLOCK_LOG2] = uint8(s)


@kernel
def quantize_mxfp8_f32_kernel(x_words, data_half, scales, rceil):
    """MXFP8-quantize fp32 input (formulas of :data:`quantize_mxfp8_bf16_kernel`).

    Args:
        x_words: (N // 2,) uint64, f32 bits, 2 per word (element 0 lowest). Read.
        data_half: (N // 2,) uint16, e4m3fn bits, 2 per word. Written.
        scales: (N // 32,) uint8, e8m0 bits. Written.
        rceil: bool; True for the rceil scale, False for floor.
    Launch: launch_1d(ceil(N / 2 / WORDS_PER_THREAD)), blockDim.x <= THREADS_PER_BLOCK, a multiple
        of 16: WORDS_PER_THREAD words per thread per tile, grid-stride.
    """
    scratch = cuda.shared.array(THREADS_PER_BLOCK, uint32)  # simulator only (lanes_max)
    words = cuda.local.array(WORDS_PER_THREAD, uint64)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    n = x_words.shape[0]
    tile = nthreads * WORDS_PER_THREAD
    lead = tid % F32_WORDS_PER_BLOCK == 0
    for base in range(cuda.blockIdx.x * tile + tid, n + tid, cuda.gridDim.x * tile):
        for k in range(WORDS_PER_THREAD):  # all loads first: WORDS_PER_THREAD in flight
            i = base + k * nthreads
            words[k] = x_words[i] if i < n else uint64(0)
        for k in range(WORDS_PER_THREAD):  # uniform per CUDA block: every lane meets lanes_max
            amax = lanes_max(f32x2_absmax(words[k]), scratch, F32_WORDS_PER_BLOCK)
            i = base + k * nthreads
            if i < n:
                quantize_f32_word(data_half, scales, i, words[k], amax, lead, rceil)
