"""EP token path on arrays: layout exchange, dispatch, combine, their backwards, the drop-in.

Every rank regenerates every rank's routed tokens from its seed (``SEED + r``) and computes the
expected result of the whole exchange locally, with plain NumPy (no kernels, no communicator):
bf16 movement is exact, MXFP8 movement equals the reference quantizer's bits moved.

Run: ``mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_ep.py`` (and ``-n 3``).
"""

import ml_dtypes
import numpy
import pytest

from mxcomm import comm as mxc
from mxcomm.a2a import (a2a_combine, a2a_combine_backward, a2a_dispatch, a2a_dispatch_backward,
                        all_to_all_single)
from mxcomm.kernels import array_module
from mxcomm.layout import exchange_layout
from mxcomm.mxfp8 import MXFP8Array, dequantize_mxfp8
from mxcomm.permutation import permute, unpermute
from reference import dequantize_mxfp8_ref, quantize_mxfp8_ref

SEED = 1234
BF16 = numpy.dtype(ml_dtypes.bfloat16)
E_LOCAL = 2     # experts per rank
TOPK = 2        # experts per token
D = 64          # hidden
H = 32          # expert output width
ALIGN = 8       # permute padding (small: the simulator is slow)
TIMEOUT_S = 60.0

pytestmark = pytest.mark.mpi


# ------------------------------------------------------------------------------- helpers
def to_host(a):
    return a.get() if hasattr(a, "get") else numpy.asarray(a)


def to_device(a):
    return array_module().asarray(a)


def bits(a):
    """The bit patterns of a bf16/fp32 array (exact comparison, NaN included)."""
    a = to_host(a)
    return a.view(numpy.uint16 if a.dtype == BF16 else numpy.uint32)


def fake_quantize(x):
    """Reference MXFP8 round trip (rceil) of bf16 rows, as bf16."""
    return dequantize_mxfp8_ref(*quantize_mxfp8_ref(x, "rceil"))


class Routed:
    """One rank's routed tokens, regenerated from its seed on every rank.

    Rank 1 routes no tokens (a rank that sends nothing); nobody routes to the last expert (an
    expert that receives nothing).

    Attributes:
        x: (M, D) bf16, rows sorted by global expert (M = tokens * TOPK).
        experts: (M,) int64, the global expert of each row.
        counts: (E,) int32, rows per global expert.
    """

    def __init__(self, rank, world, d=D):
        rng = numpy.random.default_rng(SEED + rank)
        num_experts = world * E_LOCAL
        tokens = 0 if rank == 1 else int(rng.integers(3, 7))
        chosen = numpy.array([rng.choice(num_experts - 1, TOPK, replace=False)
                              for _ in range(tokens)], dtype=numpy.int64).reshape(tokens, TOPK)
        token_rows = rng.standard_normal((tokens, d)).astype(BF16)
        flat = chosen.reshape(-1)
        order = numpy.argsort(flat, kind="stable")
        self.x = token_rows[numpy.repeat(numpy.arange(tokens), TOPK)[order]]
        self.experts = flat[order]
        self.counts = numpy.bincount(self.experts, minlength=num_experts).astype(numpy.int32)


def all_routed(world, d=D):
    return [Routed(r, world, d) for r in range(world)]


def layout_ref(routed, me):
    """(group counts (E,), input_splits, output_splits) of rank ``me``."""
    lo, hi = me * E_LOCAL, (me + 1) * E_LOCAL
    group = numpy.concatenate([r.counts[lo:hi] for r in routed])
    input_splits = [int(v) for v in routed[me].counts.reshape(len(routed), E_LOCAL).sum(axis=1)]
    output_splits = [int(r.counts[lo:hi].sum()) for r in routed]
    return group, input_splits, output_splits


def move_ref(arrays, splits, me):
    """Rows rank ``me`` receives when every rank s sends ``splits[s][r]`` rows of ``arrays[s]``
    to rank r (consecutive segments, rank order)."""
    parts = []
    for a, s in zip(arrays, splits):
        start = sum(s[:me])
        parts.append(a[start:start + s[me]])
    return numpy.concatenate(parts)


def expert_weights(world):
    """(E, D, H) float64 weights with bf16 values: products of bf16 values are exact in float64."""
    rng = numpy.random.default_rng(SEED + 1000)
    w = rng.standard_normal((world * E_LOCAL, D, H)).astype(BF16)
    return w.astype(numpy.float64)


