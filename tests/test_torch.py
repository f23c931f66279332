"""mxcomm.torch: MXFP8Tensor and the EP token path under torch autograd.

CPU (simulator + MPI) tests compare forward values and every gradient exactly with a NumPy
reference of the whole token path (tests/test_ep.py's routing; the grouped GEMM is a per-expert
loop of float64 matmuls on bf16 values, exact, so any row order gives the same bits). GPU tests
run the pipeline with ``torch._grouped_mm`` against a bf16 reference built on
``torch.distributed``'s all-to-all, by SQNR (torchao's thresholds, DESIGN.md).

Run: ``mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_torch.py`` (and ``-n 3``);
``python -m pytest -q -m "not mpi" tests/test_torch.py`` for the serial tests.
"""

import numpy
import pytest

torch = pytest.importorskip("torch")

import mxcomm.formats  # noqa: E402
import mxcomm.torch as mt  # noqa: E402
from mxcomm import comm as mxc, sqnr  # noqa: E402
from reference import dequantize_mxfp8_ref, quantize_mxfp8_ref  # noqa: E402
from test_formats import dequantize_ref, quantize_ref  # noqa: E402
from test_ep import (BF16, D, E_LOCAL, H, SEED, TIMEOUT_S, Routed, expert_ref,  # noqa: E402
                     expert_weights, fake_quantize, layout_ref, move_ref)

ALIGN = 8


# ------------------------------------------------------------------------------- helpers
def to_torch(a, device):
    """A NumPy array (bf16, int or float) as a torch tensor on ``device``."""
    if a.dtype == BF16:
        return torch.from_numpy(numpy.ascontiguousarray(a).view(numpy.int16)).view(
            torch.bfloat16).to(device)
    return torch.from_numpy(numpy.ascontiguousarray(a)).to(device)


