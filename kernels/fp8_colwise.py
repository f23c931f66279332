"""fp8 rowwise rows -> fp8 scaled per (group, column), transposed: the wgrad operands of a grouped GEMM.

The weight gradient of a grouped GEMM, dw[g] = x[g]^T @ grad[g], reduces over the tokens (rows) of
each group g, so its fp8 operands are scaled along the token axis: one scale per (group, column),
and laid out with the tokens contiguous (``torch._scaled_grouped_mm``'s 2d-2d case: A (K, T)
row-major, B (T, N) column-major, one fp32 scale per group and row of A / column of B; the
dynamic dimension T grouped by offsets that must be multiples of 16). The input is fp8 rowwise
rows (P, D): e4m3 bytes and power-of-two row scales 2^(r_p - 127) (r_p biased), sorted into G
groups by ``group_ends`` (G,) int32, the cumulative group ends (``permute``'s ``group_offsets``;
rows from ``group_ends[G - 1]`` on belong to no group). With v[p, d] = e4m3[p, d] * 2^(r_p - 127)
(exact) and, for group g and column d, amax = max |v| over the group's rows:

    s[g, d]      = clamp(ceil(log2(amax / 448)), -126, 127) + 127   (biased; amax = 0: 1)
    scales[g, d] = 2^(s - 127)                                       (float32, (G, D))
    out[d, t]    = RNE_e4m3(v[p, d] / scales[g, d])                  ((D, T) uint8)

the fp8 rowwise rule (``fp8_rowwise``) along the other axis. v / scale = e4m3 * 2^(r_p - s) is an
exact product rounded once (|result| <= 448, no saturation; an element 33 or more binades below
its column's maximum rounds to a signed zero, so the exponent difference is clamped to
[-32, 18]). Because both scales are powers of two, an element keeps its bits wherever its row's
scale is already its column's, and rounds only where it lands in e4m3's subnormal range: on
Gaussian rows the operands' SQNR against bf16 equals that of quantizing the bf16 columns directly
(bench/NOTES.md).

Two exact shortcuts carry the common case (both measured in bench/NOTES.md, twelfth session; the
first versions decoded every byte to fp32 and multiplied it, ~50 and ~30 instructions per byte):
  - the amax compares integers: every nonzero e4m3 times a power of two is 2^E (1 + M / 8) (a
    subnormal's 1-3 significant bits fit the same form), and its key 8 (E + KEY_BIAS) + M orders
    such values exactly; for a normal e4m3 of magnitude m in a row of scale 2^e it is m plus the
    row's base 8 (e - 7 + KEY_BIAS). Keys are below 2^12, so a thread keeps its 8 columns' running
    maxima in 16-bit halves: one add and one ``max.u16x2`` per two bytes where a SWAR test of the
    8-byte word finds only normals, a mask more where it also finds zeros (key 0), the general
    form per byte where it finds a subnormal or a NaN;
  - the encode rescales in f16 pairs: 2^k, k = r_p - s in -14..15, is a normal f16, and e4m3 (4
    significant bits) times it is exact in f16 wherever the result can be nonzero (a result
    below 2^-10, half e4m3's smallest subnormal, rounds to a signed zero either way, as in the
    MXFP8 -> rowwise gather), so a decode to f16 pairs, one f16 multiply and one encode round
    each element once. Where some factor of a position quad and a lane's 4 columns falls outside
    that range (rows 2^15 apart, a NaN column, a zero or subnormal row scale) the quad takes the
    fp32 path: the byte decoded to fp32, times row scale x the column's inverse scale (capped at
    2^RESCALE_EXP_MAX).

Token positions t: each group starts at a multiple of 16 and takes max(16, 16 * ceil(n_g / 16))
positions (``aligned_ends``, written by :func:`group_colwise_scales_kernel`): its rows first, then
zero padding; an empty group gets 16 zero positions, so the GEMM sees no empty and no misaligned
group (its 2d-2d kernel asserts on the device that every group is a multiple of 16, and the EP
path cannot promise that of the tokens without a host sync). T = 16 * ceil(P / 16) + 16 * G
bounds the positions statically; positions past the last group are zeros.

Group ends past P read no row past P (those positions are zeros). Non-finite: a row with a NaN
(or Inf) scale, or a NaN element (0x7F, 0xFF), makes its group's column NaN: scale NaN (0x7FC00000) and every element of that group and column 0x7F, so the GEMM
gives NaN where such a token contributed. Scales must be powers of two (as fp8 rowwise quantizers
write them), 0 or NaN.

Three kernels, grid-stride:
  1. :func:`group_colwise_amax_kernel`: each thread takes one data word (8 columns) of CHUNK_ROWS
     consecutive rows, keeps the running max of the keys per column and group, and merges it into
     ``keys`` (G, D) with one atomic max per column and group met (the rows are sorted by group,
     so a chunk meets one group, rarely two). Zero has the key 0, NaN (a NaN element or a
     non-finite row scale) KEY_NAN, above every other key.
  2. :func:`group_colwise_scales_kernel`: the keys become the scale bits, in place; thread 0 also
     writes ``aligned_ends``.
  3. :func:`group_colwise_encode_kernel`: tiles of TILE_POSITIONS token positions x TILE_WORDS data
     words (4 columns each): lane j of a warp takes data word j of the rows of 4-position quads
     (coalesced loads, ENCODE_LOADS words per thread in flight; a quad never spans two groups,
     which start at multiples of 16), transposes the quad's 4 x 4 bytes into one word per column
     with byte permutes, rescales them (f16 pairs, or fp32 per byte), so it holds whole output
     words (4 positions of a column), and stores them position-contiguous through a swizzled
     word tile. A CUDA block takes CHUNK_TILES tiles of one stripe of positions in a row, looking
     up the stripe's source rows, row exponents and each quad's exponent range once.
"""

