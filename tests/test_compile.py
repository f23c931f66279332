"""torch.compile through mxcomm's custom ops (docs/design.md, "torch.compile and custom ops").

CPU, the host backend, 2 ranks of gloo in spawned processes (``torch_world.run_world``): each test
is one world. Compiling is slow on a small CI machine: one compiled graph pair (forward and
backward), tiny shapes.

Run: ``python -m pytest -q tests/test_compile.py``.
"""

import gc

import pytest

torch = pytest.importorskip("torch")

from torch_world import run_world  # noqa: E402

WORLD = 2
E_LOCAL, D, H = 2, 64, 32
ALIGN = 32
SEED = 1234


def _routed(rank, size, device="cpu"):
    """Seeded token rows of one rank on ``device``: ``(num_tokens_per_expert (E,) int64,
    x (M, D) bf16, w (E_local, D, H) bf16)``, some experts empty."""
    g = torch.Generator().manual_seed(SEED + rank)
    counts = torch.randint(0, 6, (E_LOCAL * size,), generator=g)
    counts[rank] = 0  # an empty expert
    x = torch.randn(int(counts.sum()), D, generator=g).to(torch.bfloat16)
    w = (torch.randn(E_LOCAL, D, H, generator=g) / 8).to(torch.bfloat16)
    return counts.to(device), x.to(device), w.to(device)


def _ep_layer(x, num_tokens_per_expert, w, group):
    """A small EP layer on mxcomm's primitives: layout, dispatch (MXFP8, permuted), grouped GEMM,
    combine (bf16, MXFP8 gradient)."""
    import mxcomm.torch as mt
    layout = mt.exchange_layout(num_tokens_per_expert, group)
    rows, _, offsets = mt.a2a_dispatch(x, layout, precision="mxfp8", grad_precision="bf16",
                                       permute_align=ALIGN)
    y = mt.grouped_mm(rows, w, offsets)
    return mt.a2a_combine(y, layout, precision="bf16", grad_precision="mxfp8",
                          permute_align=ALIGN)


def _compiled_layer_world(rank, size, device="cpu"):
    import warnings

    import torch.distributed as dist

    from mxcomm.torch import _ops
    import mxcomm.torch as mt
    group = dist.group.WORLD
    comm = mt.communicator_for(group)  # the layer on an mxcomm communicator, the drop-in on group
    ran = []
    real = _ops._exchange

    def counted(function, *args):  # every exchange mxcomm makes, eager or in the compiled graph
        ran.append(function)
        return real(function, *args)

    _ops._exchange = counted
    targets = []

    def backend(gm, example_inputs):  # the traced graph's calls, then torch's default backend
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                targets.extend(str(node.target) for node in module.graph.nodes
                               if node.op == "call_function")
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    counts, x0, w0 = _routed(rank, size, device)
    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(_ep_layer, fullgraph=True, backend=backend)
        for name, layer in (("eager", _ep_layer), ("compiled", compiled)):
            ran.clear()
            x = x0.clone().requires_grad_(True)
            w = w0.clone().requires_grad_(True)
            out = layer(x, counts, w, comm)
            forward = list(ran)
            out.float().square().sum().backward()
            results[name] = (out.detach(), x.grad, w.grad, forward, list(ran))
        # the drop-in for torch's all_to_all_single_autograd, given a ProcessGroup

        def dropin(x):
            return mt.all_to_all_single(x, [2] * size, [2] * size, group, precision="mxfp8")

        rows = torch.randn(2 * size, D, generator=torch.Generator().manual_seed(SEED + rank))
        for name, fn in (("eager", dropin), ("compiled", torch.compile(dropin, fullgraph=True))):
            x = rows.to(device, torch.bfloat16).requires_grad_(True)
            y = fn(x)
            y.float().square().sum().backward()
            results[f"drop-in {name}"] = (y.detach(), x.grad)
    warned = [str(w.message) for w in caught if "mxcomm" in str(w.message)]
    dropins = [torch.equal(a, b) for a, b in zip(results["drop-in eager"],
                                                 results["drop-in compiled"])]
    eager, compiled = results["eager"], results["compiled"]
    # plain values back to the parent (tensors would travel through shared memory)
    equal = {name: (a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b))
             for name, a, b in zip(("output", "x.grad", "w.grad"), eager[:3], compiled[:3])}
    equal["drop-in"] = all(dropins)
    return (equal, bool(eager[2].abs().sum() > 0), eager[3:], compiled[3:], targets, warned)


