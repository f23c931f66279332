"""Workloads of the benchmarks: split matrices, expert routing counts, bandwidth and SQNR arithmetic.

Pure NumPy, no device: everything here is host integers and small host arrays, so the tests check it
without a GPU. Glossary: M rows per rank, D hidden, H GEMM output, E experts, E_local experts per
rank, W ranks.
"""

import math

import numpy

#: GB as nccl-tests counts it.
GB = 1e9


def integer_split(total, weights):
    """Split ``total`` rows into ``len(weights)`` non-negative ints proportional to ``weights``.

    Largest-remainder rounding: the parts sum to ``total`` exactly and each differs from its exact
    share by less than one row.

    Args:
        total: non-negative int.
        weights: (n,) non-negative floats, not all zero.
    Returns:
        A list of ``n`` host ints summing to ``total``.
    Raises:
        ValueError: ``total`` negative, or the weights negative or all zero.
    """
    w = numpy.asarray(weights, dtype=numpy.float64)
    if total < 0:
        raise ValueError(f"total: expected >= 0, got {total}")
    if w.ndim != 1 or w.size == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights: expected a non-empty 1-D array of non-negative values with a "
                         f"positive sum, got {weights!r}")
    exact = w / w.sum() * total
    parts = numpy.floor(exact).astype(numpy.int64)
    short = total - int(parts.sum())
    # Ties broken by index, so every rank computing this gets the same answer.
    order = numpy.argsort(-(exact - parts), kind="stable")
    parts[order[:short]] += 1
    return [int(p) for p in parts]


def split_matrix(world_size, rows, kind="uniform", seed=0, alpha=1.0):
    """The full W×W all-to-all split matrix, identical on every rank that passes the same seed.

    ``S[i, j]`` = rows rank i sends to rank j. Row i sums to ``rows`` (every rank sends the same
    bytes, as in nccl-tests); column j is what rank j receives.

    Args:
        world_size: W >= 1.
        rows: rows each rank sends, >= 0.
        kind: ``"uniform"`` (equal shares, remainder to the lowest ranks) or ``"skewed"``
            (each row's shares drawn from a Dirichlet(alpha) distribution).
        seed: the shared seed (the same on every rank).
        alpha: Dirichlet concentration for ``"skewed"``; smaller is more skewed.
    Returns:
        (W, W) int64 NumPy array.
    Raises:
        ValueError: unknown ``kind`` or a bad size.
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    if kind == "uniform":
        weights = numpy.ones((world_size, world_size))
    elif kind == "skewed":
        weights = numpy.random.default_rng(seed).dirichlet([alpha] * world_size, size=world_size)
    else:
        raise ValueError(f"kind: expected 'uniform' or 'skewed', got {kind!r}")
    return numpy.array([integer_split(rows, w) for w in weights], dtype=numpy.int64)


def rank_splits(matrix, rank):
    """``(send_counts, recv_counts)`` of ``rank`` from a split matrix, as lists of host ints."""
    m = numpy.asarray(matrix)
    return [int(c) for c in m[rank, :]], [int(c) for c in m[:, rank]]


def uniform_expert_counts(rows, num_experts):
    """Rows per expert when every expert gets an equal share (uniform routing).

    Returns:
        (E,) int32 NumPy array summing to ``rows``.
    """
    return numpy.array(integer_split(rows, numpy.ones(num_experts)), dtype=numpy.int32)


def topk_expert_counts(rows, num_experts, top_k=8, seed=0, rank=0, zipf=1.2):
    """Rows per expert of a top-k router with skewed expert popularity.

    ``rows // k`` tokens each pick their top-``k`` experts by ``popularity + noise``; popularity is
    a Zipf profile over a permutation of the experts drawn from ``seed`` (the same on every rank),
    the per-token noise comes from ``seed + rank``. ``k = min(top_k, E)``; the ``rows % k`` rows
    left over go to the most popular experts, so the counts sum to ``rows`` exactly and every
    routing moves the same bytes.

    Args:
        rows: M, rows (token copies) on this rank.
        num_experts: E, experts in total.
        top_k: experts per token (torchtitan/DeepSeek: 8).
        seed: shared seed; rank: this rank (per-rank token noise).
        zipf: exponent of the popularity profile.
    Returns:
        (E,) int32 NumPy array summing to ``rows``.
    """
    k = min(top_k, num_experts)
    order = numpy.random.default_rng(seed).permutation(num_experts)
    popularity = numpy.empty(num_experts)
    popularity[order] = -zipf * numpy.log(numpy.arange(1, num_experts + 1))
    tokens = rows // k
    rng = numpy.random.default_rng(seed + 1 + rank)
    scores = popularity[None, :] + rng.gumbel(size=(tokens, num_experts))
    chosen = numpy.argpartition(-scores, k - 1, axis=1)[:, :k] if k < num_experts \
        else numpy.tile(numpy.arange(num_experts), (tokens, 1))
    counts = numpy.bincount(chosen.ravel(), minlength=num_experts)
    for i in range(rows - tokens * k):
        counts[order[i % num_experts]] += 1
    return counts.astype(numpy.int32)


def expert_counts(routing, rows, num_experts, *, seed=0, rank=0):
    """Dispatch on ``routing`` (``"uniform"`` or ``"topk"``): (E,) int32 counts summing to ``rows``.

    Raises:
        ValueError: unknown routing.
    """
    if routing == "uniform":
        return uniform_expert_counts(rows, num_experts)
    if routing == "topk":
        return topk_expert_counts(rows, num_experts, seed=seed, rank=rank)
    raise ValueError(f"routing: expected 'uniform' or 'topk', got {routing!r}")


def padded_rows(rows, num_local_experts, align=32):
    """P, the static row bound of ``permute``: ``round_up(rows + E_local * align, align)``."""
    return -(-(rows + num_local_experts * align) // align) * align


def gbps(nbytes, ms):
    """GB/s (1e9 bytes) of ``nbytes`` moved in ``ms`` milliseconds; NaN for a non-positive time."""
    return nbytes / (ms * 1e-3) / GB if ms > 0 else float("nan")


def busbw(algbw, world_size):
    """nccl-tests' all-to-all bus bandwidth: ``algbw * (W - 1) / W``."""
    return algbw * (world_size - 1) / world_size


def sqnr_db(ref, out):
    """Signal-to-quantization-noise ratio in dB: ``20 * log10(||ref|| / ||ref - out||)``.

    Computed in float64 on the host. ``inf`` when ``out`` equals ``ref`` exactly (both all zero
    included: a gradient of experts that received no rows); NaN when either holds a non-finite
    value, or ``ref`` is all zero and ``out`` is not.

    Args:
        ref, out: arrays of one shape (NumPy or anything ``numpy.asarray`` takes).
    Raises:
        ValueError: the shapes differ.
    """
    r = numpy.asarray(ref, dtype=numpy.float64)
    o = numpy.asarray(out, dtype=numpy.float64)
    if r.shape != o.shape:
        raise ValueError(f"out: expected shape {r.shape} like ref, got {o.shape}")
    if not (numpy.isfinite(r).all() and numpy.isfinite(o).all()):
        return float("nan")
    signal = float(numpy.linalg.norm(r))
    noise = float(numpy.linalg.norm(r - o))
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return float("nan")
    return 20.0 * math.log10(signal / noise)
