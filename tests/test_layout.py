"""The layout path: ranks agree once, in ``exchange_layout``; calls given the layout make no host
collective, order themselves through flags in peer memory, and fail in bounded time.

Run: ``mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_layout.py`` (and ``-n 3``).
On the host the pull transport's peer memory is an MPI shared window; the same protocol runs on
GPUs over CUDA IPC (the gpu-marked tests at the end).
"""

import os
import time

import numpy
import pytest

from mxcomm import comm as mxc
from mxcomm.a2a import a2a_combine, a2a_combine_backward, a2a_dispatch, a2a_dispatch_backward
from mxcomm.layout import Layout, exchange_layout
from mxcomm.mxfp8 import MXFP8Array
from mxcomm.permutation import permute, unpermute
from reference import quantize_mxfp8_ref
from test_ep import BF16, E_LOCAL, SETUPS, bits, fake_quantize, move_ref, to_device, to_host

SEED = 4321
D = 32
pytestmark = pytest.mark.mpi


def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def random_counts(rng, w, step):
    """Every rank's (E,) counts for one step: empty ranks, empty experts, one rank receiving
    everything, and plain random ones, in turn."""
    e = w * E_LOCAL
    kind = step % 4
    if kind == 0:
        return rng.integers(0, 4, size=(w, e))
    if kind == 1:  # rank 0 sends nothing, expert 1 receives nothing
        c = rng.integers(0, 3, size=(w, e))
        c[0] = 0
        c[:, 1] = 0
        return c
    if kind == 2:  # everything goes to the last rank
        c = numpy.zeros((w, e), dtype=numpy.int64)
        c[:, (w - 1) * E_LOCAL:] = rng.integers(1, 4, size=(w, E_LOCAL))
        return c
    return rng.integers(0, 7, size=(w, e))


def rows_for(counts_row, seed, width=D):
    rng = numpy.random.default_rng(seed)
    return rng.standard_normal((int(counts_row.sum()), width)).astype(BF16)


def splits_of(counts, w):
    """splits[s][r]: rows rank s sends rank r."""
    return [[int(v) for v in row.reshape(w, E_LOCAL).sum(axis=1)] for row in counts]


@pytest.fixture(params=list(SETUPS), ids=list(SETUPS))
def comm(request):
    peer_memory, small, medium = SETUPS[request.param]
    c = mxc.init("mpi", timeout=30.0, peer_memory=peer_memory, small_exchange_bytes=small,
                 medium_exchange_bytes=medium)
    yield c
    c.close()


