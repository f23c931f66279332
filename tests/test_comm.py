"""Communicators: alltoallv / alltoall_counts against an independent reference, argument checks
that fail the same way on every rank, and timeouts that abort instead of hanging.

Run under MPI with any number of ranks:

    timeout 300 mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_comm.py
    timeout 300 mpiexec -n 3 python -m pytest -q --with-mpi -m mpi tests/test_comm.py

The reference never uses MPI: every rank regenerates every peer's send data from the peer's seed
(``SEED + peer``) and the shared count matrix, and builds the expected receive buffer locally.
"""

import subprocess
import sys
import time
import types

import ml_dtypes
import numpy
import pytest

from mxcomm._driver import copy_bytes, row_range

from mxcomm import comm as mxc
from mxcomm.comm._staged import MAX_PIECES, Plan

SEED = 1234
TIMEOUT_S = 2.0  # timeout of the timeout tests: expiry must come within this, plus slack
DTYPES = [numpy.dtype(ml_dtypes.bfloat16), numpy.dtype(numpy.uint8), numpy.dtype(numpy.int32)]


# --------------------------------------------------------------------------------- references
def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def count_matrix(pattern, size, seed=SEED):
    """(W, W) int counts, ``counts[src, dst]`` = rows src sends to dst; identical on every rank."""
    rng = numpy.random.default_rng(seed)
    if pattern == "random":
        return rng.integers(0, 7, size=(size, size))
    if pattern == "zeros":  # random with many zero blocks
        return rng.integers(0, 4, size=(size, size)) * (rng.random((size, size)) < 0.4)
    if pattern == "one_receiver":  # every rank sends everything to the last rank
        counts = numpy.zeros((size, size), dtype=numpy.int64)
        counts[:, size - 1] = rng.integers(1, 9, size=size)
        return counts
    if pattern == "empty":  # nobody sends anything: 0-row arrays
        return numpy.zeros((size, size), dtype=numpy.int64)
    raise ValueError(pattern)


def rows_of(rank, n, dtype, row_shape, salt=0):
    """Rank ``rank``'s deterministic (n, *row_shape) send rows (seed SEED + rank)."""
    rng = numpy.random.default_rng([SEED + rank, salt])
    if dtype == numpy.dtype(ml_dtypes.bfloat16):
        return rng.standard_normal((n,) + row_shape).astype(dtype)
    info = numpy.iinfo(dtype)
    return rng.integers(info.min, info.max, size=(n,) + row_shape, endpoint=True, dtype=dtype)


def expected_recv(me, counts, make):
    """Rows ``me`` receives: from each source in rank order, its block addressed to ``me``."""
    blocks = []
    for src in range(counts.shape[0]):
        data = make(src, int(counts[src].sum()))
        start = int(counts[src, :me].sum())
        blocks.append(data[start:start + counts[src, me]])
    return numpy.concatenate(blocks)


def bits(a):
    """Exact-comparison view (bf16 compared bit for bit)."""
    a = numpy.ascontiguousarray(a)
    return a.view(numpy.uint16) if a.dtype == numpy.dtype(ml_dtypes.bfloat16) else a


def same_error_everywhere(exc):
    """All ranks' messages (gathered with mpi4py); assert they are identical and return it."""
    messages = world().allgather(f"{type(exc).__name__}: {exc}")
    assert len(set(messages)) == 1, messages
    return messages[0]


@pytest.fixture
def comm():
    c = mxc.init("mpi", timeout=60.0)
    yield c
    c.close()


# ------------------------------------------------------------------------------- data movement
@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["random", "zeros", "one_receiver", "empty"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_alltoallv_matches_reference(comm, pattern, dtype):
    w, me = comm.size, comm.rank
    counts = count_matrix(pattern, w)
    row_shape = (3, 4) if dtype == numpy.int32 else (8,)  # rows may have any shape

    def make(rank, n):
        return rows_of(rank, n, dtype, row_shape)

    send = make(me, int(counts[me].sum()))
    out = comm.alltoallv(send, counts[me], counts[:, me])
    assert out.dtype == dtype and out.shape == (int(counts[:, me].sum()),) + row_shape
    numpy.testing.assert_array_equal(bits(out), bits(expected_recv(me, counts, make)))


@pytest.mark.mpi
def test_alltoallv_tuple_moves_data_and_scales_together(comm):
    """fp8-like data (M, 64) and scales (M, 2) uint8 in one call, into caller-given buffers."""
    w, me = comm.size, comm.rank
    counts = count_matrix("random", w, seed=SEED + 1)
    data = lambda r, n: rows_of(r, n, numpy.dtype(numpy.uint8), (64,), salt=1)  # noqa: E731
    scales = lambda r, n: rows_of(r, n, numpy.dtype(numpy.uint8), (2,), salt=2)  # noqa: E731
    m, n = int(counts[me].sum()), int(counts[:, me].sum())
    out = (numpy.full((n, 64), 0xAA, numpy.uint8), numpy.full((n, 2), 0xAA, numpy.uint8))
    got = comm.alltoallv((data(me, m), scales(me, m)), list(counts[me]),
                         tuple(int(c) for c in counts[:, me]), out=out)
    assert isinstance(got, tuple) and got[0] is out[0] and got[1] is out[1]
    numpy.testing.assert_array_equal(got[0], expected_recv(me, counts, data))
    numpy.testing.assert_array_equal(got[1], expected_recv(me, counts, scales))


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["random", "zeros", "one_receiver", "empty"])
def test_alltoallv_plan_moves_what_alltoallv_moves(comm, pattern):
    """``alltoallv_plan`` (an agreed Plan, no second check, no vote): the same rows as the
    reference, for a tuple of arrays, into the caller's buffers, with no host collective."""
    w, me = comm.size, comm.rank
    counts = count_matrix(pattern, w, seed=SEED + 5)
    data = lambda r, n: rows_of(r, n, numpy.dtype(numpy.uint8), (64,), salt=1)  # noqa: E731
    words = lambda r, n: rows_of(r, n, DTYPES[0], (3, 5), salt=3)  # noqa: E731
    plan = Plan(me, counts.tolist())
    m, n = plan.rows_sent, plan.rows_received
    outs = (numpy.full((n, 64), 0xAA, numpy.uint8), numpy.zeros((n, 3, 5), DTYPES[0]))
    before = comm.host_collectives
    comm.alltoallv_plan((data(me, m), words(me, m)), outs, plan, None)
    assert comm.host_collectives == before
    numpy.testing.assert_array_equal(outs[0], expected_recv(me, counts, data))
    numpy.testing.assert_array_equal(bits(outs[1]), bits(expected_recv(me, counts, words)))


@pytest.mark.mpi
@pytest.mark.parametrize("chunks", [2, 3])
def test_alltoallv_chunked_with_offsets_equals_unchunked(comm, chunks):
    """Pipelining: the exchange split into chunks of every peer block, called on the same full
    arrays with send_offsets/recv_offsets, equals the one-shot exchange."""
    w, me = comm.size, comm.rank
    counts = count_matrix("random", w, seed=SEED + 2)
    dtype = numpy.dtype(ml_dtypes.bfloat16)
    send = rows_of(me, int(counts[me].sum()), dtype, (16,))
    whole = comm.alltoallv(send, counts[me], counts[:, me])

    send_base = numpy.concatenate([[0], numpy.cumsum(counts[me])[:-1]])
    recv_base = numpy.concatenate([[0], numpy.cumsum(counts[:, me])[:-1]])
    out = numpy.zeros_like(whole)

    def chunk(total, c):  # rows [lo, hi) of chunk c of a block of `total` rows
        return total * c // chunks, total * (c + 1) // chunks

    for c in range(chunks):
        s_lo, s_hi = zip(*(chunk(int(n), c) for n in counts[me]))
        r_lo, r_hi = zip(*(chunk(int(n), c) for n in counts[:, me]))
        comm.alltoallv(send, numpy.subtract(s_hi, s_lo), numpy.subtract(r_hi, r_lo), out=out,
                       send_offsets=send_base + s_lo, recv_offsets=recv_base + r_lo)
    numpy.testing.assert_array_equal(bits(out), bits(whole))


