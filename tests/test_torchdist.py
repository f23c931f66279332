"""Communicators over torch.distributed groups (``mxcomm.comm.init(group=...)``), with no MPI.

Spawned worlds of gloo processes (``tests/torch_world.py``, a FileStore as torchrun's TCP store
would be) check: the torch host communicator moves exactly the reference bytes (alltoallv with
every dtype, tuples, explicit offsets; alltoall_counts); a bad call raises the same error on every
rank; the layout path (exchange_layout, then dispatch/combine, bf16 and MXFP8) moves exactly the
reference rows with no host collective; sub-groups of a 3-process world (ranks are the group's,
two communicators over one group, a DeviceMesh dimension) work; a rank that skips a collective
makes the others time out; the drop-in ``mxcomm.torch.all_to_all_single`` against torch's own
collective; ``torchrun -m mxcomm.bench pipeline``. Every reference is rebuilt locally from the
peers' seeds, never moved by the code under test. No process imports mpi4py.

Run: ``python -m pytest -q tests/test_torchdist.py`` (part of the serial suite).
"""

import sys

import ml_dtypes
import numpy
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch_world import run_torchrun, run_world  # noqa: E402

SEED = 4321
BF16 = numpy.dtype(ml_dtypes.bfloat16)
TIMEOUT_S = 2.0


# --------------------------------------------------------------------------------- references
def count_matrix(size, seed):
    """(W, W) counts, ``[src, dst]`` rows src sends dst, with zeros; the same on every rank."""
    rng = numpy.random.default_rng(seed)
    return rng.integers(0, 5, size=(size, size)) * (rng.random((size, size)) < 0.8)


def rows_of(rank, n, dtype, row_shape, salt=0):
    """Rank ``rank``'s deterministic (n, *row_shape) rows."""
    rng = numpy.random.default_rng([SEED + rank, salt])
    if dtype == BF16 or dtype.kind == "f":
        return rng.standard_normal((n,) + row_shape).astype(dtype)
    info = numpy.iinfo(dtype)
    return rng.integers(info.min, info.max, size=(n,) + row_shape, endpoint=True, dtype=dtype)


def expected_recv(me, counts, make):
    """What ``me`` receives: rows each source sends it, sources in rank order (built locally)."""
    parts = []
    for src in range(counts.shape[0]):
        rows = make(src, int(counts[src].sum()))
        start = int(counts[src, :me].sum())
        parts.append(rows[start:start + int(counts[src, me])])
    return numpy.concatenate(parts)


def routed_rows(rank, experts, dim, seed):
    """Rank ``rank``'s token rows sorted by global expert and its (E,) counts."""
    rng = numpy.random.default_rng([seed, rank])
    counts = rng.integers(0, 4, size=experts)
    x = rng.standard_normal((int(counts.sum()), dim)).astype(BF16)
    return x, counts


def bits(a):
    return numpy.ascontiguousarray(a).view(numpy.uint8)


