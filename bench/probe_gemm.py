"""The fp8 grouped GEMM's pieces, each alone (SM90 GPU only), at the pipeline's 131072-row shapes
(8 groups of 16384 rows; K x N = 7168 x 2048 and 8192 x 5120): the weight quantizations of the
forward (along K) and of dgrad (along N, from the transposed view the MoE layer holds: a
contiguous copy then the rowwise kernel, and the transposing kernel ``grouped_mm`` uses), the
forward, dgrad and wgrad products with and without fast accumulation, the bf16 products beside
them, and the fp8 wgrad's operand conversion. Median ms of 20 after 5 warm-up (CUDA events, back
to back), and the SQNR (dB) of each fp8 product against the bf16 one of the same bf16 operands.
``python bench/probe_gemm.py``; bench/NOTES.md says what it found.
"""

import torch

from mxcomm import _torch_gemm as g, colwise, sqnr
from mxcomm._torch_arrays import _array, _stream, _tensor
from mxcomm.bench._timing import Clock, measure_back_to_back


def group_colwise(data, scales, offs):
    """fp8 rowwise rows (P, C) as the wgrad's operand: ((C, T) e4m3fn, (G * C,) float32, (G,)
    int32 aligned group ends), as ``grouped_mm``'s backward makes them."""
    data_t, scales_t, aligned = colwise.fp8_rowwise_to_group_colwise(
        _array(data, "data"), _array(scales, "scales"), _array(offs, "offs"),
        stream=_stream(data))
    return (_tensor(data_t, torch.float8_e4m3fn), _tensor(scales_t).reshape(-1),
            _tensor(aligned))


def median_ms(fn):
    return measure_back_to_back(fn, Clock("torch"), iters=20, warmup=5).median


def main(rows=131072, groups=8):
    torch.manual_seed(0)
    for k, n in ((7168, 2048), (8192, 5120)):
        shape(rows, groups, k, n)
        torch.cuda.empty_cache()


def shape(rows, groups, k, n):
    """Every piece at one shape (module docstring)."""
    offs = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * (rows // groups)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    # the MoE layer's weights (G, N, K), used as (G, K, N) through a transposed view
    w = (torch.randn(groups, n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    w = w.transpose(-2, -1)
    a, sa = g.quantize_rows_pow2(x)
    ga, gs = g.quantize_rows_pow2(grad)
    b, sb = g._fp8_weight(w)
    bt, sbt = g._fp8_weight_t(w)
    xt = group_colwise(a, sa, offs)
    gt = group_colwise(ga, gs, offs)
    y_ref = torch._grouped_mm(x, w, offs=offs)
    dx_ref = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs)
    dw_ref = torch._grouped_mm(x.t(), grad, offs=offs)

    def forward(fast):
        return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

    def dgrad(fast):
        return torch._scaled_grouped_mm(ga, bt, gs, sbt, offs=offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)

    def wgrad(fast):
        return torch._scaled_grouped_mm(xt[0], gt[0].t(), xt[1], gt[1], offs=xt[2],
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)

    print(f"==== {rows} x {k} -> {n}, {groups} groups")
    cases = [
        ("weight quantize, forward (along K)", lambda: g._fp8_weight(w), None, None),
        ("weight quantize, dgrad (along N, copy first)",
         lambda: g.quantize_rows_pow2(w.contiguous()), None, None),
        ("weight quantize, dgrad (along N, transposed kernel)", lambda: g._fp8_weight_t(w),
         None, None),
        ("x conversion for the fp8 wgrad", lambda: group_colwise(a, sa, offs), None, None),
        ("grad conversion for the fp8 wgrad", lambda: group_colwise(ga, gs, offs), None,
         None),
        ("forward bf16", lambda: torch._grouped_mm(x, w, offs=offs), None, None),
        ("dgrad bf16", lambda: torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs), None,
         None),
        ("wgrad bf16", lambda: torch._grouped_mm(x.t(), grad, offs=offs), None, None),
    ]
    for fast in (False, True):
        tag = "fast" if fast else "fp32 promotion"
        cases += [(f"forward fp8, {tag}", lambda f=fast: forward(f), y_ref, forward),
                  (f"dgrad fp8, {tag}", lambda f=fast: dgrad(f), dx_ref, dgrad),
                  (f"wgrad fp8, {tag}", lambda f=fast: wgrad(f), dw_ref, wgrad)]
    for name, fn, ref, product in cases:
        ms = median_ms(fn)
        quality = ""
        if ref is not None:
            quality = f"  {sqnr(ref, product('fast' in name)):6.2f} dB vs bf16"
        print(f"{name:52s} {ms:7.3f} ms{quality}")


if __name__ == "__main__":
    main()
