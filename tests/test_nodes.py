"""EP across (emulated) nodes on the host: ranks split into nodes of ``node_size`` consecutive
ranks take the ``grouped`` transport (one alltoallv), or with ``peer_memory=True`` the ``hier``
one (the pull inside a node, one alltoallv between nodes); both give the flat exchange's results
(the pull over every rank) bit for bit, in every format and direction; the split is agreed on
every rank; peer memory never spans two nodes.

Run: ``mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_nodes.py`` (and ``-n 3``,
``-n 4``).
"""

import contextlib
import os

import numpy
import pytest

from mxcomm import comm as mxc
from mxcomm.a2a import (a2a_combine, a2a_combine_backward, a2a_dispatch, a2a_dispatch_backward,
                        all_to_all_single)
from mxcomm.layout import exchange_layout
from test_ep import BF16, bits, to_device, to_host
from test_layout import random_counts, rows_for

SEED = 2611
WIDTH = 128     # a multiple of every format's block
ALIGN = 8
PRECISIONS = ("bf16", "mxfp8", "fp8_rowwise", "fp8_block128", "fp8_block128_pow2")

pytestmark = pytest.mark.mpi
#: What says where the nodes are (comm/_nodes.py): a test that emulates nodes must leave both as
#: it found them, or every later communicator of the process sees its nodes.
NODE_ENV = ("NCCL_HOSTID", "MXCOMM_NODE_SIZE")


@contextlib.contextmanager
def node_env_cleared():
    """:data:`NODE_ENV` unset inside the block and, after it, exactly as before (set or unset),
    whatever the block set: ``init("nccl", node_size=k)`` exports ``NCCL_HOSTID=node<k>`` for
    the rest of the process (``Nodes.export_hostid``). ``monkeypatch.delenv(name,
    raising=False)`` records nothing for a variable that was unset, so it left that export
    behind (bench/NOTES.md, 2026-11-27)."""
    saved = {name: os.environ.pop(name, None) for name in NODE_ENV}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module", params=[(1, True), (2, True), (1, None), (2, None)],
                ids=["hier_nodes_of_1", "hier_nodes_of_2", "grouped_nodes_of_1",
                     "grouped_nodes_of_2"])
def pair(request):
    """The flat communicator (every rank pulls from every rank) and one over emulated nodes of
    ``node_size`` ranks: ``hier`` where ``peer_memory=True`` asks for it, else (the default
    across nodes) ``grouped``."""
    node_size, peer_memory = request.param
    flat = mxc.init("mpi", timeout=60.0)
    split = mxc.init("mpi", timeout=60.0, node_size=node_size, peer_memory=peer_memory)
    assert flat.transport == "pull"
    assert split.transport == ("pull" if node_size >= split.size
                               else "hier" if peer_memory else "grouped")
    yield flat, split
    split.close()
    flat.close()


def _same(got, want):
    """Bit-equal results: bf16 arrays, or quantized arrays (data and scales)."""
    if hasattr(want, "scales"):
        numpy.testing.assert_array_equal(to_host(got.data), to_host(want.data))
        numpy.testing.assert_array_equal(to_host(got.scales).view(numpy.uint8),
                                         to_host(want.scales).view(numpy.uint8))
    else:
        numpy.testing.assert_array_equal(bits(got), bits(want))


def _every_direction(comm, counts, precision, step):
    """Every exchange of one layout on ``comm``: dispatch (plain and in permute's order),
    combine, their backwards and the drop-in; the inputs are seeded alike on every comm."""
    me, w = comm.rank, comm.size
    layout = exchange_layout(to_device(counts[me].astype(numpy.int32)), comm)
    x = to_device(rows_for(counts[me], SEED + 100 * step + me, WIDTH))
    splits = [[int(v) for v in row.reshape(w, -1).sum(axis=1)] for row in counts]
    send, recv = splits[me], [row[me] for row in splits]
    y = to_device(rows_for(numpy.array([sum(recv)]), SEED + 100 * step + 50 + me, WIDTH))
    permuted, _, _ = a2a_dispatch(x, layout, precision=precision, permute_align=ALIGN)
    p = layout.permuted_rows(ALIGN)
    yp = to_device(numpy.random.default_rng(SEED + step).standard_normal(
        (p, WIDTH)).astype(BF16))
    return [a2a_dispatch(x, layout, precision=precision), permuted,
            a2a_combine(y, layout, precision=precision),
            a2a_combine_backward(x, layout, precision=precision),
            a2a_dispatch_backward(y, layout, precision=precision),
            a2a_combine(yp, layout, precision=precision, permute_align=ALIGN),
            all_to_all_single(x, recv, send, comm, precision)]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_across_nodes_equals_flat_in_every_format_and_direction(pair, precision):
    """Layouts with empty ranks, empty experts and one rank receiving everything: every
    direction of the exchange across nodes (``hier`` or ``grouped``) equals the flat one bit for
    bit."""
    flat, split = pair
    rng = numpy.random.default_rng(SEED)
    for step in range(4):
        counts = random_counts(rng, flat.size, step)
        for got, want in zip(_every_direction(split, counts, precision, step),
                             _every_direction(flat, counts, precision, step)):
            _same(got, want)


