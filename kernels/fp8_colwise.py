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

the fp8 rowwise rule (``fp8_rowwise``) along the other axis. v / scale = e4m3 * 2^(r_p - s) is
computed on the e4m3 fields, in integers: the exponent moves by r_p - s (exact), and only a result
below e4m3's normal range rounds (a right shift of the significand, ties to even); a result above
448 (possible only where the scale clamps at 2^127) saturates. So an element keeps its bits
wherever its row's scale is already its column's, and rounds only where it lands in e4m3's
subnormal range: on Gaussian rows the operands' SQNR against bf16 equals that of quantizing the
bf16 columns directly (bench/NOTES.md). The common case is inline in both passes: a normal byte's
amax key is one add (:func:`fast_key`), and its rescale one add on its exponent field
(:func:`fast_rescale`); the general rules run only for zeros, subnormals, NaN, saturation and
zero-scale rows. (A first version decoded each byte to fp32, multiplied and converted back:
3.56 ms for the encode pass at 131072 x 7168 on an H200, compute-bound; the general integer rules
on every byte: 4.21 ms on an H100, still compute-bound.)

Token positions t: each group starts at a multiple of 16 and takes max(16, 16 * ceil(n_g / 16))
positions (``aligned_ends``, written by :func:`group_colwise_scales_kernel`): its rows first, then
zero padding; an empty group gets 16 zero positions, so the GEMM sees no empty and no misaligned
group (its 2d-2d kernel asserts on the device that every group is a multiple of 16, and the EP
path cannot promise that of the tokens without a host sync). T = 16 * ceil(P / 16) + 16 * G
bounds the positions statically; positions past the last group are zeros.

Group ends past P read no row past P (those positions are zeros). Non-finite: a row with a NaN
(or Inf) scale, or a NaN element (0x7F, 0xFF), makes its group's column NaN: scale NaN
(0x7FC00000) and every element of that group and column 0x7F, so the GEMM gives NaN where such a
token contributed. Scales must be normal powers of two (as fp8 rowwise quantizers write them), 0
or NaN: only their exponent is read.

Three kernels, grid-stride:
  1. :func:`group_colwise_amax_kernel`: each thread takes one data word (8 columns) of CHUNK_ROWS
     consecutive rows, keeps the running max of |v| per column and group, and merges it into
     ``keys`` (G, D) with one atomic max per column and group met (the rows are sorted by group,
     so a chunk meets one group, rarely two). |v| is kept as an integer key that orders like it
     (:func:`abs_key`: binade and mantissa; KEY_NAN above every finite key).
  2. :func:`group_colwise_scales_kernel`: the keys become the scale bits, in place; thread 0 also
     writes ``aligned_ends``.
  3. :func:`group_colwise_encode_kernel`: tiles of TILE_POSITIONS token positions x TILE_WORDS data
     words (4 columns each): the tile's source rows are loaded row by row (coalesced, ENCODE_LOADS
     words per thread in flight), rescaled and transposed through shared memory, and stored
     position-contiguous (coalesced).
