"""MXFP8 dequantize kernels (OCP Microscaling v1.0): plain, gathered by a permutation (the permute's
MXFP8 -> bf16), and the quantize-dequantize round trips; layout as in ``kernels.mx_quantize``. Also
the flat dequantize loop the 1x128-block format shares (:func:`flat_dequantize_kernel`).
"""

from numba import cuda, uint16, uint32, uint64

from ._fp8 import (BF16_NAN, E4M3_NAN, E8M0_NAN, F32_NAN, bf16_bits_from_f32_bits, bits_from_f32,
                   cvt_bf16x2_f32, cvt_f16x2_e4m3x2, f32_from_bits, f32_from_e4m3,
                   f32_from_f16_bits, scale_f32_bits)
from ._launch import THREADS_PER_BLOCK, kernel
from ._memory import load_item, load_pair, load_word, store_pair, store_pair_flat
from .mx_quantize import (BF16_PAIRS_PER_BLOCK, PAIRS_PER_THREAD, WARP, WORDS_PER_THREAD,
                          _HIGH16, encode_bf16_pair, gather_pairs, load_pairs, pairs_amax)

#: log2 of the e4m3 words (8 elements) and of their pairs (16 elements, one 16-byte load) per MX
#: block (block index = word index >> log2; indices are never negative).
E4M3_WORDS_PER_BLOCK_LOG2, E4M3_PAIRS_PER_BLOCK_LOG2 = 2, 1
#: Pairs of data words (16 e4m3) each lane of the MXFP8 -> bf16 gather loads before decoding them;
#: the gather gives each permuted row one warp.
GATHER_PAIRS = 4
#: CUDA blocks (of THREADS_PER_BLOCK threads) per multiprocessor the gather is compiled for (launch
#: bounds) and launched with: the structure of ``mx_rowwise``'s gather.
GATHER_BLOCKS_PER_SM = 3
#: Scales s for which e4m3 * 2^(s - 127) is a normal finite bf16 for every finite e4m3:
#: 2^-9 * 2^(s - 127) >= 2^-126 and 448 * 2^(s - 127) <= bf16 max.
BF16_EXACT_SCALES = (10, 246)


@cuda.jit(device=True)
def dequantize_e4m3(b, mult):
    """f32 bits of the e4m3 byte ``b`` (in a uint32) times ``mult`` = 2^(s - 127), exact (4
    significant bits times a power of two, f32 subnormals included); F32_NAN for a NaN element."""
    bits = bits_from_f32(f32_from_e4m3(b) * mult)
    return uint32(F32_NAN) if (b & uint32(0x7F)) == uint32(E4M3_NAN) else bits


@cuda.jit(device=True)
def bf16_word_of_e4m3x4(d, s):
    """The 4 bf16 (one uint64, element 0 lowest) of the 4 e4m3 in ``d`` with block scale ``s``, by
    integer arithmetic (NaN elements and scales included). For s in BF16_EXACT_SCALES every product
    is a normal finite bf16, so the upper half of its f32 bits is the bf16: no rounding."""
    if s == uint32(E8M0_NAN):
        return uint64(BF16_NAN * 0x0001000100010001)
    mult = f32_from_bits(scale_f32_bits(s))
    f0 = dequantize_e4m3(d & uint32(0xFF), mult)
    f1 = dequantize_e4m3((d >> uint32(8)) & uint32(0xFF), mult)
    f2 = dequantize_e4m3((d >> uint32(16)) & uint32(0xFF), mult)
    f3 = dequantize_e4m3(d >> uint32(24), mult)
    if s >= uint32(BF16_EXACT_SCALES[0]) and s <= uint32(BF16_EXACT_SCALES[1]):
        lo = (f0 >> uint32(16)) | (f1 & _HIGH16)
        hi = (f2 >> uint32(16)) | (f3 & _HIGH16)
    else:
        lo = bf16_bits_from_f32_bits(f0) | (bf16_bits_from_f32_bits(f1) << uint32(16))
        hi = bf16_bits_from_f32_bits(f2) | (bf16_bits_from_f32_bits(f3) << uint32(16))
    return uint64(lo) | (uint64(hi) << uint64(32))


