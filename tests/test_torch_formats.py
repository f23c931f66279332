"""The torch adapter for every format: QuantizedTensor (MXFP8Tensor its mxfp8 case), permute with
out_format, the differentiable grouped GEMM for fp8 rowwise rows (CPU: its bf16 fallback, so the
autograd wiring runs here; GPU-marked: SQNR of the SM90 fp8 path against bf16), and the EP path
in every format through autograd at any world size."""

import numpy
import pytest

torch = pytest.importorskip("torch")

import mxcomm.torch as mt
from mxcomm._array import bfloat16  # noqa: E402
from mxcomm import _torch_gemm  # noqa: E402
from mxcomm.formats import get_format, sqnr  # noqa: E402

QUANTIZED = ("mxfp8", "fp8_rowwise", "fp8_block128", "fp8_block128_pow2")


def quantized_tensor(x, name):
    """The bf16 tensor ``x`` (CPU) as a QuantizedTensor of format ``name``."""
    q = get_format(name).quantize(x.view(torch.int16).numpy().view(bfloat16))
    return mt._tensors._wrap(q)


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_tensor(name):
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    t = quantized_tensor(x, name)
    assert isinstance(t, mt.QuantizedTensor) and t.format.name == name
    assert isinstance(t, mt.MXFP8Tensor) == (name == "mxfp8")
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (4, 256)
    assert tuple(t.scales.shape) == get_format(name).scales_shape(4, 256)
    t.requires_grad_(True)
    y = t.dequantize()
    assert sqnr(x, y) > 28
    (y * 3).sum().backward()
    assert (t.grad == 3).all()  # straight-through, bf16
    assert torch.equal(t.detach().qdata.view(torch.uint8), t.qdata.view(torch.uint8))  # kept
    assert torch.equal(t + 0, y.detach())  # any other op runs on the dequantized values
    if name == "mxfp8":
        assert t.data_e4m3 is t.qdata and t.scales_e8m0 is t.scales


def test_quantized_tensor_records_its_parts_on_a_stream(monkeypatch):
    """``record_stream`` on a QuantizedTensor reaches the data and the scales, and dequantizes
    nothing: the allocator then keeps their memory until that stream has read it. (Autograd's
    engine does not come through here: it records a gradient's own storage directly, which a
    QuantizedTensor's wrapper has not; bench/NOTES.md, 2026-11-28.)"""
    from mxcomm.torch import _quantized
    t = quantized_tensor(torch.randn(4, 256, dtype=torch.bfloat16), "fp8_rowwise")
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: recorded.append((self, stream)))
    monkeypatch.setattr(_quantized, "_dequantized", lambda *a: pytest.fail("dequantized"))
    stream = torch.Stream("cpu")
    torch.ops.aten.record_stream.default(t, stream)
    assert [(a is b, s == stream) for (a, s), b in zip(recorded, (t.qdata, t.scales))] == \
        [(True, True)] * 2 and len(recorded) == 2


@pytest.mark.gpu
def test_gpu_quantized_gradient_on_another_stream_keeps_its_memory():
    """A QuantizedTensor made on a side stream and recorded on the main stream by its
    ``record_stream``: while the main stream is busy, new blocks of the same sizes on the side
    stream are not the data's or the scales' (a plain tensor's block, freed unrecorded, is: the
    control)."""
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    with torch.cuda.stream(side):
        control = torch.empty(4096, 1024, dtype=torch.uint8, device="cuda")
        ptr = control.data_ptr()
        del control
        again = torch.empty(4096, 1024, dtype=torch.uint8, device="cuda")
        assert again.data_ptr() == ptr  # the allocator hands a freed block out again at once
        del again
        data = torch.randint(0, 127, (4096, 1024), dtype=torch.uint8, device="cuda")
        scales = torch.rand(4096, device="cuda")
        t = mt.QuantizedTensor(data, scales, "fp8_rowwise")
    main.wait_stream(side)
    torch.cuda._sleep(200_000_000)  # the main stream busy long after the host goes on
    t.record_stream(main)
    ptrs = {data.data_ptr(), scales.data_ptr()}
    del t, data, scales
    with torch.cuda.stream(side):
        reused = {torch.empty(4096, 1024, dtype=torch.uint8, device="cuda").data_ptr(),
                  torch.empty(4096, device="cuda").data_ptr()}
    assert not ptrs & reused
    torch.cuda.synchronize()