def test_layout_object(comm):
    w, me = comm.size, comm.rank
    counts = random_counts(numpy.random.default_rng(SEED), w, 0)
    layout = exchange_layout(to_device(counts[me].astype(numpy.int64)), comm)  # int64 accepted
    assert isinstance(layout, Layout) and len(layout) == 3
    group, input_splits, output_splits = layout
    splits = splits_of(counts, w)
    assert input_splits == splits[me] and output_splits == [s[me] for s in splits]
    numpy.testing.assert_array_equal(
        to_host(group), counts[:, me * E_LOCAL:(me + 1) * E_LOCAL].reshape(-1))
    assert to_host(group).dtype == numpy.int32
    numpy.testing.assert_array_equal(layout.counts, counts)
    assert layout.sent == splits and layout.num_local_experts == E_LOCAL
    assert layout.num_rows == sum(splits[me]) and layout.num_received == sum(s[me] for s in splits)
    assert layout.permuted_rows(8) == -(-(layout.num_received + E_LOCAL * 8) // 8) * 8
    assert layout.dispatch_plan.recv_counts == output_splits
    assert layout.combine_plan.send_counts == output_splits


def test_hundreds_of_calls_without_host_collectives(comm):
    """Layouts change every few steps; within a step dispatch (MXFP8), permute, unpermute,
    combine (bf16) and their backwards move exactly the reference rows, and the only host
    collectives are the layout exchanges' (2 for the communicator's first, then 1 each: the
    number of experts is known) and the staging's rare growth."""
    w, me = comm.size, comm.rank
    rng = numpy.random.default_rng(SEED)  # the same stream on every rank: the same layouts
    layouts = exchanges = 0
    for step in range(12):
        counts = random_counts(rng, w, step)
        before = comm.host_collectives
        layout = exchange_layout(to_device(counts[me].astype(numpy.int32)), comm)
        assert comm.host_collectives - before == (2 if step == 0 else 1)
        layouts += 1
        splits = splits_of(counts, w)
        xs = [rows_for(counts[s], SEED + 100 * step + s) for s in range(w)]
        received_ref = move_ref([fake_quantize(x) for x in xs], splits, me)
        grown = comm._transport.memory.capacity if comm.transport == "pull" else 0
        before = comm.host_collectives
        for call in range(5):
            got = a2a_dispatch(to_device(xs[me]), layout)
            assert isinstance(got, MXFP8Array)
            data, scales = quantize_mxfp8_ref(move_ref(xs, splits, me), "rceil")
            numpy.testing.assert_array_equal(to_host(got.data), data)
            numpy.testing.assert_array_equal(to_host(got.scales), scales)
            permuted, indices, _ = permute(got, layout, align=8)
            back = unpermute(permuted, indices, layout)
            numpy.testing.assert_array_equal(to_host(back.data), data)
            home = a2a_combine(to_device(received_ref), layout)
            numpy.testing.assert_array_equal(bits(home), bits(fake_quantize(xs[me])))
            grad_home = a2a_dispatch_backward(to_device(received_ref), layout, precision="mxfp8")
            numpy.testing.assert_array_equal(bits(grad_home), bits(fake_quantize(xs[me])))
            grad_out = a2a_combine_backward(to_device(xs[me]), layout, precision="bf16")
            numpy.testing.assert_array_equal(bits(grad_out), bits(move_ref(xs, splits, me)))
            exchanges += 4
        growth = comm.host_collectives - before
        if comm.transport == "pull":  # growth: a barrier (after the first) + the window
            assert growth == 0 or comm._transport.memory.capacity > grown
        else:
            assert growth == 0
    assert layouts == 12 and exchanges == 240


def test_generation_wraps_around():
    """The generation counter crosses 2^32 and the exchanges go on, exact."""
    c = mxc.init("mpi", timeout=30.0)
    try:
        if c.transport != "pull":
            pytest.skip("the generation counter belongs to the pull transport")
        memory = c._transport.memory
        memory.generation = 2**32 - 3  # the same on every rank, before the first exchange
        w, me = c.size, c.rank
        counts = random_counts(numpy.random.default_rng(SEED + 1), w, 3)
        layout = exchange_layout(counts[me].astype(numpy.int32), c)
        splits = splits_of(counts, w)
        xs = [rows_for(counts[s], SEED + s) for s in range(w)]
        for _ in range(8):
            got = a2a_combine_backward(xs[me], layout, precision="mxfp8")
            data, _ = quantize_mxfp8_ref(move_ref(xs, splits, me), "rceil")
            numpy.testing.assert_array_equal(to_host(got.data), data)
        assert memory.generation == 5  # 2^32 - 3 + 8, modulo 2^32
    finally:
        c.close()


@pytest.mark.parametrize("mode", ["staged", "small", "medium"])
def test_rank_skipping_a_call_times_out_naming_it(mode):
    """The last rank skips one dispatch: the others raise TimeoutError naming it within the
    timeout (nothing waits forever); their communicator is aborted. Staged, the sender's ready
    flag is what is missing; small or medium (one ``alltoallv``), the layout check before it
    names the rank that did not arrive."""
    w0 = world()
    w, me = w0.Get_size(), w0.Get_rank()
    if w == 1:
        pytest.skip("needs two ranks")
    timeout = 2.0
    small = mode != "staged"
    c = mxc.init("mpi", timeout=timeout, small_exchange_bytes=(1 << 40) * (mode == "small"),
                 medium_exchange_bytes=(1 << 40) * (mode == "medium"))
    late = w - 1
    counts = numpy.full((w, w * E_LOCAL), 2)
    layout = exchange_layout(counts[me].astype(numpy.int32), c)
    x = rows_for(counts[me], SEED + me)
    a2a_dispatch(x, layout)  # everybody once: the staging is in place
    if me != late:
        start = time.monotonic()
        named = (f"alltoallv of a layout.*rank {late} did not arrive" if small else
                 f"rank {late} did not send its rows within 2 s")
        with pytest.raises(TimeoutError, match=named):
            a2a_dispatch(x, layout)
        assert timeout <= time.monotonic() - start < timeout + 5.0
        assert c.aborted
        with pytest.raises(RuntimeError, match="aborted"):
            a2a_dispatch(x, layout)
    w0.Barrier()
    if me == late:
        c.abort()  # its peers are gone
    c.close()


def test_ranks_calling_different_exchanges_raise():
    """A peer calling another exchange of the same row size is caught by the kind in its ready
    word: RuntimeError on every rank, instead of mixed rows: naming what each called, or, on a
    rank that comes to the exchange after its peers found the mismatch and gave up (3 ranks),
    saying that they found it mis-paired."""
    w0 = world()
    w, me = w0.Get_size(), w0.Get_rank()
    if w == 1:
        pytest.skip("needs two ranks")
    c = mxc.init("mpi", timeout=10.0)
    try:
        if c.transport != "pull":
            pytest.skip("the kind is checked by the pull transport")
        counts = numpy.full((w, w * E_LOCAL), 2)
        layout = exchange_layout(counts[me].astype(numpy.int32), c)
        x = rows_for(counts[me], SEED + me)
        a2a_dispatch(x, layout)
        call = a2a_dispatch if me == 0 else a2a_combine_backward
        with pytest.raises(RuntimeError, match="disagree on the operation, precision or D|"
                                               "found this exchange .* mis-paired"):
            call(x, layout, precision="mxfp8")
        assert c.aborted
    finally:
        w0.Barrier()
        c.abort()
        c.close()


@pytest.mark.parametrize("after_a_layout", [False, True], ids=["first", "after a layout"])
def test_bad_counts_raise_the_same_error_on_every_rank(comm, after_a_layout):
    """exchange_layout: a bad length, dtype, negative or oversized count on ONE rank raises the
    same exception on every rank at once (no rank waits for the timeout), naming the rank; the
    same after a layout of the communicator (whose E lets the next exchange take one round,
    which finds the bad rank and falls back to the two rounds on every rank)."""
    w0 = world()
    w, me = comm.size, comm.rank
    bad = w - 1
    good = numpy.ones(w * E_LOCAL, numpy.int32)
    if after_a_layout:
        exchange_layout(good, comm)
    cases = [
        (numpy.ones(w * E_LOCAL + 1, numpy.int32), ValueError,
         f"num_tokens_per_expert on rank {bad}: length {w * E_LOCAL + 1} is not a positive "
         f"multiple of the {w} ranks"),
        (numpy.ones(w * E_LOCAL, numpy.float32), TypeError,
         f"num_tokens_per_expert on rank {bad}: expected an integer array, got dtype float32"),
        (numpy.array([-1] + [1] * (w * E_LOCAL - 1), numpy.int32), ValueError,
         f"num_tokens_per_expert on rank {bad}: count -1 for expert 0 is negative"),
        (numpy.array([2**33] + [1] * (w * E_LOCAL - 1), numpy.int64), ValueError,
         f"num_tokens_per_expert on rank {bad}: count 8589934592 for expert 0 is beyond "
         f"2\\*\\*31 - 1 rows"),
    ]
    for counts, error, message in cases:
        start = time.monotonic()
        with pytest.raises(error, match=message) as info:
            exchange_layout(counts if me == bad else good, comm)
        assert time.monotonic() - start < 5.0
        assert len(set(w0.allgather(str(info.value)))) == 1
    if w > 1:  # E differing across ranks
        with pytest.raises(ValueError, match="every rank must count the same E experts"):
            exchange_layout(numpy.ones(2 * w * E_LOCAL if me == bad else w * E_LOCAL,
                                       numpy.int32), comm)
    layout = exchange_layout(good, comm)  # still usable
    assert layout.num_rows == w * E_LOCAL


def test_layouts_of_a_new_number_of_experts(comm):
    """The communicator's first layout takes two host rounds (the agreement, then counts), a
    later one of the same E one, a layout of a new E (on every rank) two (the agreement finds
    the change) and then one again; every layout equals the reference."""
    w, me = comm.size, comm.rank
    rng = numpy.random.default_rng(SEED + 11)
    for e_local, rounds in ((E_LOCAL, 2), (E_LOCAL, 1), (2 * E_LOCAL, 2), (2 * E_LOCAL, 1),
                            (E_LOCAL, 2)):
        counts = rng.integers(0, 9, (w, w * e_local))
        before = comm.host_collectives
        layout = exchange_layout(counts[me].astype(numpy.int64), comm)
        assert comm.host_collectives - before == rounds
        numpy.testing.assert_array_equal(layout.counts, counts)
        assert layout.num_local_experts == e_local
        assert layout.output_splits == [int(counts[j, me * e_local:(me + 1) * e_local].sum())
                                        for j in range(w)]
        numpy.testing.assert_array_equal(to_host(layout.num_tokens_per_expert_group),
                                         counts[:, me * e_local:(me + 1) * e_local].reshape(-1))


def test_layout_calls_check_locally(comm):
    """With a layout, wrong rows are caught locally at once, naming the rank and the layout."""
    w, me = comm.size, comm.rank
    layout = exchange_layout(numpy.full(w * E_LOCAL, 2, numpy.int32), comm)
    with pytest.raises(ValueError, match=f"x on rank {me}: has 3 rows, but the layout sends "
                                         f"{layout.num_rows}"):
        a2a_dispatch(numpy.zeros((3, D), BF16), layout)
    with pytest.raises(TypeError, match="either a layout or input_splits"):
        a2a_dispatch(numpy.zeros((layout.num_rows, D), BF16), layout, [1] * w)
    with pytest.raises(ValueError, match="the layout receives"):
        import mxcomm.torch as mxt  # noqa: F401 (the torch adapter checks rows too)
        import torch
        mxt.permute(torch.zeros((layout.num_received + 1, D), dtype=torch.bfloat16),
                    mxt.TensorLayout.of(layout))


def test_torch_pipeline_on_layout_makes_no_host_collective(comm):
    """mxcomm.torch forward and backward through a layout: no host collective after it, and
    the same results as the explicit-splits calls."""
    torch = pytest.importorskip("torch")
    import mxcomm.torch as mxt
    w, me = comm.size, comm.rank
    counts = random_counts(numpy.random.default_rng(SEED + 2), w, 0)
    layout = mxt.exchange_layout(torch.from_numpy(counts[me].astype(numpy.int64)), comm)
    group, input_splits, output_splits = layout
    assert group.dtype == torch.int32

    def run(use_layout):
        x = torch.from_numpy(rows_for(counts[me], SEED + me).view(numpy.int16)).view(
            torch.bfloat16).requires_grad_()
        if use_layout:
            received = mxt.a2a_dispatch(x, layout)
            permuted, indices, offsets = mxt.permute(received, layout, align=8)
        else:
            received = mxt.a2a_dispatch(x, input_splits, output_splits, comm)
            permuted, indices, offsets = mxt.permute(received, group, E_LOCAL, 8)
        y = permuted.dequantize() * 2
        back = mxt.unpermute(y, indices, layout if use_layout else received.shape[0])
        out = mxt.a2a_combine(back, layout) if use_layout else \
            mxt.a2a_combine(back, input_splits, output_splits, comm)
        out.float().square().sum().backward()
        return out.detach(), x.grad

    before = comm.host_collectives
    out, grad = run(True)
    # the peer memory's setup at most: the barriers around the flags window, the staging
    assert comm.host_collectives - before <= 3
    before = comm.host_collectives
    out, grad = run(True)
    assert comm.host_collectives == before
    ref_out, ref_grad = run(False)
    assert comm.host_collectives > before  # the explicit calls vote
    assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16))
    assert torch.equal(grad.view(torch.int16), ref_grad.view(torch.int16))