# ---------------------------------------------------------------------- worker: the whole world
def _alltoallv_checks(c, me, w):
    """Exact alltoallv (dtypes, tuples, offsets) and alltoall_counts on communicator ``c``."""
    for salt, (dtype, row_shape) in enumerate([(BF16, (5,)), (numpy.dtype(numpy.uint8), (3, 2)),
                                                (numpy.dtype(numpy.int32), ())]):
        counts = count_matrix(w, SEED + salt)
        make = lambda r, n: rows_of(r, n, dtype, row_shape, salt)  # noqa: E731
        got = c.alltoallv(make(me, int(counts[me].sum())), counts[me], counts[:, me])
        assert got.dtype == dtype and got.shape[1:] == row_shape
        numpy.testing.assert_array_equal(bits(got), bits(expected_recv(me, counts, make)))
    # a tuple moved together, into a given out
    counts = count_matrix(w, SEED + 10)
    a = lambda r, n: rows_of(r, n, BF16, (4,), 10)  # noqa: E731
    b = lambda r, n: rows_of(r, n, numpy.dtype(numpy.uint8), (1,), 11)  # noqa: E731
    n_me = int(counts[me].sum())
    outs = (numpy.empty((int(counts[:, me].sum()), 4), BF16),
            numpy.empty((int(counts[:, me].sum()), 1), numpy.uint8))
    got = c.alltoallv((a(me, n_me), b(me, n_me)), counts[me], counts[:, me], outs)
    assert got[0] is outs[0] and got[1] is outs[1]
    numpy.testing.assert_array_equal(bits(got[0]), bits(expected_recv(me, counts, a)))
    numpy.testing.assert_array_equal(got[1], expected_recv(me, counts, b))
    # explicit offsets: regions sent in reverse rank order, received with a gap row after each
    send = a(me, n_me)
    sc = [int(v) for v in counts[me]]
    so, at = [0] * w, 0
    for r in reversed(range(w)):
        so[r], at = at, at + sc[r]
    reordered = numpy.empty_like(send)
    start = 0
    for r in range(w):
        reordered[so[r]:so[r] + sc[r]] = send[start:start + sc[r]]
        start += sc[r]
    rc = [int(v) for v in counts[:, me]]
    ro = [sum(rc[:r]) + r for r in range(w)]
    out = numpy.zeros((sum(rc) + w, 4), BF16)
    c.alltoallv(reordered, sc, rc, out, send_offsets=so, recv_offsets=ro)
    expected = expected_recv(me, counts, a)
    for r in range(w):
        numpy.testing.assert_array_equal(bits(out[ro[r]:ro[r] + rc[r]]),
                                         bits(expected[sum(rc[:r]):sum(rc[:r]) + rc[r]]))
        assert not out[ro[r] + rc[r]].any()  # the gap row is untouched
    # counts vectors
    k = 3
    vec = numpy.arange(w * k, dtype=numpy.int64) + 100 * me
    got = c.alltoall_counts(vec)
    numpy.testing.assert_array_equal(got, [100 * src + me * k + j for src in range(w)
                                           for j in range(k)])


def _layout_checks(c, me, w, seed):
    """exchange_layout, then dispatch and combine on the layout path: exact, no host collective."""
    import mxcomm
    e_local, dim = 2, 64
    x, counts = routed_rows(me, w * e_local, dim, seed)
    layout = mxcomm.exchange_layout(counts, c)
    everyone = [routed_rows(r, w * e_local, dim, seed) for r in range(w)]
    assert layout.counts.tolist() == [list(cnt) for _, cnt in everyone]
    per_rank = numpy.array([cnt.reshape(w, e_local).sum(axis=1) for _, cnt in everyone])
    assert layout.input_splits == per_rank[me].tolist()
    assert layout.output_splits == per_rank[:, me].tolist()
    expected = expected_recv(me, per_rank, lambda r, n: everyone[r][0])
    before = c.host_collectives
    received = mxcomm.a2a_dispatch(x, layout, precision="bf16")
    back = mxcomm.a2a_combine(received, layout, precision="bf16")
    quantized = mxcomm.a2a_dispatch(x, layout, precision="mxfp8")
    assert c.host_collectives == before, "a layout-path call made a host collective"
    numpy.testing.assert_array_equal(bits(received), bits(expected))
    numpy.testing.assert_array_equal(bits(back), bits(x))
    reference = mxcomm.quantize_mxfp8(expected)  # row-local: quantize(moved) == moved(quantize)
    numpy.testing.assert_array_equal(quantized.data, reference.data)
    numpy.testing.assert_array_equal(quantized.scales, reference.scales)