# ---------------------------------------------------------------------------- staged exchange
class Rows:
    """A producer/consumer of the staged exchange (``mxcomm.comm._staged``) over host arrays:
    records what it produced and consumed, and copies consumed rows into ``received``."""

    def __init__(self, send, arrays, received_rows, kind="test rows"):
        self.arrays = tuple((shape, numpy.dtype(dtype)) for shape, dtype in arrays)
        self.kind = kind
        self.send = send
        self.produced, self.consumed = [], []
        self.received = tuple(numpy.empty((received_rows,) + shape, dtype)
                              for shape, dtype in self.arrays)
        for r in self.received:
            r.view(numpy.uint8)[...] = 0xA5  # rows never handed over would show

    def produce(self, begin, end, slots, stream):
        assert stream == 0  # the host
        self.produced.append((begin, end))
        for slot, a in zip(slots, self.send):
            assert slot.shape == (end - begin,) + a.shape[1:]
            slot[...] = a[begin:end]

    def consume(self, begin, end, rows, stream):
        assert stream == 0
        self.consumed.append((begin, end))
        for c, r in zip(self.received, rows):
            assert r.shape == (end - begin,) + c.shape[1:]
            c[begin:end] = r

    def keep(self, begin, end, at, slots, stream):  # own rows in place: through the slots
        self.produce(begin, end, slots, stream)
        self.consume(at, at + end - begin, slots, stream)


def staged(comm, counts, make, arrays, in_place=False):
    """Run ``comm.exchange`` of ``make(me, m)`` rows under the plan of ``counts``; return the
    received rows (``out``, or with ``in_place`` what ``consume`` copied) and the producer."""
    me = comm.rank
    plan = Plan(me, counts.tolist())
    rows = Rows(make(me, plan.rows_sent), arrays, plan.rows_received)
    outs = comm.exchange(rows, plan, in_place=in_place)
    # Every peer's rows produced once, in consecutive pieces: pulled, own rows last; grouped,
    # all in one launch (nothing overlaps its transfer).
    offsets = numpy.concatenate([[0], numpy.cumsum(counts[me])])
    produced = sorted(rows.produced)
    assert all(e == b2 for (_, e), (b2, _) in zip(produced, produced[1:]))
    assert sum(e - b for b, e in produced) == plan.rows_sent
    if comm.transport == "grouped":
        assert rows.produced == ([(0, plan.rows_sent)] if plan.rows_sent else [])
    elif counts[me, me]:
        assert rows.produced[-1][1] == offsets[me + 1]
    if in_place:
        assert outs is None
        return rows.received, rows
    return outs, rows


@pytest.fixture(params=[None, False], ids=["pull", "grouped"])
def staged_comm(request):
    c = mxc.init("mpi", timeout=60.0, peer_memory=request.param)
    yield c
    c.close()


def test_transport_from_the_nodes_the_votes_and_peer_memory():
    """``transport_of``'s table: one node pulls; across nodes ``grouped`` unless
    ``peer_memory=True`` asks for ``hier``, which needs runs of consecutive ranks and peer
    memory on every rank."""
    from mxcomm.comm._nodes import Nodes
    from mxcomm.comm._transport import transport_of
    one, pairs, alternating = Nodes((0, 0)), Nodes((0, 0, 1, 1)), Nodes((0, 1, 0, 1))
    every = [True] * 4
    assert [transport_of(one, every[:2], pm) for pm in (None, True)] == ["pull", "pull"]
    assert transport_of(one, [True, False], None) == "grouped"  # peer_memory=False votes no
    assert [transport_of(pairs, every, pm) for pm in (None, True, False)] == \
        ["grouped", "hier", "grouped"]
    assert transport_of(pairs, [True, True, False, True], True) == "grouped"
    assert transport_of(alternating, every, True) == "grouped"


@pytest.fixture(params=[False, True], ids=["whole", "pieces"])
def pieces(request, monkeypatch):
    """``pieces``: every peer's rows move in up to MAX_PIECES pieces (as large exchanges do)."""
    if request.param:
        from mxcomm.comm import _staged
        monkeypatch.setattr(_staged, "PIECE_BYTES", 1)
    return request.param


@pytest.mark.mpi
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("pattern", ["random", "zeros", "one_receiver", "empty"])
def test_exchange_matches_reference(staged_comm, pattern, in_place, pieces):
    """Both transports move (data, scales, words) like the reference, into ``out`` or read in
    place, whole or in pieces; each sender's rows are consumed once, whole; the staging grows
    between calls and is reused; no host collective but the staging's growth."""
    comm = staged_comm
    w, me = comm.size, comm.rank
    assert comm.transport == ("grouped" if comm._peer_memory is False else "pull")
    data = lambda r, n: rows_of(r, n, numpy.dtype(numpy.uint8), (64,), salt=1)  # noqa: E731
    scales = lambda r, n: rows_of(r, n, numpy.dtype(numpy.uint8), (2,), salt=2)  # noqa: E731
    words = lambda r, n: rows_of(r, n, DTYPES[0], (3, 5), salt=3)  # noqa: E731
    arrays = (((64,), numpy.uint8), ((2,), numpy.uint8), ((3, 5), DTYPES[0]))
    counts = count_matrix(pattern, w, seed=SEED + 11)
    for factor in (1, 3, 2, 3):  # grow, then reuse
        scaled = counts * factor
        make = lambda r, n: (data(r, n), scales(r, n), words(r, n))  # noqa: E731
        before = comm.host_collectives
        outs, rows = staged(comm, scaled, make, arrays, in_place)
        grew = comm.host_collectives - before
        assert grew == 0 or factor in (1, 3)
        for out, ref in zip(outs, (data, scales, words)):
            numpy.testing.assert_array_equal(bits(out), bits(expected_recv(me, scaled, ref)))
        if in_place:  # each sender's rows handed over once, whole
            offsets = numpy.concatenate([[0], numpy.cumsum(scaled[:, me])])
            assert sorted(rows.consumed) == [(offsets[p], offsets[p + 1]) for p in range(w)
                                             if scaled[p, me]]
        split = pieces and not in_place and comm.transport == "pull"
        if split and any(scaled[me, p] >= MAX_PIECES for p in range(w) if p != me):
            assert len(rows.produced) > w


@pytest.mark.mpi
def test_peer_memory_argument():
    with pytest.raises(ValueError, match="peer_memory: expected None"):
        mxc.init("mpi", peer_memory="yes")
    with mxc.init("mpi", peer_memory=True) as c:  # every rank of the test shares one node
        assert c.transport == "pull"


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [numpy.int32, numpy.int64])
@pytest.mark.parametrize("k", [1, 3])
def test_alltoall_counts(comm, dtype, k):
    w, me = comm.size, comm.rank
    counts = (numpy.arange(w * k) + 1000 * me).astype(dtype)
    got = comm.alltoall_counts(counts)
    expected = numpy.concatenate([numpy.arange(me * k, (me + 1) * k) + 1000 * src
                                  for src in range(w)]).astype(dtype)
    assert got.dtype == dtype
    numpy.testing.assert_array_equal(got, expected)