def test_torch_layout_keeps_its_index(comm):
    """The torch layout is made by the one exchange (its group tensor equals its group array);
    its permute index, handed back to unpermute, is found as the array kept beside the layout
    (no new view), and another tensor of the same values is viewed anew; ``Layout.of`` gives an
    array layout's equivalent on tensors."""
    torch = pytest.importorskip("torch")
    import mxcomm.torch as mxt
    w, me = comm.size, comm.rank
    counts = random_counts(numpy.random.default_rng(SEED + 9), w, 1)
    layout = mxt.exchange_layout(torch.from_numpy(counts[me].astype(numpy.int64)), comm)
    assert isinstance(layout, mxt.TensorLayout)
    numpy.testing.assert_array_equal(layout.group_tensor.numpy(),
                                     numpy.asarray(layout.num_tokens_per_expert_group))
    h = torch.zeros((layout.num_received, D), dtype=torch.bfloat16)
    _, indices, offsets = mxt.permute(h, layout, align=8)
    kept = layout._cache["permute", 8][0]
    assert mxt._index_array(indices, layout) is kept
    other = mxt._index_array(indices.clone(), layout)
    assert other is not kept
    numpy.testing.assert_array_equal(numpy.asarray(other), numpy.asarray(kept))
    on_arrays = exchange_layout(counts[me].astype(numpy.int32), comm)
    again = mxt.TensorLayout.of(on_arrays)
    assert again.input_splits == layout.input_splits == on_arrays.input_splits
    assert torch.equal(again.group_tensor, layout.group_tensor)