def to_numpy(t):
    """A torch tensor as NumPy (bf16 as ml_dtypes bf16)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def bits(a):
    a = numpy.asarray(a)
    return a.view(numpy.uint16) if a.dtype == BF16 else a


def grads_ref(world, me, dispatch, dispatch_grad, combine, combine_grad):
    """Expected (out, x.grad, w.grad) of rank ``me`` for loss = sum(out * G), all in NumPy.

    Every rank's rows, output gradients G (seed SEED + 500 + r) and the expert weights are
    regenerated here; MXFP8 legs use the reference quantizer (a per-row round trip).
    """
    routed = [Routed(r, world) for r in range(world)]
    weights = expert_weights(world)
    grads = [numpy.random.default_rng(SEED + 500 + r).standard_normal(
        (len(routed[r].x), H)).astype(BF16) for r in range(world)]

    def wire(rows, precision):  # the reference round trip of a quantized format, per row
        if precision in ("bf16", "native") or not len(rows):
            return rows
        return dequantize_ref(precision, *quantize_ref(precision, rows))

    xq = [wire(r.x, dispatch) for r in routed]
    gq = [wire(g, combine_grad) for g in grads]
    out = numpy.zeros((len(routed[me].x), H), BF16)
    dx = numpy.zeros(routed[me].x.shape, BF16)
    for i, e in enumerate(routed[me].experts):
        out[i] = expert_ref(xq[me][i:i + 1], weights[e])[0]
        dx[i] = expert_ref(gq[me][i:i + 1], weights[e].T)[0]
    dw = numpy.zeros((E_LOCAL, D, H))
    for r in range(world):
        for i, e in enumerate(routed[r].experts):
            if e // E_LOCAL == me:
                dw[e % E_LOCAL] += numpy.outer(xq[r][i].astype(numpy.float64),
                                               gq[r][i].astype(numpy.float64))
    return wire(out, combine), wire(dx, dispatch_grad), dw, grads[me]


def expert_loop(permuted, weights, offsets):
    """The grouped GEMM of the CPU tests: a per-expert float64 matmul of bf16 rows, to bf16.

    Slicing an MXFP8Tensor dequantizes it (``__torch_dispatch__``), with a straight-through
    gradient; padding rows past the last group give zero rows.
    """
    parts, start = [], 0
    for j, end in enumerate(offsets.tolist()):
        rows = permuted[start:end].float().double()
        parts.append((rows @ weights[j]).float().to(torch.bfloat16))
        start = end
    parts.append(torch.zeros(permuted.shape[0] - start, weights.shape[2], dtype=torch.bfloat16,
                             device=weights.device))
    return torch.cat(parts)


@pytest.fixture(scope="module")
def small_comm():
    """A communicator that moves every quantized exchange unquantized (small_exchange_bytes)."""
    c = mxc.init(timeout=TIMEOUT_S, small_exchange_bytes=1 << 40)
    yield c
    c.close()


# ------------------------------------------------------------------------- serial: tensors
def quantized_tensor(rng, m=4, d=64, device="cpu"):
    x = rng.standard_normal((m, d)).astype(BF16)
    data, scales = quantize_mxfp8_ref(x, "rceil")
    return mt.MXFP8Tensor(torch.from_numpy(data).to(device), torch.from_numpy(scales).to(device)), \
        dequantize_mxfp8_ref(data, scales)


def test_mxfp8_tensor_is_bf16_and_dequantizes(rng):
    t, values = quantized_tensor(rng)
    assert t.dtype == torch.bfloat16 and t.shape == (4, 64)
    assert t.data_e4m3.dtype == torch.float8_e4m3fn and t.scales_e8m0.dtype == torch.float8_e8m0fnu
    numpy.testing.assert_array_equal(bits(to_numpy(t.dequantize())), bits(values))
    assert "MXFP8Tensor" in repr(t)


def test_mxfp8_tensor_ops_run_on_dequantized_values(rng):
    t, values = quantized_tensor(rng)
    d = t.detach()
    assert isinstance(d, mt.MXFP8Tensor) and d.data_e4m3 is t.data_e4m3
    s = t[1:3]
    assert type(s) is torch.Tensor and s.dtype == torch.bfloat16
    numpy.testing.assert_array_equal(bits(to_numpy(s)), bits(values[1:3]))
    w = torch.ones(64, 8, dtype=torch.bfloat16)
    numpy.testing.assert_array_equal(bits(to_numpy(t @ w)),
                                     bits(to_numpy(to_torch(values, "cpu") @ w)))


def test_mxfp8_tensor_gradient_is_straight_through(rng):
    t, _ = quantized_tensor(rng)
    t.requires_grad_()
    (t.dequantize().float() * 3).sum().backward()
    assert t.grad.dtype == torch.bfloat16 and t.grad.shape == t.shape
    assert (t.grad == 3).all()


def test_permute_to_bf16_and_unpermute_gradient_to_bf16(rng):
    """``permute(out_format="bf16")`` of an MXFP8Tensor equals the permute then the dequantize,
    bit for bit, as a plain bf16 tensor; ``unpermute(grad_format="bf16")`` hands its input a
    plain bf16 gradient equal to the dequantized quantized gradient gathered by the index
    (padding rows 0); the gradient of the permute's input is bf16 either way."""
    t, _ = quantized_tensor(rng, m=6, d=64)
    counts = torch.tensor([2, 0, 3, 1], dtype=torch.int32)  # E = 4, E_local = 2
    x = t.detach().requires_grad_()
    fused, idx, _ = mt.permute(x, counts, 2, 4, out_format="bf16")
    separate, idx2, _ = mt.permute(t, counts, 2, 4)
    assert type(fused) is torch.Tensor and fused.dtype == torch.bfloat16
    assert torch.equal(idx, idx2)
    numpy.testing.assert_array_equal(bits(to_numpy(fused)),
                                     bits(to_numpy(separate.dequantize())))
    y = fused.detach().clone().requires_grad_()
    g, _ = quantized_tensor(rng, m=6, d=64)  # an MXFP8 gradient, as combine's backward gives
    mt.unpermute(y, idx, 6, grad_format="bf16").backward(g)
    assert type(y.grad) is torch.Tensor and y.grad.dtype == torch.bfloat16
    keep = idx >= 0
    want = torch.zeros_like(y.grad)
    want[keep] = g.dequantize()[idx[keep].long()]
    numpy.testing.assert_array_equal(bits(to_numpy(y.grad)), bits(to_numpy(want)))
    fused.backward(torch.ones_like(fused))
    assert x.grad.dtype == torch.bfloat16 and x.grad.shape == x.shape
    assert (x.grad == 1).all()  # every received row lands once in the permute
    with pytest.raises(ValueError, match="grad_format"):
        mt.unpermute(y, idx, 6, grad_format="fp9")


