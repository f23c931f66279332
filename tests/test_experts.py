"""mxcomm's experts in torchtitan's ``GroupedExperts`` seam (``grouped_experts_class``) and the
grouped GEMM over several weights (``grouped_mm(x, (w1, w3), offs)``).

Serial tests, on the CPU: the bf16 fallback, and the fp8 path with ``torch._scaled_grouped_mm``
emulated in float64 as SM90 runs it (``reference_gemm.scaled_grouped_mm_float64``). The one
GEMM over [w1 | w3] against the unfused experts (three ``grouped_mm`` calls through torchtitan's
``_grouped_mm`` seam, what the integration ran before): the output and the w2 gradient equal bit
for bit, the w1|w3 GEMM's output gradient is [dh1 | dh3] of the unfused run bit for bit, the w1
and w3 gradients equal bit for bit on the bf16 path (the same products) and on the fp8 path
equal or >= 80 dB apart (their rows are quantized with one scale over [dh1 | dh3]: the same
e4m3 bits after the rescale per column unless an element falls into e4m3's subnormal range;
86-89 dB apart and the same SQNR against float64 at 896 / 256, bench/NOTES.md), and the rows'
gradient (the dgrad, whose reduction width becomes 2F: one accumulation and one rounding for
the two products, one fp8 scale per row over both) is at least as close to a float64 product
of that gradient and the weights as the unfused sum, and within 40 dB of it;
compiled (``torch.compile(fullgraph=True)``) equals eager bit for bit; the weight cache keys a
pair of weights by both; GEMM launches counted. Bad weights raise naming the argument.

Run: ``python -m pytest -q tests/test_experts.py``.
"""

import pytest

torch = pytest.importorskip("torch")
moe = pytest.importorskip("torchtitan.models.common.moe",
                          reason="torchtitan 0.3 is not installed")

import mxcomm.torch as mt  # noqa: E402
from mxcomm import _torch_gemm, sqnr  # noqa: E402
from mxcomm._torch_ep import grouped_experts_class  # noqa: E402
from reference_gemm import scaled_grouped_mm_float64 as _emulated_scaled_grouped_mm  # noqa: E402

SEED = 2718
D, F, G = 64, 32, 3
COUNTS = (32, 0, 48)  # rows per expert (padded groups; one empty)


@pytest.fixture(params=["bf16 GEMM", "fp8 GEMM"])
def fp8(request, monkeypatch):
    """The GEMM's path: the bf16 fallback, or the fp8 one with SM90's GEMM emulated; a log of
    the GEMM launches (``(kind, a's shape)``)."""
    launches = []
    if request.param == "fp8 GEMM":
        monkeypatch.setattr(_torch_gemm, "fp8_gemm_available", lambda device: True)

        def scaled(a, b, *args, **kwargs):
            launches.append(("fp8", tuple(a.shape)))
            return _emulated_scaled_grouped_mm(a, b, *args, **kwargs)
        monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled, raising=False)
    plain = torch._grouped_mm

    def bf16(a, b, *args, **kwargs):
        launches.append(("bf16", tuple(a.shape)))
        return plain(a, b, *args, **kwargs)
    monkeypatch.setattr(torch, "_grouped_mm", bf16)
    return request.param == "fp8 GEMM", launches


class _Unfused(moe.GroupedExperts):
    """torchtitan's experts with mxcomm's GEMM in its seam: three ``grouped_mm`` calls (the
    integration's experts before the w1|w3 GEMM)."""

    def _grouped_mm(self, *, A, B_t, offs):
        return mt.grouped_mm(A, B_t, offs, weight_cache=False)