@pytest.mark.parametrize("second_use", [False, True])
def test_permute_backward_folds_into_the_quantized_dispatch_gradient(comm, monkeypatch,
                                                                     second_use):
    """With a layout and an MXFP8 dispatch gradient, permute's backward hands dispatch's
    backward its permuted gradient and the inverse index (a pending gather), and the MXFP8
    producer quantizes the permuted rows in place: the input gradient is bit-identical to the
    explicit-splits calls (which scatter, then quantize). With a second use of the received
    rows the gradients are summed first, which gathers them: identical again."""
    torch = pytest.importorskip("torch")
    import mxcomm.torch as mxt
    from mxcomm.formats import Format
    gathered = []  # rows read through the index: peers' rows quantized, own rows round-tripped
    quantize_gather = Format.launch_quantize_gather
    round_trip = Format.launch_round_trip

    def spy(fmt, x, rows, *args, **kwargs):
        gathered.append(rows.shape[0])
        return quantize_gather(fmt, x, rows, *args, **kwargs)

    def spy_round_trip(fmt, x, rows, *args, **kwargs):
        if rows is not None:
            gathered.append(rows.shape[0])
        return round_trip(fmt, x, rows, *args, **kwargs)

    monkeypatch.setattr(Format, "launch_quantize_gather", spy)
    monkeypatch.setattr(Format, "launch_round_trip", spy_round_trip)
    w, me = comm.size, comm.rank
    counts = random_counts(numpy.random.default_rng(SEED + 5), w, 3)
    layout = mxt.exchange_layout(torch.from_numpy(counts[me].astype(numpy.int64)), comm)
    group, input_splits, output_splits = layout
    scale = torch.linspace(-2, 2, D, dtype=torch.bfloat16)

    def run(use_layout, grad_precision="mxfp8"):
        x = torch.from_numpy(rows_for(counts[me], SEED + me).view(numpy.int16)).view(
            torch.bfloat16).requires_grad_()
        if use_layout:
            received = mxt.a2a_dispatch(x, layout, precision="fp8_rowwise",
                                        grad_precision=grad_precision)
            permuted, _, _ = mxt.permute(received, layout, align=8)
        else:
            received = mxt.a2a_dispatch(x, input_splits, output_splits, comm,
                                        precision="fp8_rowwise", grad_precision=grad_precision)
            permuted, _, _ = mxt.permute(received, group, E_LOCAL, 8)
        loss = (permuted.dequantize() * scale).float().square().sum()
        if second_use:
            loss = loss + (received.dequantize() * 3).float().sum()
        loss.backward()
        return x.grad

    folded = run(True)
    rows_quantized = sum(gathered)
    reference = run(False)
    assert torch.equal(folded.view(torch.int16), reference.view(torch.int16))
    received_rows = int(counts[:, me * E_LOCAL:(me + 1) * E_LOCAL].sum())
    # a small exchange gathers the rows, moves them as they are and quantizes them on arrival
    assert rows_quantized == (0 if second_use or comm.small_exchange_bytes else received_rows)
    assert sum(gathered) == rows_quantized  # the explicit calls never gather
    gathered.clear()
    run(True, grad_precision="bf16")  # a bf16 dispatch gradient: no pending gather
    assert not gathered


def _words(r):
    """The bytes of a result: a QuantizedArray's data and scales, or a plain array, as uint8
    rows (exact comparison)."""
    arrays = (r.data, r.scales) if hasattr(r, "scales") else (r,)
    return [numpy.ascontiguousarray(to_host(a)).view(numpy.uint8) for a in arrays]


def _same(got, want):
    for g, w in zip(_words(got), _words(want)):
        numpy.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8", "fp8_rowwise", "fp8_block128"])
def test_expert_side_in_permute_order(comm, precision):
    """``permute_align``: each of the four exchanges with its expert side in permute's order
    equals the exchange and a separate permute / unpermute bit for bit, over layouts with empty
    ranks, empty experts and one rank receiving everything (and their padding rows)."""
    from mxcomm.permutation import permute_backward, unpermute_backward
    w, me = comm.size, comm.rank
    width, align = 128, 8
    rng = numpy.random.default_rng(SEED + 11)
    for step in range(4):
        counts = random_counts(rng, w, step)
        layout = exchange_layout(to_device(counts[me].astype(numpy.int32)), comm)
        x = to_device(rows_for(counts[me], SEED + 100 * step + me, width))
        permuted, idx, offs = a2a_dispatch(x, layout, precision=precision, permute_align=align)
        want, want_idx, want_offs = permute(a2a_dispatch(x, layout, precision=precision),
                                            layout, align=align)
        _same(permuted, want)
        numpy.testing.assert_array_equal(to_host(idx), to_host(want_idx))
        numpy.testing.assert_array_equal(to_host(offs), to_host(want_offs))

        g = to_device(rows_for(counts[me], SEED + 100 * step + 50 + me, width))
        got = a2a_combine_backward(g, layout, precision=precision, permute_align=align)[0]
        _same(got, unpermute_backward(a2a_combine_backward(g, layout, precision=precision),
                                      want_idx))

        p = layout.permuted_rows(align)
        y = to_device(numpy.random.default_rng(SEED + step).standard_normal(
            (p, width)).astype(BF16))
        _same(a2a_combine(y, layout, precision=precision, permute_align=align),
              a2a_combine(unpermute(y, want_idx, layout), layout, precision=precision))
        _same(a2a_dispatch_backward(y, layout, precision=precision, permute_align=align),
              a2a_dispatch_backward(permute_backward(y, want_idx, layout), layout,
                                    precision=precision))


