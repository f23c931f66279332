"""MXFP8 -> fp8 rowwise inside the permute: gather MXFP8 rows and rescale them to one scale per row.

For each permuted row p, with source row i = indices[p] of the MXFP8 rows (data e4m3 (N, D), e8m0
scales s_b (N, D / 32)):

    i < 0 or i >= N (padding):     elements 0x00, scale 1.0
    some s_b == 0xFF (NaN block):  elements 0x7F, scale NaN (0x7FC00000): the whole row is NaN
    otherwise:                     r = max(max_b s_b, 1)               (biased exponent)
                                   scale = 2^(r - 127)                 (>= 2^-126, as fp8 rowwise)
                                   element = RNE_e4m3(v * 2^(s_b - r)) for element v of block b

computed in f16 pairs and rounded once (:func:`rescale_e4m3x8`); |result| <= |v| needs no
saturation; a block at the row's scale is copied bit for bit, NaN elements stay. For "rceil" MXFP8
the row scale is the rowwise scale of the original row (docs/design.md, "Formats"). One warp per
permuted row, grid-stride: the row's scale max met through warp shuffles, then each lane streams
16-byte pairs of data words with their blocks' scales.
"""

from numba import cuda, int32, uint32, uint64

from ._fp8 import E4M3_NAN, E8M0_NAN, F32_NAN, rescale_e4m3x4
from ._launch import THREADS_PER_BLOCK, kernel
from ._memory import load_pair, load_word, store_pair
from .fp8_rowwise import F32_ONE, SCALE_EXP_MIN, WARP, nan_byte_mask
from .mx_quantize import lanes_max

#: Pairs of data words (16 e4m3, one 16-byte load) each thread loads per step, all in flight.
PASS_PAIRS = 4
#: CUDA blocks (of 256 threads) per multiprocessor the gather is compiled for (launch bounds).
GATHER_BLOCKS_PER_SM = 3
#: Registers per thread of the gather kernel (ptxas -v, sm_90; 76 under those bounds): the wrapper
#: caps its grid at the blocks that stay resident.
GATHER_REGISTERS = 80
#: log2 of the pairs of data words per MX block (32 elements = 4 words = 2 pairs).
MX_PAIRS_PER_BLOCK_LOG2 = 1
#: Smallest rescale exponent used: 448 * 2^-19 < 2^-10 already rounds to zero in e4m3 (and 2^-19
#: is an f16, a subnormal one).
RESCALE_EXP_MIN = -19
_E4M3_NAN_X8 = uint64(E4M3_NAN * 0x0101010101010101)


@cuda.jit(device=True)
def f16x2_pow2(k):
    """The f16 pair (uint32 bits) of 2^k in both halves, -24 <= k <= 15 (below -14 subnormal)."""
    if k >= int32(-14):
        bits = uint32(int32(int32(15) + k)) << uint32(10)
    else:
        bits = uint32(1) << uint32(int32(int32(24) + k))
    return bits | (bits << uint32(16))


@cuda.jit(device=True)
def rescale_e4m3x8(d, mult):
    """The 8 e4m3 of the uint64 ``d`` times ``mult`` (the f16 pair of 2^k, -19 <= k <= 0), NaN
    bytes kept. The f16 products are exact wherever the result can be nonzero (v * 2^k is a multiple
    of 2^-24 unless below 2^-21, and below 2^-10 everything rounds to zero)."""
    lo = rescale_e4m3x4(uint32(d & uint64(0xFFFFFFFF)), mult, mult)
    hi = rescale_e4m3x4(uint32(d >> uint64(32)), mult, mult)
    nan = nan_byte_mask(d)
    return ((uint64(lo) | (uint64(hi) << uint64(32))) & ~nan) | (d & nan)


@cuda.jit(device=True)
def rescale_pair(first, second, s, r):
    """The 16 e4m3 of ``first``, ``second`` (one block, scale 2^(s - 127)) at the row scale
    2^(r - 127), r >= s: RNE_e4m3(v * 2^(s - r)), NaN bytes kept; as they are when s == r."""
    if s >= r:
        return first, second
    mult = f16x2_pow2(max(int32(int32(s) - int32(r)), int32(RESCALE_EXP_MIN)))
    return rescale_e4m3x8(first, mult), rescale_e4m3x8(second, mult)


@kernel(launch_bounds=(THREADS_PER_BLOCK, GATHER_BLOCKS_PER_SM))
def mx_to_rowwise_gather_kernel(indices, data_words, mx_scales, out_words, out_scales):
    """out[p] = the fp8 rowwise form of MXFP8 row indices[p] (module docstring).

    Args:
        indices: (P,) int32 source rows, or -1 for padding (a row >= N too). Read.
        data_words: (N, D // 8) uint64, MXFP8 e4m3fn bits, 8 per word (element 0 lowest). Read.
        mx_scales: (N, D // 32) uint8, e8m0 bits. Read.
        out_words: (P, D // 8) uint64, e4m3fn bits. Written.
        out_scales: (P,) uint32, fp32 bits of the row scales. Written.
    Launch: launch_1d(ceil(P / R) * 32 * R, threads=32 * R): a warp per permuted row, grid-stride
        in steps uniform per CUDA block; lane l takes word pairs l + 32 k, PASS_PAIRS loads in
        flight. Data and out data addresses multiples of 16 bytes.
    """
    scratch = cuda.shared.array(THREADS_PER_BLOCK, uint32)  # simulator only (lanes_max)
    first = cuda.local.array(PASS_PAIRS, uint64)
    second = cuda.local.array(PASS_PAIRS, uint64)
    sb = cuda.local.array(PASS_PAIRS, uint32)
    lane = cuda.threadIdx.x % WARP
    rows_per_block = cuda.blockDim.x // WARP
    npermuted = indices.shape[0]
    nsrc = data_words.shape[0]
    ncols = out_words.shape[1]
    npairs = ncols // 2
    nblocks = mx_scales.shape[1]
    step = WARP * PASS_PAIRS
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
            for start in range(lane, npairs, step):
                for k in range(PASS_PAIRS):  # all loads first
                    q = start + k * WARP
                    if q < npairs:
                        first[k], second[k] = load_pair(data_words, i, q)
                        sb[k] = uint32(load_word(mx_scales, i, q >> MX_PAIRS_PER_BLOCK_LOG2))
                for k in range(PASS_PAIRS):
                    q = start + k * WARP
                    if q < npairs:
                        a, b = rescale_pair(first[k], second[k], sb[k], r)
                        store_pair(out_words, p, q, a, b)
            scale_bits = r << uint32(23)
        if lane == 0:
            out_scales[p] = scale_bits