class _QuantizeGrad(torch.autograd.Function):
    """Identity; its backward hands the gradient on as an fp8 rowwise QuantizedTensor (as the
    combine's backward does)."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        return mt.QuantizedTensor(*_torch_gemm.quantize_rows_pow2(grad.contiguous()),
                                  "fp8_rowwise")


class _Sleep(torch.autograd.Function):
    """Identity; its backward keeps its stream busy (~0.1 s) before passing the gradient on."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(200_000_000)
        return grad


class _Scribble(torch.autograd.Function):
    """Identity; its backward takes blocks of the given sizes and fills them with NaN bytes."""

    @staticmethod
    def forward(ctx, u, sizes):
        ctx.sizes = sizes
        return u.clone()

    @staticmethod
    def backward(ctx, grad):
        kept = [torch.full((n,), 255, dtype=torch.uint8, device=grad.device)
                for n in ctx.sizes for _ in range(4)]
        del kept
        return grad, None


def _seeded_gemm_inputs(groups, k, n, rows, device="cuda"):
    """Seeded inputs of a grouped GEMM: ``(offs, x, w, grad)``, ``groups`` equal groups of the
    ``rows`` (k wide, bf16), weights (groups, k, n) scaled by 1/sqrt(k), the output's gradient."""
    torch.manual_seed(0)
    offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * (rows // groups)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    w = (torch.randn(groups, k, n, device=device) / k ** 0.5).to(torch.bfloat16)
    grad = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    return offs, x, w, grad


@pytest.mark.gpu
def test_gpu_quantized_gradient_from_another_stream_is_read_intact():
    """A QuantizedTensor gradient made on a side stream and read by ``grouped_mm``'s backward on
    the main stream, which is still busy when autograd frees it (the engine records a gradient
    crossing streams by its own storage, which the wrapper has not): a side-stream node run
    next takes blocks of the data's and the scales' sizes and fills them with NaN bytes. The
    input and weight gradients equal those of the same graph on one stream, bit for bit."""
    if not mt.fp8_gemm_available("cuda"):
        pytest.skip("needs an SM90 GPU with torch._scaled_grouped_mm")
    rows, n = 4096, 512
    offs, x0, w0, grad = _seeded_gemm_inputs(4, 256, n, rows)
    u0 = torch.randn(1024, device="cuda")
    sizes = (rows * n, rows * 4)  # the gradient's data and scales, in bytes

    def step(side):
        x, w, u = (t.clone().requires_grad_() for t in (x0, w0, u0))
        with torch.cuda.stream(side or torch.cuda.current_stream()):
            scribbled = _Scribble.apply(u, sizes)  # made first: its backward runs last
        y = _Sleep.apply(mt.grouped_mm(x, w, offs, fp8=True))
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side or torch.cuda.current_stream()):
            out = _QuantizeGrad.apply(y)
        torch.autograd.backward([out, scribbled], [grad, torch.ones_like(u0)])
        torch.cuda.synchronize()
        return x.grad, w.grad

    want = step(None)
    got = step(torch.cuda.Stream())
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_quantized_tensor_rejects_bad_parts():
    with pytest.raises(ValueError, match=r"scales \(M,\) \(fp8_rowwise\)"):
        mt.QuantizedTensor(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 2), "fp8_rowwise")
    with pytest.raises(TypeError, match="float32 scales"):
        mt.QuantizedTensor(torch.zeros(2, 32, dtype=torch.uint8),
                           torch.zeros(2, dtype=torch.uint8), "fp8_rowwise")
    with pytest.raises(TypeError, match="quantized format"):
        mt.QuantizedTensor(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2), "bf16")