def expert_ref(rows, w):
    """An expert's output rows in bf16: exact float64 product, then float32, then bf16."""
    return (rows.astype(numpy.float64) @ w).astype(numpy.float32).astype(BF16)


#: Communicators of every test (peer_memory, small_exchange_bytes, medium_exchange_bytes): both
#: transports of the quantized exchanges, every exchange small enough to travel unquantized, and
#: every one kept quantized medium enough to travel quantized in one alltoallv.
SETUPS = {"pull": (None, 0, 0), "grouped": (False, 0, 0), "small": (None, 1 << 40, 0),
          "medium": (None, 0, 1 << 40)}


@pytest.fixture(scope="module", params=list(SETUPS), ids=list(SETUPS))
def comm(request):
    """Both transports of the MXFP8 exchanges, pulled from peer memory (auto on one node) and
    one grouped exchange, the small exchanges' path (rows moved unquantized, quantized on
    arrival) and the medium ones' (quantized, then one alltoallv): every test's reference holds
    for each."""
    peer_memory, small, medium = SETUPS[request.param]
    c = mxc.init(timeout=TIMEOUT_S, peer_memory=peer_memory, small_exchange_bytes=small,
                 medium_exchange_bytes=medium)
    assert c.transport == ("grouped" if peer_memory is False else "pull")
    assert (c.small_exchange_bytes, c.medium_exchange_bytes) == (small, medium)
    yield c
    c.close()


@pytest.fixture(scope="module")
def routed(comm):
    return all_routed(comm.size)


# ---------------------------------------------------------------------------------- tests
def test_exchange_layout(comm, routed):
    me = comm.rank
    group, input_splits, output_splits = exchange_layout(to_device(routed[me].counts), comm)
    group_ref, input_ref, output_ref = layout_ref(routed, me)
    assert group.dtype == numpy.int32
    numpy.testing.assert_array_equal(to_host(group), group_ref)
    assert input_splits == input_ref and output_splits == output_ref
    assert all(type(v) is int for v in input_splits + output_splits)


def test_exchange_layout_rejects_bad_counts(comm):
    w = comm.size
    with pytest.raises(ValueError, match=f"length {2 * w + 1} is not a positive multiple of the "
                                         f"{w} ranks"):
        exchange_layout(to_device(numpy.zeros(2 * w + 1, numpy.int32)), comm)
    with pytest.raises(ValueError, match="1-D"):
        exchange_layout(to_device(numpy.zeros((w, 2), numpy.int32)), comm)
    with pytest.raises(TypeError, match="integer"):
        exchange_layout(to_device(numpy.zeros(2 * w, numpy.float32)), comm)


def test_dispatch_bf16_exact(comm, routed):
    me = comm.rank
    _, input_splits, output_splits = layout_ref(routed, me)
    got = a2a_dispatch(to_device(routed[me].x), input_splits, output_splits, comm, "bf16")
    splits = [layout_ref(routed, r)[1] for r in range(comm.size)]
    expected = move_ref([r.x for r in routed], splits, me)
    assert got.dtype == BF16
    numpy.testing.assert_array_equal(bits(got), bits(expected))


def test_dispatch_mxfp8_moves_reference_bits(comm, routed):
    me = comm.rank
    _, input_splits, output_splits = layout_ref(routed, me)
    got = a2a_dispatch(to_device(routed[me].x), input_splits, output_splits, comm)
    splits = [layout_ref(routed, r)[1] for r in range(comm.size)]
    data, scales = quantize_mxfp8_ref(move_ref([r.x for r in routed], splits, me), "rceil")
    assert isinstance(got, MXFP8Array)
    numpy.testing.assert_array_equal(to_host(got.data), data)
    numpy.testing.assert_array_equal(to_host(got.scales), scales)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_dispatch_without_the_vote(comm, routed, precision):
    """``validate=False`` with explicit splits: this rank's counts make the plan. bf16 moves
    exactly and MXFP8 moves the reference bits on the grouped transport; the pull transport,
    which needs every rank's counts, refuses MXFP8 on every rank, naming the way out."""
    me = comm.rank
    _, input_splits, output_splits = layout_ref(routed, me)
    x = to_device(routed[me].x)
    splits = [layout_ref(routed, r)[1] for r in range(comm.size)]
    moved = move_ref([r.x for r in routed], splits, me)
    if precision == "mxfp8" and comm.transport == "pull":
        with pytest.raises(ValueError, match=f"validate=False on rank {me}: the pull transport "
                                             f"needs every rank's counts; pass a layout"):
            a2a_dispatch(x, input_splits, output_splits, comm, precision, validate=False)
        return
    got = a2a_dispatch(x, input_splits, output_splits, comm, precision, validate=False)
    if precision == "bf16":
        numpy.testing.assert_array_equal(bits(got), bits(moved))
        return
    data, scales = quantize_mxfp8_ref(moved, "rceil")
    numpy.testing.assert_array_equal(to_host(got.data), data)
    numpy.testing.assert_array_equal(to_host(got.scales), scales)