@pytest.mark.mpi
def test_barrier_and_context_manager():
    with mxc.init("mpi", timeout=30.0) as c:
        c.barrier()
        c.wait()  # nothing in flight on MPI: returns at once
    with pytest.raises(RuntimeError, match="closed"):
        c.barrier()
    c.close()  # idempotent


# ---------------------------------------------------------------------------- argument checks
def bad_arguments(comm, case):
    """Arguments of an alltoallv call where only the last rank (``bad``) is wrong, and the
    message (a substring) every rank is expected to see: ``(args, kwargs, expect)``."""
    w, me = comm.size, comm.rank
    bad = w - 1
    counts = count_matrix("random", w, seed=SEED + 3) + 1  # every block non-empty
    sc, rc = counts[me].copy(), counts[:, me].copy()
    send = rows_of(me, int(sc.sum()), numpy.dtype(numpy.uint8), (4,))
    kwargs = {}
    expect = None
    if case == "wrong_length":
        if me == bad:
            sc = list(sc) + [1]
        expect = f"alltoallv: send_counts on rank {bad} has {w + 1} entries, expected {w} " \
                 f"(one per rank)"
    elif case == "negative":
        if me == bad:
            rc[0] = -2
        expect = f"alltoallv: recv_counts on rank {bad} is negative for rank 0: -2"
    elif case == "sum_mismatch":
        if me == bad:
            send = numpy.concatenate([send, send[:1]])
        total = int(counts[bad].sum())
        expect = f"alltoallv: send_counts on rank {bad} add up to {total} rows, but " \
                 f"send has {total + 1} rows"
    elif case == "cross_rank":
        if me == bad:
            rc[0] += 1
        expect = f"alltoallv: rank {bad} expects {int(counts[0, bad]) + 1} rows from rank 0, " \
                 f"but rank 0 sends {int(counts[0, bad])}"
    elif case == "offsets_past_end":
        if me == bad:
            kwargs["send_offsets"] = [int(sc.sum())] * w
        expect = f"on rank {bad} runs past the {int(counts[bad].sum())} rows of send"
    elif case == "float_counts":
        if me == bad:
            sc = [float(v) for v in sc]
        expect = f"alltoallv: send_counts on rank {bad} must hold integers"
    elif case == "out_dtype":
        if me == bad:
            kwargs["out"] = numpy.empty((int(rc.sum()), 4), numpy.int8)
        expect = f"alltoallv: out on rank {bad} has dtype int8, send uint8"
    elif case == "row_shape_across_ranks":
        if me == bad:
            send = numpy.zeros((int(sc.sum()), 5), numpy.uint8)
        expect = "rows differ across ranks"
    return (send, sc, rc), kwargs, expect


BAD_CASES = {"wrong_length": ValueError, "negative": ValueError, "sum_mismatch": ValueError,
             "cross_rank": ValueError, "offsets_past_end": ValueError,
             "float_counts": TypeError, "out_dtype": TypeError,
             "row_shape_across_ranks": ValueError}


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_arguments_raise_same_error_on_every_rank(comm, case):
    if case == "row_shape_across_ranks" and comm.size == 1:
        pytest.skip("needs two ranks")
    args, kwargs, expect = bad_arguments(comm, case)
    with pytest.raises(BAD_CASES[case]) as info:
        comm.alltoallv(*args, **kwargs)
    message = same_error_everywhere(info.value)
    assert expect in message, (expect, message)
    # Nothing was aborted: the communicator still works.
    assert list(comm.alltoall_counts(numpy.arange(comm.size, dtype=numpy.int32))) == \
        [comm.rank] * comm.size


@pytest.mark.mpi
def test_bad_counts_length_for_alltoall_counts(comm):
    w, me = comm.size, comm.rank
    k = 2 if me == w - 1 else 1
    if w == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(ValueError) as info:
        comm.alltoall_counts(numpy.zeros(w * k, numpy.int32))
    message = same_error_everywhere(info.value)
    assert "alltoall_counts: rank" in message and "entries" in message


@pytest.mark.mpi
def test_validate_false_still_checks_locally(comm):
    me = comm.rank
    # Every rank is wrong the same way, so every rank raises locally and nobody waits.
    with pytest.raises(ValueError, match=f"send_counts on rank {me} has {comm.size + 1} "
                                         f"entries"):
        comm.alltoallv(numpy.zeros((1, 2), numpy.uint8), [1] + [0] * comm.size,
                       [1] * comm.size, validate=False)
    if comm.size > 1:
        w = comm.size
        counts = count_matrix("random", w, seed=SEED + 4)
        send = rows_of(me, int(counts[me].sum()), numpy.dtype(numpy.int32), (2,))
        make = lambda r, n: rows_of(r, n, numpy.dtype(numpy.int32), (2,))  # noqa: E731
        got = comm.alltoallv(send, counts[me], counts[:, me], validate=False)
        numpy.testing.assert_array_equal(got, expected_recv(me, counts, make))


@pytest.mark.mpi
def test_host_only_and_init_arguments():
    with pytest.raises(ValueError, match="backend"):
        mxc.init("gloo")
    with pytest.raises(ValueError, match="timeout"):
        mxc.init("mpi", timeout=0)
    from mxcomm.kernels import simulated
    c = mxc.init("auto")  # MPI under the simulator, NCCL on a GPU
    try:
        assert type(c).__name__ == ("MpiCommunicator" if simulated() else "NcclCommunicator")
        assert (c.rank, c.size) == (world().Get_rank(), world().Get_size())
    finally:
        c.close()


# ----------------------------------------------------------------------------------- timeouts
@pytest.mark.mpi
def test_timeout_when_a_rank_stops_participating():
    """The last rank skips a collective; the others raise TimeoutError within the timeout, and
    the communicator is aborted for them (later calls raise RuntimeError).

    MPI cannot cancel a collective, so the late rank must eventually join what the others left
    pending, or its peers could not finalize MPI cleanly: after the others have raised, it makes
    the matching call (a test convenience, not something an application would do).
    Three rounds: a barrier; an alltoallv stopped in its argument check (the late rank joins with
    a call that fails the check, so the vote completes and nobody moves data); and an alltoallv
    with validate=False stopped in the data exchange itself (the late rank joins with the same
    call and receives correct data: the timed-out ranks kept their buffers alive).
    """
    w0 = world()
    w, me = w0.Get_size(), w0.Get_rank()
    if w == 1:
        pytest.skip("needs two ranks")
    late = w - 1
    counts = count_matrix("random", w, seed=SEED + 5) + 1
    make = lambda r, n: rows_of(r, n, numpy.dtype(numpy.uint8), (8,))  # noqa: E731
    send = make(me, int(counts[me].sum()))

    def round_(call, late_join, named=True):
        c = mxc.init("mpi", timeout=TIMEOUT_S)
        if me != late:
            start = time.monotonic()
            with pytest.raises(TimeoutError, match="did not finish within 2 s") as info:
                call(c)
            if named:  # the side channel's collectives name the rank that did not arrive
                assert f"rank {late} did not arrive" in str(info.value)
            elapsed = time.monotonic() - start
            assert TIMEOUT_S <= elapsed < TIMEOUT_S + 5.0, elapsed
            assert c.aborted
            with pytest.raises(RuntimeError, match="communicator aborted"):
                call(c)
        w0.Barrier()           # the late rank waits until the others gave up ...
        if me == late:
            late_join(c)       # ... then joins, completing their pending requests
        w0.Barrier()           # progress for everybody until the late rank is through
        c.close()

    round_(lambda c: c.barrier(), lambda c: c.barrier())

    def late_invalid(c):
        with pytest.raises(ValueError, match=f"send_counts on rank {late} has 1 entries"):
            c.alltoallv(send, [1], counts[:, me])
    round_(lambda c: c.alltoallv(send, counts[me], counts[:, me]), late_invalid)

    def late_data(c):
        got = c.alltoallv(send, counts[me], counts[:, me], validate=False)
        numpy.testing.assert_array_equal(got, expected_recv(me, counts, make))
    round_(lambda c: c.alltoallv(send, counts[me], counts[:, me], validate=False), late_data,
           named=False)