class _ReusingAllocator:
    """An allocator of the arrays a route's path writes (``mxcomm.route.arrays``) that behaves
    like a caching allocator at its worst: an array's memory is poisoned the moment the caller
    drops its owner, and handed to the next request that fits."""

    class Owner:
        def __init__(self, allocator, block, array):
            self.allocator, self.block, self.array = allocator, block, array

        def __del__(self):
            self.block[...] = 0xA5
            self.allocator.free.append(self.block)

    def __init__(self):
        self.free = []

    def __call__(self, shape, dtype, kind):
        nbytes = int(numpy.prod(shape)) * numpy.dtype(dtype).itemsize
        fits = [b for b in self.free if b.nbytes >= nbytes]
        block = fits[0] if fits else numpy.empty(max(nbytes, 1), numpy.uint8)
        if fits:
            self.free.remove(block)
        array = block[:nbytes].view(dtype).reshape(shape)
        return self.Owner(self, block, array), array


@pytest.mark.parametrize("mode", ["small", "medium", "staged"])
@pytest.mark.parametrize("precision", ["bf16", "mxfp8", "fp8_rowwise", "fp8_block128"])
def test_routes_hold_their_arrays_until_launched(precision, mode):
    """A route's path (``mxcomm.route``: an exchange that is one ``alltoallv``, a medium one, or
    a staged one whose result stays quantized) writes only the arrays ``route.arrays`` lists,
    which the caller holds until ``route.run`` returns: with an allocator that poisons and
    reuses an array's memory as soon as its owner is dropped (torch's and CuPy's caching
    allocators reuse it in stream order; an address alone does not keep it), its results in
    every direction it runs equal the engine's bit for bit. Medium and staged, it runs the
    quantized exchanges kept quantized (the dispatch and the combine's gradient) and no
    dequantized one; a medium one (quantized, then one alltoallv) equals the staged exchange of
    a communicator that stages it."""
    from mxcomm import route
    w, me = world().size, world().rank
    width = 128
    rng = numpy.random.default_rng(SEED + 23)
    huge = 1 << 40
    with mxc.init("mpi", timeout=30.0, small_exchange_bytes=huge if mode == "small" else 0,
                  medium_exchange_bytes=huge if mode == "medium" else 0) as c, \
            mxc.init("mpi", timeout=30.0, small_exchange_bytes=0,
                     medium_exchange_bytes=0) as staging:
        for step in range(3):
            counts = random_counts(rng, w, step)
            layout = exchange_layout(to_device(counts[me].astype(numpy.int32)), c)
            reference = exchange_layout(to_device(counts[me].astype(numpy.int32)), staging) \
                if mode == "medium" else layout
            x = to_device(rows_for(counts[me], SEED + 100 * step + me, width))
            y = to_device(rows_for(numpy.array([layout.num_received]), SEED + step, width))
            for function, call in (("a2a_dispatch", a2a_dispatch),
                                   ("a2a_combine_backward", a2a_combine_backward),
                                   ("a2a_combine", a2a_combine),
                                   ("a2a_dispatch_backward", a2a_dispatch_backward)):
                rows = x if function in ("a2a_dispatch", "a2a_combine_backward") else y
                r = route.route(function, precision, "rceil", BF16, width)
                plan = layout.dispatch_plan if r.dispatch else layout.combine_plan
                staged = not route.small(c, plan.largest_peer_rows, r.row_bytes)
                path = r.path(c, plan)
                if staged and r.fmt.quantized and r.dequantize:
                    assert path is None  # consumed in place: the engine's
                    continue
                assert path == ("alltoallv" if not staged or not r.fmt.quantized else mode)
                assert (r.path(c, plan, staged=False) is not None) == (
                    not staged or mode != "staged" or not r.fmt.quantized)
                alloc = _ReusingAllocator()
                held = [alloc(*spec) for spec in route.arrays(r, path, plan)]  # (owner, array)
                route.run(r, path, c, plan, rows, 0, [array for _, array in held])
                got = r.fmt.view(held[0][1], held[1][1]) if r.kept else held[0][1]
                _same(got, call(rows, reference, precision=precision))


def test_permute_align_errors(comm):
    """``permute_align`` needs a layout and a positive int; the permuted input of the combine
    direction must have the layout's P rows: each raises at once on the rank that made it."""
    w, me = comm.size, comm.rank
    counts = random_counts(numpy.random.default_rng(SEED), w, 0)
    layout = exchange_layout(to_device(counts[me].astype(numpy.int32)), comm)
    x = to_device(rows_for(counts[me], SEED + me))
    with pytest.raises(TypeError, match=f"permute_align on rank {me}: needs a layout"):
        a2a_dispatch(x, layout.input_splits, layout.output_splits, comm, permute_align=8,
                     validate=False)
    with pytest.raises(ValueError, match=f"permute_align on rank {me}: expected an int >= 1"):
        a2a_dispatch(x, layout, permute_align=0)
    with pytest.raises(ValueError, match=f"y on rank {me}: has 3 rows, but the layout permutes "
                                         f"to {layout.permuted_rows(8)} rows"):
        a2a_combine(to_device(numpy.zeros((3, D), BF16)), layout, permute_align=8)


@pytest.mark.parametrize("dispatch, grad", [("fp8_rowwise", "mxfp8"), ("mxfp8", "bf16")])
def test_torch_permute_align_equals_separate_calls(comm, dispatch, grad):
    """``mxcomm.torch``: dispatch and permute in one call, unpermute and combine in one call,
    forward and backward bit for bit as the four separate calls."""
    torch = pytest.importorskip("torch")
    import mxcomm.torch as mxt
    w, me = comm.size, comm.rank
    width, align = 64, 16
    counts = random_counts(numpy.random.default_rng(SEED + 7), w, 3)
    layout = mxt.exchange_layout(torch.from_numpy(counts[me].astype(numpy.int64)), comm)
    scale = torch.linspace(-2, 2, width, dtype=torch.bfloat16)

    def run(fused):
        x = torch.from_numpy(rows_for(counts[me], SEED + me, width).view(numpy.int16)).view(
            torch.bfloat16).requires_grad_()
        if fused:
            p, idx, _ = mxt.a2a_dispatch(x, layout, precision=dispatch, grad_precision=grad,
                                         permute_align=align)
        else:
            p, idx, _ = mxt.permute(mxt.a2a_dispatch(x, layout, precision=dispatch,
                                                     grad_precision=grad), layout, align=align)
        y = (p.dequantize() if hasattr(p, "qdata") else p) * scale
        y.retain_grad()
        if fused:
            out = mxt.a2a_combine(y, layout, grad_precision=dispatch, permute_align=align)
        else:
            out = mxt.a2a_combine(mxt.unpermute(y, idx, layout), layout, grad_precision=dispatch)
        (out.float() ** 2).sum().backward()
        return out, x.grad, y.grad

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# ------------------------------------------------------------------------------- GPU (H200s)
def _gpu_routed(w, me, step, width):
    rng = numpy.random.default_rng(SEED + step)
    counts = random_counts(rng, w, step) * 37
    return counts, [rows_for(counts[s], SEED + 10 * step + s, width) for s in range(w)]