def test_dispatch_floor_scales(comm, routed):
    me = comm.rank
    _, input_splits, output_splits = layout_ref(routed, me)
    got = a2a_dispatch(to_device(routed[me].x), input_splits, output_splits, comm,
                       scale_mode="floor")
    splits = [layout_ref(routed, r)[1] for r in range(comm.size)]
    data, scales = quantize_mxfp8_ref(move_ref([r.x for r in routed], splits, me), "floor")
    numpy.testing.assert_array_equal(to_host(got.data), data)
    numpy.testing.assert_array_equal(to_host(got.scales), scales)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_all_to_all_single(comm, routed, precision):
    """The drop-in, both directions: (output_splits, input_splits) order, result in x's dtype."""
    me = comm.rank
    _, input_splits, output_splits = layout_ref(routed, me)
    splits = [layout_ref(routed, r)[1] for r in range(comm.size)]
    sources = [r.x if precision == "bf16" else fake_quantize(r.x) for r in routed]
    got = all_to_all_single(to_device(routed[me].x), output_splits, input_splits, comm,
                            precision)
    expected = move_ref(sources, splits, me)
    assert got.dtype == BF16 and got.shape == expected.shape
    numpy.testing.assert_array_equal(bits(got), bits(expected))
    # Backward direction: the same call with the splits swapped sends the rows home.
    back = all_to_all_single(got, input_splits, output_splits, comm, precision)
    numpy.testing.assert_array_equal(bits(back), bits(sources[me]))


def test_all_to_all_single_fp32(comm, routed):
    me = comm.rank
    _, input_splits, output_splits = layout_ref(routed, me)
    splits = [layout_ref(routed, r)[1] for r in range(comm.size)]
    x = routed[me].x.astype(numpy.float32)
    got = all_to_all_single(to_device(x), output_splits, input_splits, comm)
    expected = move_ref([dequantize_mxfp8_ref(*quantize_mxfp8_ref(r.x.astype(numpy.float32)),
                                              dtype=numpy.float32) for r in routed], splits, me)
    assert got.dtype == numpy.float32
    numpy.testing.assert_array_equal(bits(got), bits(expected))
    # bf16 on the wire: fp32 rows rounded to bf16, returned as fp32.
    x = routed[me].x.astype(numpy.float32) * numpy.float32(1 + 2 ** -12)  # not bf16-exact
    got = all_to_all_single(to_device(x), output_splits, input_splits, comm, "bf16")
    expected = move_ref([(r.x.astype(numpy.float32) * numpy.float32(1 + 2 ** -12)).astype(BF16)
                         .astype(numpy.float32) for r in routed], splits, me)
    assert got.dtype == numpy.float32
    numpy.testing.assert_array_equal(bits(got), bits(expected))


def test_backward_directions(comm, routed):
    """dispatch_backward sends received rows home; combine_backward is a dispatch-direction move."""
    me = comm.rank
    _, input_splits, output_splits = layout_ref(routed, me)
    splits = [layout_ref(routed, r)[1] for r in range(comm.size)]
    received = move_ref([r.x for r in routed], splits, me)
    home = a2a_dispatch_backward(to_device(received), input_splits, output_splits, comm)
    numpy.testing.assert_array_equal(bits(home), bits(routed[me].x))
    home = a2a_dispatch_backward(to_device(received), input_splits, output_splits, comm, "mxfp8")
    numpy.testing.assert_array_equal(bits(home), bits(fake_quantize(routed[me].x)))

    sent = a2a_combine_backward(to_device(routed[me].x), input_splits, output_splits, comm)
    data, scales = quantize_mxfp8_ref(received, "rceil")
    assert isinstance(sent, MXFP8Array)
    numpy.testing.assert_array_equal(to_host(sent.data), data)
    numpy.testing.assert_array_equal(to_host(sent.scales), scales)
    sent = a2a_combine_backward(to_device(routed[me].x), input_splits, output_splits, comm, "bf16")
    numpy.testing.assert_array_equal(bits(sent), bits(received))