"""

from numba import cuda, int32, uint8, uint32, uint64

from ._fp8 import E4M3_NAN, F32_INF, F32_NAN
from ._launch import kernel

#: Rows each thread of the amax kernel walks (one atomic per column and group met), AMAX_UNROLL
#: rows loaded at a time, AMAX_COLUMNS columns (one uint64 data word) per thread.
CHUNK_ROWS = 64
AMAX_UNROLL = 8
AMAX_COLUMNS = 8
#: Token positions and data words (4 columns each) of one tile of the encode kernel.
TILE_POSITIONS = 64
TILE_WORDS = 32
#: Data words each thread of the encode kernel loads at a time (all in flight first).
ENCODE_LOADS = 8
#: Groups start at multiples of this many positions (the GEMM's rule for fp8: 16 bytes).
GROUP_ALIGN = 16
#: Shared tile of the encode kernel: 4 * TILE_WORDS columns x TILE_POSITIONS positions (+1 pad).
_TILE_SHAPE = (4 * TILE_WORDS, TILE_POSITIONS + 1)
_ABS = 0x7FFFFFFF
#: The amax key of a NaN element (above every finite key).
KEY_NAN = 0xFFFFFFFF


@cuda.jit(device=True)
def first_group(group_ends, p):
    """The group of row ``p``: the number of groups ending at or before it (G: none)."""
    g = 0
    n = group_ends.shape[0]
    while g < n and group_ends[g] <= p:
        g += 1
    return g


@cuda.jit(device=True)
def abs_key(b, r):
    """The amax key of the e4m3 byte ``b`` (uint32) in a row whose scale has the biased exponent
    ``r`` (uint32, from its fp32 bits; 255: NaN or Inf, 0: zero): an integer that orders like
    |v| = |e4m3| * 2^(r - 127). With |e4m3| = (8 + m) * 2^(e - 10), m < 8 (subnormals
    normalized: e <= 0), the key is ((r + e + 3) << 3) | m; 0 for a zero, KEY_NAN for NaN."""
    mag = b & uint32(0x7F)
    if mag == uint32(E4M3_NAN) or r == uint32(255):
        return uint32(KEY_NAN)
    if mag == uint32(0) or r == uint32(0):
        return uint32(0)
    e = int32(mag >> uint32(3))
    m = int32(mag & uint32(7))
    if e == 0:  # m * 2^-9: shift m up to 8..15, the exponent down as far
        shift = int32(3) if m == 1 else (int32(2) if m < 4 else int32(1))
        m = (m << shift) - int32(8)
        e = int32(1) - shift
    return uint32(((int32(r) + e + int32(3)) << int32(3)) | m)


@cuda.jit(device=True)
def fast_key(b, r, base):
    """:func:`abs_key` of the e4m3 byte ``b`` in a row of biased scale exponent ``r``, its common
    case inline: with ``base`` = (r + 3) << 3 for a row of finite, non-zero scale (0 for any other
    row), a normal finite byte's key is base + its 7 magnitude bits (binade and mantissa add up:
    ((r + e + 3) << 3) | m); zeros, subnormals, NaN and the other rows take :func:`abs_key`."""
    mag = b & uint32(0x7F)
    if base != uint32(0) and mag >= uint32(8) and mag != uint32(E4M3_NAN):
        return base + mag
    return abs_key(b, r)


@cuda.jit(device=True)
def flush_keys(keys, g, col, k, exclusive):
    """Merge the running keys ``k`` (8, local) of columns col..col+7 of group ``g`` into ``keys``:
    atomic max, or a plain store where this thread is the only one to write them
    (``exclusive``); then reset them."""
    for j in range(AMAX_COLUMNS):
        if exclusive:
            keys[g, col + j] = max(keys[g, col + j], k[j])
        elif k[j]:
            cuda.atomic.max(keys, (g, col + j), k[j])
        k[j] = uint32(0)


@kernel
def group_colwise_amax_kernel(data_words, row_scales, group_ends, keys, chunk_rows):
    """Per (group, column) amax keys of fp8 rowwise rows (module docstring, kernel 1).

    Args:
        data_words: (P, D // 8) uint64, e4m3 bits of the rows, 8 per word (element 0 lowest).
            Read.
        row_scales: (P,) uint32, fp32 bits of the row scales. Read.
        group_ends: (G,) int32, cumulative group ends (non-decreasing, <= P). Read.
        keys: (G, D) uint32, zeros on entry; max over the group's rows of :func:`abs_key`
            (KEY_NAN for a non-finite element). Written (atomic max).
        chunk_rows: rows per work item: CHUNK_ROWS on a GPU; >= P makes every key written by one
            thread only (plain stores: the simulator's atomics serialize its Python threads on
            one lock, seconds per small launch).
    Launch: launch_1d(ceil(P / chunk_rows) * D // 8): item i is word i % (D // 8) of the rows
        [c * chunk_rows, (c + 1) * chunk_rows), c = i // (D // 8), grid-stride; AMAX_UNROLL rows
        loaded at a time (all loads in flight first).
    """
    loaded = cuda.local.array(AMAX_UNROLL, uint64)
    loaded_scales = cuda.local.array(AMAX_UNROLL, uint32)
    k = cuda.local.array(AMAX_COLUMNS, uint32)
    words = data_words.shape[1]
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
        first = c * chunk_rows
        end = min(first + chunk_rows, rows)
        g = first_group(group_ends, first)
        g_end = group_ends[g]
        for j in range(AMAX_COLUMNS):
            k[j] = uint32(0)
        for p in range(first, end, AMAX_UNROLL):
            for u in range(AMAX_UNROLL):  # all loads first
                if p + u < end:
                    loaded[u] = data_words[p + u, w]
                    loaded_scales[u] = row_scales[p + u]
            for u in range(AMAX_UNROLL):
                q = p + u
                if q < end:
                    if q >= g_end:
                        flush_keys(keys, g, col, k, exclusive)
                        while g < n_groups - 1 and group_ends[g] <= q:  # bounded: bad ends
                            g += 1
                        g_end = group_ends[g]
                    r = (loaded_scales[u] >> uint32(23)) & uint32(0xFF)
                    base = (r + uint32(3)) << uint32(3) if r != uint32(0) and r != uint32(255) \
                        else uint32(0)
                    d = loaded[u]
                    for j in range(AMAX_COLUMNS):
                        k[j] = max(k[j], fast_key(uint32((d >> uint64(8 * j)) & uint64(0xFF)), r,
                                                  base))
        flush_keys(keys, g, col, k, exclusive)


@cuda.jit(device=True)
def scale_exp_of_key(key):
    """Biased exponent s (1..254) of the scale of a finite key (:func:`abs_key`): with
    R = key >> 3 and m = key & 7, amax = (1 + m / 8) * 2^(R - 137), so the rowwise rule
    clamp(ceil(log2(amax / 448)), -126, 127) + 127 is R - 18, plus one for m = 7 (above 1.75,
    448 = 1.75 * 2^8); a zero key gives 1."""
    if key == uint32(0):
        return uint32(1)
    s = int32(key >> uint32(3)) - int32(18)
    if (key & uint32(7)) == uint32(7):
        s += 1
    return uint32(min(max(s, int32(1)), int32(254)))


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
        if key == uint32(KEY_NAN):
            keys[i] = uint32(F32_NAN)
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
def rescale_byte(b, r, scale_bits):
    """The e4m3 byte ``b`` (uint32) of a row with biased scale exponent ``r`` (int32), rescaled to
    the column scale with fp32 bits ``scale_bits``: RNE_e4m3(e4m3 * 2^(r - s)), on the integer
    fields (uint32): the exponent moves by r - s; only a result below e4m3's normal range rounds
    (a right shift, ties to even); above 448 (a column scale clamped at 2^127) it saturates; 0x7F
    for a NaN column; a zero-scale row gives signed zeros."""
    if (scale_bits & uint32(_ABS)) >= uint32(F32_INF):
        return uint32(E4M3_NAN)
    mag = b & uint32(0x7F)
    sign = b & uint32(0x80)
    if mag == uint32(0) or r == 0:
        return sign
    e = int32(mag >> uint32(3))
    sig = int32(mag & uint32(7))
    if e == 0:
        e = int32(1)        # subnormal: sig * 2^(1 - 10)
    else:
        sig += int32(8)     # normal: (8 + m) * 2^(e - 10)
    e2 = e + r - int32(scale_bits >> uint32(23))
    if e2 >= 1:
        while sig < 8 and e2 > 1:
            sig <<= int32(1)
            e2 -= int32(1)
        if sig < 8:
            return sign | uint32(sig)                    # e4m3 subnormal
        if e2 > 15 or (e2 == 15 and sig == 15):
            return sign | uint32(0x7E)                   # saturate at 448
        return sign | uint32((e2 << int32(3)) | (sig - int32(8)))
    shift = int32(1) - e2
    if shift > 4:
        return sign                                      # below half the smallest subnormal
    q = sig >> shift
    rest = sig & ((int32(1) << shift) - int32(1))
    half = int32(1) << (shift - int32(1))
    if rest > half or (rest == half and (q & int32(1)) != 0):
        q += int32(1)
    return sign | uint32(q)


#: The exponent shift of :func:`fast_rescale` that sends every byte to :func:`rescale_byte`.
NO_SHIFT = -1024


@cuda.jit(device=True)
def fast_rescale(b, r, scale_bits, delta):
    """:func:`rescale_byte` with its common case inline: ``delta`` = r - s, the row's biased
    scale exponent minus the column's (:func:`column_exponent`: far below NO_SHIFT for a NaN
    column; zero-scale rows go to :func:`rescale_byte` directly). A normal
    byte whose exponent field stays in 1..15 (and is not 15 with mantissa 7, e4m3fn's NaN) only
    moves its exponent by delta: one add on the byte; the rest takes :func:`rescale_byte`."""
    mag = int32(b & uint32(0x7F))
    e2 = (mag >> int32(3)) + delta
    if mag >= int32(8) and e2 >= int32(1) and \
            (e2 < int32(15) or (e2 == int32(15) and (mag & int32(7)) != int32(7))):
        return uint32(int32(b) + (delta << int32(3)))
    return rescale_byte(b, r, scale_bits)


@cuda.jit(device=True)
def column_exponent(scale_bits):
    """The biased exponent of a column scale (its fp32 bits), or a value no row exponent reaches
    by NO_SHIFT's margin for a NaN column (so its bytes take :func:`rescale_byte`)."""
    if (scale_bits & uint32(_ABS)) >= uint32(F32_INF):
        return int32(-NO_SHIFT)
    return int32(scale_bits >> uint32(23))


@kernel
def group_colwise_encode_kernel(data_words, row_scales, group_ends, scale_bits, out_words):
    """fp8 rowwise rows -> (D, T) e4m3 scaled per (group, column) (module docstring, kernel 3).

    Args:
        data_words: (P, D // 4) uint32, e4m3 bits of the rows, 4 per word. Read.
        row_scales: (P,) uint32, fp32 bits of the power-of-two row scales. Read.
        group_ends: (G,) int32, cumulative group ends. Read.
        scale_bits: (G, D) uint32, fp32 bits of the column scales (kernel 2). Read.
        out_words: (D, T // 4) uint32, e4m3 bits, 4 token positions per word. Written (every
            word).
    Launch: launch_1d(tiles * THREADS_PER_BLOCK) with tiles = ceil(T / TILE_POSITIONS) *
        ceil(D / 4 / TILE_WORDS): one tile at a time per CUDA block, grid-stride over tiles. In a
        tile, each thread loads ENCODE_LOADS words first (with 256 threads: one word column,
        every 8th position), keeps its columns' scales while the group stays the same, and
        stores position-contiguous words through the shared tile.
    """
    tile = cuda.shared.array(_TILE_SHAPE, uint8)  # the +1 position: no bank conflicts
    source = cuda.shared.array(TILE_POSITIONS, int32)   # row of each position, -1 for padding
    group = cuda.shared.array(TILE_POSITIONS, int32)
    row_exp = cuda.shared.array(TILE_POSITIONS, int32)
    loaded = cuda.local.array(ENCODE_LOADS, uint32)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    words = data_words.shape[1]
    n_rows = data_words.shape[0]
    d = 4 * words
    positions = 4 * out_words.shape[1]
    n_groups = group_ends.shape[0]
    tiles_w = -(-words // TILE_WORDS)
    tiles = -(-positions // TILE_POSITIONS) * tiles_w
    items = TILE_POSITIONS * TILE_WORDS
    for t in range(cuda.blockIdx.x, tiles, cuda.gridDim.x):
        q0 = (t // tiles_w) * TILE_POSITIONS
        w0 = (t % tiles_w) * TILE_WORDS
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
            source[i] = src
            group[i] = g
            row_exp[i] = int32((row_scales[src] >> uint32(23)) & uint32(0xFF)) if src >= 0 else 0
        cuda.syncthreads()
        cached_g = -1
        cached_w = -1
        s0 = s1 = s2 = s3 = uint32(0)
        x0 = x1 = x2 = x3 = int32(0)
        for base in range(tid, items, nthreads * ENCODE_LOADS):  # load, rescale, transpose
            for u in range(ENCODE_LOADS):  # all loads first
                i = base + u * nthreads
                loaded[u] = uint32(0)
                if i < items:
                    r = i // TILE_WORDS
                    w = w0 + (i - r * TILE_WORDS)
                    src = source[r]
                    if src >= 0 and w < words:
                        loaded[u] = data_words[src, w]
            for u in range(ENCODE_LOADS):
                i = base + u * nthreads
                if i < items:
                    r = i // TILE_WORDS
                    j = i - r * TILE_WORDS
                    w = w0 + j
                    b0 = b1 = b2 = b3 = uint32(0)
                    if source[r] >= 0 and w < words:
                        g = group[r]
                        if g != cached_g or w != cached_w:
                            cached_g = g
                            cached_w = w
                            s0 = scale_bits[g, 4 * w]
                            s1 = scale_bits[g, 4 * w + 1]
                            s2 = scale_bits[g, 4 * w + 2]
                            s3 = scale_bits[g, 4 * w + 3]
                            x0 = column_exponent(s0)
                            x1 = column_exponent(s1)
                            x2 = column_exponent(s2)
                            x3 = column_exponent(s3)
                        e = row_exp[r]
                        word = loaded[u]
                        if e != 0:
                            b0 = fast_rescale(word & uint32(0xFF), e, s0, e - x0)
                            b1 = fast_rescale((word >> uint32(8)) & uint32(0xFF), e, s1, e - x1)
                            b2 = fast_rescale((word >> uint32(16)) & uint32(0xFF), e, s2, e - x2)
                            b3 = fast_rescale(word >> uint32(24), e, s3, e - x3)
                        else:  # a zero-scale row: signed zeros (NaN in a NaN column)
                            b0 = rescale_byte(word & uint32(0xFF), e, s0)
                            b1 = rescale_byte((word >> uint32(8)) & uint32(0xFF), e, s1)
                            b2 = rescale_byte((word >> uint32(16)) & uint32(0xFF), e, s2)
                            b3 = rescale_byte(word >> uint32(24), e, s3)
                    tile[4 * j, r] = b0
                    tile[4 * j + 1, r] = b1
                    tile[4 * j + 2, r] = b2
                    tile[4 * j + 3, r] = b3
        cuda.syncthreads()
        for i in range(tid, 4 * TILE_WORDS * (TILE_POSITIONS // 4), nthreads):  # store
            c = i // (TILE_POSITIONS // 4)
            k = i - c * (TILE_POSITIONS // 4)
            col = 4 * w0 + c
            q = q0 + 4 * k
            if col < d and q < positions:
                out_words[col, q // 4] = (uint32(tile[c, 4 * k])
                                          | (uint32(tile[c, 4 * k + 1]) << uint32(8))
                                          | (uint32(tile[c, 4 * k + 2]) << uint32(16))
                                          | (uint32(tile[c, 4 * k + 3]) << uint32(24)))
        cuda.syncthreads()