def test_between_nodes_only_remote_rows_travel(pair, monkeypatch):
    """The hier transport's alltoallv moves no row between ranks of one node, and every row
    between nodes; its peer memory (the MPI shared window's communicator) holds exactly the
    ranks of this rank's node."""
    from mpi4py import MPI
    _, hier = pair
    if hier.transport != "hier":
        pytest.skip(f"the {hier.transport} transport")
    me, w = hier.rank, hier.size
    transport = hier._transport
    node = transport.ranks
    window_comm = transport.memory._comm._side.mpi
    world = hier._side.mpi.Get_group()
    assert MPI.Group.Translate_ranks(window_comm.Get_group(), list(range(len(node))),
                                     world) == node
    moved = []
    original = type(hier)._move_rows

    def spy(self, sends, outs, sc, so, rc, ro, stream_ptr):
        moved.append((list(sc), list(rc)))
        return original(self, sends, outs, sc, so, rc, ro, stream_ptr)

    monkeypatch.setattr(type(hier), "_move_rows", spy)
    counts = random_counts(numpy.random.default_rng(SEED + 1), w, 3)
    layout = exchange_layout(to_device(counts[me].astype(numpy.int32)), hier)
    a2a_dispatch(to_device(rows_for(counts[me], SEED + me, WIDTH)), layout, precision="mxfp8")
    splits = [[int(v) for v in row.reshape(w, -1).sum(axis=1)] for row in counts]
    assert moved == [([0 if p in node else splits[me][p] for p in range(w)],
                      [0 if p in node else splits[p][me] for p in range(w)])]


def test_node_size_must_agree():
    """Ranks giving different node sizes: the same ValueError on every rank."""
    from mpi4py import MPI
    me = MPI.COMM_WORLD.Get_rank()
    with pytest.raises(ValueError, match=r"node_size on rank \d+: the ranks must give the same "
                                         r"positive int .* \{0: 2, 1: 1"):
        mxc.init("mpi", timeout=30.0, node_size=1 + (me == 0))


def test_node_size_from_the_environment(monkeypatch):
    """``$MXCOMM_NODE_SIZE`` splits the ranks as ``node_size`` does; a value that is not an int
    on one rank is an error on every rank."""
    from mpi4py import MPI
    me = MPI.COMM_WORLD.Get_rank()
    monkeypatch.setenv("MXCOMM_NODE_SIZE", "1")
    with mxc.init("mpi", timeout=30.0) as c:
        assert c._side.nodes.of_rank == tuple(range(c.size))
        assert c.transport == "grouped"
    monkeypatch.setenv("MXCOMM_NODE_SIZE", "two" if me == 1 else "1")
    with pytest.raises(ValueError, match=r"node_size on rank \d+: .* 1: -1"):
        mxc.init("mpi", timeout=30.0)


def test_nccl_hostid_must_split_the_ranks_alike(monkeypatch):
    """``NCCL_HOSTID`` on some ranks only, or splitting the ranks unlike ``node_size``: the same
    ValueError on every rank; where every rank sets it, it is the split."""
    from mpi4py import MPI
    me, w = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    monkeypatch.delenv("MXCOMM_NODE_SIZE", raising=False)
    if me == 0:
        monkeypatch.setenv("NCCL_HOSTID", "node0")
    else:
        monkeypatch.delenv("NCCL_HOSTID", raising=False)
    with pytest.raises(ValueError, match=r"\$NCCL_HOSTID on rank \d+: set on ranks \[0\] only"):
        mxc.init("mpi", timeout=30.0)
    monkeypatch.setenv("NCCL_HOSTID", f"host{me}")
    with pytest.raises(ValueError, match=r"node_size on rank \d+: \$NCCL_HOSTID puts the ranks"):
        mxc.init("mpi", timeout=30.0, node_size=w)
    with mxc.init("mpi", timeout=30.0, peer_memory=True) as c:
        assert c._side.nodes.of_rank == tuple(range(w))
        assert c.transport == "hier"