@pytest.mark.parametrize("dispatch,combine", [("bf16", "bf16"), ("mxfp8", "bf16"),
                                              ("mxfp8", "mxfp8")])
def test_token_path(comm, routed, dispatch, combine):
    """Layout, dispatch, permute, per-expert product, unpermute, combine: each token row comes
    back as its expert's output of it (exact, with the reference quantizer for MXFP8 legs)."""
    me, world = comm.rank, comm.size
    weights = expert_weights(world)
    group, input_splits, output_splits = exchange_layout(to_device(routed[me].counts), comm)
    received = a2a_dispatch(to_device(routed[me].x), input_splits, output_splits, comm, dispatch)
    permuted, indices, offsets = permute(received, group, E_LOCAL, ALIGN)
    if isinstance(permuted, MXFP8Array):
        permuted = dequantize_mxfp8(permuted)
    permuted = to_host(permuted)
    y = numpy.zeros((permuted.shape[0], H), BF16)
    start = 0
    for j, end in enumerate(to_host(offsets).tolist()):
        y[start:end] = expert_ref(permuted[start:end], weights[me * E_LOCAL + j])
        start = end
    rows = sum(output_splits)
    out = a2a_combine(unpermute(to_device(y), indices, rows), input_splits, output_splits, comm,
                      combine)

    x = routed[me].x if dispatch == "bf16" else fake_quantize(routed[me].x)
    expected = numpy.stack([expert_ref(x[i:i + 1], weights[e])[0]
                            for i, e in enumerate(routed[me].experts)]) if len(x) else \
        numpy.zeros((0, H), BF16)
    if combine == "mxfp8":
        expected = fake_quantize(expected)
    assert out.shape == (len(x), H)
    numpy.testing.assert_array_equal(bits(out), bits(expected))