@pytest.mark.gpu
def test_gpu_layout_path_equals_validated_path():
    """On GPUs (CUDA IPC pull with device flags): layout-path results equal the validated
    explicit-splits path bit for bit, over consecutive calls with changing layouts, and no host
    collective but the layout exchanges and the staging's growth."""
    import cupy
    with mxc.init("nccl", timeout=30.0, small_exchange_bytes=0,
                  medium_exchange_bytes=0) as c:
        w, me = c.size, c.rank
        stream = cupy.cuda.Stream(non_blocking=True)
        for step in range(6):
            counts, xs = _gpu_routed(w, me, step, 256)
            layout = exchange_layout(cupy.asarray(counts[me].astype(numpy.int32)), c)
            x = cupy.asarray(xs[me])
            y = cupy.asarray(fake_quantize(move_ref(xs, splits_of(counts, w), me)))
            # The copies above run on the current (null) stream, which the non-blocking
            # `stream` does not wait for: the inputs must be complete before it reads them.
            cupy.cuda.get_current_stream().synchronize()
            before = c.host_collectives
            fast = [a2a_dispatch(x, layout, stream=stream) for _ in range(3)]
            back = a2a_combine(y, layout, precision="mxfp8", stream=stream)
            grown = c.host_collectives - before
            assert grown == 0 or step == 0 or c._transport.memory.capacity > 0
            slow = a2a_dispatch(x, layout.input_splits, layout.output_splits, c, stream=stream)
            slow_back = a2a_combine(y, layout.input_splits, layout.output_splits, c,
                                    precision="mxfp8", stream=stream)
            c.wait(stream)
            for f in fast:
                assert bool((f.data == slow.data).all()) and bool((f.scales == slow.scales).all())
            assert bool((back.view(numpy.uint16) == slow_back.view(numpy.uint16)).all())
            data, _ = quantize_mxfp8_ref(move_ref(xs, splits_of(counts, w), me), "rceil")
            numpy.testing.assert_array_equal(to_host(fast[0].data), data)


@pytest.mark.gpu
def test_gpu_small_exchanges_equal_the_pulled_ones():
    """On GPUs: small exchanges (rows over NCCL as they are, quantized, round-tripped or
    permuted on arrival) and medium ones (quantized, then one NCCL group; the results kept
    quantized) equal the pulled quantized exchanges bit for bit, in every direction, MXFP8 and
    fp8 rowwise, over changing layouts."""
    import cupy
    huge = 1 << 40
    with mxc.init("nccl", timeout=30.0, small_exchange_bytes=0,
                  medium_exchange_bytes=0) as pulled, \
            mxc.init("nccl", timeout=30.0, small_exchange_bytes=huge) as small, \
            mxc.init("nccl", timeout=30.0, small_exchange_bytes=0,
                     medium_exchange_bytes=huge) as medium:
        w, me = pulled.size, pulled.rank
        staged = {small: [], medium: []}  # the kinds each staged

        def counting(c):
            exchange = c.exchange

            def counted(rows, *args, **kwargs):
                staged[c].append(rows.kind)
                return exchange(rows, *args, **kwargs)
            c.exchange = counted
        counting(small)
        counting(medium)
        stream = cupy.cuda.Stream(non_blocking=True)
        for step in range(3):
            counts, xs = _gpu_routed(w, me, step, 512)
            x = cupy.asarray(xs[me])
            y = cupy.asarray(move_ref(xs, splits_of(counts, w), me))
            cupy.cuda.get_current_stream().synchronize()  # inputs complete before `stream`
            results = []
            for c in (pulled, small, medium):
                layout = exchange_layout(cupy.asarray(counts[me].astype(numpy.int32)), c)
                got = []
                for precision in ("mxfp8", "fp8_rowwise"):
                    got.append(a2a_dispatch(x, layout, precision=precision, stream=stream))
                    got.append(a2a_dispatch(x, layout, precision=precision, stream=stream,
                                            permute_align=16)[0])
                    got.append(a2a_combine_backward(x, layout, precision=precision,
                                                    stream=stream))
                    got.append(a2a_combine(y, layout, precision=precision, stream=stream))
                    got.append(a2a_dispatch_backward(y, layout, precision=precision,
                                                     stream=stream))
                c.wait(stream)
                results.append(got)
            for other in results[1:]:
                for a, b in zip(results[0], other):
                    for u, v in zip(_words(a), _words(b)):
                        numpy.testing.assert_array_equal(u, v)
        # every small exchange went over NCCL, none was staged; of the medium ones only those
        # whose result is dequantized (the combine and the dispatch's gradient) were staged
        assert staged[small] == []
        assert staged[medium] and all(kind.startswith(("a2a_combine ", "a2a_dispatch_backward "))
                                      for kind in staged[medium])


def _tensor_words(t):
    """The bytes of a torch result (a QuantizedTensor's data and scales, or a plain tensor) as
    uint8 rows, like :func:`_words`."""
    import torch
    tensors = (t.qdata, t.scales) if hasattr(t, "scales") else (t,)
    return [u.detach().contiguous().view(torch.uint8).cpu().numpy() for u in tensors]