def test_mxfp8_tensor_rejects_bad_parts():
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        mt.MXFP8Tensor(torch.zeros(2, 32), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\(M, D // 32\)"):
        mt.MXFP8Tensor(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))


def test_tensors_cross_to_arrays_zero_copy(rng):
    """``_array`` views a tensor's memory (bf16 and fp8 as their array dtypes); the torch
    allocator of the engine hands back the very tensors it allocated (no DLPack round trip)."""
    x = torch.from_numpy(rng.standard_normal((4, 64)).astype(numpy.float32)).to(torch.bfloat16)
    a = mt._array(x, "x")
    assert a.dtype == BF16 and a.shape == (4, 64)
    a[0, 0] = BF16.type(3.0)
    assert x[0, 0].item() == 3.0
    q = torch.zeros(2, 32, dtype=torch.float8_e4m3fn)
    assert mt._array(q, "q").dtype == numpy.uint8
    alloc = mt._Alloc(torch.device("cpu"))
    fmt = mxcomm.formats.get_format("mxfp8")
    made = fmt.empty(3, 64, alloc)
    made.data[...] = 0x38  # 1.0 in e4m3
    made.scales[...] = 127  # 2^0
    wrapped = mt._tensors._wrap(made, alloc)
    assert isinstance(wrapped, mt.MXFP8Tensor)
    assert wrapped.qdata.data_ptr() == alloc._made[0][1].data_ptr()
    assert torch.equal(wrapped.dequantize(), torch.ones(3, 64, dtype=torch.bfloat16))
    other = numpy.ones((2, 2), dtype=numpy.float32)  # not made by alloc: through DLPack
    assert torch.equal(alloc.tensor(other), torch.ones(2, 2))


def test_torch_precision_errors():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="grad_precision: expected one of 'bf16', 'native', "
                                         "'mxfp8', 'fp8_rowwise', 'fp8_block128', "
                                         "'fp8_block128_pow2', got 'fp8_block64'"):
        mt.a2a_dispatch(x, [2], [2], None, grad_precision="fp8_block64")
    with pytest.raises(ValueError, match="precision: expected one of .*got 'e4m3'"):
        mt.a2a_combine(x, [2], [2], None, precision="e4m3")


# -------------------------------------------------------------------------- MPI: autograd
@pytest.mark.mpi
def test_exchange_layout_tensors(comm, device):
    me, world = comm.rank, comm.size
    routed = Routed(me, world)
    group, input_splits, output_splits = mt.exchange_layout(to_torch(routed.counts, device), comm)
    group_ref, input_ref, output_ref = layout_ref([Routed(r, world) for r in range(world)], me)
    assert isinstance(group, torch.Tensor) and group.dtype == torch.int32
    numpy.testing.assert_array_equal(to_numpy(group), group_ref)
    assert (input_splits, output_splits) == (input_ref, output_ref)