def test_nan_token_poisons_its_block(comm, routed):
    """A NaN element turns its 32-element block into NaN after an MXFP8 dispatch, nothing else."""
    me, world = comm.rank, comm.size
    xs = [r.x.copy() for r in routed]
    xs[0][0, 37] = numpy.nan  # rank 0, row 0, block 1
    _, input_splits, output_splits = layout_ref(routed, me)
    splits = [layout_ref(routed, r)[1] for r in range(world)]
    got = a2a_dispatch(to_device(xs[me]), input_splits, output_splits, comm)
    values = to_host(dequantize_mxfp8(got)).astype(numpy.float32)
    moved = all_to_all_single(to_device(xs[me]), output_splits, input_splits, comm)
    moved = to_host(moved).astype(numpy.float32)
    expected = move_ref([_poison_mask(x) for x in xs], splits, me)
    for v in (values, moved):
        numpy.testing.assert_array_equal(numpy.isnan(v), expected)
    # Row 0 of rank 0 goes to the rank of its expert: exactly one block of NaN arrives there.
    assert expected.sum() == (32 if me == routed[0].experts[0] // E_LOCAL else 0)
    assert (to_host(got.scales)[expected[:, ::32]] == 0xFF).all()
    assert (to_host(got.scales)[~expected[:, ::32]] != 0xFF).all()


def _poison_mask(x):
    """Where a rank's rows dequantize to NaN: every block holding a NaN."""
    nan = numpy.isnan(x.astype(numpy.float32)).reshape(x.shape[0], x.shape[1] // 32, 32).any(axis=2)
    return numpy.repeat(nan, 32, axis=1)


# ---------------------------------------------------------------------------- bad input
def test_precision_errors(comm, routed):
    me = comm.rank
    _, input_splits, output_splits = layout_ref(routed, me)
    x = to_device(routed[me].x)
    listed = "'bf16', 'native', 'mxfp8', 'fp8_rowwise', 'fp8_block128', 'fp8_block128_pow2'"
    with pytest.raises(ValueError, match=rf"precision on rank \d+: expected one of {listed}, "
                                         f"got 'fp16'"):
        all_to_all_single(x, output_splits, input_splits, comm, "fp16")
    with pytest.raises(ValueError, match="expected one of .*got 'fp8_block64'"):
        a2a_combine_backward(x, input_splits, output_splits, comm, "fp8_block64")
    with pytest.raises(ValueError, match="D = 48 is not a multiple of 128, which the "
                                         "'fp8_block128' format needs"):
        a2a_dispatch(to_device(numpy.zeros((x.shape[0], 48), BF16)), input_splits,
                     output_splits, comm, "fp8_block128")


def test_bad_arrays(comm, routed):
    """Wrong dtype, shape, layout or width: raised before any data moves (every rank bad)."""
    me = comm.rank
    _, input_splits, output_splits = layout_ref(routed, me)
    x = routed[me].x
    with pytest.raises(TypeError, match="bfloat16 or float32, got float16"):
        a2a_dispatch(to_device(x.astype(numpy.float16)), input_splits, output_splits, comm)
    with pytest.raises(ValueError, match="2-D"):
        a2a_dispatch(to_device(x.reshape(-1)), input_splits, output_splits, comm)
    wide = to_device(numpy.zeros((4, 2 * D), BF16))  # not 0 rows: those count as contiguous
    with pytest.raises(ValueError, match="C-contiguous"):
        a2a_dispatch(wide[:, ::2], input_splits, output_splits, comm)
    with pytest.raises(ValueError, match="D = 48 is not a multiple of 32, which the 'mxfp8' format needs"):
        all_to_all_single(to_device(numpy.zeros((x.shape[0], 48), BF16)), output_splits,
                          input_splits, comm)


def test_bad_array_on_one_rank_raises_on_every_rank(comm, routed):
    """Only the last rank passes a bad array: it votes its error into the peers' check, so every
    rank raises the same TypeError at once (nobody waits for the timeout); then a rank that
    disagrees on the wire precision is caught the same way."""
    from mpi4py import MPI

    me, last = comm.rank, comm.size - 1
    _, input_splits, output_splits = layout_ref(routed, me)
    x = routed[me].x
    bad = to_device(x.astype(numpy.float16) if me == last else x)
    with pytest.raises(TypeError, match="bfloat16 or float32, got float16") as info:
        a2a_dispatch(bad, input_splits, output_splits, comm)
    messages = MPI.COMM_WORLD.allgather(str(info.value))
    assert len(set(messages)) == 1 and f"rank {last}" in messages[0]
    if comm.size > 1:
        precision = "bf16" if me == last else "mxfp8"
        with pytest.raises(ValueError) as info:
            all_to_all_single(to_device(x), output_splits, input_splits, comm, precision)
        assert len(set(MPI.COMM_WORLD.allgather(str(info.value)))) == 1
    mode = "ceil" if me == last else "rceil"  # a bad scale_mode on one rank: the same way
    with pytest.raises(ValueError, match=f"scale_mode on rank {last}: expected one of") as info:
        all_to_all_single(to_device(x), output_splits, input_splits, comm, scale_mode=mode)
    messages = MPI.COMM_WORLD.allgather(str(info.value))
    assert len(set(messages)) == 1 and f"rank {last}" in messages[0]
    got = a2a_dispatch(to_device(x), input_splits, output_splits, comm, "bf16")
    assert got.shape == (sum(output_splits), D)


def test_bad_splits_raise_on_every_rank(comm, routed):
    """Split errors, even on one rank only, raise the same ValueError everywhere: nobody hangs."""
    me, world = comm.rank, comm.size
    _, input_splits, output_splits = layout_ref(routed, me)
    x = to_device(routed[me].x)
    with pytest.raises(ValueError, match="one per rank"):
        a2a_dispatch(x, input_splits + [0], output_splits, comm)
    # Only rank 0 miscounts its rows.
    bad = list(input_splits)
    if me == 0:
        bad[-1] += 1
    for precision in ("bf16", "mxfp8"):
        with pytest.raises(ValueError, match="adds up to") as info:
            a2a_dispatch(x, bad, output_splits, comm, precision)
        assert "input_splits on rank 0: adds up to" in str(info.value)
    # Rank 0 expects one row more from the last rank than that rank sends.
    bad = list(output_splits)
    if me == 0:
        bad[world - 1] += 1
    with pytest.raises(ValueError, match=f"rank 0 expects {bad[world - 1]} rows from rank "
                                         f"{world - 1}" if me == 0 else "expects"):
        all_to_all_single(x, bad, input_splits, comm)
    # The communicator is still usable.
    got = a2a_dispatch(x, input_splits, output_splits, comm, "bf16")
    assert got.shape == (sum(output_splits), D)


@pytest.mark.parametrize("below", [False, True], ids=["at", "one_byte_below"])
def test_small_exchange_is_chosen_alike_on_every_rank(below):
    """Whether an exchange travels unquantized is decided by the largest rank's bytes to its
    peers (in the exchange's direction), so ranks sending less (rank 1 sends nothing) choose
    as the largest does: a limit of exactly those bytes moves every rank's rows in one plain
    ``alltoallv`` and no staged exchange; one byte less, the staged exchange on every rank.
    Both move the reference bits, in every direction."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD.Get_size()
    routed = all_routed(world)
    splits = [layout_ref(routed, r)[1] for r in range(world)]
    row = D * BF16.itemsize
    dispatch = max(sum(s) - s[r] for r, s in enumerate(splits)) * row  # the largest sender's
    combine = max(sum(s[r] for s in splits) - splits[r][r] for r in range(world)) * row
    assert min(dispatch, combine) > 0
    limit = min(dispatch, combine) - 1 if below else max(dispatch, combine)
    with mxc.init(timeout=TIMEOUT_S, small_exchange_bytes=limit) as c:
        calls = {"exchange": 0, "alltoallv_plan": 0}
        for name in calls:
            def counted(*args, _name=name, _method=getattr(c, name), **kwargs):
                calls[_name] += 1
                return _method(*args, **kwargs)
            setattr(c, name, counted)
        me = c.rank
        group, input_splits, output_splits = exchange_layout(to_device(routed[me].counts), c)
        moved = move_ref([r.x for r in routed], splits, me)
        got = a2a_dispatch(to_device(routed[me].x), input_splits, output_splits, c)
        data, scales = quantize_mxfp8_ref(moved, "rceil")
        numpy.testing.assert_array_equal(to_host(got.data), data)
        numpy.testing.assert_array_equal(to_host(got.scales), scales)
        home = a2a_combine(to_device(moved), input_splits, output_splits, c, "mxfp8")
        numpy.testing.assert_array_equal(bits(home), bits(fake_quantize(routed[me].x)))
        grad = a2a_dispatch_backward(to_device(moved), input_splits, output_splits, c, "mxfp8")
        numpy.testing.assert_array_equal(bits(grad), bits(fake_quantize(routed[me].x)))
        drop_in = all_to_all_single(to_device(routed[me].x), output_splits, input_splits, c)
        numpy.testing.assert_array_equal(bits(drop_in), bits(fake_quantize(moved)))
        assert calls == ({"exchange": 4, "alltoallv_plan": 0} if below else
                         {"exchange": 0, "alltoallv_plan": 4})


@pytest.mark.parametrize("name", ["small_exchange_bytes", "medium_exchange_bytes"])
def test_small_exchange_bytes_must_agree(name):
    """``small_exchange_bytes`` and ``medium_exchange_bytes`` are agreed when the communicator is
    built: ranks giving different values get the same ValueError, naming every rank's; a bad
    value is refused at once."""
    from mpi4py import MPI
    me = MPI.COMM_WORLD.Get_rank()
    with pytest.raises(ValueError, match=rf"{name} on rank \d+: the ranks must "
                                         r"agree, but they gave \{0: 0, 1: 1") as info:
        mxc.init(timeout=TIMEOUT_S, **{name: me})
    assert len(set(MPI.COMM_WORLD.allgather(str(info.value).split(":", 1)[1]))) == 1
    for bad in (-1, 1 << 63, 2.0, True):  # the ranks agree on it as an int64
        with pytest.raises(ValueError, match=f"{name}: expected None or a non-negative int"):
            mxc.init(timeout=TIMEOUT_S, **{name: bad})
    with mxc.init(timeout=TIMEOUT_S) as c:  # the host backend's default
        assert c.small_exchange_bytes == c.medium_exchange_bytes == 0