def _drop_in_checks(me, w, group, mesh, comm, device="cpu"):
    """mxcomm.torch.all_to_all_single against torch's own collective on the same rows."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    import mxcomm.torch as mxt
    from reference import dequantize_mxfp8_ref, quantize_mxfp8_ref
    counts = count_matrix(w, SEED + 20)
    send, recv = [int(v) for v in counts[me]], [int(v) for v in counts[:, me]]
    x32 = torch.from_numpy(rows_of(me, sum(send), numpy.dtype(numpy.float32), (64,),
                                   20)).to(device)

    def reference(t, grad=None):
        t = t.detach().clone().requires_grad_()
        out = all_to_all_single_autograd(t, recv, send, group)
        out = out.wait() if hasattr(out, "wait") else out
        out.backward(grad if grad is not None else torch.ones_like(out))
        return out.detach(), t.grad

    bf = x32.to(torch.bfloat16)
    ref, _ = reference(bf)
    for g in (group, mesh, comm):  # every accepted kind of group: the same rows
        got = mxt.all_to_all_single(bf, recv, send, g, precision="bf16")
        assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    assert mxt.communicator_for(mesh) is mxt.communicator_for(group)  # cached per group
    # "native" keeps fp32 exactly, forward and backward (torch's factory signature)
    fn = mxt.all_to_all_single_fn("native")
    grad = torch.from_numpy(rows_of(me, sum(recv), numpy.dtype(numpy.float32), (64,),
                                    21)).to(device)
    ref32, ref_grad = reference(x32, grad)
    x = x32.clone().requires_grad_()
    got = fn(x, recv, send, group)
    got.backward(grad)
    assert got.dtype == torch.float32 and torch.equal(got, ref32) and torch.equal(x.grad, ref_grad)
    # MXFP8 on the wire: the received rows are the (float64 reference) quantized rows
    mx = mxt.all_to_all_single(bf, recv, send, group=group)
    moved = ref.view(torch.int16).cpu().numpy().view(BF16)
    expected = dequantize_mxfp8_ref(*quantize_mxfp8_ref(moved))
    numpy.testing.assert_array_equal(bits(mx.view(torch.int16).cpu().numpy()), bits(expected))
    # integer rows and None splits pass through to torch unchanged; 3-D rows keep their shape
    ints = torch.arange(w * 2 * 3, dtype=torch.int64, device=device).reshape(w * 2, 3) + 1000 * me
    got = mxt.all_to_all_single(ints, None, None, group)
    got = got.wait() if hasattr(got, "wait") else got
    assert torch.equal(got.cpu(), torch.cat([torch.arange(me * 6, me * 6 + 6).reshape(2, 3) +
                                             1000 * s for s in range(w)]))
    cube = bf.reshape(-1, 2, 32)
    assert torch.equal(mxt.all_to_all_single(cube, recv, send, group, precision="bf16"),
                       ref.reshape(-1, 2, 32))
    with pytest.raises(TypeError, match="ProcessGroup, a 1-D DeviceMesh or an mxcomm "
                                        "communicator"):
        mxt.all_to_all_single(bf, recv, send, [0, 1])
    with pytest.raises(ValueError, match="precision"):
        mxt.all_to_all_single_fn("fp4")


def gpu_world_checks(rank, size):
    """Rank ``rank`` of an NCCL world: mxcomm's NCCL communicator bootstrapped over the group,
    on this rank's GPU, moving exact rows; the drop-in against torch's NCCL collective."""
    import cupy

    import mxcomm.comm as mxc
    from torch.distributed.device_mesh import init_device_mesh
    group = dist.group.WORLD
    with mxc.init(group=group, timeout=60.0) as c:
        assert type(c).__name__ == "NcclCommunicator"
        assert c.device == rank == torch.cuda.current_device() and c.group == group
        counts = count_matrix(size, SEED + 50)
        make = lambda r, n: rows_of(r, n, BF16, (64,), 50)  # noqa: E731
        got = c.alltoallv(cupy.asarray(make(rank, int(counts[rank].sum()))), counts[rank],
                          counts[:, rank])
        c.wait()
        numpy.testing.assert_array_equal(bits(cupy.asnumpy(got)),
                                         bits(expected_recv(rank, counts, make)))
        mesh = init_device_mesh("cuda", (size,), mesh_dim_names=("ep",))
        _drop_in_checks(rank, size, group, mesh, c, device="cuda")
        return c.transport


def _side_channel_checks(side, rank, size):
    """The side channel's broadcast carries each root's object of its own size to every rank;
    every rank is on this host, so its local rank is its rank."""
    for root in range(size):
        sent = {"root": root, "bytes": bytes(range(7 * root + 1))}
        assert side.bcast_object(sent if rank == root else None, "test", root=root) == sent
    assert side.local_rank() == rank


def world_checks(rank, size):
    """Rank ``rank`` of the whole world: the communicator, its errors, the drop-in."""
    import mxcomm.comm as mxc
    from torch.distributed.device_mesh import init_device_mesh
    group = dist.group.WORLD
    with mxc.init(group=group, timeout=30.0) as c:
        assert type(c).__name__ == "TorchHostCommunicator" and c.transport == "grouped"
        assert (c.rank, c.size, c.group) == (rank, size, group)
        _alltoallv_checks(c, rank, size)
        _layout_checks(c, rank, size, SEED + 1)
        _side_channel_checks(c._side, rank, size)
        # one rank's bad counts: the same ValueError on every rank, before any data moves
        send = rows_of(rank, 4, BF16, (2,))
        bad = [4] + [0] * (size - 1) if rank != 1 else [1] * (size + 1)  # rank 1: W + 1 counts
        with pytest.raises(ValueError) as info:
            c.alltoallv(send, bad, [0] * size)
        message = str(info.value)
        with pytest.raises(RuntimeError, match="peer_memory=True"):
            mxc.init(group=group, peer_memory=True)  # no shared windows without MPI
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("ep",))
        _drop_in_checks(rank, size, group, mesh, c)
    return {"message": message, "mpi4py": "mpi4py" in sys.modules}


def subgroup_checks(rank, size):
    """Sub-groups of a 3-process world: {0, 2} and {1}; a 2-D mesh's dimensions."""
    import mxcomm
    import mxcomm.comm as mxc
    import mxcomm.torch as mxt
    from torch.distributed.device_mesh import init_device_mesh
    pair = dist.new_group([0, 2])   # every rank creates every group, members use theirs
    alone = dist.new_group([1])
    mine, members = (alone, [1]) if rank == 1 else (pair, [0, 2])
    c = mxc.init(group=mine, timeout=30.0)
    twin = mxc.init(group=mine, timeout=30.0)  # a second communicator over the same group
    me, w = members.index(rank), len(members)
    assert (c.rank, c.size, twin.rank, twin.size) == (me, w, me, w)
    for comm in (c, twin, c):  # interleaved: each has its own private gloo group
        _alltoallv_checks(comm, me, w)
    _layout_checks(c, me, w, SEED + 2)
    x = torch.from_numpy(rows_of(rank, 2 * w, numpy.dtype(numpy.float32), (32,), 30))
    got = mxt.all_to_all_single(x, [2] * w, [2] * w, mine, precision="native")
    assert torch.equal(got, torch.cat([torch.from_numpy(
        rows_of(g, 2 * w, numpy.dtype(numpy.float32), (32,), 30))[2 * me:2 * me + 2]
        for g in members]))
    mesh = init_device_mesh("cpu", (size, 1), mesh_dim_names=("dp", "ep"))
    with pytest.raises(ValueError, match="1-D DeviceMesh"):
        mxc.init(group=mesh)
    with mxc.init(group=mesh["dp"], timeout=30.0) as row:  # a 1-D mesh over every rank
        assert (row.rank, row.size) == (rank, size)
        _layout_checks(row, rank, size, SEED + 3)
    with mxc.init(group=mesh["ep"], timeout=30.0) as single:
        assert (single.rank, single.size) == (0, 1)
        assert mxcomm.a2a_dispatch(numpy.ones((3, 32), BF16), [3], [3], single).shape == (3, 32)
    c.close()
    twin.close()
    return "mpi4py" in sys.modules