def test_compiled_ep_layer_equals_eager_and_keeps_mxcomm_exchanges():
    """``torch.compile(fullgraph=True)`` of layout -> dispatch -> grouped_mm -> combine on an
    mxcomm communicator (the ops name it by its registered key): output,
    input and weight gradients equal eager's bit for bit on every rank; the compiled graph calls
    mxcomm's ops (no torch all-to-all), and its run makes mxcomm's exchanges, 2 forward and 2
    backward, as eager does; the dispatch's MXFP8 rows reach the GEMM op quantized, the combine's
    MXFP8 gradient comes back dequantized (warned about). The drop-in
    ``all_to_all_single`` on a ProcessGroup compiles too, equal to eager forward and backward."""
    _check_compiled_layer(run_world(WORLD, _compiled_layer_world, timeout=600))


@pytest.mark.gpu
def test_gpu_compiled_ep_layer_equals_eager():
    """The same on 2 GPUs over NCCL: there the compiled grouped GEMM is the fp8 op on SM90, given
    the MXFP8 rows as data and scales (the same code as eager's GEMM on the MXFP8Tensor)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check_compiled_layer(run_world(WORLD, _compiled_layer_world, "cuda", timeout=600,
                                    gpu=True))


def _check_compiled_layer(results):
    for rank, (equal, nonzero, eager, compiled, targets, warned) in enumerate(results):
        assert all(equal.values()), f"rank {rank}: differs from eager: {equal}"
        assert nonzero, rank  # the weight gradient is not trivially zero
        assert eager[0] == compiled[0] == ["a2a_dispatch", "a2a_combine"], rank
        assert sorted(compiled[1]) == sorted(eager[1]) == sorted(
            ["a2a_dispatch", "a2a_combine", "a2a_combine_backward", "a2a_dispatch_backward"])
        ops = [t.split(".")[1] for t in targets if t.startswith("mxcomm.")]
        assert ops.count("exchange_layout") == 1, targets
        assert ops.count("exchange") >= 2, targets  # dispatch and combine, forward and backward
        assert not [t for t in targets if "all_to_all" in t], targets
        assert any("dequantized to bf16" in w for w in warned), warned


def _opcheck_world(rank, size):
    import torch.distributed as dist

    from mxcomm.torch import _ops
    key = _ops.group_key(dist.group.WORLD)
    counts, x, _ = _routed(rank, size)
    # each call names a new layout (a new handle value): AOT dispatch's comparison of two calls'
    # outputs does not apply to this op
    torch.library.opcheck(torch.ops.mxcomm.exchange_layout, (counts, key),
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
    handle = torch.ops.mxcomm.exchange_layout(counts, key)
    layout = _ops._registry.layout(handle)
    splits_in, splits_out = list(layout.input_splits), list(layout.output_splits)
    m, n = x.shape[0], layout.num_received
    cases = [  # (args, result rows: None where permuted)
        ((x, handle, "a2a_dispatch", None, None, "", "bf16", 0, -1, E_LOCAL, False), n),
        ((x, handle, "a2a_dispatch", None, None, "", "mxfp8", ALIGN, -1, E_LOCAL, False), None),
        ((x, handle, "a2a_dispatch", None, None, "", "fp8_rowwise", ALIGN, -1, E_LOCAL, True),
         None),
        ((x, None, "all_to_all_single", splits_in, splits_out, key, "mxfp8", 0, n, 0, False), n),
    ]
    for args, rows in cases:
        torch.library.opcheck(torch.ops.mxcomm.exchange, args)
        out, scales, indices, offsets = torch.ops.mxcomm.exchange(*args)
        if args[-1]:  # kept quantized: fp8 rowwise data and one fp32 scale per row
            assert out.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
            assert scales.shape == (out.shape[0],)
        else:
            assert out.dtype == torch.bfloat16 and scales.numel() == 0
        if rows is not None:
            assert out.shape == (rows, D) and indices.numel() == offsets.numel() == 0
        else:  # permuted: P rows, the index and the group ends
            assert out.shape[0] == indices.shape[0] and offsets.shape == (E_LOCAL,)
            assert int(offsets[-1]) <= out.shape[0] and out.shape[0] % ALIGN == 0
    y = torch.randn(n, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    combine = (y, handle, "a2a_combine", None, None, "", "bf16", 0, m, E_LOCAL, False)
    torch.library.opcheck(torch.ops.mxcomm.exchange, combine)
    back = torch.ops.mxcomm.exchange(*combine)[0]
    assert back.shape == (m, H)
    return True


def test_opcheck_custom_ops():
    """``torch.library.opcheck`` (schema, fake tensors, autograd registration, AOT dispatch; the
    layout op without AOT dispatch: its handles differ per call) on
    ``mxcomm::exchange_layout`` and ``mxcomm::exchange``: dispatch with a layout handle, plain
    and permuted MXFP8, the drop-in with splits, the combine with its known rows."""
    assert run_world(WORLD, _opcheck_world, timeout=600) == [True] * WORLD


def test_layout_handles_and_group_keys():
    """A layout lives in the registry while its handle does; unknown handles and communicators
    raise RuntimeError naming what to do; other groups raise TypeError."""
    from mxcomm.torch import _ops
    registry = _ops._Registry()
    layout = object()
    handle = registry.add_layout(layout)
    assert handle.dtype == torch.int64 and handle.shape == (1,) and handle.device.type == "cpu"
    assert registry.layout(handle) is layout
    key = int(handle)
    del handle
    gc.collect()
    with pytest.raises(RuntimeError, match="names no live mxcomm layout"):
        registry.layout(torch.tensor([key]))
    with pytest.raises(RuntimeError, match="used once outside it"):
        registry.communicator("comm:12345")
    with pytest.raises(TypeError, match="group: expected a torch.distributed ProcessGroup, a 1-D"):
        _ops.group_key("world")


def test_permute_raises_under_compile():
    """The permute has no op: under torch.compile it raises, naming permute_align."""
    import mxcomm.torch as mt

    def permute(x, counts):
        return mt.permute(x, counts, 1)[0]

    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    with pytest.raises(Exception, match="permute_align"):
        torch.compile(permute, fullgraph=True, backend="eager")(x, torch.tensor([4]))


def _grouped_mm_inputs(device, requires_grad):
    """Seeded (x (P, K) bf16, w (G, K, N) bf16, offs (G,) int32) with an empty group."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(96, D, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(3, D, H, generator=g) / 8).to(device, torch.bfloat16)
    offs = torch.tensor([40, 40, 96], dtype=torch.int32, device=device)
    return x.requires_grad_(requires_grad), w.requires_grad_(requires_grad), offs


