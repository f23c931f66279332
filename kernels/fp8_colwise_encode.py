"""The encode kernel of ``kernels.fp8_colwise`` (formulas there): fp8 rowwise rows rescaled to their
(group, column) scales and written transposed, (D, T) e4m3.

Tiles of TILE_POSITIONS positions x TILE_WORDS data words (4 columns each): lane j of a warp takes
data word j of the rows of 4-position quads (coalesced; a quad never spans two groups, which start
at multiples of 16), transposes the quad's 4 x 4 bytes into one word per column with byte permutes,
rescales, and stores whole output words position-contiguous through a swizzled shared tile. A CUDA
block takes CHUNK_TILES tiles of one stripe, looking up its rows, row exponents and quad exponent
ranges once.

The rescale runs in f16 pairs where it can: 2^k, k = r_p - s in FAST_K_MIN..FAST_K_MAX, is a normal
f16, and e4m3 (4 significant bits) times it is exact in f16 wherever the result can be nonzero, so
decode to f16, one f16 multiply and one encode round each element once. Where a factor of a quad
falls outside that range (rows 2^15 apart, a NaN column, a zero or subnormal row scale) the quad
takes the fp32 path: the byte in fp32 times the row scale and the column's inverse scale (capped at
2^RESCALE_EXP_MAX).
"""

from numba import cuda, float32, int32, uint32

from ._fp8 import (F32_INF, F32_NAN, byte_perm, cvt_e4m3x2, f32_from_bits, f32_from_e4m3,
                   rescale_e4m3x4)
from ._launch import THREADS_PER_BLOCK, kernel
from ._memory import load_flat, load_item, load_word, store_item
from .fp8_colwise import _ABS, GROUP_ALIGN, RESCALE_EXP_MAX
from .fp8_transpose import store_tile