from numba import cuda, float32, int32, uint16, uint32, uint64

from ._fp8 import E4M3_NAN, F32_INF, F32_NAN, byte_perm, cvt_e4m3x2, cvt_e4m3x2_f16x2, \
    cvt_f16x2_e4m3x2, max_u16x2, mul_f16x2, \
    f32_from_bits, f32_from_e4m3
from ._launch import THREADS_PER_BLOCK, kernel
from ._memory import load_flat, load_item, load_word, store_flat, store_item

#: Rows each thread of the amax kernel walks (one atomic per column and group met; 256 rather
#: than 64: 0.52 -> 0.49 ms at 131072 x 7168, 0.20 -> 0.17 ms at x 2048 on an H200, fewer
#: atomics, bench/NOTES.md twelfth session), AMAX_UNROLL
#: rows loaded at a time (written out: the kernel's four scalars), AMAX_COLUMNS columns (one
#: uint64 data word) per thread. In a loop over a local array the loaded words went through local
#: memory whenever the compiler did not unroll it (ptxas: 96 bytes of stack with 8 rows at a time,
#: 48 with 4 once the integer keys' general case made the loop body longer).
CHUNK_ROWS = 256
AMAX_UNROLL = 4
AMAX_COLUMNS = 8
_KEY_PAIRS = AMAX_COLUMNS // 2   # running keys of a thread, two columns per uint32
#: Token positions and data words (4 columns each) of one tile of the encode kernel.
TILE_POSITIONS = 64
TILE_WORDS = 32
#: Tiles of one stripe of TILE_POSITIONS positions an encode work item takes (the stripe's source
#: rows, groups and row scales looked up once for them, where each tile looked them up before:
#: 56 times per stripe at D = 7168).
CHUNK_TILES = 8
#: CUDA blocks (of 256 threads) per multiprocessor the encode kernel is compiled for (launch
#: bounds: 64 registers, 76 bytes spilled, where 83 unbounded leave 3 blocks): 1.25 ms at 131072 x
#: 7168 on an H200 against 1.27 under bounds for 3 and 1.51 unbounded (bench/NOTES.md).
ENCODE_BLOCKS_PER_SM = 4
#: Words (4 bytes) the encode kernel's input and output may each hold: it indexes them in int32.
ENCODE_MAX_WORDS = 2 ** 31 - 1
#: Position quads (4 consecutive positions, one output word per column) each thread of the encode
#: kernel takes at a time: ENCODE_LOADS data words, all loaded first.
ENCODE_QUADS = 2
ENCODE_LOADS = 4 * ENCODE_QUADS
#: Groups start at multiples of this many positions (the GEMM's rule for fp8: 16 bytes).
GROUP_ALIGN = 16
#: Clamp of the rescale exponent r_p - s (module docstring).
RESCALE_EXP_MIN = -32
RESCALE_EXP_MAX = 18
_RESCALE_CAP = float32(2.0 ** RESCALE_EXP_MAX)
#: Shared tile of the encode kernel: 4 * TILE_WORDS columns x TILE_POSITIONS / 4 words (4
#: positions each), swizzled.
_TILE_OUT_WORDS = 4 * TILE_WORDS * (TILE_POSITIONS // 4)
_TILE_QUADS = TILE_POSITIONS // 4
_TILE_PAIRS = TILE_POSITIONS // 2
#: Amax keys (module docstring, kernel 1): |v| = 2^E (1 + M / 8) has the key 8 (E + KEY_BIAS) + M,
#: positive for every nonzero e4m3 times a power-of-two f32 (E >= -9 - 149); zero has 0, NaN
#: KEY_NAN, above every other.
KEY_BIAS = 160
KEY_NAN = uint32(0xFFFFFFFF)
#: The encode's f16 path (module docstring): rescale exponents r - s it takes (2^k a normal f16),
#: the f16 pair of 2^1 as an exponent step in both halves, and its row lookup's sentinels.
FAST_K_MIN, FAST_K_MAX = -14, 15
F16X2_EXP_ONE = uint32(0x04000400)
R_PAD, R_SLOW, R_BIG = -1, -2, 1 << 16
#: Row kinds of :func:`row_key_base`.
ROW_NORMAL, ROW_ZERO, ROW_NAN = 0, 1, 2
_ABS = 0x7FFFFFFF


@cuda.jit(device=True)
def first_group(group_ends, p):
    """The group of row ``p``: the number of groups ending at or before it (G: none)."""
    g = 0
    n = group_ends.shape[0]
    while g < n and group_ends[g] <= p:
        g += 1
    return g


@cuda.jit(device=True)
def row_key_base(scale_bits):
    """The amax key base of a row whose scale has f32 bits ``scale_bits`` (uint32): (base, kind),
    kind ROW_NORMAL with base = 8 (e - 7 + KEY_BIAS) for a scale 2^e (f32 normal or subnormal;
    the key of a normal e4m3 magnitude m is then m + base), ROW_ZERO for a zero scale, ROW_NAN
    for a non-finite one (base 0)."""
    bits = scale_bits & uint32(_ABS)
    if bits >= uint32(F32_INF):
        return int32(0), ROW_NAN
    if bits == uint32(0):
        return int32(0), ROW_ZERO
    e = int32(bits >> uint32(23)) - int32(127)
    if e == int32(-127):  # an f32 subnormal 2^e = 2^-149 * bits: its bit's position
        e = int32(-118) - int32(cuda.clz(bits))
    return int32(8) * (e - int32(7) + int32(KEY_BIAS)), ROW_NORMAL


@cuda.jit(device=True)
def exact_key(b, base, kind):
    """The amax key of the e4m3 byte ``b`` (uint32) in a row of key base and kind ``base``,
    ``kind`` (:func:`row_key_base`): the general case, subnormals, zeros and NaN included."""
    m = b & uint32(0x7F)
    if m == uint32(E4M3_NAN) or kind == ROW_NAN:
        return KEY_NAN
    if m == uint32(0) or kind == ROW_ZERO:
        return uint32(0)
    if m >= uint32(8):
        return uint32(int32(m) + base)
    # a subnormal mant * 2^-9: 2^(top - 9) (1 + M / 8) with top = floor(log2 mant)
    top = int32(2) if m >= uint32(4) else (int32(1) if m >= uint32(2) else int32(0))
    frac = int32((m << uint32(int32(3) - top)) & uint32(7))
    return uint32(base + int32(8) * (top - int32(2)) + frac)


#: Word kinds of :func:`word_kind`.
WORD_NORMAL, WORD_ZEROS, WORD_SPECIAL = 0, 1, 2


@cuda.jit(device=True)
def word_kind(x):
    """What the 4 e4m3 bytes of the uint32 ``x`` hold, by SWAR tests of their magnitudes:
    WORD_NORMAL (normals only: the key is the magnitude plus the row's base), WORD_ZEROS (normals
    and zeros: key 0 for a zero), WORD_SPECIAL (a subnormal or a NaN: :func:`exact_key`)."""
    m = (x & uint32(0x7F7F7F7F)) | uint32(0x80808080)          # magnitudes, top bits set
    below_8 = ~(m - uint32(0x08080808)) & uint32(0x80808080)   # no borrow across bytes
    nonzero = (m - uint32(0x01010101)) & uint32(0x80808080)
    nan = ((x & uint32(0x7F7F7F7F)) + uint32(0x01010101)) & uint32(0x80808080)
    if (below_8 & nonzero) | nan:
        return WORD_SPECIAL
    return WORD_ZEROS if below_8 else WORD_NORMAL


@cuda.jit(device=True)
def pair_slot(c):
    """(index, shift) of column ``c`` (0..7) of a thread's word in its packed running keys:
    columns (0, 2), (1, 3), (4, 6), (5, 7) share a uint32, the first in the low half."""
    return ((c & 4) >> 1) | (c & 1), uint32(16 * ((c >> 1) & 1))


@cuda.jit(device=True)
def nonzero_lanes(v):
    """0xFFFF in each 16-bit half of the uint32 ``v`` (two magnitudes, 0..127) that is nonzero,
    0 in each that is zero."""
    return (((v + uint32(0x007F007F)) >> uint32(7)) & uint32(0x00010001)) * uint32(0xFFFF)


@cuda.jit(device=True)
def flush_keys(keys, g, col, k, exclusive):
    """Merge the packed running keys ``k`` (4, local; :func:`pair_slot`) of columns col..col+7 of
    group ``g`` into ``keys``: atomic max, or a plain store where this thread is the only one to
    write them (``exclusive``); then reset them."""
    for c in range(AMAX_COLUMNS):
        at, shift = pair_slot(c)
        key = (k[at] >> shift) & uint32(0xFFFF)
        if key == uint32(0xFFFF):
            key = KEY_NAN
        if exclusive:
            keys[g, col + c] = max(keys[g, col + c], key)
        elif key:
            cuda.atomic.max(keys, (g, col + c), key)
    for i in range(_KEY_PAIRS):
        k[i] = uint32(0)


@cuda.jit(device=True)
def take_row(keys, group_ends, k, g, g_end, q, d, scale_bits, col, exclusive):
    """Merge row ``q``'s data word ``d`` (uint64: columns col..col+7) of row scale bits
    ``scale_bits`` into the packed running keys ``k`` of group ``g`` (ending at ``g_end``), first
    flushing them into ``keys`` where row ``q`` starts a later group; returns (g, g_end).

    Keys (< 2^12) run in 16-bit halves, two columns per uint32, so one add and one
    ``max.u16x2`` serve two bytes; NaN runs as 0xFFFF."""
    if q >= g_end:
        flush_keys(keys, g, col, k, exclusive)
        while g < group_ends.shape[0] - 1 and group_ends[g] <= q:  # bounded: bad ends
            g += 1
        g_end = group_ends[g]
    base, kind = row_key_base(scale_bits)
    lo = uint32(d & uint64(0xFFFFFFFF))  # bytes by 32-bit shifts
    hi = uint32(d >> uint64(32))
    words = max(word_kind(lo), word_kind(hi)) if kind == ROW_NORMAL else WORD_SPECIAL
    if words != WORD_SPECIAL:  # magnitude + base, two bytes at a time
        both = uint32(base) * uint32(0x00010001)
        v0 = lo & uint32(0x007F007F)                      # columns 0, 2
        v1 = (lo >> uint32(8)) & uint32(0x007F007F)       # 1, 3
        v2 = hi & uint32(0x007F007F)                      # 4, 6
        v3 = (hi >> uint32(8)) & uint32(0x007F007F)       # 5, 7
        if words == WORD_NORMAL:
            k[0] = max_u16x2(k[0], v0 + both)
            k[1] = max_u16x2(k[1], v1 + both)
            k[2] = max_u16x2(k[2], v2 + both)
            k[3] = max_u16x2(k[3], v3 + both)
        else:  # zeros key 0 (ReLU-sparse rows)
            k[0] = max_u16x2(k[0], (v0 + both) & nonzero_lanes(v0))
            k[1] = max_u16x2(k[1], (v1 + both) & nonzero_lanes(v1))
            k[2] = max_u16x2(k[2], (v2 + both) & nonzero_lanes(v2))
            k[3] = max_u16x2(k[3], (v3 + both) & nonzero_lanes(v3))
    else:
        for c in range(AMAX_COLUMNS):
            word = lo if c < 4 else hi
            key = min(exact_key((word >> uint32(8 * (c & 3))) & uint32(0xFF), base, kind),
                      uint32(0xFFFF))
            at, shift = pair_slot(c)
            k[at] = max_u16x2(k[at], key << shift)
    return g, g_end


@kernel
def group_colwise_amax_kernel(data_words, row_scales, group_ends, keys, chunk_rows):
    """Per (group, column) amax keys of fp8 rowwise rows (module docstring, kernel 1).

    Args:
        data_words: (P, D // 8) uint64, e4m3 bits of the rows, 8 per word (element 0 lowest).
            Read.
        row_scales: (P,) uint32, fp32 bits of the row scales. Read.
        group_ends: (G,) int32, cumulative group ends (non-decreasing, <= P). Read.
        keys: (G, D) uint32, zeros on entry; max over the group's rows of the keys of |v|
            (module docstring; KEY_NAN for a non-finite element). Written (atomic max).
        chunk_rows: rows per work item: CHUNK_ROWS on a GPU; >= P makes every key written by one
            thread only (plain stores: the simulator's atomics serialize its Python threads on
            one lock, seconds per small launch).
    Launch: launch_1d(ceil(P / chunk_rows) * D // 8): item i is word i % (D // 8) of the rows
        [c * chunk_rows, (c + 1) * chunk_rows), c = i // (D // 8), grid-stride; AMAX_UNROLL rows
        loaded at a time (all loads in flight first).
    """
    k = cuda.local.array(_KEY_PAIRS, uint32)   # packed: pair_slot
    words = int32(data_words.shape[1])
    n_groups = group_ends.shape[0]
    if n_groups == 0:
        return
    rows = min(data_words.shape[0], group_ends[n_groups - 1])
    exclusive = chunk_rows >= rows
    n = -(-rows // chunk_rows) * words
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        c = i // words
        w = i - c * words
        col = AMAX_COLUMNS * w
        first = int32(c * chunk_rows)
        end = int32(min(first + chunk_rows, rows))
        g = first_group(group_ends, first)
        g_end = group_ends[g]
        for j in range(_KEY_PAIRS):
            k[j] = uint32(0)
        # AMAX_UNROLL = 4 rows at a time, loaded first into scalars (a local array indexed in a
        # loop the compiler does not unroll would live in local memory); rows and word indices
        # in int32 (64-bit (row, word) products cost ~7 instructions per 4 rows more)
        p = first
        at = int32(first * words + w)   # the flat index of row p's word
        while p < end:
            d0 = load_flat(data_words, at)
            s0 = load_item(row_scales, p)
            d1 = load_flat(data_words, int32(at + words)) if p + 1 < end else uint64(0)
            s1 = load_item(row_scales, p + 1) if p + 1 < end else uint32(0)
            d2 = load_flat(data_words, int32(at + 2 * words)) if p + 2 < end else uint64(0)
            s2 = load_item(row_scales, p + 2) if p + 2 < end else uint32(0)
            d3 = load_flat(data_words, int32(at + 3 * words)) if p + 3 < end else uint64(0)
            s3 = load_item(row_scales, p + 3) if p + 3 < end else uint32(0)
            g, g_end = take_row(keys, group_ends, k, g, g_end, p, d0, s0, col, exclusive)
            if p + 1 < end:
                g, g_end = take_row(keys, group_ends, k, g, g_end, p + 1, d1, s1, col,
                                    exclusive)
            if p + 2 < end:
                g, g_end = take_row(keys, group_ends, k, g, g_end, p + 2, d2, s2, col,
                                    exclusive)
            if p + 3 < end:
                g, g_end = take_row(keys, group_ends, k, g, g_end, p + 3, d3, s3, col,
                                    exclusive)
            p = int32(p + AMAX_UNROLL)
            at = int32(at + AMAX_UNROLL * words)
        flush_keys(keys, g, col, k, exclusive)


@cuda.jit(device=True)
def scale_exp_of_key(key):
    """Biased exponent s (1..254) of the scale of a finite nonzero key: with amax = 2^E (1 + M/8),
    E = key / 8 - KEY_BIAS, M = key % 8, the rowwise rule clamp(ceil(log2(amax / 448)), -126,
    127) + 127 is E - 8 + 127, plus one for M = 7 (1.875 > 1.75: 448 = 1.75 * 2^8)."""
    e = int32(key >> uint32(3)) - int32(KEY_BIAS) - int32(8)
    if (key & uint32(7)) == uint32(7):
        e += int32(1)
    return uint32(min(max(e, int32(-126)), int32(127)) + int32(127))


@kernel
def group_colwise_scales_kernel(keys, group_ends, aligned_ends):
    """The keys of kernel 1 become scale bits, in place; thread 0 writes the aligned group ends.

    Args:
        keys: (G * D,) uint32: amax keys on entry, fp32 bits of the scales on exit (NaN bits for
            a non-finite group column). Read and written.
        group_ends: (G,) int32, cumulative group ends. Read.
        aligned_ends: (G,) int32, cumulative ends of the groups' token positions, each group
            max(16, 16 * ceil(n_g / 16)) long. Written.
    Launch: launch_1d(G * D), grid-stride.
    """
    n = keys.shape[0]
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        key = keys[i]
        if key == KEY_NAN:
            keys[i] = uint32(F32_NAN)
        elif key == uint32(0):  # amax 0: 2^-126
            keys[i] = uint32(1) << uint32(23)
        else:
            keys[i] = scale_exp_of_key(key) << uint32(23)
    if cuda.grid(1) == 0:
        start = int32(0)
        aligned = int32(0)
        for g in range(group_ends.shape[0]):
            size = group_ends[g] - start
            start = group_ends[g]
            aligned += max(int32(GROUP_ALIGN),
                           (size + int32(GROUP_ALIGN - 1)) // int32(GROUP_ALIGN) * int32(GROUP_ALIGN))
            aligned_ends[g] = aligned


@cuda.jit(device=True)
def inverse_scale(bits):
    """1 / scale (f32) of a column scale with f32 bits ``bits`` (uint32): 2^(127 - s) for
    2^(s - 127), 1 <= s <= 254 (s = 254: the subnormal 2^-127), built from the exponent (exact,
    no division); NaN for NaN."""
    if (bits & uint32(_ABS)) >= uint32(F32_INF):
        return f32_from_bits(uint32(F32_NAN))
    s = bits >> uint32(23)
    if s >= uint32(254):
        return f32_from_bits(uint32(0x00400000))
    return f32_from_bits((uint32(254) - s) << uint32(23))


@cuda.jit(device=True)
def load_inverse_scales(scale_bits, g, w, inverse):
    """``inverse[0..3]``: 1 / scale of group ``g``'s columns 4w..4w+3 (exact: powers of two; NaN
    for a NaN column)."""
    for c in range(4):
        inverse[c] = inverse_scale(load_word(scale_bits, g, 4 * w + c))


@cuda.jit(device=True)
def rescale_factor(row_scale, inverse):
    """2^(r_p - s) as f32: the row scale times the column's inverse scale, capped at
    2^RESCALE_EXP_MAX; NaN stays NaN. Exact where the module docstring's clamp leaves the
    exponent alone; below 2^RESCALE_EXP_MIN it may differ from the clamped factor (down to 0),
    but every e4m3 value times either rounds to the same signed zero."""
    f = row_scale * inverse
    return f if not f > _RESCALE_CAP else _RESCALE_CAP


@cuda.jit(device=True)
def rescale_word(v, row_scale, inverse):
    """The 4 e4m3 bytes of the data word ``v`` (uint32; columns 4w..4w+3, element 0 lowest) of
    a row of scale ``row_scale`` (f32), each times its rescale factor (``inverse``: the columns'
    inverse scales): 4 f32 products, exact (the caller rounds them to e4m3)."""
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
    """The biased exponent r (1..254) of a row scale 2^(r - 127) with f32 bits ``scale_bits``
    (uint32) for the f16 path; R_SLOW where that path does not apply (zero, f32-subnormal,
    negative, non-finite or not a power of two)."""
    e = int32(scale_bits >> uint32(23))
    if (scale_bits & uint32(0x807FFFFF)) or e == 0 or e == 255:
        return int32(R_SLOW)
    return e


@cuda.jit(device=True)
def rescale_column(col, drop_ab, drop_cd, col_term):
    """The output word of one column: ``col`` (uint32) holds its e4m3 bytes at 4 positions (a, b,
    c, d from the lowest byte). With hi the quad's top row exponent: ``col_term`` is
    (hi + 15 - s) * 0x04000400 for the column's scale exponent s, ``drop_ab`` / ``drop_cd``
    the pairs (hi - r) << 10 of positions a, b / c, d (high half: b, d), so col_term - drop is
    the f16 pair 2^(r - s) of each position (every field in 1..30: no borrow). Each byte times
    its factor in f16 (exact where the result can be nonzero; module docstring), rounded once
    to e4m3."""
    lo = cvt_e4m3x2_f16x2(mul_f16x2(cvt_f16x2_e4m3x2(uint16(col & uint32(0xFFFF))),
                                    col_term - drop_ab))
    hi = cvt_e4m3x2_f16x2(mul_f16x2(cvt_f16x2_e4m3x2(uint16(col >> uint32(16))),
                                    col_term - drop_cd))
    return uint32(lo) | (uint32(hi) << uint32(16))


@cuda.jit(device=True)
def slow_pair(loaded, at, src_a, src_b, scale_a, scale_b, inverse):
    """The f32 path of two positions (the general case): 4 e4m3 pairs (uint16 each, position b's
    byte high) of the columns of data words ``loaded[at]``, ``loaded[at + 1]``."""
    fa0 = fa1 = fa2 = fa3 = fb0 = fb1 = fb2 = fb3 = float32(0)
    if src_a >= 0:
        fa0, fa1, fa2, fa3 = rescale_word(loaded[at], scale_a, inverse)
    if src_b >= 0:
        fb0, fb1, fb2, fb3 = rescale_word(loaded[at + 1], scale_b, inverse)
    return (uint32(cvt_e4m3x2(fb0, fa0)), uint32(cvt_e4m3x2(fb1, fa1)),
            uint32(cvt_e4m3x2(fb2, fa2)), uint32(cvt_e4m3x2(fb3, fa3)))


@kernel(launch_bounds=(THREADS_PER_BLOCK, ENCODE_BLOCKS_PER_SM))
def group_colwise_encode_kernel(data_words, row_scales, group_ends, scale_bits, out_words):
    """fp8 rowwise rows -> (D, T) e4m3 scaled per (group, column) (module docstring, kernel 3).

    Args:
        data_words: (P, D // 4) uint32, e4m3 bits of the rows, 4 per word. Read.
        row_scales: (P,) uint32, fp32 bits of the power-of-two row scales. Read.
        group_ends: (G,) int32, cumulative group ends. Read.
        scale_bits: (G, D) uint32, fp32 bits of the column scales (kernel 2). Read.
        out_words: (D, T // 4) uint32, e4m3 bits, 4 token positions per word. Written (every
            word).
        Both word arrays hold at most ENCODE_MAX_WORDS words: they are indexed flat, in int32.
    Launch: launch_1d(encode_items(T, D) * THREADS_PER_BLOCK), blockDim.x one of 32, 64, 128,
        256: one work item at a time per CUDA block, grid-stride over items. An item is up to
        CHUNK_TILES tiles of one stripe of TILE_POSITIONS positions: the stripe's source rows,
        groups, row scales and, per position quad, the range of its rows' scale exponents and
        their f16 factor terms go into shared memory once, then its tiles follow. In a tile,
        lane j of each warp takes data word w0 + j (4 columns) of the rows of position quads (4
        consecutive positions, always of one group: groups start at multiples of 16): it loads
        the 4 rows of two quads first (ENCODE_LOADS words in flight, coalesced across the warp),
        transposes each quad's 4 x 4 bytes with byte permutes into one word per column (its 4
        positions), and rescales them in f16 pairs where every factor 2^(r - s) of the quad and
        its columns is a normal f16 (the common case), else per byte in f32 (the general case);
        the output words go into a shared tile, then out position-contiguous (coalesced). The
        shared tile is swizzled (word (c, k) at 16 c + (k + c / 4) mod 16): at most 2-way bank
        conflicts on either side. Each position's row is kept in shared memory as the int32
        index of its first word, so a load costs a shared load, an add and one wide multiply-add
        (with 64-bit (row, word) products it took ~12 instructions: bench/NOTES.md).
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
            # store, position-contiguous: thread tid takes word k = tid % 16 of columns c =
            # tid / 16, tid / 16 + nthreads / 16, ... (int32 throughout: with the 64-bit
            # loop counter of a range, each store took ~40 instructions)
            if store_quad < positions:
                c = int32(tid >> 4)
                c_end = int32(min(4 * TILE_WORDS, d - 4 * w0))  # the tile's columns
                at = int32((4 * w0 + c) * out_stride + (store_quad >> 2))
                while c < c_end:
                    store_flat(out_words, at,
                               load_item(tile, (c << 4) + ((k_store + (c >> 2)) & 15)))
                    c = int32(c + c_step)
                    at = int32(at + at_step)
            cuda.syncthreads()