@pytest.mark.mpi
@pytest.mark.parametrize("dispatch,dispatch_grad,combine,combine_grad", [
    ("bf16", "bf16", "bf16", "bf16"),
    ("mxfp8", "bf16", "bf16", "mxfp8"),      # the defaults
    ("mxfp8", "mxfp8", "mxfp8", "bf16"),
    ("fp8_rowwise", "bf16", "native", "fp8_rowwise"),
    ("fp8_rowwise", "fp8_rowwise", "fp8_rowwise", "mxfp8"),
])
@pytest.mark.parametrize("given", ["splits", "layout", "layout, small"])
def test_token_path_autograd(request, comm, device, monkeypatch, dispatch, dispatch_grad,
                             combine, combine_grad, given):
    """Forward and all gradients of the whole path equal the reference exactly, given the
    splits (the engine's path, voted) or the layout (through the direct call: the plain
    exchanges and the staged ones whose result stays quantized, the dispatch and the combine's
    gradient; with "small" every one)."""
    if given == "layout, small":
        comm = request.getfixturevalue("small_comm")
    me, world = comm.rank, comm.size
    routed = Routed(me, world)
    out_ref, dx_ref, dw_ref, grad = grads_ref(world, me, dispatch, dispatch_grad, combine,
                                              combine_grad)
    x = to_torch(routed.x, device).requires_grad_()
    weights = to_torch(expert_weights(world)[me * E_LOCAL:(me + 1) * E_LOCAL],
                       device).requires_grad_()
    layout = mt.exchange_layout(to_torch(routed.counts, device), comm)
    group, input_splits, output_splits = layout
    direct_calls = []
    exchange_direct = mt._exchange_direct

    def counted(*args):
        out = exchange_direct(*args)
        direct_calls.append(out is not None)
        return out
    monkeypatch.setattr(mt._ops, "_exchange_direct", counted)
    splits = (layout,) if given != "splits" else (input_splits, output_splits, comm)

    received = mt.a2a_dispatch(x, *splits, precision=dispatch, grad_precision=dispatch_grad)
    assert isinstance(received, mt.MXFP8Tensor) == (dispatch == "mxfp8")
    seen = {}
    received.register_hook(lambda g: seen.setdefault("received", g))
    permuted, indices, offsets = mt.permute(received, group, E_LOCAL, ALIGN)
    assert isinstance(permuted, mt.MXFP8Tensor) == (dispatch == "mxfp8")
    assert isinstance(permuted, mt.QuantizedTensor) == (dispatch not in ("bf16", "native"))
    y = expert_loop(permuted, weights, offsets)
    back = mt.unpermute(y, indices, received.shape[0])
    back.register_hook(lambda g: seen.setdefault("back", g))
    out = mt.a2a_combine(back, *splits, precision=combine, grad_precision=combine_grad)
    (out.float() * to_torch(grad, device).float()).sum().backward()
    precisions = (dispatch, combine, combine_grad, dispatch_grad)
    plain = sum(p in ("bf16", "native") for p in precisions)
    kept = sum(p not in ("bf16", "native") for p in (dispatch, combine_grad))  # staged, quantized
    assert sum(direct_calls) == {"splits": 0, "layout": plain + kept, "layout, small": 4}[given]

    numpy.testing.assert_array_equal(bits(to_numpy(out)), bits(out_ref))
    numpy.testing.assert_array_equal(bits(to_numpy(x.grad)), bits(dx_ref))
    numpy.testing.assert_array_equal(to_numpy(weights.grad), dw_ref)
    # The dispatch output gets a bf16 gradient of its shape; combine's input gets an MXFP8Tensor
    # when its backward runs in MXFP8.
    assert seen["received"].dtype == torch.bfloat16
    assert seen["received"].shape == received.shape
    assert isinstance(seen["back"], mt.MXFP8Tensor) == (combine_grad == "mxfp8")
    if isinstance(seen["back"], mt.QuantizedTensor):
        assert seen["back"].format.name == combine_grad


@pytest.mark.mpi
def test_direct_call_leaves_other_tensors_to_the_engine(small_comm, device, monkeypatch):
    """Tensors the direct call does not take go to the engine: a strided view (copied there
    first: the same bits as the contiguous rows' direct call) and rows that do not fit the
    layout (the engine's error, on the rank that made it)."""
    comm = small_comm
    routed = Routed(comm.rank, comm.size)
    layout = mt.exchange_layout(to_torch(routed.counts, device), comm)
    x = to_torch(routed.x, device)
    strided = torch.cat([x, x], dim=1)[:, :x.shape[1]]
    assert strided.is_contiguous() == (x.shape[0] == 0)  # torch calls empty views contiguous
    direct = mt.a2a_dispatch(x, layout)
    taken = []
    exchange_direct = mt._exchange_direct
    monkeypatch.setattr(mt._ops, "_exchange_direct",
                        lambda *args: taken.append(exchange_direct(*args)) or taken[-1])
    engine = mt.a2a_dispatch(strided, layout)
    assert len(taken) == 1 and (taken[0] is None) == (x.shape[0] > 0)  # declined: the engine
    assert torch.equal(direct.qdata.view(torch.uint8), engine.qdata.view(torch.uint8))
    assert torch.equal(direct.scales.view(torch.uint8), engine.scales.view(torch.uint8))
    with pytest.raises(ValueError, match=f"rank {comm.rank}: has {x.shape[0] + 1} rows"):
        mt.a2a_dispatch(torch.cat([x, x.new_zeros((1, x.shape[1]))]), layout)