def timeout_checks(rank, size):
    """The last rank skips a barrier: the others raise TimeoutError within the timeout, naming
    it by the arrival board (gloo cannot say who is missing)."""
    import time

    import mxcomm.comm as mxc
    c = mxc.init(group=dist.group.WORLD, timeout=TIMEOUT_S)
    if rank == size - 1:
        time.sleep(TIMEOUT_S + 1.5)  # the others give up meanwhile
        return None
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"did not finish within {TIMEOUT_S:g} s on rank "
                                           f"{rank} of {size}; by this node's arrival board, "
                                           f"rank {size - 1} had not entered this side-channel "
                                           f"collective"):
        c.barrier()
    elapsed = time.monotonic() - start
    assert c.aborted
    with pytest.raises(RuntimeError, match="communicator aborted"):
        c.barrier()
    return elapsed


# ------------------------------------------------------------------------------------- tests
def test_world_of_three_moves_exact_rows_without_mpi():
    results = run_world(3, world_checks)
    assert len({r["message"] for r in results}) == 1, "ranks raised different errors"
    assert "rank 1" in results[0]["message"]
    assert not any(r["mpi4py"] for r in results), "a rank imported mpi4py"


def test_subgroups_of_a_three_process_world():
    assert not any(run_world(3, subgroup_checks))