#: Token positions and data words (4 columns each) of one tile of the encode kernel.
TILE_POSITIONS = 64
TILE_WORDS = 32
#: Tiles of one stripe of TILE_POSITIONS positions an encode work item takes (the stripe's source
#: rows, groups and row scales looked up once for them).
CHUNK_TILES = 8
#: CUDA blocks (of 256 threads) per multiprocessor the encode kernel is compiled for (launch
#: bounds).
ENCODE_BLOCKS_PER_SM = 4
#: Words (4 bytes) the encode kernel's input and output may each hold: it indexes them in int32.
ENCODE_MAX_WORDS = 2 ** 31 - 1
#: Position quads (4 consecutive positions, one output word per column) each thread of the encode
#: kernel takes at a time: ENCODE_LOADS data words, all loaded first.
ENCODE_QUADS = 2
ENCODE_LOADS = 4 * ENCODE_QUADS
_RESCALE_CAP = float32(2.0 ** RESCALE_EXP_MAX)
#: Shared tile of the encode kernel: 4 * TILE_WORDS columns x TILE_POSITIONS / 4 words (4
#: positions each), swizzled.
_TILE_OUT_WORDS = 4 * TILE_WORDS * (TILE_POSITIONS // 4)
_TILE_QUADS = TILE_POSITIONS // 4
_TILE_PAIRS = TILE_POSITIONS // 2
#: The encode's f16 path (module docstring): rescale exponents r - s it takes (2^k a normal f16),
#: the f16 pair of 2^1 as an exponent step in both halves, and its row lookup's sentinels.
FAST_K_MIN, FAST_K_MAX = -14, 15
F16X2_EXP_ONE = uint32(0x04000400)
R_PAD, R_SLOW, R_BIG = -1, -2, 1 << 16


@cuda.jit(device=True)
def inverse_scale(bits):
    """1 / scale (f32) of a column scale 2^(s - 127) with f32 bits ``bits``: 2^(127 - s) built from
    the exponent (exact; s = 254 gives the subnormal 2^-127); NaN for NaN."""
    if (bits & uint32(_ABS)) >= uint32(F32_INF):
        return f32_from_bits(uint32(F32_NAN))
    s = bits >> uint32(23)
    if s >= uint32(254):
        return f32_from_bits(uint32(0x00400000))
    return f32_from_bits((uint32(254) - s) << uint32(23))


@cuda.jit(device=True)
def load_inverse_scales(scale_bits, g, w, inverse):
    """``inverse[0..3]``: 1 / scale of group ``g``'s columns 4w..4w+3 (exact; NaN for a NaN
    column)."""
    for c in range(4):
        inverse[c] = inverse_scale(load_word(scale_bits, g, 4 * w + c))


@cuda.jit(device=True)
def rescale_factor(row_scale, inverse):
    """2^(r_p - s) as f32: row scale times the column's inverse scale, capped at 2^RESCALE_EXP_MAX;
    NaN stays NaN. Below 2^RESCALE_EXP_MIN it may differ from the clamped factor, but every e4m3
    value times either rounds to the same signed zero."""
    f = row_scale * inverse
    return f if not f > _RESCALE_CAP else _RESCALE_CAP


@cuda.jit(device=True)
def rescale_word(v, row_scale, inverse):
    """4 exact f32 products: each e4m3 byte of ``v`` (columns 4w..4w+3) times its rescale factor."""
    return (f32_from_e4m3(v & uint32(0xFF)) * rescale_factor(row_scale, inverse[0]),
            f32_from_e4m3((v >> uint32(8)) & uint32(0xFF)) * rescale_factor(row_scale, inverse[1]),
            f32_from_e4m3((v >> uint32(16)) & uint32(0xFF)) * rescale_factor(row_scale,
                                                                             inverse[2]),
            f32_from_e4m3(v >> uint32(24)) * rescale_factor(row_scale, inverse[3]))


def encode_items(positions, d):
    """Work items of :func:`group_colwise_encode_kernel` for T = ``positions`` and D = ``d``."""
    tiles_w = -(-(d // 4) // TILE_WORDS)
    return -(-positions // TILE_POSITIONS) * -(-tiles_w // CHUNK_TILES)


@cuda.jit(device=True)
def row_exponent(scale_bits):
    """Biased exponent r (1..254) of a power-of-two row scale (f32 bits) for the f16 path; R_SLOW
    where that path does not apply (zero, subnormal, negative, non-finite, not a power of two)."""
    e = int32(scale_bits >> uint32(23))
    if (scale_bits & uint32(0x807FFFFF)) or e == 0 or e == 255:
        return int32(R_SLOW)
    return e


@cuda.jit(device=True)
def rescale_column(col, drop_ab, drop_cd, col_term):
    """The output word of one column from its e4m3 bytes ``col`` at positions a, b, c, d (lowest
    first). With hi the quad's top row exponent, ``col_term`` = (hi + 15 - s) * 0x04000400 and
    ``drop_ab`` / ``drop_cd`` = (hi - r) << 10 per position (high half: b, d), col_term - drop is
    the f16 pair 2^(r - s) (fields in 1..30: no borrow); bytes times it in f16, rounded once to
    e4m3."""
    return rescale_e4m3x4(col, col_term - drop_ab, col_term - drop_cd)


@cuda.jit(device=True)
def slow_pair(loaded, at, src_a, src_b, scale_a, scale_b, inverse):
    """The f32 path of two positions: 4 e4m3 pairs (uint16, position b's byte high) of the columns
    of data words ``loaded[at]``, ``loaded[at + 1]``."""
    fa0 = fa1 = fa2 = fa3 = fb0 = fb1 = fb2 = fb3 = float32(0)
    if src_a >= 0:
        fa0, fa1, fa2, fa3 = rescale_word(loaded[at], scale_a, inverse)
    if src_b >= 0:
        fb0, fb1, fb2, fb3 = rescale_word(loaded[at + 1], scale_b, inverse)
    return (uint32(cvt_e4m3x2(fb0, fa0)), uint32(cvt_e4m3x2(fb1, fa1)),
            uint32(cvt_e4m3x2(fb2, fa2)), uint32(cvt_e4m3x2(fb3, fa3)))


@kernel(launch_bounds=(THREADS_PER_BLOCK, ENCODE_BLOCKS_PER_SM))
def group_colwise_encode_kernel(data_words, row_scales, group_ends, scale_bits, out_words):
    """fp8 rowwise rows -> (D, T) e4m3 scaled per (group, column) (module docstring).

    Args:
        data_words: (P, D // 4) uint32, e4m3 bits of the rows, 4 per word. Read.
        row_scales: (P,) uint32, fp32 bits of the power-of-two row scales. Read.
        group_ends: (G,) int32, cumulative group ends. Read.
        scale_bits: (G, D) uint32, fp32 bits of the column scales. Read.
        out_words: (D, T // 4) uint32, e4m3 bits, 4 positions per word. Written (every word).
        Both word arrays hold at most ENCODE_MAX_WORDS words (indexed flat in int32).
    Launch: launch_1d(encode_items(T, D) * THREADS_PER_BLOCK), blockDim.x 32, 64, 128 or 256:
        one work item (up to CHUNK_TILES tiles of one stripe) per CUDA block at a time,
        grid-stride. The shared tile is swizzled (word (c, k) at 16 c + (k + c / 4) mod 16: at
        most 2-way bank conflicts).
    """
    tile = cuda.shared.array(_TILE_OUT_WORDS, uint32)
    row_word = cuda.shared.array(TILE_POSITIONS, int32)  # first word of each position's row, -1
    group = cuda.shared.array(TILE_POSITIONS, int32)
    row_scale = cuda.shared.array(TILE_POSITIONS, float32)
    rexp = cuda.shared.array(TILE_POSITIONS, int32)     # row exponent, R_PAD, R_SLOW
    quad_lo = cuda.shared.array(_TILE_QUADS, int32)
    quad_hi = cuda.shared.array(_TILE_QUADS, int32)
    pair_drop = cuda.shared.array(_TILE_PAIRS, uint32)
    loaded = cuda.local.array(ENCODE_LOADS, uint32)
    inverse = cuda.local.array(4, float32)
    s_exp = cuda.local.array(4, int32)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    lane = tid % TILE_WORDS
    slot = tid // TILE_WORDS
    slots = nthreads // TILE_WORDS
    words = data_words.shape[1]
    n_rows = data_words.shape[0]
    d = 4 * words
    out_stride = out_words.shape[1]
    positions = 4 * out_stride
    n_groups = group_ends.shape[0]
    tiles_w = -(-words // TILE_WORDS)
    chunks_w = -(-tiles_w // CHUNK_TILES)
    items = -(-positions // TILE_POSITIONS) * chunks_w
    k_store = int32(tid & 15)           # the output word (4 positions) a thread stores
    c_step = int32(nthreads >> 4)       # columns between a thread's stores
    at_step = int32(c_step * out_stride)
    for item in range(cuda.blockIdx.x, items, cuda.gridDim.x):
        q0 = (item // chunks_w) * TILE_POSITIONS
        first_tile = (item % chunks_w) * CHUNK_TILES
        store_quad = int32(q0 + 4 * k_store)  # its first position
        for i in range(tid, TILE_POSITIONS, nthreads):  # each position's source row
            q = q0 + i
            src = -1
            g = 0
            start = 0
            aligned = 0
            while g < n_groups:
                size = group_ends[g] - start
                span = max(GROUP_ALIGN, (size + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN)
                if q < aligned + span:
                    if q - aligned < size and start + q - aligned < n_rows:  # bad ends: no read
                        src = start + q - aligned
                    break
                aligned += span
                start = group_ends[g]
                g += 1
            row_word[i] = int32(src * words) if src >= 0 else int32(-1)
            group[i] = g
            bits = row_scales[src] if src >= 0 else uint32(0)
            row_scale[i] = f32_from_bits(bits)
            rexp[i] = row_exponent(bits) if src >= 0 else int32(R_PAD)
        cuda.syncthreads()
        for i in range(tid, TILE_POSITIONS // 4, nthreads):  # each quad's exponent range
            lo = int32(R_BIG)
            hi = int32(-R_BIG)
            for j in range(4):
                r = rexp[4 * i + j]
                if r == R_SLOW:
                    lo = int32(-R_BIG)
                    hi = int32(R_BIG)
                elif r != R_PAD:
                    lo = min(lo, r)
                    hi = max(hi, r)
            quad_lo[i] = lo
            quad_hi[i] = hi
            for h in range(2):  # (hi - r) per pair; padding rows (zeros) take r = hi
                ra = rexp[4 * i + 2 * h]
                rb = rexp[4 * i + 2 * h + 1]
                da = uint32(hi - ra if ra >= 0 else 0) & uint32(0x1F)  # <= 29 where it is used
                db = uint32(hi - rb if rb >= 0 else 0) & uint32(0x1F)
                pair_drop[2 * i + h] = (da << uint32(10)) | (db << uint32(26))
        cuda.syncthreads()
        for t in range(first_tile, min(first_tile + CHUNK_TILES, tiles_w)):
            w0 = t * TILE_WORDS
            w = int32(w0 + lane)
            lane_in = w < words
            cached_g = int32(-1)   # the group of ``inverse`` (f32 path)
            fast_g = int32(-1)     # the group of ``s_exp``, s_min, s_max (f16 path)
            s_min = s_max = int32(0)
            for quad0 in range(slot, TILE_POSITIONS // 4, ENCODE_QUADS * slots):
                for u in range(ENCODE_LOADS):  # all loads first: the 4 rows of each quad
                    first = load_item(row_word, 4 * (quad0 + (u // 4) * slots) + u % 4)
                    loaded[u] = load_flat(data_words, int32(first + w)) \
                        if first >= 0 and lane_in else uint32(0)
                for qi in range(ENCODE_QUADS):
                    quad = quad0 + qi * slots
                    qp = 4 * quad
                    lo = load_item(quad_lo, quad)
                    hi = load_item(quad_hi, quad)
                    out0 = out1 = out2 = out3 = uint32(0)
                    if hi != int32(-R_BIG) and lane_in:  # some row (else all padding: zeros)
                        g = load_item(group, qp)
                        if g != fast_g:
                            fast_g = g
                            s_min = int32(R_BIG)
                            s_max = int32(0)
                            for c in range(4):
                                s = int32(load_word(scale_bits, g, 4 * w + c) >> uint32(23))
                                s_exp[c] = s
                                s_min = min(s_min, s if s != 255 else int32(-R_BIG))
                                s_max = max(s_max, s)
                        if int32(hi - s_min) <= FAST_K_MAX and int32(lo - s_max) >= FAST_K_MIN:
                            a = loaded[4 * qi]
                            b = loaded[4 * qi + 1]
                            c = loaded[4 * qi + 2]
                            e = loaded[4 * qi + 3]
                            t0 = byte_perm(a, b, uint32(0x5140))   # a0 b0 a1 b1
                            t1 = byte_perm(c, e, uint32(0x5140))   # c0 d0 c1 d1
                            t2 = byte_perm(a, b, uint32(0x7362))   # a2 b2 a3 b3
                            t3 = byte_perm(c, e, uint32(0x7362))   # c2 d2 c3 d3
                            dab = load_item(pair_drop, 2 * quad)
                            dcd = load_item(pair_drop, 2 * quad + 1)
                            top = hi + int32(15)
                            out0 = rescale_column(byte_perm(t0, t1, uint32(0x5410)), dab, dcd,
                                                  uint32(top - s_exp[0]) * F16X2_EXP_ONE)
                            out1 = rescale_column(byte_perm(t0, t1, uint32(0x7632)), dab, dcd,
                                                  uint32(top - s_exp[1]) * F16X2_EXP_ONE)
                            out2 = rescale_column(byte_perm(t2, t3, uint32(0x5410)), dab, dcd,
                                                  uint32(top - s_exp[2]) * F16X2_EXP_ONE)
                            out3 = rescale_column(byte_perm(t2, t3, uint32(0x7632)), dab, dcd,
                                                  uint32(top - s_exp[3]) * F16X2_EXP_ONE)
                        else:
                            if g != cached_g:
                                cached_g = g
                                load_inverse_scales(scale_bits, g, w, inverse)
                            for half in range(2):  # positions (0, 1), then (2, 3) of the quad
                                ra = qp + 2 * half
                                p0, p1, p2, p3 = slow_pair(
                                    loaded, 4 * qi + 2 * half, load_item(row_word, ra),
                                    load_item(row_word, ra + 1), load_item(row_scale, ra),
                                    load_item(row_scale, ra + 1), inverse)
                                at = uint32(16 * half)
                                out0 |= p0 << at
                                out1 |= p1 << at
                                out2 |= p2 << at
                                out3 |= p3 << at
                    at = 64 * lane + ((quad + lane) & 15)  # swizzled (column 4 lane, quad)
                    store_item(tile, at, out0)
                    store_item(tile, at + 16, out1)
                    store_item(tile, at + 32, out2)
                    store_item(tile, at + 48, out3)
            cuda.syncthreads()
            # store, position-contiguous: thread tid takes word tid % 16 of columns
            # tid / 16 + j * nthreads / 16
            if store_quad < positions:
                c = int32(tid >> 4)
                store_tile(out_words, tile, c, int32(min(4 * TILE_WORDS, d - 4 * w0)),
                           int32((4 * w0 + c) * out_stride + (store_quad >> 2)), k_store, c_step,
                           at_step)
            cuda.syncthreads()