@pytest.mark.gpu
def test_gpu_torch_direct_calls_equal_the_engine(monkeypatch):
    """On GPUs: mxcomm.torch's direct calls (tensors passed by address, results allocated by
    torch, quantized ones wrapped unchecked) equal the array engine's results bit for bit, in
    every direction, bf16, MXFP8 and fp8 rowwise, over changing layouts, small exchanges and
    staged ones: every small exchange took the direct call, and of the staged ones those whose
    result stays quantized (the dispatch and the combine's gradient)."""
    torch = pytest.importorskip("torch")
    import mxcomm.torch as mxt
    functions = {"a2a_dispatch": a2a_dispatch, "a2a_combine_backward": a2a_combine_backward,
                 "a2a_combine": a2a_combine, "a2a_dispatch_backward": a2a_dispatch_backward}
    exchange_direct = mxt._exchange_direct
    for small in (True, False):
        _gpu_torch_direct_calls(torch, small, functions, exchange_direct, monkeypatch)


def _gpu_torch_direct_calls(torch, small, functions, exchange_direct, monkeypatch):
    """One communicator's half of :func:`test_gpu_torch_direct_calls_equal_the_engine`."""
    import cupy
    import mxcomm.torch as mxt
    with mxc.init("nccl", timeout=30.0, small_exchange_bytes=(1 << 40) if small else 0,
                  medium_exchange_bytes=0) as c:
        torch.cuda.set_device(c.device)
        w, me = c.size, c.rank
        taken = []
        monkeypatch.setattr(mxt._ops, "_exchange_direct",
                            lambda *args: taken.append(exchange_direct(*args)) or taken[-1])
        stream = torch.cuda.current_stream().cuda_stream
        for step in range(3):
            counts, xs = _gpu_routed(w, me, step, 512)
            x = cupy.asarray(xs[me])
            y = cupy.asarray(move_ref(xs, splits_of(counts, w), me))
            cupy.cuda.get_current_stream().synchronize()  # inputs complete before `stream`
            layout = exchange_layout(cupy.asarray(counts[me].astype(numpy.int32)), c)
            on_tensors = mxt.TensorLayout.of(layout)
            rows = {"x": (x, mxt._tensor(x)), "y": (y, mxt._tensor(y))}
            for precision in ("bf16", "mxfp8", "fp8_rowwise"):
                for function, call in functions.items():
                    array, tensor = rows["x" if call in (a2a_dispatch, a2a_combine_backward)
                                         else "y"]
                    want = call(array, layout, precision=precision, stream=stream)
                    got = mxt._ops.exchange(function, tensor, None, None, None, precision,
                                            on_tensors)
                    torch.cuda.synchronize()
                    for g, v in zip(_tensor_words(got), _words(want)):
                        numpy.testing.assert_array_equal(g, v)
        assert len(taken) == 3 * 3 * 4
        kept = ("a2a_dispatch", "a2a_combine_backward")
        want = [small or precision == "bf16" or function in kept for _ in range(3)
                for precision in ("bf16", "mxfp8", "fp8_rowwise") for function in functions]
        assert [t is not None for t in taken] == want


