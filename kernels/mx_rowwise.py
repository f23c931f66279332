"""MXFP8 -> fp8 rowwise inside the permute: gather MXFP8 rows and rescale them to one scale per row.

For each permuted row p, with source row i = indices[p] of the MXFP8 rows (data e4m3 (N, D), e8m0
scales s_b (N, D / 32)):

    i < 0 or i >= N (padding):     elements 0x00, scale 1.0
    some s_b == 0xFF (NaN block):  elements 0x7F, scale NaN (0x7FC00000): the whole row is NaN
    otherwise:                     r = max(max_b s_b, 1)               (biased exponent)
                                   scale = 2^(r - 127)                 (>= 2^-126, as fp8 rowwise)
                                   element = RNE_e4m3(v * 2^(s_b - r)) for element v of block b

v * 2^(s_b - r) is exact in f32 (4 significant bits times a power of two >= 2^-32; every element
of a block 19 or more binades below the row's maximum rounds to a signed zero anyway), so each
element is rounded once, and |result| <= |v| <= 448 needs no saturation. A block at the row's
scale (s_b == r) is copied bit for bit. Elements that are e4m3 NaN (0x7F, 0xFF; quantize_mxfp8
writes them only in NaN blocks) stay as they are. For MXFP8 quantized with the "rceil" scale,
the row scale is exactly the rowwise scale of the original row, and since a normal e4m3 times 2^-k
stays exact down to e4m3's smallest normal, the elements differ from quantizing the row directly
only where they land in e4m3's subnormal range (below 2^-6 of the row scale): measured on Gaussian,
outlier-channel and Student-t rows at 1024 x 7168, the SQNR against the bf16 rows is the same to
1e-4 dB (31.49 dB on Gaussian rows).

Work split: one warp per permuted row, grid-stride over rows (as the rowwise quantize kernels; one
CUDA block per row measured 0.49x copy bandwidth on an H200, bench/NOTES.md). The warp first reads
the row's D / 32 scale bytes, whose max meets through warp shuffles; then each lane streams data
words l + 32 k of the row with their blocks' scales (PASS_WORDS loads in flight), rescales and
stores them.
"""

from numba import cuda, int32, uint16, uint32, uint64

from ._fp8 import (E4M3_NAN, E8M0_NAN, F32_NAN, cvt_e4m3x2, cvt_f16x2_e4m3x2, f32_from_bits,
                   f32_from_f16_bits)
from ._launch import THREADS_PER_BLOCK, kernel
from .fp8_rowwise import F32_ONE, SCALE_EXP_MIN, WARP, nan_byte_mask
from .mxfp8 import lanes_max

#: Data words (8 e4m3 each) each thread loads per step, all in flight at once.
PASS_WORDS = 8
#: Registers per thread of the gather kernel (ptxas -v, sm_90, numba-cuda 0.30.4, CUDA 13.0): the
#: wrapper caps its grid at the blocks that stay resident.
GATHER_REGISTERS = 96
#: log2 of the data words per MX block (32 elements = 4 words).
MX_WORDS_PER_BLOCK_LOG2 = 2
#: Smallest rescale exponent used: 448 * 2^-19 < 2^-10 already rounds to zero in e4m3.
RESCALE_EXP_MIN = -32
_E4M3_NAN_X8 = uint64(E4M3_NAN * 0x0101010101010101)


@cuda.jit(device=True)
def rescale_e4m3x4(d, mult):
    """4 e4m3 (uint32, element 0 lowest) of the 4 e4m3 in the uint32 ``d`` times the power of two
    ``mult`` (f32, <= 1): exact decode (cvt.f16x2.e4m3x2), exact product, one RNE to e4m3."""
    h01 = cvt_f16x2_e4m3x2(uint16(d & uint32(0xFFFF)))
    h23 = cvt_f16x2_e4m3x2(uint16(d >> uint32(16)))
    p01 = cvt_e4m3x2(f32_from_f16_bits(uint16(h01 >> uint32(16))) * mult,
                     f32_from_f16_bits(uint16(h01 & uint32(0xFFFF))) * mult)
    p23 = cvt_e4m3x2(f32_from_f16_bits(uint16(h23 >> uint32(16))) * mult,
                     f32_from_f16_bits(uint16(h23 & uint32(0xFFFF))) * mult)
    return uint32(p01) | (uint32(p23) << uint32(16))


