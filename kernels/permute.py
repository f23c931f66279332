"""Token permutation kernels: received order <-> expert-major order, padded groups (layout:
``mxcomm.permutation``), the index built on the device; rows move as machine words, one CUDA block
per row."""

from numba import cuda, int32

from ._launch import kernel


@kernel
def permute_layout_kernel(counts, num_local, align, src_start, dst_start, group_offsets):
    """Source and destination starts of every (rank, local expert) segment, and padded group ends.

    Args:
        counts: (E,) int32, rank-major row counts (E = W * E_local). Read.
        num_local: E_local.
        align: rows (> 0); each non-empty group is padded to a multiple of it.
        src_start: (E,) int32, first received row of segment (r, e), at r * E_local + e. Written.
        dst_start: (E,) int32, first permuted row of segment (r, e). Written.
        group_offsets: (E_local,) int32, cumulative padded group ends. Written.
    Launch: one thread (launch_1d(1)); E is small.
    """
    if cuda.grid(1) != 0:
        return
    n = counts.shape[0]
    row = 0
    for k in range(n):
        src_start[k] = row
        row += counts[k]
    end = 0
    for e in range(num_local):
        for k in range(e, n, num_local):
            dst_start[k] = end
            end += counts[k]
        end = (end + align - 1) // align * align
        group_offsets[e] = end


@kernel
def permute_indices_kernel(counts, src_start, dst_start, group_offsets, num_rows, indices,
                           inverse):
    """``indices[p]``: the received row landing on permuted row p, or -1 (padding, or past the end);
    ``inverse[r] = p`` for every received row r that lands.

    Args:
        counts, src_start, dst_start: (E,) int32, from :func:`permute_layout_kernel`. Read.
        group_offsets: (E_local,) int32. Read.
        num_rows: M_recv; a source row at or beyond it gives -1.
        indices: (P,) int32. Written.
        inverse: (M_recv,) int32. Written where a row lands (every row, where the counts add up
            to M_recv).
    Launch: launch_1d(P): one thread per permuted row, grid-stride.
    """
    num_local = group_offsets.shape[0]
    n = counts.shape[0]
    for p in range(cuda.grid(1), indices.shape[0], cuda.gridsize(1)):
        src = -1
        e = 0
        while e < num_local and p >= group_offsets[e]:
            e += 1
        if e < num_local:
            for k in range(e, n, num_local):
                off = p - dst_start[k]
                if off >= 0 and off < counts[k]:
                    src = src_start[k] + off
        if src >= num_rows:
            src = -1
        indices[p] = int32(src)
        if src >= 0:
            inverse[src] = int32(p)


#: Words each thread loads before storing in the row copy.
ROW_UNROLL = 4


@cuda.jit(device=True)
def copy_rows(src0, src1, i, dst0, dst1, p, tid, nthreads):
    """Rows p of ``dst0``, ``dst1`` = rows i of ``src0``, ``src1``; thread ``tid`` of ``nthreads``
    takes every nthreads-th word, ROW_UNROLL of dst0's loaded at a time."""
    ncols = dst0.shape[1]
    step = nthreads * ROW_UNROLL
    w = tid
    while w + step - nthreads < ncols:  # ROW_UNROLL full words
        a = src0[i, w]
        b = src0[i, w + nthreads]
        c = src0[i, w + 2 * nthreads]
        d = src0[i, w + 3 * nthreads]
        dst0[p, w] = a
        dst0[p, w + nthreads] = b
        dst0[p, w + 2 * nthreads] = c
        dst0[p, w + 3 * nthreads] = d
        w += step
    while w < ncols:
        dst0[p, w] = src0[i, w]
        w += nthreads
    for w in range(tid, dst1.shape[1], nthreads):
        dst1[p, w] = src1[i, w]


@cuda.jit(device=True)
def pad_row(dst0, dst1, p, fill1, tid, nthreads):
    """Row p of ``dst0`` zeros, of ``dst1`` every word ``fill1`` (threads as :func:`copy_rows`)."""
    for w in range(tid, dst0.shape[1], nthreads):
        dst0[p, w] = 0
    for w in range(tid, dst1.shape[1], nthreads):
        dst1[p, w] = fill1


@kernel
def gather_rows_kernel(indices, src0, dst0, src1, dst1, fill1):
    """dst[p, :] = src[indices[p], :] for two (src, dst) pairs; where indices[p] < 0, zeros in
    dst0's row and ``fill1`` in every word of dst1's.

    Args:
        indices: (P,) int32 source rows or -1; a row >= src.shape[0] counts as -1. Read.
        src0, dst0: (M, W0) and (P, W0) words (uint64/32/16/8), C-contiguous. Read / written.
        src1, dst1: a second pair (the scales) of the same rows, or an empty (0, 0) pair.
        fill1: int, a word of dst1's padding rows (the padding scale repeated; 0 for e8m0).
    Launch: launch_1d(P * blockDim): a CUDA block per row, grid-stride.
    """
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    nsrc = src0.shape[0]
    for p in range(cuda.blockIdx.x, indices.shape[0], cuda.gridDim.x):
        i = indices[p]
        if i >= 0 and i < nsrc:
            copy_rows(src0, src1, i, dst0, dst1, p, tid, nthreads)
        else:
            pad_row(dst0, dst1, p, fill1, tid, nthreads)


@kernel
def scatter_rows_kernel(indices, src0, dst0, src1, dst1):
    """dst[indices[p], :] = src[p, :] for 0 <= indices[p] < dst.shape[0], for two pairs at once.

    Args:
        indices: (P,) int32 destination rows or -1 (dropped). Read.
        src0, dst0: (P, W0) and (M, W0) words, C-contiguous. Read / written.
        src1, dst1: a second pair (the scales), or an empty (0, 0) pair.
    Launch: as :func:`gather_rows_kernel`.
    """
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    ndst = dst0.shape[0]
    for p in range(cuda.blockIdx.x, indices.shape[0], cuda.gridDim.x):
        i = indices[p]
        if i >= 0 and i < ndst:
            copy_rows(src0, src1, p, dst0, dst1, i, tid, nthreads)


@kernel
def zero_rows_kernel(indices, dst0, dst1, fill1):
    """The padding rows (indices[p] < 0) of :func:`gather_rows_kernel`; other rows untouched.

    Args:
        indices: (P,) int32 source rows or -1. Read.
        dst0, dst1: (P, W0) and (P, W1) words, C-contiguous, or an empty second. Written.
        fill1: int, a word of dst1's padding rows.
    Launch: as :func:`gather_rows_kernel`.
    """
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    for p in range(cuda.blockIdx.x, indices.shape[0], cuda.gridDim.x):
        if indices[p] < 0:
            pad_row(dst0, dst1, p, fill1, tid, nthreads)