@pytest.mark.gpu
def test_gpu_permute_align_equals_separate_calls():
    """On GPUs (CUDA IPC pull): the quantized exchanges with their expert side in permute's
    order (each sender's rows scattered over NVLink into their permuted rows, the padding rows
    filled beside them) equal the exchange and a separate permute / unpermute bit for bit, over
    consecutive calls with changing layouts (empty ranks and experts included)."""
    import cupy
    from mxcomm.permutation import permute_backward, unpermute_backward
    with mxc.init("nccl", timeout=30.0, small_exchange_bytes=0,
                  medium_exchange_bytes=0) as c:
        w, me = c.size, c.rank
        stream = cupy.cuda.Stream(non_blocking=True)
        align = 16
        for step in range(4):
            counts, xs = _gpu_routed(w, me, step, 512)
            layout = exchange_layout(cupy.asarray(counts[me].astype(numpy.int32)), c)
            x = cupy.asarray(xs[me])
            rng = numpy.random.default_rng(SEED + step)
            y = cupy.asarray(rng.standard_normal((layout.permuted_rows(align), 512)).astype(BF16))
            cupy.cuda.get_current_stream().synchronize()
            for precision in ("fp8_rowwise", "mxfp8"):
                got, idx, _ = a2a_dispatch(x, layout, precision=precision, stream=stream,
                                           permute_align=align)
                want = permute(a2a_dispatch(x, layout, precision=precision, stream=stream),
                               layout, align=align, stream=stream)[0]
                got_g = a2a_combine_backward(x, layout, precision=precision, stream=stream,
                                             permute_align=align)[0]
                want_g = unpermute_backward(a2a_combine_backward(x, layout, precision=precision,
                                                                 stream=stream), idx,
                                            stream=stream)
                c.wait(stream)
                for a, b in ((got, want), (got_g, want_g)):
                    assert bool((a.data == b.data).all()) and bool((a.scales == b.scales).all())
            # combine direction: MXFP8 (gathered in the quantize's loads) and bf16 (gathered
            # into the staging the peers pull from)
            for precision in ("mxfp8", "bf16"):
                back = a2a_combine(y, layout, precision=precision, stream=stream,
                                   permute_align=align)
                want_back = a2a_combine(unpermute(y, idx, layout, stream=stream), layout,
                                        precision=precision, stream=stream)
                grad = a2a_dispatch_backward(y, layout, precision=precision, stream=stream,
                                             permute_align=align)
                want_grad = a2a_dispatch_backward(permute_backward(y, idx, layout,
                                                                   stream=stream),
                                                  layout, precision=precision, stream=stream)
                c.wait(stream)
                assert bool((back.view(numpy.uint16) == want_back.view(numpy.uint16)).all())
                assert bool((grad.view(numpy.uint16) == want_grad.view(numpy.uint16)).all())


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_the_token_path():
    """With a fixed layout, dispatch (MXFP8, pulled over CUDA IPC) -> permute -> unpermute ->
    combine (bf16 over NCCL, and MXFP8 read in place) is captured into ONE CUDA graph and
    replayed with identical results: the path makes no host synchronization. With
    MXCOMM_GRAPH_TEST=pull, the bf16 combine (NCCL) is left out: the exchanges all pull from
    peer memory, so it runs with ranks sharing one GPU (nccl_init='lazy').

    The ranks agree (over MPI) that every capture succeeded before any replays, so a capture
    failing on one rank fails the test on every rank with that rank's error instead of leaving
    the others' replays waiting for it."""
    import cupy
    with mxc.init("nccl", timeout=15.0, small_exchange_bytes=0,
                  medium_exchange_bytes=0) as c:
        w, me = c.size, c.rank
        counts, xs = _gpu_routed(w, me, 1, 512)
        layout = exchange_layout(cupy.asarray(counts[me].astype(numpy.int32)), c)
        x = cupy.asarray(xs[me])
        stream = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.get_current_stream().synchronize()  # x complete before `stream` reads it

        def token_path():
            from mxcomm.mxfp8 import dequantize_mxfp8
            received = a2a_dispatch(x, layout, stream=stream)
            permuted, indices, _ = permute(received, layout, align=32, stream=stream)
            back = unpermute(permuted, indices, layout, stream=stream)
            with stream:  # the expert's output stand-in: the received values, bf16
                y = dequantize_mxfp8(back, stream=stream)
            mxfp8 = a2a_combine(y, layout, precision="mxfp8", stream=stream)
            if os.environ.get("MXCOMM_GRAPH_TEST") == "pull":
                return (mxfp8,)
            return (a2a_combine(y, layout, stream=stream), mxfp8)

        # Allocations inside the capture come from CuPy's default pool, warmed by the calls
        # before it (cached blocks: no cudaMalloc while capturing, relaxed mode): the graph
        # writes to fixed addresses, which the arrays it returned keep. (With the stream-ordered
        # pool, cudaMallocAsync became graph allocation nodes never freed inside the graph, and
        # a graph holding unfreed allocations must not be launched again: the first 2xH200 runs
        # failed in the replays.)
        with stream:
            expected = [to_host(a).view(numpy.uint16) for a in token_path()]
            c.wait(stream)
            token_path()  # warm: every kernel compiled, every cache of the layout built
            c.wait(stream)
            # Relaxed: the communicator's watchdog thread may query events meanwhile.
            stream.begin_capture(getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", 2))
            error = None
            try:
                outs = token_path()
            except Exception as exc:  # reported on every rank below
                error = f"rank {me}: {type(exc).__name__}: {exc}"
            try:
                graph = stream.end_capture()
            except Exception as exc:
                error = error or f"rank {me}: end_capture: {type(exc).__name__}: {exc}"
            errors = [e for e in world().allgather(error) if e]
            if errors:
                c.abort()
                pytest.fail("capture failed: " + "; ".join(errors))
            for replay in range(4):  # every rank learns of a failed replay before the next
                error = None
                try:
                    for o in outs:
                        o.fill(0)
                    graph.launch(stream)
                    c.wait(stream)
                    for o, e in zip(outs, expected):
                        numpy.testing.assert_array_equal(to_host(o).view(numpy.uint16), e)
                except Exception as exc:
                    error = f"rank {me}, replay {replay}: {type(exc).__name__}: {exc}"
                errors = [e for e in world().allgather(error) if e]
                if errors:
                    pytest.fail("replay failed: " + "; ".join(errors))
            # NCCL releases a communicator only once every graph holding its work is destroyed:
            # the graph goes before the communicator closes (close would wait for it, bounded).
            del graph
        # What came home is each row's own MXFP8 round trip.
        numpy.testing.assert_array_equal(expected[0], bits(fake_quantize(xs[me])))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["staged", "small", "medium"])
def test_gpu_rank_skipping_a_call_times_out_naming_it(mode):
    """The last rank skips a dispatch: on the others the device wait (staged: the pull's; small
    or medium: NCCL's, ended by the watchdog) gives up after the timeout, comm.wait raises
    TimeoutError naming that rank, the communicator is aborted, and no GPU work stays queued."""
    import cupy
    w0 = world()
    w, me = w0.Get_size(), w0.Get_rank()
    if w == 1:
        pytest.skip("needs two ranks")
    small = mode != "staged"
    if small and os.environ.get("MXCOMM_NCCL_INIT") == "lazy":
        pytest.skip("small and medium exchanges move over NCCL, which ranks sharing a GPU "
                    "cannot build")
    c = mxc.init("nccl", timeout=3.0, small_exchange_bytes=(1 << 40) * (mode == "small"),
                 medium_exchange_bytes=(1 << 40) * (mode == "medium"))
    late = w - 1
    counts = numpy.full((w, w * E_LOCAL), 64)
    layout = exchange_layout(cupy.asarray(counts[me].astype(numpy.int32)), c)
    x = cupy.asarray(rows_for(counts[me], SEED + me, 256))
    a2a_dispatch(x, layout)
    c.wait()
    problem = None  # this rank's failed expectation, shared below so no rank waits on another
    if me != late:
        start = time.monotonic()
        try:
            a2a_dispatch(x, layout)
            c.wait()
            problem = "no error raised"
        except TimeoutError as exc:
            seconds = time.monotonic() - start
            named = f"rank {late} had not entered this exchange call" if small else \
                f"rank {late} did not arrive"
            if named not in str(exc):
                problem = f"TimeoutError not naming rank {late}: {exc}"
            elif seconds >= 3.0 + 10.0:
                problem = f"raised after {seconds:.1f} s"
            elif not c.aborted:
                problem = "communicator not aborted"
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        cupy.cuda.get_current_stream().synchronize()  # nothing left waiting on the GPU
    problems = [f"rank {r}: {p}" for r, p in enumerate(w0.allgather(problem)) if p]
    if me == late:
        c.abort()
    c.close()
    assert not problems, "; ".join(problems)