def _experts(seed=SEED, device="cpu"):
    """(mxcomm's experts, the unfused ones), the same seeded bf16 weights, on ``device``."""
    cfg = moe.GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=G)
    cls = grouped_experts_class(moe.GroupedExperts)
    assert grouped_experts_class(moe.GroupedExperts) is cls
    ours, unfused = cls(cfg), _Unfused(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    ours, unfused = ours.to(device, torch.bfloat16), unfused.to(device, torch.bfloat16)
    unfused.load_state_dict(ours.state_dict())
    return ours, unfused


def _rows(seed=SEED, device="cpu"):
    """fp8 rowwise rows (a QuantizedTensor, as the fp8_rowwise dispatch delivers them), their
    counts, and a seeded output gradient (bf16), on ``device``."""
    gen = torch.Generator().manual_seed(seed + 1)
    m = sum(COUNTS)
    x = torch.randn(m, D, generator=gen).to(device, torch.bfloat16)
    q, scale = _torch_gemm.quantize_rows_pow2(x)
    from mxcomm.formats import get_format
    from mxcomm.torch._quantized import _quantized_tensor
    rows = _quantized_tensor(q, scale, get_format("fp8_rowwise"))
    grad = torch.randn(m, D, generator=gen).to(device, torch.bfloat16)
    return rows, torch.tensor(COUNTS, device=device), grad


def _step(experts, rows, counts, grad):
    """Forward and backward; (output, rows' gradient, {weight name: gradient}, the output
    gradients the GEMMs of the rows were handed)."""
    handed = []
    backward = _torch_gemm._GroupedMM.backward

    def spy(ctx, g):
        w = ctx.saved_tensors[-1]
        if w.shape[-1] == F:  # w1 and/or w3 ((G, D, F); w2's: (G, F, D)): the last weight's name
            handed.append((names[w.data_ptr()], g.detach().clone()))
        return backward(ctx, g)
    names = {p.data_ptr(): n for n, p in experts.named_parameters()}
    _torch_gemm._GroupedMM.backward = staticmethod(spy)
    try:
        x = rows.detach().requires_grad_()
        y = experts(x, counts)
        y.backward(grad)
    finally:
        _torch_gemm._GroupedMM.backward = staticmethod(backward)
    # in the weights' order (autograd runs w3's GEMM backward before w1's)
    return (y.detach(), x.grad, {n: p.grad for n, p in experts.named_parameters()},
            [g for _, g in sorted(handed)])


def _dgrad_reference(handed, ws, counts):
    """The rows' gradient in float64: the GEMM output gradient(s) of w1 and w3 times the
    weights, per expert (independent of mxcomm: torch matmul in float64)."""
    g = torch.cat([h.double().cpu() for h in handed], dim=1)  # (P, 2F): [dh1 | dh3]
    w = torch.cat([w.double().cpu() for w in ws], dim=1)      # (G, 2F, D)
    out, start = torch.zeros(g.shape[0], D, dtype=torch.float64), 0
    for e, n in enumerate(counts.tolist()):
        out[start:start + n] = g[start:start + n] @ w[e]
        start += n
    return out


def test_one_gemm_over_w1_w3_against_the_unfused_experts(fp8):
    """The w1|w3 GEMM: output and w2's gradient bit for bit the unfused experts', w1's and w3's
    too on the bf16 path (on the fp8 one: bit for bit or >= 80 dB apart), the w1|w3 GEMM
    handed [dh1 | dh3] bit for bit, the rows' gradient as close to float64 as the unfused sum
    (or closer) and >= 40 dB from it; 2 GEMMs forward, 4 backward (the unfused: 3 and 6); the
    fp8 path runs w1|w3 in fp8 on the delivered rows and w2 in bf16."""
    on_fp8, launches = fp8
    ours, unfused = _experts()
    rows, counts, grad = _rows()
    launches.clear()
    y, dx, dw, handed = _step(ours, rows, counts, grad)
    ours_launches = list(launches)
    launches.clear()
    y0, dx0, dw0, handed0 = _step(unfused, rows, counts, grad)
    assert torch.equal(y, y0)
    for name in dw:
        assert torch.equal(dw[name], dw0[name]) or (
            on_fp8 and name != "w2_EDF" and sqnr(dw0[name].float(), dw[name].float()) >= 80), name
    assert len(handed) == 1 and len(handed0) == 2
    assert torch.equal(handed[0], torch.cat(handed0, dim=1))
    ref = _dgrad_reference(handed0, (ours.w1_EFD.detach(), ours.w3_EFD.detach()), counts)
    fused_db, unfused_db = sqnr(ref, dx.double()), sqnr(ref, dx0.double())
    assert fused_db >= unfused_db - 0.05, (fused_db, unfused_db)
    assert sqnr(dx0.float(), dx.float()) >= 40
    if not on_fp8:  # one fp32 accumulation, one rounding, against two and a bf16 sum
        assert fused_db > unfused_db
    kinds = [kind for kind, _ in ours_launches]
    assert len(ours_launches) == 6 and len(launches) == 9
    # forward: w1|w3, then w2; backward: w2's dgrad and wgrad, then w1|w3's
    expected = ["fp8", "bf16", "bf16", "bf16", "fp8", "fp8"] if on_fp8 else ["bf16"] * 6
    assert kinds == expected, ours_launches
    assert ours_launches[0][1] == (sum(COUNTS), D)


def test_compiled_equals_eager(fp8):
    """``torch.compile(fullgraph=True)`` of the experts (aot_eager: the ops' eager bodies)
    equals eager bit for bit, output and gradients (the compiled GEMM op joins the weights in
    the graph)."""
    ours, _ = _experts()
    rows, counts, grad = _rows()
    results = []
    for run in (ours, torch.compile(ours, fullgraph=True, backend="aot_eager")):
        ours.zero_grad(set_to_none=True)
        x = rows.detach().requires_grad_()
        y = run(x, counts)
        y.backward(grad)
        results.append([y.detach(), x.grad] + [p.grad for p in ours.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_the_weight_cache_keys_a_pair_by_both(monkeypatch):
    """The fp8 operands of [w1 | w3] are made once while both weights are unchanged, again after
    either changes (its version) or is replaced, and equal the uncached operands bit for
    bit; the forward's is the per-weight operands side by side."""
    monkeypatch.setattr(_torch_gemm, "fp8_gemm_available", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_scaled_grouped_mm, raising=False)
    ours, _ = _experts()
    w1, w3 = ours.w1_EFD.detach(), ours.w3_EFD.detach()
    pair = (w1.transpose(-2, -1), w3.transpose(-2, -1))
    cache = mt.WeightCache()
    made = []

    def make(w):
        made.append(1)
        return _torch_gemm._fp8_weight(w)
    first = _torch_gemm._weight_operand(cache, pair, "forward", make)
    again = _torch_gemm._weight_operand(cache, pair, "forward", make)
    assert again is first and len(made) == 1
    alone = [_torch_gemm._fp8_weight(w) for w in pair]
    assert torch.equal(first[0].float(), torch.cat([a[0].float() for a in alone], dim=-1))
    assert torch.equal(first[1], torch.cat([a[1] for a in alone], dim=-1))
    with torch.no_grad():
        w3.mul_(2)                                      # the second weight written in place
    _torch_gemm._weight_operand(cache, pair, "forward", make)
    assert len(made) == 2
    other = (pair[0], w3.clone().transpose(-2, -1))     # the second weight replaced
    value = _torch_gemm._weight_operand(cache, other, "forward", make)
    assert len(made) == 3 and torch.equal(value[1], _torch_gemm._fp8_weight(
        _torch_gemm.joined(other))[1])
    assert (cache.hits, cache.misses) == (1, 3)


def test_bad_weights_raise():
    """A pair of weights of different G or K, a weight not bf16, an empty tuple: errors naming
    the weight."""
    x = torch.zeros(32, D, dtype=torch.bfloat16)
    offs = torch.tensor([16, 32], dtype=torch.int32)
    w = torch.zeros(2, D, F, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"w\[1\] \(G, K, N\).*w\[1\] \(3, 64, 32\)"):
        mt.grouped_mm(x, (w, torch.zeros(3, D, F, dtype=torch.bfloat16)), offs)
    with pytest.raises(ValueError, match=r"w\[1\].*\(2, 32, 32\)"):
        mt.grouped_mm(x, [w, torch.zeros(2, 32, F, dtype=torch.bfloat16)], offs)
    with pytest.raises(TypeError, match=r"w\[0\]: expected dtype bfloat16"):
        mt.grouped_mm(x, (w.float(), w), offs)
    with pytest.raises(ValueError, match="empty tuple"):
        mt.grouped_mm(x, (), offs)


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_one_gemm_over_w1_w3_on_sm90():
    """On an SM90 GPU (the real ``torch._scaled_grouped_mm``, fast accumulation): the w1|w3 GEMM
    against the unfused experts: the output and the weight gradients equal, or within 45 dB
    where the GEMM's kernel tiles N = 2F otherwise than N = F (it is the same per-element
    product); [dh1 | dh3] handed alike (bit for bit where the outputs are); the rows' gradient
    within 40 dB of the unfused sum and as close to float64 (0.1 dB)."""
    if not torch.cuda.is_available() or not _torch_gemm.fp8_gemm_available(
            torch.device("cuda")):
        pytest.skip("needs an SM90 GPU with torch._scaled_grouped_mm")
    ours, unfused = _experts(device="cuda")
    rows, counts, grad = _rows(device="cuda")
    y, dx, dw, handed = _step(ours, rows, counts, grad)
    y0, dx0, dw0, handed0 = _step(unfused, rows, counts, grad)
    torch.cuda.synchronize()
    exact = torch.equal(y, y0)
    assert exact or sqnr(y0.float(), y.float()) >= 45
    for name in dw:
        assert torch.equal(dw[name], dw0[name]) or \
            sqnr(dw0[name].float(), dw[name].float()) >= 45, name
    if exact:
        assert torch.equal(handed[0], torch.cat(handed0, dim=1))
    ref = _dgrad_reference(handed0, (ours.w1_EFD.detach(), ours.w3_EFD.detach()), counts)
    assert sqnr(ref, dx.double().cpu()) >= sqnr(ref, dx0.double().cpu()) - 0.1
    assert sqnr(dx0.float(), dx.float()) >= 40


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_of_the_joined_halves_equals_torchs(dtype):
    """``_SwiGLU`` (silu(h1) * h3 of [h1 | h3], its backward writing dh1 and dh3 into one
    tensor) equals ``F.silu(h1) * h3`` and its autograd bit for bit, forward and backward."""
    from mxcomm._torch_ep import _SwiGLU
    gen = torch.Generator().manual_seed(SEED)
    h13 = (torch.randn(37, 2 * 24, generator=gen) * 3).to(dtype)
    dh = torch.randn(37, 24, generator=gen).to(dtype)
    a = h13.clone().requires_grad_()
    h = _SwiGLU.apply(a)
    h.backward(dh)
    b = h13.clone().requires_grad_()
    h1, h3 = b.split(24, dim=-1)
    h0 = torch.nn.functional.silu(h1) * h3
    h0.backward(dh)
    assert torch.equal(h, h0) and torch.equal(a.grad, b.grad)


def test_plain_rows_take_torchtitans_three_gemms(fp8):
    """Plain bf16 rows (no mxcomm dispatch before them) take torchtitan's forward with
    ``grouped_mm`` in its seam: three bf16 GEMMs (no per-call join of w1 and w3), the same
    bits as the unfused experts, forward and backward."""
    _, launches = fp8
    ours, unfused = _experts()
    rows, counts, grad = _rows()
    plain = rows.dequantize().detach()
    launches.clear()
    y, dx, dw, _ = _step(ours, plain, counts, grad)
    assert [kind for kind, _ in launches] == ["bf16"] * 9
    y0, dx0, dw0, _ = _step(unfused, plain, counts, grad)
    assert torch.equal(y, y0) and torch.equal(dx, dx0)
    assert all(torch.equal(dw[k], dw0[k]) for k in dw)
