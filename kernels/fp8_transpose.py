"""bf16 matrices -> fp8 rowwise along their columns, transposed: the weights of a dgrad.

dx[g] = grad[g] @ w[g]^T reduces over N, so its fp8 B operand is w[g] (K, N) scaled along N, N
contiguous; MoE layers keep expert weights as (G, N, K), K contiguous (torchtitan's ``w1`` is (E, H,
D)), so the operand is a transpose. For x (B, R, C) bf16, C-contiguous, and every (b, c), with
amax = max |x[b, :, c]|:

    s[b, c]        = clamp(ceil(log2(amax / 448)), -126, 127) + 127   (biased; amax = 0: 1)
    scales[b, c]   = 2^(s - 127)                                       (float32, (B, C))
    out[b, c, r]   = RNE_e4m3(x[b, r, c] / scales[b, c]), saturated    ((B, C, R) uint8)

bit-identical to ``quantize_fp8_rowwise`` of ``x.transpose(0, 2, 1)`` made contiguous, without that
copy. A column holding NaN or Inf gets scale NaN and elements 0x7F. Kernels, grid-stride:
:func:`transpose_amax_kernel` (atomic max of |x| bits per column), then
:func:`transpose_encode_kernel` (tiles stored transposed through a swizzled shared tile).
"""

from numba import cuda, float32, int32, uint32, uint64

from ._fp8 import BF16_INF, E4M3_NAN, F32_NAN, cvt_e4m3x2, f32_from_bits, inv_scale_f32_bits
from ._launch import kernel
from ._memory import load_flat, load_item, load_word, store_flat, store_item
from .fp8_rowwise import rowwise_scale_exp_bf16