@cuda.jit(device=True)
def bf16x2_from_e4m3x2(pair, mult):
    """Two bf16 (uint32, element 0 lowest) of the two e4m3 in ``pair`` times ``mult``:
    e4m3 -> f16 -> f32 and the product are exact (down to 2^-136), one RNE to bf16 matches
    float64."""
    h = cvt_f16x2_e4m3x2(pair)
    return cvt_bf16x2_f32(f32_from_f16_bits(uint16(h >> uint32(16))) * mult,
                          f32_from_f16_bits(uint16(h & uint32(0xFFFF))) * mult)


@cuda.jit(device=True)
def bf16x4_from_e4m3x4(w, mult):
    """The 4 bf16 (one uint64) of the 4 e4m3 in the uint32 ``w`` times ``mult`` by the hardware
    conversions (:func:`bf16x2_from_e4m3x2`; no NaN byte)."""
    return uint64(bf16x2_from_e4m3x2(uint16(w & uint32(0xFFFF)), mult)) | (
        uint64(bf16x2_from_e4m3x2(uint16(w >> uint32(16)), mult)) << uint64(32))


@cuda.jit(device=True)
def bf16_words_of_e4m3x8(d, s):
    """The 8 bf16 (two uint64) of the 8 e4m3 in ``d`` with block scale ``s``: words without NaN take
    the hardware conversions, the rest the integer path (identical NaN bits)."""
    low7 = d & uint64(0x7F7F7F7F7F7F7F7F)
    nan_byte = ((low7 + uint64(0x0101010101010101)) & uint64(0x8080808080808080)) != uint64(0)
    lo = uint32(d & uint64(0xFFFFFFFF))
    hi = uint32(d >> uint64(32))
    if nan_byte or s == uint32(E8M0_NAN):
        return bf16_word_of_e4m3x4(lo, s), bf16_word_of_e4m3x4(hi, s)
    mult = f32_from_bits(scale_f32_bits(s))
    return bf16x4_from_e4m3x4(lo, mult), bf16x4_from_e4m3x4(hi, mult)


def flat_dequantize_kernel(name, scale_shift, store):
    """The dequantize kernel ``name(data_words, scales, out_words)`` over flat data words (uint64, 8
    e4m3 each): word i under scale ``scales[i >> scale_shift]``, decoded into ``out_words`` by the
    device function ``store(out_words, i, word, scale)``. Launch: launch_1d(ceil(N / 8 /
    WORDS_PER_THREAD)): words t + k * blockDim.x, k < WORDS_PER_THREAD, of each tile per thread,
    all loads first, grid-stride."""

    def dequantize_kernel(data_words, scales, out_words):
        words = cuda.local.array(WORDS_PER_THREAD, uint64)
        svals = cuda.local.array(WORDS_PER_THREAD, uint32)
        n = data_words.shape[0]
        nthreads = cuda.blockDim.x
        tile = nthreads * WORDS_PER_THREAD
        for base in range(cuda.blockIdx.x * tile + cuda.threadIdx.x, n, cuda.gridDim.x * tile):
            for k in range(WORDS_PER_THREAD):  # all loads first: WORDS_PER_THREAD in flight
                i = base + k * nthreads
                if i < n:
                    words[k] = data_words[i]
                    svals[k] = uint32(scales[i >> scale_shift])
            for k in range(WORDS_PER_THREAD):
                i = base + k * nthreads
                if i < n:
                    store(out_words, i, words[k], svals[k])

    dequantize_kernel.__name__ = dequantize_kernel.__qualname__ = name  # the PTX entry's name
    return kernel(dequantize_kernel)


@cuda.jit(device=True)
def store_bf16_word(out_words, i, d, s):
    """Decode data word ``i`` (``d``, one MX block's scale ``s``) into ``out_words[2i:2i + 2]``."""
    first, second = bf16_words_of_e4m3x8(d, s)
    out_words[2 * i] = first
    out_words[2 * i + 1] = second


#: MXFP8 -> bf16 (:func:`flat_dequantize_kernel`): x = e4m3 * 2^(s - 127) (OCP MX v1.0), exact in
#: f32, then RNE to bf16; a NaN scale (0xFF) or element gives NaN (0x7FC0). data_words (N // 8,)
#: uint64, e4m3fn bits, 8 per word (element 0 lowest); scales (N // 32,) uint8, e8m0 bits;
#: out_words (N // 4,) uint64, bf16 bits, 4 per word.
dequantize_mxfp8_bf16_kernel = flat_dequantize_kernel("dequantize_mxfp8_bf16_kernel",
                                                      E4M3_WORDS_PER_BLOCK_LOG2, store_bf16_word)


