"""An independent float64 reference of ``torch._scaled_grouped_mm``'s rowwise cases, for the CPU
(which has none): tests and bench/probe_wgrad.py put it in place of torch's to run mxcomm's fp8
GEMM path exactly as SM90 computes it, up to the accumulation's rounding."""

import torch


def scaled_grouped_mm_float64(a, b, scale_a, scale_b, offs=None, out_dtype=None,
                              use_fast_accum=False):
    """2d-3d (forward, dgrad: ``a`` (M, K), ``b`` (G, K, N), per-row and per-(group, column)
    scales, row groups ending at ``offs``) and 2d-2d (wgrad: ``a`` (K, T), ``b`` (T, N), token
    groups ending at ``offs``, scales (G * K,) and (G * N,)), in float64, cast to ``out_dtype``."""
    if b.dim() == 3:
        x = a.double() * scale_a.double()[:, None]
        out = torch.zeros(a.shape[0], b.shape[-1], dtype=torch.float64)
        start = 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = x[start:end] @ (b[g].double() * scale_b[g].double()[None, :])
            start = end
        return out.to(out_dtype)
    groups = offs.shape[0]
    k, n = a.shape[0], b.shape[1]
    sa, sb = scale_a.double().view(groups, k), scale_b.double().view(groups, n)
    out = torch.zeros(groups, k, n, dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[g] = (a[:, start:end].double() * sa[g][:, None]) @ \
            (b[start:end].double() * sb[g][None, :])
        start = end
    return out.to(out_dtype)