def test_permute_out_format_rowwise():
    """An MXFP8Tensor permuted into fp8 rowwise rows; the gradient comes back bf16 to x."""
    x = torch.randn(9, 128, dtype=torch.bfloat16)
    mx = quantized_tensor(x, "mxfp8").requires_grad_(True)
    counts = torch.tensor([2, 3, 0, 4], dtype=torch.int32)
    permuted, indices, offsets = mt.permute(mx, counts, 2, 16, out_format="fp8_rowwise")
    assert permuted.format.name == "fp8_rowwise" and offsets.tolist() == [16, 32]
    keep = indices >= 0
    assert sqnr(mx.dequantize().detach()[indices[keep].long()],
                   permuted.dequantize().detach()[keep]) > 25
    (permuted.dequantize() * 2).sum().backward()
    assert torch.equal(mx.grad, torch.full_like(mx.grad, 2))


def test_grouped_mm_fallback_autograd(monkeypatch):
    """The bf16 fallback (CPU): forward, dgrad and wgrad equal a per-group float64 reference of
    the dequantized rows within bf16 rounding; empty groups give zero weight gradients."""
    torch.manual_seed(0)
    k, n = 64, 32
    offs = torch.tensor([16, 16, 48], dtype=torch.int32)  # group 1 empty
    x = quantized_tensor(torch.randn(48, k, dtype=torch.bfloat16), "fp8_rowwise")
    x.requires_grad_(True)
    w = (torch.randn(3, k, n) / 8).to(torch.bfloat16).requires_grad_(True)
    assert not mt.fp8_gemm_available("cpu")
    with pytest.raises(RuntimeError, match="SM90"):
        mt.grouped_mm(x, w, offs, fp8=True)
    y = mt.grouped_mm(x, w, offs)
    g = torch.randn(48, n, dtype=torch.bfloat16)
    y.backward(g)
    xd = x.dequantize().detach().double()
    bounds = [(0, 16, 0), (16, 48, 2)]
    for lo, hi, e in bounds:
        ref = xd[lo:hi] @ w[e].detach().double()
        assert sqnr(ref, y[lo:hi].detach()) > 40
        assert sqnr(g[lo:hi].double() @ w[e].detach().double().t(), x.grad[lo:hi]) > 40
        assert sqnr(xd[lo:hi].t() @ g[lo:hi].double(), w.grad[e]) > 40
    assert (w.grad[1] == 0).all()
    with pytest.raises(ValueError, match="wgrad: expected 'fp8' or 'bf16'"):
        mt.grouped_mm(x, w, offs, wgrad="fp16")
    with monkeypatch.context() as m:  # as on an SM90 GPU: the fp8 path's own shape rule
        m.setattr(_torch_gemm, "fp8_gemm_available", lambda device: True)
        with pytest.raises(ValueError, match="N = 24 is not a multiple of 16"):
            mt.grouped_mm(x, torch.zeros(3, k, 24, dtype=torch.bfloat16), offs)
        assert mt.grouped_mm(x, torch.zeros(3, k, 24, dtype=torch.bfloat16), offs,
                             fp8=False).shape == (48, 24)
    with pytest.raises(ValueError, match="multiple of 16"):
        mt.grouped_mm(torch.zeros(4, 24, dtype=torch.bfloat16),
                      torch.zeros(1, 24, 8, dtype=torch.bfloat16),
                      torch.tensor([4], dtype=torch.int32))