@kernel
def round_trip_mxfp8_bf16_kernel(x_words, out_words, rceil):
    """bf16 -> MXFP8 -> bf16 in one pass, bit for bit :func:`quantize_mxfp8_bf16_kernel` then
    :func:`dequantize_mxfp8_bf16_kernel`, the bytes and scales kept in registers: the rows a rank
    sends itself in a quantized exchange returning bf16 (they need every other row's rounding).

    Args:
        x_words: (N // 4,) uint64, bf16 bits, 4 per word (element 0 lowest). Read.
        out_words: (N // 4,) uint64, bf16 bits, 16-byte aligned, not overlapping ``x_words``.
            Written.
        rceil: bool; True for the rceil scale, False for floor.
    Launch: as :func:`quantize_mxfp8_bf16_kernel` (over pairs of input words).
    """
    scratch = cuda.shared.array(THREADS_PER_BLOCK, uint32)  # simulator only (lanes_max)
    first = cuda.local.array(PAIRS_PER_THREAD, uint64)
    second = cuda.local.array(PAIRS_PER_THREAD, uint64)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    n = x_words.shape[0] >> 1
    tile = nthreads * PAIRS_PER_THREAD
    for base in range(cuda.blockIdx.x * tile + tid, n + tid, cuda.gridDim.x * tile):
        load_pairs(x_words, base, nthreads, n, first, second)
        for k in range(PAIRS_PER_THREAD):  # uniform per CUDA block: every lane meets lanes_max
            amax = pairs_amax(first, second, k, scratch, BF16_PAIRS_PER_BLOCK)
            p = base + k * nthreads
            if p < n:
                a, b = bf16_words_of_e4m3x8(*encode_bf16_pair(first[k], second[k], amax, rceil))
                store_pair_flat(out_words, p, a, b)


@kernel
def gather_round_trip_mxfp8_bf16_kernel(rows, x_words, out_words, rceil):
    """:func:`round_trip_mxfp8_bf16_kernel` of rows picked by an index: output row r is input row
    ``rows[r]`` through MXFP8 and back, bit for bit (a quantized dispatch gradient's own rows).

    Args:
        rows: (R,) int32, 0 <= rows[r] < M, not checked. Read.
        x_words: (M, D // 4) uint64, bf16 bits; rows 16-byte aligned. Read.
        out_words: (R * D // 4,) uint64, bf16 bits, row-major, 16-byte aligned. Written.
        rceil: bool; True for the rceil scale, False for floor.
    Launch: as :func:`gather_quantize_mxfp8_bf16_kernel`.
    """
    scratch = cuda.shared.array(THREADS_PER_BLOCK, uint32)  # simulator only (lanes_max)
    first = cuda.local.array(PAIRS_PER_THREAD, uint64)
    second = cuda.local.array(PAIRS_PER_THREAD, uint64)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    n = out_words.shape[0] >> 1
    tile = nthreads * PAIRS_PER_THREAD
    for base in range(cuda.blockIdx.x * tile + tid, n + tid, cuda.gridDim.x * tile):
        gather_pairs(rows, x_words, base, nthreads, n, first, second)
        for k in range(PAIRS_PER_THREAD):  # uniform per CUDA block: every lane meets lanes_max
            amax = pairs_amax(first, second, k, scratch, BF16_PAIRS_PER_BLOCK)
            p = base + k * nthreads
            if p < n:
                a, b = bf16_words_of_e4m3x8(*encode_bf16_pair(first[k], second[k], amax, rceil))
                store_pair_flat(out_words, p, a, b)