@cuda.jit(device=True)
def rescale_e4m3x8(d, s, r):
    """The 8 e4m3 of the uint64 ``d`` (block scale 2^(s - 127)) re-expressed at the row scale
    2^(r - 127), r >= s: RNE_e4m3(v * 2^(s - r)); NaN bytes kept; ``d`` itself when s == r."""
    if s >= r:
        return d
    k = max(int32(s) - int32(r), int32(RESCALE_EXP_MIN))
    mult = f32_from_bits(uint32(int32(127) + k) << uint32(23))
    lo = rescale_e4m3x4(uint32(d & uint64(0xFFFFFFFF)), mult)
    hi = rescale_e4m3x4(uint32(d >> uint64(32)), mult)
    nan = nan_byte_mask(d)
    return ((uint64(lo) | (uint64(hi) << uint64(32))) & ~nan) | (d & nan)


@kernel
def mx_to_rowwise_gather_kernel(indices, data_words, mx_scales, out_words, out_scales):
    """out[p] = fp8 rowwise form of MXFP8 row indices[p] (rules in the module docstring).

    Args:
        indices: (P,) int32 source rows, or -1 for padding (a row >= N is padding too). Read.
        data_words: (N, D // 8) uint64, MXFP8 e4m3fn bits, 8 per word (element 0 lowest). Read.
        mx_scales: (N, D // 32) uint8, e8m0 bits. Read.
        out_words: (P, D // 8) uint64, e4m3fn bits. Written.
        out_scales: (P,) uint32, fp32 bits of the row scales. Written.
    Launch: launch_1d(ceil(P / R) * 32 * R, threads=32 * R): one warp per permuted row (R rows
        per CUDA block), grid-stride over rows in steps uniform per CUDA block; lane l takes
        words l + 32 k, PASS_WORDS loads in flight.
    """
    scratch = cuda.shared.array(THREADS_PER_BLOCK, uint32)  # simulator only (lanes_max)
    words = cuda.local.array(PASS_WORDS, uint64)
    sb = cuda.local.array(PASS_WORDS, uint32)
    lane = cuda.threadIdx.x % WARP
    rows_per_block = cuda.blockDim.x // WARP
    npermuted = indices.shape[0]
    nsrc = data_words.shape[0]
    ncols = out_words.shape[1]
    nblocks = mx_scales.shape[1]
    step = WARP * PASS_WORDS
    for base in range(cuda.blockIdx.x * rows_per_block, npermuted,
                      cuda.gridDim.x * rows_per_block):
        p = base + cuda.threadIdx.x // WARP
        i = indices[p] if p < npermuted else -1
        source = 0 <= i < nsrc  # uniform per warp
        smax = uint32(0)
        if source:
            for b in range(lane, nblocks, WARP):  # the row's scales: 1/32 of its bytes
                smax = max(smax, uint32(mx_scales[i, b]))
        smax = lanes_max(smax, scratch, WARP)  # every lane of the block (the simulator syncs)
        if p >= npermuted:
            continue
        if not source:  # padding
            for w in range(lane, ncols, WARP):
                out_words[p, w] = 0
            scale_bits = uint32(F32_ONE)
        elif smax == uint32(E8M0_NAN):  # 0xFF is the largest byte: some block is NaN
            for w in range(lane, ncols, WARP):
                out_words[p, w] = _E4M3_NAN_X8
            scale_bits = uint32(F32_NAN)
        else:
            r = max(smax, uint32(SCALE_EXP_MIN))
            for start in range(lane, ncols, step):
                for k in range(PASS_WORDS):  # all loads first
                    w = start + k * WARP
                    if w < ncols:
                        words[k] = data_words[i, w]
                        sb[k] = uint32(mx_scales[i, w >> MX_WORDS_PER_BLOCK_LOG2])
                for k in range(PASS_WORDS):
                    w = start + k * WARP
                    if w < ncols:
                        out_words[p, w] = rescale_e4m3x8(words[k], sb[k], r)
            scale_bits = r << uint32(23)
        if lane == 0:
            out_scales[p] = scale_bits