def test_import_needs_no_cupy_nor_mpi():
    """``import mxcomm.comm`` loads neither CuPy nor mpi4py (backends load on first use)."""
    code = ("import sys, mxcomm.comm as c; assert callable(c.init); "
            "print('cupy' in sys.modules, 'mpi4py.MPI' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


# ------------------------------------------------------------------------------- GPU (H200s)
class _RecordedNccl:
    """A stand-in for CuPy's NCCL module and communicator: records each group's sends and
    receives as ``(op, peer, bytes)``."""

    NCCL_UINT8 = 0

    def __init__(self):
        self.groups = []

    def groupStart(self):  # noqa: N802 (CuPy's name)
        self.groups.append([])

    def groupEnd(self):  # noqa: N802
        pass

    def send(self, ptr, nbytes, dtype, peer, stream):
        self.groups[-1].append(("send", peer, nbytes))

    def recv(self, ptr, nbytes, dtype, peer, stream):
        self.groups[-1].append(("recv", peer, nbytes))


@pytest.mark.parametrize("across_nodes", [False, True], ids=["one_node", "across_nodes"])
def test_nccl_groups_send_once_per_peer_across_nodes(across_nodes):
    """NCCL's groups of an exchange of two arrays with the call header, 3 ranks: on one node one
    group with the header and both arrays per peer; across nodes the headers' group, then one
    group per array, so no group sends a peer twice (a second send to a peer in one group cost
    ~20 % of the network transport's bandwidth, bench/probe_wire.py). Every rank sends the same
    ops in the same order either way. No GPU: the NCCL module is a recorder."""
    from mxcomm.comm._header import HEADER_BYTES
    from mxcomm.comm._nccl import NcclCommunicator
    nccl = _RecordedNccl()
    comm = object.__new__(NcclCommunicator)
    comm._nccl, comm._nccl_mod, comm._uint8 = nccl, nccl, nccl.NCCL_UINT8
    comm.rank, comm.size = 1, 3
    comm._group_per_block = across_nodes
    recorded = []
    comm._record = lambda stream, call: recorded.append(call)

    class Headers:
        def begin(self, sends, plan, stream):
            return 1000, 2000, (0,) * 7

        def check(self, received, words, outs, stream):
            recorded.append("checked")

    data, scales = (10, 20, 64), (30, 40, 2)  # (send ptr, recv ptr, row bytes)
    sc, rc = [2, 0, 3], [1, 4, 0]  # rank 1 keeps nothing; sends 2 and 3, receives 1 and 4
    so, ro = [0, 2, 2], [0, 1, 5]
    comm._group([data, scales], sc, so, rc, ro, 7, 5, (Headers(), (), (), None))
    header = [("send", 0, HEADER_BYTES), ("recv", 0, HEADER_BYTES),
              ("send", 2, HEADER_BYTES), ("recv", 2, HEADER_BYTES)]
    rows = {row: [("send", 0, 2 * row), ("recv", 0, 1 * row), ("recv", 1, 4 * row),
                  ("send", 2, 3 * row)] for row in (64, 2)}
    if across_nodes:
        assert nccl.groups == [header, rows[64], rows[2]]
    else:
        assert nccl.groups == [header[:2] + [("send", 0, 128), ("recv", 0, 64),
                                             ("send", 0, 4), ("recv", 0, 2),
                                             ("recv", 1, 256), ("recv", 1, 8)]
                               + header[2:] + [("send", 2, 192), ("send", 2, 6)]]
    assert recorded == ["checked", 5]


@pytest.fixture(scope="module")
def torch_dist():
    """torch.distributed over NCCL on this process's GPU (node-local rank), rendezvous address
    broadcast over MPI. Yields the ``torch`` module."""
    import os
    import socket

    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    w0 = MPI.COMM_WORLD
    node = w0.Split_type(MPI.COMM_TYPE_SHARED, key=w0.Get_rank())
    local_rank = node.Get_rank()
    node.Free()
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    port = None
    if w0.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = w0.bcast(port, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("nccl", rank=w0.Get_rank(), world_size=w0.Get_size(),
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    yield torch
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def nccl_comm():
    c = mxc.init("nccl", timeout=120.0)
    yield c
    c.close()


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("pattern", ["random", "zeros", "one_receiver", "empty"])
def test_nccl_alltoallv_equals_torch_and_mpi(nccl_comm, torch_dist, dtype, pattern):
    import cupy
    torch = torch_dist
    import torch.distributed as dist
    w, me = nccl_comm.size, nccl_comm.rank
    counts = count_matrix(pattern, w, seed=SEED + 6) * 97  # a few hundred rows per block
    hidden = 256
    host = rows_of(me, int(counts[me].sum()), dtype, (hidden,))
    send = cupy.asarray(host)
    got = nccl_comm.alltoallv(send, counts[me], counts[:, me])
    # torch.distributed on the same bits (bf16 via DLPack; ints as they are)
    t_in = torch.from_dlpack(send)
    t_out = torch.empty((int(counts[:, me].sum()), hidden), dtype=t_in.dtype, device=t_in.device)
    dist.all_to_all_single(t_out, t_in, [int(c) for c in counts[:, me]],
                           [int(c) for c in counts[me]])
    torch.cuda.synchronize()
    ours = cupy.asnumpy(got)
    theirs = cupy.asnumpy(cupy.from_dlpack(t_out))
    numpy.testing.assert_array_equal(bits(ours), bits(theirs))
    with mxc.init("mpi", timeout=60.0) as mpi:
        numpy.testing.assert_array_equal(bits(ours),
                                         bits(mpi.alltoallv(host, counts[me], counts[:, me])))
    make = lambda r, n: rows_of(r, n, dtype, (hidden,))  # noqa: E731
    numpy.testing.assert_array_equal(bits(ours), bits(expected_recv(me, counts, make)))


@pytest.mark.gpu
@pytest.mark.mpi
def test_nccl_tuple_offsets_counts_and_no_growth(nccl_comm):
    """(data, scales) in one group, chunked with offsets, alltoall_counts + wait, and no
    growth of the event pool or CuPy's pool over 1000 calls."""
    import cupy
    w, me = nccl_comm.size, nccl_comm.rank
    counts = count_matrix("random", w, seed=SEED + 7) * 53
    data = lambda r, n: rows_of(r, n, numpy.dtype(numpy.uint8), (512,), salt=1)  # noqa: E731
    scales = lambda r, n: rows_of(r, n, numpy.dtype(numpy.uint8), (16,), salt=2)  # noqa: E731
    m, n = int(counts[me].sum()), int(counts[:, me].sum())
    send = (cupy.asarray(data(me, m)), cupy.asarray(scales(me, m)))
    out = (cupy.zeros((n, 512), cupy.uint8), cupy.zeros((n, 16), cupy.uint8))
    send_base = numpy.concatenate([[0], numpy.cumsum(counts[me])[:-1]])
    recv_base = numpy.concatenate([[0], numpy.cumsum(counts[:, me])[:-1]])
    half_s, half_r = counts[me] // 2, counts[:, me] // 2
    nccl_comm.alltoallv(send, half_s, half_r, out=out, send_offsets=send_base,
                        recv_offsets=recv_base)
    nccl_comm.alltoallv(send, counts[me] - half_s, counts[:, me] - half_r, out=out,
                        send_offsets=send_base + half_s, recv_offsets=recv_base + half_r)
    nccl_comm.wait()
    numpy.testing.assert_array_equal(cupy.asnumpy(out[0]), expected_recv(me, counts, data))
    numpy.testing.assert_array_equal(cupy.asnumpy(out[1]), expected_recv(me, counts, scales))

    got = nccl_comm.alltoall_counts(cupy.asarray(numpy.arange(w * 2, dtype=numpy.int32) +
                                                 1000 * me))
    nccl_comm.wait()
    expected = numpy.concatenate([numpy.arange(me * 2, me * 2 + 2) + 1000 * s for s in range(w)])
    numpy.testing.assert_array_equal(cupy.asnumpy(got), expected)

    pool = cupy.get_default_memory_pool()
    for i in range(1000):
        nccl_comm.alltoallv(send, counts[me], counts[:, me], out=out, validate=(i % 100 == 0))
        if i == 99:
            nccl_comm.wait()
            used, events = pool.used_bytes(), len(nccl_comm._free_events)
    nccl_comm.wait()
    time.sleep(0.05)  # let the watchdog recycle the last events
    assert pool.used_bytes() <= used
    assert len(nccl_comm._in_flight) + len(nccl_comm._free_events) <= max(events, 1) + 1100


class DeviceRows:
    """A producer/consumer of device rows: copies on the stream it is handed (a consumer in
    place must read on the side stream the transport gives it)."""

    def __init__(self, send, arrays, received_rows):
        import cupy
        self.cupy = cupy
        self.arrays = tuple((shape, numpy.dtype(dtype)) for shape, dtype in arrays)
        self.kind = "device test rows"
        self.send = send
        self.consumed = cupy.zeros((received_rows,) + self.arrays[0][0], self.arrays[0][1])
        self.streams = set()

    def produce(self, begin, end, slots, stream):
        # slots are arrays by address (the pull transport's staging) or CuPy arrays (grouped)
        for slot, a in zip(slots, self.send):
            copy_bytes(slot, a[begin:end], stream)

    def consume(self, begin, end, rows, stream):
        self.streams.add(stream)
        copy_bytes(row_range(self.consumed, begin, end), rows[0], stream)

    def keep(self, begin, end, at, slots, stream):  # own rows in place: through the slots
        self.produce(begin, end, slots, stream)
        self.consume(at, at + end - begin, slots, stream)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("peer_memory", [None, False], ids=["pull", "grouped"])
def test_nccl_exchange(peer_memory, in_place, pieces):
    """The CUDA IPC pull with device flags (and the NCCL grouped fallback) equal the reference,
    whole or in pieces, on a non-default stream (in place: consumed on the side stream the
    transport hands over), over repeated and growing calls with no host collective but growth."""
    import cupy
    with mxc.init("nccl", timeout=120.0, peer_memory=peer_memory) as comm:
        w, me = comm.size, comm.rank
        assert comm.transport == ("grouped" if peer_memory is False else "pull")
        data = lambda r, n: rows_of(r, n, numpy.dtype(numpy.uint8), (1024,), salt=1)  # noqa
        scales = lambda r, n: rows_of(r, n, numpy.dtype(numpy.uint8), (32,), salt=2)  # noqa
        counts = count_matrix("random", w, seed=SEED + 13) * 101
        stream = cupy.cuda.Stream(non_blocking=True)
        arrays = (((1024,), numpy.uint8), ((32,), numpy.uint8))
        for factor in (1, 4, 4, 2, 4, 3):
            scaled = counts * factor
            plan = Plan(me, scaled.tolist())
            send = (cupy.asarray(data(me, plan.rows_sent)),
                    cupy.asarray(scales(me, plan.rows_sent)))
            rows = DeviceRows(send, arrays, plan.rows_received)
            # The copies and the zero fill above run on the current (null) stream, which the
            # non-blocking `stream` (and the transport's side stream) do not wait for.
            cupy.cuda.get_current_stream().synchronize()
            before = comm.host_collectives
            outs = comm.exchange(rows, plan, in_place=in_place, stream=stream)
            assert comm.host_collectives == before or factor in (1, 4)
            comm.wait(stream)
            if in_place:
                assert outs is None
                numpy.testing.assert_array_equal(cupy.asnumpy(rows.consumed),
                                                 expected_recv(me, scaled, data))
                continue
            numpy.testing.assert_array_equal(cupy.asnumpy(outs[0]),
                                             expected_recv(me, scaled, data))
            numpy.testing.assert_array_equal(cupy.asnumpy(outs[1]),
                                             expected_recv(me, scaled, scales))


@pytest.mark.gpu
@pytest.mark.mpi
def test_nccl_timeout_aborts():
    """The last rank skips an NCCL exchange: the others' wait() raises TimeoutError within the
    timeout (watchdog or wait: ncclCommAbort) naming it by the arrival board, later calls raise
    RuntimeError; the late rank aborts its own communicator (its peers are gone) and the GPU
    stays usable."""
    import faulthandler

    import cupy
    w0 = world()
    w, me = w0.Get_size(), w0.Get_rank()
    if w == 1:
        pytest.skip("needs two ranks")
    faulthandler.dump_traceback_later(60, exit=True)  # a hang here shows its stacks, then ends
    c = mxc.init("nccl", timeout=TIMEOUT_S)
    counts = numpy.ones((w, w), dtype=numpy.int64) * 64
    send = cupy.zeros((64 * w, 128), cupy.uint8)
    c.alltoallv(send, counts[me], counts[:, me])  # connect the peers first: the stall is then
    c.wait()                                      # on the GPU, where the watchdog sees it
    try:  # the ranks meet below even when an assertion fails here (else the others hang)
        if me != w - 1:
            start = time.monotonic()
            with pytest.raises(TimeoutError,
                               match=f"rank {w - 1} had not entered this exchange call"):
                c.alltoallv(send, counts[me], counts[:, me], validate=False)
                c.wait()
            assert time.monotonic() - start < TIMEOUT_S + 10.0
            assert c.aborted
            with pytest.raises(RuntimeError, match="aborted"):
                c.wait()
    finally:
        w0.Barrier()
    if me == w - 1:
        c.abort()
    c.close()
    assert int(cupy.arange(10).sum()) == 45
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.gpu
@pytest.mark.mpi
def test_nccl_lazy_init():
    """nccl_init='lazy': exchanges pulled from peer memory never build NCCL's communicator; the
    first alltoallv builds it on every rank (rank 0 moving no rows included) and moves the
    rows."""
    import cupy

    import mxcomm
    with mxc.init("nccl", timeout=120.0, nccl_init="lazy", small_exchange_bytes=0,
                  medium_exchange_bytes=0) as c:
        w, me = c.size, c.rank
        assert c._nccl is None
        if c.transport == "pull":
            layout = mxcomm.exchange_layout(cupy.full(w * 2, 16, dtype=cupy.int32), c)
            x = cupy.asarray(rows_of(me, 32 * w, numpy.dtype(ml_dtypes.bfloat16), (64,)))
            mxcomm.a2a_dispatch(x, layout)
            c.wait()
            assert c._nccl is None
        counts = numpy.full((w, w), 8)
        counts[0, :] = counts[:, 0] = 0
        make = lambda r, n: rows_of(r, n, numpy.dtype(numpy.uint8), (96,), salt=3)  # noqa
        got = c.alltoallv(cupy.asarray(make(me, int(counts[me].sum()))), counts[me],
                          counts[:, me])
        c.wait()
        assert c._nccl is not None
        numpy.testing.assert_array_equal(cupy.asnumpy(got), expected_recv(me, counts, make))


class _LazyStandIn:
    """What ``NcclCommunicator._connected`` reads of its communicator (CPU stand-in)."""

    def __init__(self, capturing=False, connect_error=None):
        import threading
        self._nccl = None
        self.rank = 1
        self._lock = threading.Lock()
        self.connects = 0
        self.failed = None
        self._capturing = capturing
        self._connect_error = connect_error
        self._runtime = type("Runtime", (), {"streamIsCapturing": lambda _, s: capturing})()

    def _connect(self):
        self.connects += 1
        if self._connect_error is not None:
            raise self._connect_error
        return "nccl communicator"

    def _fail(self, error, raised=False):
        self.failed = (error, raised)


def test_nccl_lazy_connect_once_not_in_capture_aborts_on_failure():
    """The lazy bootstrap (CPU stand-in): built by the first call only; refused inside a CUDA
    graph capture with a message saying what to do; a failed bootstrap aborts the communicator
    and raises its error."""
    from mxcomm.comm._nccl import NcclCommunicator
    comm = _LazyStandIn()
    NcclCommunicator._connected(comm, 7)
    NcclCommunicator._connected(comm, 7)
    assert comm._nccl == "nccl communicator" and comm.connects == 1
    capturing = _LazyStandIn(capturing=True)
    with pytest.raises(RuntimeError, match=r"rank 1: NCCL is initialized lazily "
                                           r"\(nccl_init='lazy'\).*make one NCCL exchange "
                                           r"before capturing"):
        NcclCommunicator._connected(capturing, 7)
    assert capturing.connects == 0
    late = TimeoutError("NCCL bootstrap on rank 1 of 2: ncclCommInitRank did not complete")
    failing = _LazyStandIn(connect_error=late)
    with pytest.raises(TimeoutError, match="did not complete"):
        NcclCommunicator._connected(failing, 7)
    assert failing.failed == (late, True) and failing._nccl is None


class _WatchdogStandIn:
    """What ``NcclCommunicator._record`` and ``_retire_finished`` read of their communicator
    (CPU stand-in), with a runtime whose events finish when the test says so."""

    def __init__(self):
        import collections
        import threading
        from mxcomm.comm._nccl import NcclCommunicator
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._free_events, self._in_flight, self._mixed = [], collections.deque(), False
        self._captured = False
        self._runtime = self
        self.done, self.queries, self.created = set(), 0, 0
        self.record = lambda stream, call: NcclCommunicator._record(self, stream, call)
        self._retire_finished = lambda: NcclCommunicator._retire_finished(self)

    def streamIsCapturing(self, stream):
        return False

    def eventCreateWithFlags(self, flags):
        self.created += 1
        return self.created

    def eventRecord(self, event, stream):
        self.done.discard(event)

    def eventQuery(self, event):
        self.queries += 1
        return 0 if event in self.done else 600  # cudaSuccess, cudaErrorNotReady


@pytest.mark.parametrize("finishes", [True, False])
def test_nccl_close_waits_for_groups_on_every_stream(finishes):
    """A clean close waits (bounded) for the NCCL groups in flight on every stream, not only the
    current one, before ncclCommDestroy (which would wait for them unbounded, the watchdog
    stopped); a group that does not finish within ``1.25 * timeout + 1`` s makes the close abort
    NCCL instead (CPU stand-ins for CUDA and NCCL)."""
    import collections
    import threading
    from mxcomm.comm._nccl import NcclCommunicator
    ops, done = [], set()
    runtime = types.SimpleNamespace(
        eventQuery=lambda event: 0 if event in done else 600, eventDestroy=lambda event: None)
    comm = object.__new__(NcclCommunicator)
    comm.rank, comm.size, comm.timeout = 0, 2, 0.05
    comm._runtime, comm._lock = runtime, threading.Lock()
    comm._wake = threading.Condition(comm._lock)
    comm._state, comm._reason, comm._pending_error = "open", "", None
    comm._transport, comm._headers, comm._captured = None, None, False
    comm._free_events, comm._mixed = [], False
    comm._in_flight = collections.deque([(41, 0.0, 3, 5)])  # (event, recorded, call, stream)
    comm._watchdog = threading.current_thread()  # no thread to stop
    comm._board = types.SimpleNamespace(describe=lambda kind, call: f"call {call}")
    comm.wait = lambda stream=None: None  # the current stream is done
    comm._nccl = types.SimpleNamespace(destroy=lambda: ops.append(("destroy", 41 in done)),
                                       abort=lambda: ops.append(("abort", 41 in done)))
    if finishes:
        threading.Timer(0.2, done.add, (41,)).start()
    start = time.monotonic()
    NcclCommunicator._close_backend(comm, True)
    if finishes:
        assert ops == [("destroy", True)] and 0.15 < time.monotonic() - start < 1.0, ops
    else:
        # aborted by the drain's timeout, then released by abort (a no-op in CuPy once aborted)
        assert set(ops) == {("abort", False)} and time.monotonic() - start < 5, ops
        assert "close: an NCCL exchange did not finish within 0.05 s on rank 0 (call 3)" in \
            comm._reason


def test_nccl_watchdog_retires_finished_events():
    """The NCCL watchdog's event queue (CPU stand-in): on one stream events finish in record
    order, so the finished head of 1000 is found in O(log n) queries, exactly; on several
    streams head by head, stopping at the first unfinished one; recording with an empty pool
    reuses finished events before it creates any."""
    comm = _WatchdogStandIn()
    for call in range(1000):
        comm.record(7, call)
    assert comm.created == 1000 and not comm._mixed
    comm.queries = 0
    assert comm._retire_finished() == 0 and comm.queries == 1  # nothing finished
    comm.done.update(range(1, 638))
    comm.queries = 0
    assert comm._retire_finished() == 637
    assert comm.queries <= 2 + 10  # the head, then a binary search over 999
    assert sorted(comm._free_events) == list(range(1, 638))
    assert [e for e, *_ in comm._in_flight] == list(range(638, 1001))
    comm.done.update(range(638, 1001))
    assert comm._retire_finished() == 363 and not comm._in_flight
    comm._free_events.clear()

    comm.record(7, 0)
    comm.record(8, 1)  # a second stream: no order between them
    comm.record(7, 2)
    comm.record(8, 3)
    assert comm._mixed
    first = [e for e, *_ in comm._in_flight]
    comm.done.update([first[0], first[1], first[3]])
    assert comm._retire_finished() == 2  # stops at the unfinished third
    assert [e for e, *_ in comm._in_flight] == first[2:]
    comm.done.update(first)
    assert comm._retire_finished() == 2 and not comm._in_flight and not comm._mixed

    created = comm.created
    comm._free_events.clear()
    comm.record(7, 4)
    comm.record(7, 5)
    comm.done.update(e for e, *_ in comm._in_flight)
    comm.record(7, 6)  # an empty pool: the two finished ones come back first
    assert comm.created == created + 2
    assert len(comm._in_flight) == 1 and len(comm._free_events) == 1


@pytest.mark.mpi
def test_nccl_init_argument(monkeypatch):
    with pytest.raises(ValueError, match=r"nccl_init: expected 'eager' or 'lazy'.*got 'soon'"):
        mxc.init("mpi", nccl_init="soon")
    monkeypatch.setenv("MXCOMM_NCCL_INIT", "later")
    with pytest.raises(ValueError, match=r"MXCOMM_NCCL_INIT.*got 'later'"):
        mxc.init("mpi")


@pytest.mark.parametrize("outcome", ["blocks", "raises", "joins"])
def test_nccl_init_is_bounded_by_the_timeout(outcome):
    """ncclCommInitRank blocks until every rank has joined: a peer that died after the unique id
    went out must end in a TimeoutError on the survivors, not a hang. Exercised on the CPU with a
    stand-in NCCL whose init blocks, raises or succeeds."""
    import threading
    import types

    from mxcomm.comm._nccl import NcclCommunicator

    release = threading.Event()

    class FakeNccl:
        class NcclCommunicator:
            def __init__(self, size, unique_id, rank):
                if outcome == "blocks":
                    release.wait(30)
                elif outcome == "raises":
                    raise RuntimeError("NCCL error: remote process exited")

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda d: types.SimpleNamespace(use=lambda: None)))
    comm = types.SimpleNamespace(timeout=0.3, rank=1, size=2, device=0, _cupy=fake_cupy)
    start = time.monotonic()
    try:
        if outcome == "blocks":
            with pytest.raises(TimeoutError, match="rank 1 of 2: ncclCommInitRank did not "
                                                   "complete within 0.3 s"):
                NcclCommunicator._init_bounded(comm, FakeNccl, b"id")
            assert time.monotonic() - start < 5
        elif outcome == "raises":
            with pytest.raises(RuntimeError, match="remote process exited"):
                NcclCommunicator._init_bounded(comm, FakeNccl, b"id")
        else:
            assert isinstance(NcclCommunicator._init_bounded(comm, FakeNccl, b"id"),
                              FakeNccl.NcclCommunicator)
    finally:
        release.set()


@pytest.mark.parametrize("outcome", ["blocks", "raises", "returns"])
def test_nccl_release_is_bounded_by_the_timeout(outcome):
    """ncclCommDestroy (and ncclCommAbort) wait until every CUDA graph holding the communicator's
    work is destroyed: close must not hang on a graph still alive. Exercised on the CPU with a
    stand-in NCCL whose destroy blocks (a RuntimeWarning naming the live graph, within the
    timeout), raises (the error reaches close's caller) or returns (nothing said)."""
    import threading
    import types
    import warnings

    from mxcomm.comm._nccl import NcclCommunicator

    release = threading.Event()

    def destroy():
        if outcome == "blocks":
            release.wait(30)
        elif outcome == "raises":
            raise RuntimeError("NCCL error: unhandled cuda error")

    comm = types.SimpleNamespace(timeout=0.3, rank=1, _captured=True,
                                 _nccl=types.SimpleNamespace(destroy=destroy))
    start = time.monotonic()
    try:
        if outcome == "blocks":
            with pytest.warns(RuntimeWarning, match=r"close on rank 1: ncclCommDestroy did not "
                                                    r"return within 0.3 s: a CUDA graph"):
                NcclCommunicator._release_nccl(comm, True)
            assert time.monotonic() - start < 5
        elif outcome == "raises":
            with pytest.raises(RuntimeError, match="unhandled cuda error"):
                NcclCommunicator._release_nccl(comm, True)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                NcclCommunicator._release_nccl(comm, True)
    finally:
        release.set()


# -------------------------------------------------------------------- the pull transport's schedule
class _FakePeerMemory:
    """Views of zero-filled host buffers standing in for the staging (what a schedule keeps)."""

    def __init__(self):
        self.epoch = 1
        self.capacity = 1 << 30

    def reserve(self, nbytes, stream):
        assert nbytes <= self.capacity

    def local(self, offset, shape, dtype):
        return numpy.zeros(shape, dtype)

    def peer_view(self, peer, offset, shape, dtype):
        return numpy.zeros(shape, dtype)


def test_pull_schedule_is_made_once_per_plan_and_dropped_with_it_or_the_staging(monkeypatch):
    """The pull transport works a plan out once per (row arrays, kind, consumption): the same
    schedule serves later calls; it goes when the plan goes (weakly held) and when the staging
    moves (the peer memory's epoch); and its copy ranges cover exactly the rows each sender holds
    for this rank (rank 1 of 3 here, the senders' rows in pieces of about 2 rows)."""
    import gc
    from mxcomm.comm import _staged
    from mxcomm.comm._pull import PullTransport
    monkeypatch.setattr(_staged, "PIECE_BYTES", 18)
    memory = _FakePeerMemory()
    transport = PullTransport(None, memory)
    arrays = (((8,), numpy.dtype(numpy.uint8)), ((1,), numpy.dtype(numpy.uint8)))
    row_bytes = _staged.row_bytes_of(arrays)
    sent = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    plan = Plan(1, sent)
    first = transport._schedule(plan, (arrays, "rows", False, None), 0)
    assert transport._schedule(plan, (arrays, "rows", False, None), 0) is first
    assert transport._schedule(plan, (arrays, "rows", True, None), 0) is not first
    # per sender, every piece's copies land the sender's rows for rank 1 at their place
    covered = {0: [], 1: []}
    assert max(awaits[0][1] for awaits, _ in first.receives) > 0  # several pieces
    for awaits, copies in first.receives:
        ((peer, piece, kind),) = awaits
        # the kind text's hash; the call's tag is OR-ed in per call
        assert kind == _staged.kind_word(_staged.kind_base("rows"))
        for sender, offset, index, out_offset, nbytes in copies:
            assert sender == peer
            covered[index].append((out_offset // row_bytes[index], nbytes // row_bytes[index]))
    recv_offsets = plan.recv_offsets
    want = sorted((recv_offsets[p], sent[p][1]) for p in (0, 2))
    for index in (0, 1):
        rows = sorted(covered[index])
        merged = []
        for at, n in rows:  # pieces of one sender are contiguous
            if merged and merged[-1][0] + merged[-1][1] == at:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((at, n))
        assert merged == want
    # with a landing (runs of received rows placed elsewhere: permute_align), a schedule of its
    # own whose copies put every received row of the peers, piece by piece, where its run says
    # (received rows 0-1 from rank 0, 2-6 own, 7-14 from rank 2; runs cut inside senders)
    landing = ((0, 20, 1), (1, 5, 1), (2, 0, 5), (7, 30, 3), (10, 10, 5))
    landed = transport._schedule(plan, (arrays, "rows", False, landing), 0)
    assert landed is not first and \
        transport._schedule(plan, (arrays, "rows", False, landing), 0) is landed
    place = {r + i: at + i for r, at, n in landing for i in range(n)}
    for index in (0, 1):
        seen = []
        for _, copies in landed.receives:
            for peer, offset, i, out_offset, nbytes in copies:
                staged_first = sent[peer][0]  # rank 1's rows start after rank 0's in staging
                if i != index:
                    continue
                base = _staged.regions(row_bytes, sum(sent[peer]))[0][index]
                r = recv_offsets[peer] + (offset - base) // row_bytes[index] - staged_first
                for k in range(nbytes // row_bytes[index]):
                    assert out_offset // row_bytes[index] + k == place[r + k]
                    seen.append(r + k)
        assert sorted(seen) == [0, 1] + list(range(7, 15))
    own_begin, own_end, own_at, _, lands = landed.own
    assert [(a, b, at) for a, b, at in lands] == [(own_begin, own_end, 0)]  # rows 2-6 -> 0-4
    memory.epoch += 1  # the staging moved: every schedule is made anew
    assert transport._schedule(plan, (arrays, "rows", False, None), 0) is not first
    assert len(transport._schedules) == 1
    del plan, first, landed
    gc.collect()
    assert len(transport._schedules) == 0


@pytest.mark.parametrize("in_place", [False, True], ids=["copies", "in_place"])
def test_pull_schedule_batches_small_exchanges(monkeypatch, in_place):
    """A rank whose peers' rows are few produces them in one or two launches (the peers after it,
    then before: send order) and signals every peer once, after the last; a receiver of few rows
    waits for every sender at once, then moves each sender's rows where the per-peer schedule
    does (rank 1 of 4 here). Above ``BATCH_BYTES`` each peer has its own launch and wait."""
    from mxcomm.comm import _staged
    from mxcomm.comm._pull import _Schedule
    arrays = (((8,), numpy.dtype(numpy.uint8)), ((1,), numpy.dtype(numpy.uint8)))
    row_bytes = _staged.row_bytes_of(arrays)
    sent = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    plan = Plan(1, sent)
    batch = _Schedule(plan, _FakePeerMemory(), arrays, row_bytes, 0x1234, in_place, None)
    kind = lambda n: _staged.kind_word(0x1234)  # noqa: E731 (the same for every peer)
    # rows 0-4 go to rank 0, 5-10 own, 11-17 to rank 2, 18-25 to rank 3
    assert [(b, e) for b, e, _, _ in batch.sends] == [(11, 26), (0, 5)]
    assert batch.sends[0][3] == ()
    assert batch.sends[1][3] == ((2, 0, kind(7)), (3, 0, kind(8)), (0, 0, kind(5)))
    assert batch.own[:3] == (5, 11, plan.recv_offsets[1])
    ((awaits, work),) = batch.receives
    assert awaits == ((0, 0, kind(2)), (3, 0, kind(14)), (2, 0, kind(10)))  # pull order
    monkeypatch.setattr(_staged, "BATCH_BYTES", 8)
    each = _Schedule(plan, _FakePeerMemory(), arrays, row_bytes, 0x1234, in_place, None)
    assert [(b, e, sig) for b, e, _, sig in each.sends] == [
        (11, 18, ((2, 0, kind(7)),)), (18, 26, ((3, 0, kind(8)),)), (0, 5, ((0, 0, kind(5)),))]
    assert [a for a, _ in each.receives] == [(a,) for a in awaits]
    if in_place:  # views compared by the rows they hold: the fake memory's are zero arrays
        assert [(b, e) for _, ws in each.receives for b, e, _ in ws] == [(b, e) for b, e, _ in work]
    else:
        assert [w for _, ws in each.receives for w in ws] == work


def test_signal_kernels_batch_as_many_peers_as_the_schedule():
    """_signal.cu's PeerWords holds MAX_BATCH peers: the batched schedule never hands a launch
    more, and the launches pack exactly that many fields."""
    import pathlib
    import re
    from mxcomm.comm import _staged
    source = (pathlib.Path(_staged.__file__).with_name("_signal.cu")).read_text()
    assert int(re.search(r"#define MX_BATCH (\d+)", source).group(1)) == _staged.MAX_BATCH


def test_landed_matches_row_by_row_placement():
    """``landed`` (where received rows [lo, hi) land: the runs a schedule copies) equals a row
    by row placement, for random landings (runs of 1-4 rows in a shuffled placement) and random
    ranges, with or without a landing."""
    from mxcomm.comm._staged import landed
    rng = numpy.random.default_rng(SEED + 31)
    for _ in range(200):
        sizes = rng.integers(1, 5, rng.integers(1, 12)).tolist()
        starts = numpy.concatenate([[0], numpy.cumsum(sizes)[:-1]]).tolist()
        ats = rng.permutation(len(sizes)).tolist()
        landing = tuple((s, 100 * a, n) for s, a, n in zip(starts, ats, sizes))
        total = sum(sizes)
        lo = int(rng.integers(0, total + 1))
        hi = int(rng.integers(lo, total + 1))
        place = {s + i: at + i for s, at, n in landing for i in range(n)}
        runs = landed(landing, lo, hi)
        rows = [(r + i, out + i) for r, out, n in runs for i in range(n)]
        assert rows == [(r, place[r]) for r in range(lo, hi)]
        assert all(n > 0 for _, _, n in runs)
        assert landed(None, lo, hi) == ([(lo, lo, hi - lo)] if hi > lo else [])


@pytest.mark.mpi
def test_side_channel_broadcast_and_local_rank(comm):
    """The MPI side channel (the torch one: test_torchdist.py) broadcasts each root's object of
    its own size to every rank; all ranks run on this host, so each one's local rank is its rank."""
    side = comm._side
    for root in range(comm.size):
        sent = {"root": root, "bytes": bytes(range(7 * root + 1))}
        assert side.bcast_object(sent if comm.rank == root else None, "test", root=root) == sent
    assert side.local_rank() == comm.rank


# ------------------------------------------------------------------------------- arrival board
@pytest.mark.mpi
def test_arrival_board_names_the_ranks_behind(comm):
    """Rank r enters r + 1 exchange calls and no side-channel collective: for exchange call W,
    every rank but the last is behind, with its count, on every rank's board; for call 1 nobody
    is; the kinds are counted apart; all ranks are on this node."""
    from mxcomm.comm._board import EXCHANGE, SIDE, ArrivalBoard
    w, me = comm.size, comm.rank
    board = ArrivalBoard(comm._side)
    assert board.local == list(range(w))
    for _ in range(me + 1):
        board.enter(EXCHANGE)
    comm._side.barrier("test")
    behind, gone, unknown = board.late(EXCHANGE, w)
    assert behind == [(r, r + 1) for r in range(w - 1)] and gone == [] and unknown == []
    text = board.describe(EXCHANGE, w)
    names = "rank 0" if w == 2 else "ranks " + ", ".join(map(str, range(w - 1)))
    assert f"{names} had not entered this exchange call (number {w}; entered: rank 0: 1" in text
    assert board.late(EXCHANGE, 1) == ([], [], [])
    assert "every rank of this node had entered this exchange call (number 1)" in \
        board.describe(EXCHANGE, 1)
    assert board.late(SIDE, 1)[0] == [(r, 0) for r in range(w)]
    assert comm._side.board is not None  # init made the communicator's own
    comm._side.barrier("test")
    board._slots = None  # unreadable: the timeout message says so instead of raising
    assert board.describe(EXCHANGE, w).startswith("the arrival board could not be read (")


@pytest.mark.mpi
def test_arrival_board_names_a_rank_whose_process_is_gone(comm):
    """A slot whose pid no longer runs is named (here rank 1's pid replaced, on rank 0's view,
    by that of a finished child process)."""
    from mxcomm.comm._board import EXCHANGE, ArrivalBoard
    board = ArrivalBoard(comm._side)
    comm._side.barrier("test")
    if comm.rank == 0:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        board._slots[1, 2] = child.pid
        assert board.late(EXCHANGE, 0)[1] == [1]
        assert "rank 1: process gone" in board.describe(EXCHANGE, 0)
    comm._side.barrier("test")