@pytest.mark.mpi
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_all_to_all_single_autograd(comm, device, precision):
    me, world = comm.rank, comm.size
    routed = [Routed(r, world) for r in range(world)]
    _, input_splits, output_splits = layout_ref(routed, me)
    splits = [layout_ref(routed, r)[1] for r in range(world)]
    back_splits = [layout_ref(routed, r)[2] for r in range(world)]
    received = [move_ref([r.x for r in routed], splits, s) for s in range(world)]
    grads = [numpy.random.default_rng(SEED + 700 + s).standard_normal(
        received[s].shape).astype(BF16) for s in range(world)]

    def wire(rows):
        return fake_quantize(rows) if precision == "mxfp8" and len(rows) else rows

    x = to_torch(routed[me].x, device).requires_grad_()
    out = mt.all_to_all_single(x, output_splits, input_splits, comm, precision=precision)
    (out.float() * to_torch(grads[me], device).float()).sum().backward()
    assert type(out) is torch.Tensor and out.dtype == torch.bfloat16
    numpy.testing.assert_array_equal(bits(to_numpy(out)),
                                     bits(move_ref([wire(r.x) for r in routed], splits, me)))
    numpy.testing.assert_array_equal(bits(to_numpy(x.grad)),
                                     bits(move_ref([wire(g) for g in grads], back_splits, me)))


# ----------------------------------------------------------------------- GPU: SQNR vs bf16
GPU_TOKENS, GPU_TOPK, GPU_D, GPU_H, GPU_E_LOCAL, GPU_ALIGN = 4096, 4, 1024, 512, 4, 32