@pytest.mark.parametrize("path", ["fp8", "fp8, bf16 wgrad", "bf16"])
@pytest.mark.parametrize("stored", ["(G, N, K)", "(G, K, N)"])
@pytest.mark.parametrize("pair", [False, True], ids=["one weight", "a pair"])
def test_weight_gradient_comes_in_the_weights_layout(monkeypatch, path, stored, pair):
    """The GEMM's weight gradient comes in the layout the weight is stored in: stored (G, N, K)
    (torchtitan's ``w.transpose(-2, -1)``), the gradient of the leaf needs no transposing copy;
    its values within bf16 rounding of a float64 reference, either layout, every path (the fp8
    one with SM90's GEMM emulated in float64)."""
    from reference_gemm import scaled_grouped_mm_float64
    if path != "bf16":
        monkeypatch.setattr(_torch_gemm, "fp8_gemm_available", lambda device: True)
        monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm_float64,
                            raising=False)
    torch.manual_seed(5)
    k, widths = 64, (32, 16) if pair else (32,)
    offs = torch.tensor([16, 16, 48], dtype=torch.int32)
    x = quantized_tensor(torch.randn(48, k, dtype=torch.bfloat16), "fp8_rowwise")
    leaves, views = [], []
    for n in widths:
        shape = (3, n, k) if stored == "(G, N, K)" else (3, k, n)
        leaf = (torch.randn(shape) / 8).to(torch.bfloat16).requires_grad_(True)
        view = leaf.transpose(-2, -1) if stored == "(G, N, K)" else leaf * 1
        seen = []
        view.register_hook(seen.append)  # the gradient the GEMM hands over, before the leaf's
        leaves.append(leaf)
        views.append((view, seen))
    w = tuple(v for v, _ in views) if pair else views[0][0]
    y = mt.grouped_mm(x, w, offs, fp8=path != "bf16", wgrad="bf16" if "bf16" in path else "fp8",
                      weight_cache=False)
    g = torch.randn(48, sum(widths), dtype=torch.bfloat16)
    y.backward(g)
    xd = x.dequantize().detach().double()
    if "bf16" in path:  # the bf16 wgrad reads the gradient as given, the fp8 one quantized
        gd = g.double()
    else:
        q, scale = _torch_gemm.quantize_rows_pow2(g)
        gd = q.double() * scale.double()[:, None]
    lo = 0
    for (view, seen), n in zip(views, widths):
        handed = seen[0]
        if stored == "(G, N, K)" and not pair:  # the leaf's own layout: no copy needed
            assert handed.transpose(-2, -1).is_contiguous()
        elif stored == "(G, N, K)":  # a row block of one (G, N, K) product
            assert handed.stride(-2) == 1
        else:
            assert handed.stride(-1) == 1
        for lo_row, hi_row, e in ((0, 16, 0), (16, 48, 2)):
            ref = xd[lo_row:hi_row].t() @ gd[lo_row:hi_row, lo:lo + n]
            assert sqnr(ref, handed[e]) > 40
        assert (handed[1] == 0).all()
        lo += n


