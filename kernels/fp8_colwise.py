"""fp8 rowwise rows -> fp8 scaled per (group, column), transposed: the wgrad operands of a grouped
GEMM (amax and scale kernels; the encode is ``kernels.fp8_colwise_encode``).

dw[g] = x[g]^T @ grad[g] reduces over each group's tokens, so its operands are scaled along the
token axis, tokens contiguous (``torch._scaled_grouped_mm``'s 2d-2d case: A (K, T) row-major, B
(T, N) column-major, offsets multiples of 16). Input: fp8 rowwise rows (P, D), power-of-two row
scales 2^(r_p - 127), in G groups ending at ``group_ends`` (G,) int32 (rows from
``group_ends[G - 1]`` on in none). With v[p, d] = e4m3[p, d] * 2^(r_p - 127) and amax = max |v|
over group g's rows in column d, the fp8 rowwise rule along the other axis:

    s[g, d]      = clamp(ceil(log2(amax / 448)), -126, 127) + 127   (biased; amax = 0: 1)
    scales[g, d] = 2^(s - 127)                                       (float32, (G, D))
    out[d, t]    = RNE_e4m3(v[p, d] / scales[g, d])                  ((D, T) uint8)

v / scale = e4m3 * 2^(r_p - s) is exact, rounded once (the exponent difference clamped to
[RESCALE_EXP_MIN, RESCALE_EXP_MAX]: 33 or more binades below the column's maximum an element
rounds to a signed zero anyway). Each group starts at a multiple of GROUP_ALIGN token positions and
takes max(16, 16 ceil(n_g / 16)) (``aligned_ends``): its rows, then zeros; T = 16 ceil(P / 16) +
16 G bounds them. A row with a NaN/Inf scale or NaN element makes its group's column NaN (scale
0x7FC00000, elements 0x7F). Row scales must be powers of two, 0 or NaN.

The amax compares integer keys: a nonzero e4m3 times a power of two is 2^E (1 + M / 8), its key
8 (E + KEY_BIAS) + M orders such values exactly (zero 0, NaN KEY_NAN), below 2^12 (two keys per
uint32).
"""

from numba import cuda, int32, uint32, uint64

from ._fp8 import E4M3_NAN, F32_INF, F32_NAN, max_u16x2
from ._launch import kernel
from ._memory import load_flat, load_item

#: Rows each thread of the amax kernel walks, AMAX_UNROLL rows loaded at a time, AMAX_COLUMNS
#: columns (one uint64 data word) per thread.
CHUNK_ROWS = 256
AMAX_UNROLL = 4
AMAX_COLUMNS = 8
_KEY_PAIRS = AMAX_COLUMNS // 2   # running keys of a thread, two columns per uint32
#: Groups start at multiples of this many positions (the GEMM's rule for fp8: 16 bytes).
GROUP_ALIGN = 16
#: Clamp of the rescale exponent r_p - s (module docstring).
RESCALE_EXP_MIN = -32
RESCALE_EXP_MAX = 18
#: Amax keys (module docstring, kernel 1): |v| = 2^E (1 + M / 8) has the key 8 (E + KEY_BIAS) + M,
#: positive for every nonzero e4m3 times a power-of-two f32 (E >= -9 - 149); zero has 0, NaN
#: KEY_NAN, above every other.
KEY_BIAS = 160
KEY_NAN = uint32(0xFFFFFFFF)
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
    """(base, kind) of a row whose scale has f32 bits ``scale_bits``: ROW_NORMAL with base = 8
    (e - 7 + KEY_BIAS) for a scale 2^e (normal or subnormal; a normal e4m3 magnitude m then has key
    m + base), ROW_ZERO for a zero scale, ROW_NAN for a non-finite one (base 0)."""
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
    """The amax key of the e4m3 byte ``b`` in a row of (``base``, ``kind``): the general case,
    subnormals, zeros and NaN included."""
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
    """What the 4 e4m3 bytes of ``x`` hold (SWAR tests): WORD_NORMAL (normals only:
    key = magnitude + base), WORD_ZEROS (normals and zeros), WORD_SPECIAL (a subnormal or NaN:
    :func:`exact_key`)."""
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
    """0xFFFF in each nonzero 16-bit half of ``v`` (two magnitudes, 0..127), 0 in each zero one."""
    return (((v + uint32(0x007F007F)) >> uint32(7)) & uint32(0x00010001)) * uint32(0xFFFF)


@cuda.jit(device=True)
def flush_keys(keys, g, col, k, exclusive):
    """Merge the packed running keys ``k`` of columns col..col+7 of group ``g`` into ``keys``
    (atomic max, or a plain max where ``exclusive``: this thread alone writes them); reset them."""
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
    """Merge row ``q``'s data word ``d`` (columns col..col+7, scale bits ``scale_bits``) into the
    running keys ``k`` of group ``g``, first flushing them where ``q`` starts a later group; returns
    (g, g_end). Keys run in 16-bit halves, so one add and one ``max.u16x2`` serve two bytes; NaN
    runs as 0xFFFF."""
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
    """Per (group, column) amax keys of fp8 rowwise rows (module docstring).

    Args:
        data_words: (P, D // 8) uint64, e4m3 bits, 8 per word (element 0 lowest). Read.
        row_scales: (P,) uint32, fp32 bits of the row scales. Read.
        group_ends: (G,) int32, cumulative group ends (non-decreasing, <= P). Read.
        keys: (G, D) uint32, zeros on entry; the max key of |v| over the group's rows (KEY_NAN
            for a non-finite element). Written (atomic max).
        chunk_rows: rows per work item: CHUNK_ROWS on a GPU; >= P makes each key one thread's
            (plain stores: the simulator).
    Launch: launch_1d(ceil(P / chunk_rows) * D // 8): item i is word i % (D // 8) of rows
        [c * chunk_rows, (c + 1) * chunk_rows), c = i // (D // 8), grid-stride; AMAX_UNROLL rows
        loaded at a time.
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
        # AMAX_UNROLL = 4 rows at a time, loaded first into scalars (a local array in a loop not
        # unrolled would live in local memory); rows and word indices in int32 (cheaper)
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
    E = key / 8 - KEY_BIAS, M = key % 8, the rowwise rule gives E - 8 + 127, plus one for M = 7
    (1.875 > 1.75: 448 = 1.75 * 2^8), clamped."""
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