def test_a_rank_that_skips_a_collective_times_out_the_others():
    elapsed = [e for e in run_world(2, timeout_checks) if e is not None]
    assert elapsed and all(TIMEOUT_S - 0.1 <= e < TIMEOUT_S + 5.0 for e in elapsed), elapsed


@pytest.mark.gpu
def test_nccl_communicator_over_a_torch_group_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    transports = run_world(2, gpu_world_checks, timeout=300, gpu=True)
    assert len(set(transports)) == 1  # "pull" where the GPUs can map each other's memory


@pytest.mark.mpi
def test_drop_in_with_an_mpi_communicator():
    """The drop-in given a communicator built from MPI (no torch group): integer rows and None
    splits move exactly through it; float rows at a precision as with a torch group."""
    import mxcomm.comm as mxc
    import mxcomm.torch as mxt
    with mxc.init("mpi", timeout=60.0) as c:
        me, w = c.rank, c.size
        counts = count_matrix(w, SEED + 40)
        send, recv = [int(v) for v in counts[me]], [int(v) for v in counts[:, me]]
        make = lambda r, n: rows_of(r, n, numpy.dtype(numpy.int64), (3,), 40)  # noqa: E731
        got = mxt.all_to_all_single(torch.from_numpy(make(me, sum(send))), recv, send, c)
        numpy.testing.assert_array_equal(got.numpy(), expected_recv(me, counts, make))
        even = torch.arange(2 * w, dtype=torch.int32) + 100 * me
        got = mxt.all_to_all_single(even, None, None, c)
        assert got.tolist() == [100 * s + 2 * me + j for s in range(w) for j in range(2)]
        rows = lambda r, n: rows_of(r, n, BF16, (32,), 41)  # noqa: E731
        x = torch.from_numpy(rows(me, sum(send)).view(numpy.int16)).view(torch.bfloat16)
        got = mxt.all_to_all_single(x, recv, send, c, precision="bf16")
        numpy.testing.assert_array_equal(bits(got.view(torch.int16).numpy()),
                                         bits(expected_recv(me, counts, rows)))


def test_init_arguments_without_a_world(monkeypatch):
    import mxcomm.comm as mxc
    with pytest.raises(TypeError, match="ProcessGroup or a 1-D DeviceMesh"):
        mxc.init(group="ep")
    with pytest.raises(ValueError, match="not both"):
        mxc.init(mpi_comm=object(), group=object())
    with pytest.raises(ValueError, match="backend 'mpi'"):
        mxc.init("mpi", group=object())
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # as under torchrun
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="launched by torchrun"):
            mxc.init()


def test_bench_pipeline_under_torchrun():
    """``torchrun --nproc-per-node 2 -m mxcomm.bench pipeline``: the torch host communicator,
    every data movement exact (the benchmark exits 1 otherwise), no MPI."""
    returncode, stdout, stderr = run_torchrun(
        ["mxcomm.bench", "pipeline", "--tokens", "96", "--dim", "64", "--hidden", "32",
         "--experts", "2"])
    assert returncode == 0, stderr[-3000:]
    assert stdout.splitlines()[0].startswith("mxcomm EP pipeline, 2 ranks on a CPU")
    assert "TorchHostCommunicator" in stdout  # the notes name the communicator