@pytest.mark.parametrize("fast_accum,wgrad,expected", [
    (("forward",), "bf16", [True, False]),      # torchao's dense float8 recipe
    (True, "fp8", [True, True, True]),           # the default: torchao's fp8 rowwise MoE GEMM
    (False, "fp8", [False, False, False]),
    ("dgrad", "fp8", [False, True, False]),
    (["wgrad", "forward"], "fp8", [True, False, True]),
])
def test_grouped_mm_fast_accum_reaches_each_product(monkeypatch, fast_accum, wgrad, expected):
    """On the fp8 path (as on SM90: torch._scaled_grouped_mm replaced by a recorder), each
    product passes ``use_fast_accum`` as ``fast_accum`` names it: forward, dgrad, then the fp8
    wgrad (a bf16 wgrad is torch._grouped_mm, which has none)."""
    calls = []

    def recorder(a, b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
        calls.append(use_fast_accum)
        shape = (a.shape[0], b.shape[-1]) if b.dim() == 3 else (len(offs), a.shape[0],
                                                                 b.shape[-1])
        return torch.zeros(shape, dtype=out_dtype)

    monkeypatch.setattr(_torch_gemm, "fp8_gemm_available", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", recorder, raising=False)
    torch.manual_seed(2)
    x = quantized_tensor(torch.randn(32, 64, dtype=torch.bfloat16), "fp8_rowwise")
    w = torch.randn(2, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([16, 32], dtype=torch.int32)
    kw = {} if fast_accum is True else {"fast_accum": fast_accum}  # True: the default
    y = mt.grouped_mm(x.requires_grad_(True), w, offs, wgrad=wgrad, **kw)
    y.backward(torch.randn(32, 32, dtype=torch.bfloat16))
    assert calls == expected


@pytest.mark.parametrize("fast_accum", ["backward", ("forward", "fwd"), 3, [["forward"]]])
def test_grouped_mm_rejects_bad_fast_accum(fast_accum):
    x = torch.zeros(16, 32, dtype=torch.bfloat16)
    w = torch.zeros(1, 32, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fast_accum: expected True, False or some of"):
        mt.grouped_mm(x, w, torch.tensor([16], dtype=torch.int32), fast_accum=fast_accum)


@pytest.mark.gpu
@pytest.mark.parametrize("fast_accum", [True, ("forward",), False])
def test_grouped_mm_fp8_sqnr_gpu(fast_accum):
    """SM90: the fp8 path against the bf16 GEMMs of the same bf16 rows (131072-row scale cut to
    8192): output >= 28 dB, input grad >= 26 dB, weight grad >= 25 dB, with each accumulation
    (the default, every product fast, none)."""
    if not mt.fp8_gemm_available("cuda"):
        pytest.skip("needs an SM90 GPU with torch._scaled_grouped_mm")
    offs, xb, w, grad = _seeded_gemm_inputs(8, 1024, 512, 8192)
    xr = xb.clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True)
    torch._grouped_mm(xr, wr, offs=offs).backward(grad)
    a, s = _torch_gemm.quantize_rows_pow2(xb)
    xq = mt.QuantizedTensor(a, s, "fp8_rowwise").requires_grad_(True)
    wq = w.clone().requires_grad_(True)
    y = mt.grouped_mm(xq, wq, offs, fp8=True, fast_accum=fast_accum)
    y.backward(grad)
    assert sqnr(torch._grouped_mm(xb, w, offs=offs), y.detach()) >= 28
    assert sqnr(xr.grad, xq.grad) >= 26
    assert sqnr(wr.grad, wq.grad) >= 25


@pytest.mark.gpu
def test_grouped_mm_dgrad_weight_of_a_transposed_view_gpu():
    """The dgrad's weight operand of a (G, K, N) view of (G, N, K) weights (as MoE layers hold
    them) is quantized from the storage in place of a contiguous copy: the same bits, the same
    column-major layout."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(3)
    stored = (torch.randn(3, 48, 1040, device="cuda") * 4).to(torch.bfloat16)  # (G, N, K)
    stored[1, 5, 7] = float("nan")
    w = stored.transpose(-2, -1)  # (G, K, N)
    b, scale = _torch_gemm._fp8_weight_t(w)
    q, want = _torch_gemm.quantize_rows_pow2(w.contiguous())  # (G, K, N) along N
    assert b.shape == (3, 48, 1040) and b.stride() == (48 * 1040, 1, 48)  # column-major
    assert torch.equal(b.transpose(-2, -1).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), want.view(torch.int32))
    assert torch.isnan(scale[1, 7]) and not torch.isnan(scale[1, 6])


@pytest.mark.gpu
@pytest.mark.parametrize("stored", ["(G, K, N)", "(G, N, K)"])
def test_grouped_mm_fp8_wgrad_any_groups_gpu(stored):
    """SM90, groups of any size (not multiples of 16, an empty one, rows past the last group):
    the fp8 wgrad is the product of the fp8 rows it was given (x as quantized, the gradient as
    dgrad quantized it) to > 40 dB (its operands are those rows rescaled between power-of-two
    scales), >= 25 dB from the bf16 rows' wgrad, and zero for the empty group; the weight
    stored either way (stored (G, N, K), the GEMM runs with its operands swapped)."""
    if not mt.fp8_gemm_available("cuda"):
        pytest.skip("needs an SM90 GPU with torch._scaled_grouped_mm")
    torch.manual_seed(1)
    k, n = 1024, 512
    sizes = [1000, 0, 37, 2999, 5]
    ends = numpy.cumsum(sizes)
    offs = torch.tensor(ends, device="cuda", dtype=torch.int32)
    rows = int(ends[-1]) + 9
    xb = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(len(sizes), k, n, device="cuda") / k ** 0.5).to(torch.bfloat16)
    grad = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    a, s = _torch_gemm.quantize_rows_pow2(xb)
    ga, gs = _torch_gemm.quantize_rows_pow2(grad)
    grads = {}
    for wgrad in ("fp8", "bf16"):
        xq = mt.QuantizedTensor(a, s, "fp8_rowwise").requires_grad_(True)
        if stored == "(G, K, N)":
            leaf = wq = w.clone().requires_grad_(True)
        else:
            leaf = w.transpose(-2, -1).contiguous().requires_grad_(True)
            wq = leaf.transpose(-2, -1)
        # every sum promoted: the operands' conversion is what this checks to > 40 dB
        mt.grouped_mm(xq, wq, offs, fp8=True, wgrad=wgrad, fast_accum=False).backward(grad)
        grads[wgrad] = leaf.grad if leaf is wq else leaf.grad.transpose(-2, -1)
    wr = w.clone().requires_grad_(True)
    torch._grouped_mm(xb, wr, offs=offs).backward(grad)
    xd = (a.double() * s.double()[:, None])
    gd = (ga.double() * gs.double()[:, None])
    live = [e for e, size in enumerate(sizes) if size]
    for e in live:
        lo, hi = int(ends[e] - sizes[e]), int(ends[e])
        assert sqnr(xd[lo:hi].t() @ gd[lo:hi], grads["fp8"][e]) > 40
    assert sqnr(wr.grad[live], grads["fp8"][live]) >= 25
    # the bf16 wgrad reads the bf16 gradient as given; the fp8 one its quantized rows
    assert sqnr(wr.grad[live], grads["bf16"][live]) > sqnr(wr.grad[live], grads["fp8"][live])
    assert (grads["fp8"][1] == 0).all() and (grads["bf16"][1] == 0).all()
    assert torch.isfinite(grads["fp8"]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8, 512, 1024), (300, 7168)])
def test_quantize_rows_pow2_gpu_is_the_exact_rowwise_rule(shape):
    """On CUDA the GEMM operands' quantization is mxcomm's rowwise kernel: bit for bit the float64
    reference of the rowwise rule, for any leading shape (a weight (G, N, K) along K)."""
    from reference_fp8 import quantize_fp8_rowwise_ref
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    rng = numpy.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal(shape, dtype=numpy.float32)
                         * numpy.exp2(rng.integers(-30, 30, shape[:-1] + (1,)))).to(torch.bfloat16)
    x.view(-1, shape[-1])[1] = 0
    q, scale = _torch_gemm.quantize_rows_pow2(x.cuda())
    assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn and scale.shape == x.shape[:-1]
    rows = x.view(-1, shape[-1]).float().numpy().astype(numpy.float64)
    data, scales = quantize_fp8_rowwise_ref(rows)
    numpy.testing.assert_array_equal(q.view(torch.uint8).reshape(-1, shape[-1]).cpu().numpy(),
                                     data)
    numpy.testing.assert_array_equal(scale.reshape(-1).cpu().numpy().view(numpy.uint32),
                                     numpy.asarray(scales, numpy.float32).view(numpy.uint32))