@pytest.fixture(scope="module")
def torch_dist(comm):
    """torch.distributed (NCCL) over the same ranks, for the reference all-to-all."""
    import os
    import socket

    import torch.distributed as dist
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(world.bcast(port, root=0))
    dist.init_process_group("nccl", rank=comm.rank, world_size=comm.size,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    yield dist.group.WORLD
    dist.destroy_process_group()


def _gpu_problem(rank, world, device):
    """Routed rows (sorted by expert), counts, expert weights and output gradient of one rank."""
    gen = torch.Generator(device="cpu").manual_seed(SEED + rank)
    experts = world * GPU_E_LOCAL
    chosen = torch.rand(GPU_TOKENS, experts, generator=gen).topk(GPU_TOPK, dim=1).indices
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = torch.randn(GPU_TOKENS, GPU_D, generator=gen).to(torch.bfloat16)
    x = tokens[torch.arange(GPU_TOKENS).repeat_interleave(GPU_TOPK)[order]].to(device)
    counts = torch.bincount(flat, minlength=experts).to(torch.int32).to(device)
    w = (torch.randn(GPU_E_LOCAL, GPU_D, GPU_H, generator=gen) / GPU_D ** 0.5).to(
        torch.bfloat16).to(device)
    g = torch.randn(len(x), GPU_H, generator=gen).to(torch.bfloat16).to(device)
    return x, counts, w, g


def _reference_permutation(group_counts, e_local, align, rows):
    """(positions, sources, offsets, P) of the padded expert-major layout, built on the host."""
    counts = group_counts.tolist()
    ranks = len(counts) // e_local
    starts, row = {}, 0
    for r in range(ranks):
        for e in range(e_local):
            starts[r, e] = row
            row += counts[r * e_local + e]
    positions, sources, offsets, pos = [], [], [], 0
    for e in range(e_local):
        for r in range(ranks):
            n = counts[r * e_local + e]
            positions += range(pos, pos + n)
            sources += range(starts[r, e], starts[r, e] + n)
            pos += n
        pos = -(-pos // align) * align
        offsets.append(pos)
    total = -(-(rows + e_local * align) // align) * align
    return positions, sources, offsets, total


def _bf16_reference(x, counts, w, g, group):
    """The bf16 pipeline on torch.distributed: returns (received, out, x.grad, w.grad)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    import torch.distributed as dist
    world = dist.get_world_size(group)
    device = x.device
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    group_counts = torch.empty_like(counts)
    dist.all_to_all_single(group_counts, counts, group=group)
    input_splits = counts.view(world, -1).sum(1).tolist()
    output_splits = group_counts.view(world, -1).sum(1).tolist()
    received = all_to_all_single_autograd(x, output_splits, input_splits, group)
    received.retain_grad()
    rows = received.shape[0]
    positions, sources, offsets, total = _reference_permutation(group_counts, GPU_E_LOCAL,
                                                                GPU_ALIGN, rows)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    src = torch.tensor(sources, dtype=torch.int64, device=device)
    permuted = received.new_zeros(total, x.shape[1]).index_copy(0, pos, received[src])
    y = torch._grouped_mm(permuted, w, offs=torch.tensor(offsets, dtype=torch.int32,
                                                         device=device))
    back = y.new_zeros(rows, y.shape[1]).index_copy(0, src, y[pos])
    out = all_to_all_single_autograd(back, input_splits, output_splits, group)
    (out.float() * g.float()).sum().backward()
    return received.detach(), out.detach(), x.grad, w.grad


def _mxcomm_pipeline(x, counts, w, g, comm, dispatch, dispatch_grad, combine, combine_grad):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    group, input_splits, output_splits = mt.exchange_layout(counts, comm)
    received = mt.a2a_dispatch(x, input_splits, output_splits, comm, dispatch, dispatch_grad)
    permuted, indices, offsets = mt.permute(received, group, GPU_E_LOCAL, GPU_ALIGN)
    rows = permuted.dequantize() if isinstance(permuted, mt.MXFP8Tensor) else permuted
    y = torch._grouped_mm(rows, w, offs=offsets)
    back = mt.unpermute(y, indices, received.shape[0])
    out = mt.a2a_combine(back, input_splits, output_splits, comm, combine, combine_grad)
    (out.float() * g.float()).sum().backward()
    values = received.dequantize() if isinstance(received, mt.MXFP8Tensor) else received
    return values.detach(), out.detach(), x.grad, w.grad


@pytest.mark.gpu
@pytest.mark.mpi
def test_pipeline_gpu_sqnr(comm, torch_dist):
    """Default precisions (MXFP8 dispatch and combine-grad) against the bf16 pipeline."""
    device = torch.device("cuda", torch.cuda.current_device())
    x, counts, w, g = _gpu_problem(comm.rank, comm.size, device)
    ref = _bf16_reference(x, counts, w, g, torch_dist)
    got = _mxcomm_pipeline(x, counts, w, g, comm, "mxfp8", "bf16", "bf16", "mxfp8")
    thresholds = {"dispatch": 30.0, "output": 28.0, "input gradient": 26.0,
                  "weight gradient": 25.0}
    for (name, limit), r, o in zip(thresholds.items(), ref, got):
        assert sqnr(r, o) >= limit, f"{name}: SQNR {sqnr(r, o):.1f} dB < {limit} dB"


@pytest.mark.gpu
@pytest.mark.mpi
def test_pipeline_gpu_bf16_bit_identical(comm, torch_dist):
    device = torch.device("cuda", torch.cuda.current_device())
    x, counts, w, g = _gpu_problem(comm.rank, comm.size, device)
    ref = _bf16_reference(x, counts, w, g, torch_dist)
    got = _mxcomm_pipeline(x, counts, w, g, comm, "bf16", "bf16", "bf16", "bf16")
    for name, r, o in zip(("dispatch", "output", "input gradient", "weight gradient"), ref, got):
        assert torch.equal(r, o), f"{name} differs from the bf16 reference"


@pytest.mark.gpu
@pytest.mark.mpi
def test_all_to_all_single_gpu_sqnr(comm, torch_dist):
    """The drop-in against torch's all_to_all_single_autograd: forward and gradient."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    device = torch.device("cuda", torch.cuda.current_device())
    x, counts, _, _ = _gpu_problem(comm.rank, comm.size, device)
    _, input_splits, output_splits = mt.exchange_layout(counts, comm)
    gen = torch.Generator(device="cpu").manual_seed(SEED + 900 + comm.rank)
    g = torch.randn(sum(output_splits), GPU_D, generator=gen).to(torch.bfloat16).to(device)
    results = []
    for fn in (lambda t: all_to_all_single_autograd(t, output_splits, input_splits, torch_dist),
               lambda t: mt.all_to_all_single(t, output_splits, input_splits, comm)):
        t = x.detach().clone().requires_grad_()
        out = fn(t)
        (out.float() * g.float()).sum().backward()
        results.append((out.detach(), t.grad))
    (ref_out, ref_grad), (out, grad) = results
    assert sqnr(ref_out, out) >= 30.0
    assert sqnr(ref_grad, grad) >= 30.0