@kernel(launch_bounds=(THREADS_PER_BLOCK, GATHER_BLOCKS_PER_SM))
def gather_dequantize_mxfp8_bf16_kernel(indices, data_words, scales_rows, out_words):
    """Permute and dequantize in one pass: bf16 row p = MXFP8 row ``indices[p]`` decoded as
    :func:`dequantize_mxfp8_bf16_kernel` does (bit for bit), zeros where ``indices[p]`` is negative
    or past the rows.

    Args:
        indices: (P,) int32 source rows or -1. Read.
        data_words: (N, D // 8) uint64, e4m3fn bits, 8 per word. Read.
        scales_rows: (N, D // 32) uint8, e8m0 bits. Read.
        out_words: (P, D // 4) uint64, bf16 bits, 4 per word. Written.
    Launch: launch_1d(ceil(P / R) * 32 * R, threads=32 * R, share=GATHER_BLOCKS_PER_SM /
        (RESIDENT_THREADS_PER_SM / (32 * R))): a warp per permuted row (as
        ``mx_rowwise.mx_to_rowwise_gather_kernel``), grid-stride; lane l takes pairs of data words
        l + 32 k (one 16-byte load, two 16-byte stores), GATHER_PAIRS loads in flight. Data and
        out addresses multiples of 16 bytes.
    """
    first = cuda.local.array(GATHER_PAIRS, uint64)
    second = cuda.local.array(GATHER_PAIRS, uint64)
    sb = cuda.local.array(GATHER_PAIRS, uint32)
    lane = cuda.threadIdx.x % WARP
    rows_per_block = cuda.blockDim.x // WARP
    npermuted = indices.shape[0]
    nsrc = data_words.shape[0]
    npairs = data_words.shape[1] // 2
    step = WARP * GATHER_PAIRS
    for base in range(cuda.blockIdx.x * rows_per_block, npermuted,
                      cuda.gridDim.x * rows_per_block):
        p = base + cuda.threadIdx.x // WARP
        if p < npermuted:
            i = load_item(indices, p)
            if i >= 0 and i < nsrc:
                for start in range(lane, npairs, step):
                    for k in range(GATHER_PAIRS):  # all loads first
                        q = start + k * WARP
                        if q < npairs:
                            first[k], second[k] = load_pair(data_words, i, q)
                            sb[k] = uint32(load_word(scales_rows, i,
                                                     q >> E4M3_PAIRS_PER_BLOCK_LOG2))
                    for k in range(GATHER_PAIRS):
                        q = start + k * WARP
                        if q < npairs:
                            a, b = bf16_words_of_e4m3x8(first[k], sb[k])
                            c, d = bf16_words_of_e4m3x8(second[k], sb[k])
                            store_pair(out_words, p, 2 * q, a, b)
                            store_pair(out_words, p, 2 * q + 1, c, d)
            else:
                for q in range(lane, 2 * npairs, WARP):
                    store_pair(out_words, p, q, uint64(0), uint64(0))


@cuda.jit(device=True)
def dequantize_word_f32(d, s, out_words, i):
    """Decode the 4 e4m3 in ``d`` (block scale ``s``) into ``out_words[2i:2i + 2]`` (4 f32)."""
    if s == uint32(E8M0_NAN):
        out_words[2 * i] = uint64(F32_NAN * 0x0000000100000001)
        out_words[2 * i + 1] = uint64(F32_NAN * 0x0000000100000001)
        return
    mult = f32_from_bits(scale_f32_bits(s))
    f0 = uint64(dequantize_e4m3(d & uint32(0xFF), mult))
    f1 = uint64(dequantize_e4m3((d >> uint32(8)) & uint32(0xFF), mult))
    f2 = uint64(dequantize_e4m3((d >> uint32(16)) & uint32(0xFF), mult))
    f3 = uint64(dequantize_e4m3(d >> uint32(24), mult))
    out_words[2 * i] = f0 | (f1 << uint64(32))
    out_words[2 * i + 1] = f2 | (f3 << uint64(32))


@cuda.jit(device=True)
def store_f32_word(out_words, i, d, s):
    """Decode data word ``i`` (``d``, one MX block's scale ``s``) into ``out_words[4i:4i + 4]``."""
    dequantize_word_f32(uint32(d & uint64(0xFFFFFFFF)), s, out_words, 2 * i)
    dequantize_word_f32(uint32(d >> uint64(32)), s, out_words, 2 * i + 1)


#: MXFP8 -> fp32 (:func:`flat_dequantize_kernel`): x = e4m3 * 2^(s - 127), exact; NaN scale or
#: element -> NaN (0x7FC00000). Arrays as :data:`dequantize_mxfp8_bf16_kernel`'s but out_words
#: (N // 2,) uint64, f32 bits, 2 per word.
dequantize_mxfp8_f32_kernel = flat_dequantize_kernel("dequantize_mxfp8_f32_kernel",
                                                     E4M3_WORDS_PER_BLOCK_LOG2, store_f32_word)