#: Rows each thread of the amax kernel walks (one atomic per column met), AMAX_UNROLL at a time.
CHUNK_ROWS = 256
AMAX_UNROLL = 4
#: Rows and input words (4 columns each) of one tile of the encode kernel.
TILE_ROWS = 64
TILE_WORDS = 32
#: Row quads (one output word per column) each thread of the encode kernel takes at a time:
#: ENCODE_LOADS input words, all loaded first.
ENCODE_QUADS = 2
ENCODE_LOADS = 4 * ENCODE_QUADS
#: Words (8-byte input, 4-byte output) the encode kernel's arrays may each hold: it indexes them
#: flat in int32.
ENCODE_MAX_WORDS = 2 ** 31 - 1
#: Shared tile of the encode kernel: 4 * TILE_WORDS columns x TILE_ROWS / 4 words, swizzled.
_TILE_OUT_WORDS = 4 * TILE_WORDS * (TILE_ROWS // 4)
_QUADS = TILE_ROWS // 4
_ABS_X4 = uint64(0x7FFF7FFF7FFF7FFF)
_E4M3_NAN_X4 = uint32(E4M3_NAN * 0x01010101)

_BF16_HIGH = 16  # a bf16's bits shifted this far left are its fp32 bits


@kernel
def transpose_amax_kernel(x_words, rows, keys, chunk_rows):
    """Per (matrix, column) max |x| bits (module docstring).

    Args:
        x_words: (B * R, C // 4) uint64, bf16 bits of B matrices of R rows, 4 per word (element 0
            lowest). Read.
        rows: R.
        keys: (B * C,) uint32, zeros on entry; the column's max |x| bf16 bits. Written (atomic
            max, or plain stores where one thread owns a column).
        chunk_rows: rows per work item: CHUNK_ROWS on a GPU; >= R: one thread per key (simulator).
    Launch: launch_1d(B * ceil(R / chunk_rows) * C // 4): item i is word i % (C // 4) of chunk
        (i // (C // 4)) % chunks of matrix i // (chunks * C // 4), grid-stride; AMAX_UNROLL rows
        loaded at a time.
    """
    loaded = cuda.local.array(AMAX_UNROLL, uint64)
    k = cuda.local.array(4, uint32)
    words = x_words.shape[1]
    if rows <= 0:
        return
    matrices = x_words.shape[0] // rows
    chunks = -(-rows // chunk_rows)
    exclusive = chunk_rows >= rows
    n = matrices * chunks * words
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        w = i % words
        t = i // words
        b = t // chunks
        first = b * rows + (t % chunks) * chunk_rows
        end = min(first + chunk_rows, (b + 1) * rows)
        for j in range(4):
            k[j] = uint32(0)
        for p in range(first, end, AMAX_UNROLL):
            for u in range(AMAX_UNROLL):  # all loads first
                loaded[u] = load_word(x_words, p + u, w) if p + u < end else uint64(0)
            for u in range(AMAX_UNROLL):
                m = loaded[u] & _ABS_X4
                for j in range(4):
                    k[j] = max(k[j], uint32((m >> uint64(16 * j)) & uint64(0xFFFF)))
        col = b * 4 * words + 4 * w
        for j in range(4):
            if exclusive:
                store_item(keys, col + j, max(load_item(keys, col + j), k[j]))
            elif k[j]:
                cuda.atomic.max(keys, col + j, k[j])


@cuda.jit(device=True)
def column_bf16(word, j, mult):
    """Column ``j`` (0..3) of the uint64 of 4 bf16 ``word``, as f32, times ``mult``."""
    bits = uint32((word >> uint64(16 * j)) & uint64(0xFFFF)) << uint32(_BF16_HIGH)
    return f32_from_bits(bits) * mult


@cuda.jit(device=True)
def store_tile(out_words, tile, c, c_end, at, k, c_step, at_step):
    """Word ``k`` of columns c, c + c_step, ... below ``c_end`` of the swizzled shared ``tile``
    (word (c, k) at 16 c + (k + c / 4) mod 16) into the flat ``out_words`` at ``at``,
    ``at + at_step``, ... (int32 throughout: a range's int64 counter costs more)."""
    while c < c_end:
        store_flat(out_words, at, load_item(tile, (c << 4) + ((k + (c >> 2)) & 15)))
        c = int32(c + c_step)
        at = int32(at + at_step)


@kernel
def transpose_encode_kernel(x_words, rows, keys, out_words, scales):
    """bf16 matrices -> (B * C, R) e4m3 scaled per column, transposed (module docstring).

    Args:
        x_words: (B * R, C // 4) uint64, the bf16 bits. Read.
        rows: R (a multiple of 4).
        keys: (B * C,) uint32, the columns' max |x| bits. Read.
        out_words: (B * C, R // 4) uint32, e4m3 bits, 4 rows per word. Written (every word).
        scales: (B * C,) uint32, fp32 bits of the column scales (NaN for a non-finite column).
            Written.
    Launch: launch_1d(B * ceil(R / TILE_ROWS) * ceil(C / 4 / TILE_WORDS) * threads), blockDim.x
        32, 64, 128 or 256: a tile per CUDA block at a time, grid-stride; lane j takes input word
        w0 + j of ENCODE_QUADS row quads; shared tile swizzled (word (c, q) at 16 c + (q + c / 4)
        mod 16). Word arrays indexed flat in int32: at most ENCODE_MAX_WORDS words each.
    """
    tile = cuda.shared.array(_TILE_OUT_WORDS, uint32)
    loaded = cuda.local.array(ENCODE_LOADS, uint64)
    mult = cuda.local.array(4, float32)
    nan = cuda.local.array(4, uint32)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    lane = tid % TILE_WORDS
    slot = tid // TILE_WORDS
    slots = nthreads // TILE_WORDS
    words = x_words.shape[1]
    if rows <= 0:
        return
    cols = 4 * words
    matrices = x_words.shape[0] // rows
    out_stride = out_words.shape[1]     # R / 4
    q_store = int32(tid & 15)           # the output word (4 rows) a thread stores
    c_step = int32(nthreads >> 4)       # columns between a thread's stores
    at_step = int32(c_step * out_stride)
    tiles_r = -(-rows // TILE_ROWS)
    tiles_w = -(-words // TILE_WORDS)
    items = matrices * tiles_r * tiles_w
    for item in range(cuda.blockIdx.x, items, cuda.gridDim.x):
        b = item // (tiles_r * tiles_w)
        rest = item - b * tiles_r * tiles_w
        r0 = (rest // tiles_w) * TILE_ROWS
        w0 = (rest % tiles_w) * TILE_WORDS
        w = int32(w0 + lane)
        live = w < words
        first_word = int32((b * rows + r0) * words + w)  # word w of the tile's first row
        if live:
            for j in range(4):  # this lane's columns: their scales, from the keys
                key = load_item(keys, b * cols + 4 * w + j)
                if key >= uint32(BF16_INF):
                    nan[j] = uint32(1)
                    mult[j] = float32(0)
                    scale_bits = uint32(F32_NAN)
                else:
                    s = rowwise_scale_exp_bf16(key)
                    nan[j] = uint32(0)
                    mult[j] = f32_from_bits(inv_scale_f32_bits(s))
                    scale_bits = s << uint32(23)
                if r0 == 0 and slot == 0:
                    store_item(scales, b * cols + 4 * w + j, scale_bits)
        for quad0 in range(slot, _QUADS, ENCODE_QUADS * slots):
            for u in range(ENCODE_LOADS):  # all loads first: the 4 rows of each quad
                dr = int32(4 * (quad0 + (u // 4) * slots) + u % 4)
                loaded[u] = load_flat(x_words, int32(first_word + dr * words)) \
                    if live and r0 + dr < rows else uint64(0)
            for qi in range(ENCODE_QUADS):
                quad = quad0 + qi * slots
                if quad >= _QUADS:
                    continue
                at = 64 * lane + ((quad + lane) & 15)  # swizzled (column 4 lane, quad)
                for j in range(4):
                    out = uint32(0)  # a lane past the last word: never stored
                    if live:
                        if nan[j]:
                            out = _E4M3_NAN_X4
                        else:
                            m = mult[j]
                            lo = cvt_e4m3x2(column_bf16(loaded[4 * qi + 1], j, m),
                                            column_bf16(loaded[4 * qi], j, m))
                            hi = cvt_e4m3x2(column_bf16(loaded[4 * qi + 3], j, m),
                                            column_bf16(loaded[4 * qi + 2], j, m))
                            out = uint32(lo) | (uint32(hi) << uint32(16))
                    store_item(tile, at + 16 * j, out)
        cuda.syncthreads()
        # store, row-contiguous: thread tid takes word tid % 16 of columns
        # tid / 16 + j * nthreads / 16
        if r0 + 4 * q_store < rows:
            c = int32(tid >> 4)
            store_tile(out_words, tile, c, int32(min(4 * TILE_WORDS, cols - 4 * w0)),
                       int32((b * cols + 4 * w0 + c) * out_stride + (r0 >> 2) + q_store),
                       q_store, c_step, at_step)
        cuda.syncthreads()