def test_opcheck_grouped_mm():
    """``torch.library.opcheck`` on ``mxcomm::grouped_mm`` (its autograd: the backward op) with
    inputs that require grad, with a second weight (``w_b``: one GEMM over both, each weight
    its gradient), and on fp8 rowwise rows given as data and scales, and on
    ``mxcomm::dequantize`` (with fp8 inputs without test_schema, which CPU float8 fails); the ops' results equal the eager ``grouped_mm``'s and
    ``dequantize``'s, forward and backward (on a CPU: the bf16 fallback)."""
    import mxcomm.torch as mt
    x, w, offs = _grouped_mm_inputs("cpu", True)
    flags = [True, True, True]
    torch.library.opcheck(torch.ops.mxcomm.grouped_mm, (x, w, offs, None, "fp8", flags))
    y = torch.ops.mxcomm.grouped_mm(x, w, offs, None, "fp8", flags)
    y.float().square().sum().backward()
    got = (y.detach(), x.grad, w.grad)
    x2, w2, _ = _grouped_mm_inputs("cpu", True)
    want = mt.grouped_mm(x2, w2, offs)
    want.float().square().sum().backward()
    for a, b in zip(got, (want.detach(), x2.grad, w2.grad)):
        assert torch.equal(a, b)
    # two weights read by one GEMM (w1 and w3: ``w_b``), each its gradient, as eager's tuple
    x.grad = w.grad = None
    wb = (w.detach() * 2).requires_grad_(True)
    torch.library.opcheck(torch.ops.mxcomm.grouped_mm, (x, w, offs, None, "fp8", flags),
                          {"w_b": wb})
    y = torch.ops.mxcomm.grouped_mm(x, w, offs, None, "fp8", flags, w_b=wb)
    y.float().square().sum().backward()
    got = (y.detach(), x.grad, w.grad, wb.grad)
    x2, w2, _ = _grouped_mm_inputs("cpu", True)
    wb2 = (w2.detach() * 2).requires_grad_(True)
    want = mt.grouped_mm(x2, (w2, wb2), offs)
    want.float().square().sum().backward()
    for a, b in zip(got, (want.detach(), x2.grad, w2.grad, wb2.grad)):
        assert torch.equal(a, b)
    # fp8 rowwise rows as data and scales (what a QuantizedTensor hands the op), and the
    # dequantize op
    from mxcomm._array import bfloat16
    from mxcomm.formats import get_format
    q = get_format("fp8_rowwise").quantize(x.detach().view(torch.int16).numpy().view(bfloat16))
    rows = mt._tensors._wrap(q)
    # test_schema's mutation check multiplies the inputs, which torch's CPU float8 cannot
    fp8_inputs = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.mxcomm.dequantize,
                          (rows.qdata, rows.scales, "fp8_rowwise"), test_utils=fp8_inputs)
    assert torch.equal(torch.ops.mxcomm.dequantize(rows.qdata, rows.scales, "fp8_rowwise"),
                       rows.dequantize())
    w3 = w.detach().clone().requires_grad_(True)
    torch.library.opcheck(torch.ops.mxcomm.grouped_mm,
                          (rows.qdata, w3, offs, None, "fp8", flags),
                          {"x_scales": rows.scales, "x_format": "fp8_rowwise"},
                          test_utils=fp8_inputs)
    y = torch.ops.mxcomm.grouped_mm(rows.qdata, w3, offs, None, "fp8", flags,
                                    x_scales=rows.scales, x_format="fp8_rowwise")
    assert torch.equal(y, mt.grouped_mm(rows, w.detach(), offs))
    # a QuantizedTensor handed to the op with the second weight (its dispatch binds by name)
    y = torch.ops.mxcomm.grouped_mm(rows, w3, offs, None, "fp8", flags, w_b=w3 * 2)
    assert torch.equal(y, mt.grouped_mm(rows, (w.detach(), w.detach() * 2), offs))