@pytest.mark.parametrize("before", [None, "launcher"], ids=["unset", "set"])
def test_an_emulated_init_leaves_the_next_communicator_on_one_node(before, monkeypatch):
    """What ``init("nccl", node_size=1)`` exports on each rank (``NCCL_HOSTID=node<rank>``, by
    the same call) does not outlive :func:`node_env_cleared`, as the GPU test of this module
    uses it: NCCL_HOSTID is as before (unset, or the launcher's value on every rank) and the
    next communicator is on one node, over the flat pull transport. Left behind, every rank
    was its own node, so the next modules' communicators took ``hier`` (then the default across
    nodes) with no small or medium
    exchanges and NCCL its network transport (bench/NOTES.md, 2026-11-27)."""
    from mxcomm.comm._nodes import Nodes
    from mpi4py import MPI
    me, w = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    monkeypatch.delenv("MXCOMM_NODE_SIZE", raising=False)
    # the process's own NCCL_HOSTID comes back after the test, set or unset (setenv records an
    # unset one, delenv would not)
    monkeypatch.setenv("NCCL_HOSTID", before or "unset below")
    if before is None:
        monkeypatch.delenv("NCCL_HOSTID")
    with node_env_cleared():
        assert not any(name in os.environ for name in NODE_ENV)
        Nodes(tuple(range(w)), emulated=True).export_hostid(me)
        assert os.environ["NCCL_HOSTID"] == f"node{me}"
        with mxc.init("mpi", timeout=30.0) as c:  # what the export tells a communicator
            assert c.transport == ("grouped" if w > 1 else "pull")
    assert os.environ.get("NCCL_HOSTID") == before
    with mxc.init("mpi", timeout=30.0) as c:
        assert c._side.nodes.of_rank == (0,) * w
        assert c.transport == "pull"


def test_rank_skipping_a_hier_call_times_out():
    """The last rank skips one MXFP8 dispatch: every other rank, on its node (a pull waiting for
    its rows: 4 ranks) or on another (the alltoallv), raises TimeoutError within the timeout and
    its communicator is aborted; nothing waits forever. Nodes of 1 at 2 ranks, of 2 above."""
    import time

    from mpi4py import MPI
    w0 = MPI.COMM_WORLD
    w, me = w0.Get_size(), w0.Get_rank()
    node_size = 1 if w <= 2 else 2
    timeout = 2.0
    c = mxc.init("mpi", timeout=timeout, node_size=node_size, peer_memory=True)
    assert c.transport == "hier"
    late = w - 1
    counts = numpy.full((w, w * 2), 2)
    layout = exchange_layout(counts[me].astype(numpy.int32), c)
    x = rows_for(counts[me], SEED + me, WIDTH)
    a2a_dispatch(x, layout, precision="mxfp8")  # everybody once: the staging is in place
    if me != late:
        start = time.monotonic()
        # on the late rank's node, the pull names it as the communicator numbers it
        named = (f"exchange on rank {me}: rank {late} did not send its rows"
                 if c.nodes[me] == c.nodes[late] else "did not finish")
        with pytest.raises(TimeoutError, match=named):
            a2a_dispatch(x, layout, precision="mxfp8")
        assert timeout <= time.monotonic() - start < timeout + 5.0
        assert c.aborted
    w0.Barrier()
    if me == late:
        c.abort()  # its peers are gone
    c.close()


@pytest.mark.gpu
@pytest.mark.parametrize("node_size", [1, 2])
def test_gpu_hier_equals_flat_in_every_format_and_direction(node_size):
    """On GPUs, emulated nodes of ``node_size`` (NCCL told by ``NCCL_HOSTID``, so it takes its
    network transport between them): the hier exchange (CUDA IPC pulls inside a node, one NCCL
    group between nodes) equals the flat pull bit for bit in every format and direction, over
    layouts with empty ranks and experts (37 times the CPU test's rows). Run at 2 and 4 GPUs."""
    limits = dict(timeout=60.0, small_exchange_bytes=0, medium_exchange_bytes=0)
    # the export of NCCL_HOSTID undone after: the next modules' communicators on one node
    with node_env_cleared(), mxc.init("nccl", **limits) as flat, \
            mxc.init("nccl", node_size=node_size, peer_memory=True, **limits) as hier:
        w, me = hier.size, hier.rank
        if node_size >= w:
            pytest.skip("one node")
        assert flat.transport == "pull" and hier.transport == "hier"
        assert os.environ["NCCL_HOSTID"] == f"node{me // node_size}"
        rng = numpy.random.default_rng(SEED + 7)
        for step in range(4):
            counts = random_counts(rng, w, step) * 37
            for precision in PRECISIONS:
                for got, want in zip(_every_direction(hier, counts, precision, step),
                                     _every_direction(flat, counts, precision, step)):
                    _same(got, want)