@pytest.mark.parametrize("pair", [False, True], ids=["one weight", "a pair"])
def test_grouped_mm_op_hands_the_weight_gradient_in_the_weights_layout(pair):
    """Weights stored (G, N, K) and handed over transposed (torchtitan's layout): the op's
    weight gradients come in that layout, as its fake says (opcheck), equal to eager's, so the
    leaf's gradient needs no transposing copy (the one a weight gradient made (G, K, N) took,
    twice under compile)."""
    import mxcomm.torch as mt
    x, w, offs = _grouped_mm_inputs("cpu", True)
    stored = [w.detach().transpose(-2, -1).contiguous().requires_grad_(True)]
    if pair:
        stored.append((stored[0].detach() * 2).requires_grad_(True))
    views = [s.transpose(-2, -1) for s in stored]
    kwargs = {"w_b": views[1]} if pair else {}
    flags = [True, True, True]
    torch.library.opcheck(torch.ops.mxcomm.grouped_mm, (x, views[0], offs, None, "fp8", flags),
                          kwargs)
    handed = []
    for v in views:
        v.register_hook(handed.append)
    torch.ops.mxcomm.grouped_mm(x, views[0], offs, None, "fp8", flags, **kwargs) \
        .float().square().sum().backward()
    assert [h.stride() for h in handed] == [v.stride() for v in views]
    assert all(s.grad.is_contiguous() for s in stored)
    again = [s.detach().clone().requires_grad_(True) for s in stored]
    x2 = x.detach().clone().requires_grad_(True)
    weights = tuple(a.transpose(-2, -1) for a in again)
    mt.grouped_mm(x2, weights if pair else weights[0], offs).float().square().sum().backward()
    for a, b in zip(stored + [x], again + [x2]):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.gpu
def test_gpu_compiled_fp8_grouped_mm_equals_eager():
    """On an SM90 GPU the compiled ``grouped_mm`` (the op, fp8 GEMMs) equals eager bit for bit,
    forward and backward (the backward op quantizes the forward's rows again: the same bits)."""
    import mxcomm.torch as mt
    if not (torch.cuda.is_available() and mt.fp8_gemm_available("cuda")):
        pytest.skip("needs an SM90 GPU")
    results = []
    for fn in (mt.grouped_mm, torch.compile(mt.grouped_mm, fullgraph=True)):
        x, w, offs = _grouped_mm_inputs("cuda", True)
        y = fn(x, w, offs)
        y.float().square().sum().backward()
        results.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
