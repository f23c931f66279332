"""Which expert weight gradient loses the most in the fp8_rowwise recipe, and to which quantized
operand (CPU, float64 emulation; no GPU needed).

The SwiGLU experts of torchtitan's ``GroupedExperts`` (h1 = x w1^T, h3 = x w3^T, h = silu(h1) h3,
y = h w2^T), one process, G experts, forward and backward, with every rounding the fp8_rowwise
recipe makes inside torchtitan (``mxcomm.integrations.torchtitan`` with ``recipe="fp8_rowwise"``,
and ``mxcomm._torch_gemm``'s fp8 path) written out as a switch:

  x_wire      the dispatched rows: fp8 rowwise (pow2 scale per row), the w1|w3 GEMMs' A
  w13_fwd     w1, w3 quantized along K (D) per output column: the forward's B
  bf16_acts   h1, h3, silu(h1), h, y rounded to bf16 (the GEMMs' bf16 outputs, torch's bf16 ops)
  dy_wire     the output gradient: fp8 rowwise (the combine gradient's wire format)
  w2_fp8      the w2 GEMM in fp8 too (forward: h rowwise; dgrad: dy, w2^T along D; wgrad:
              h and dy per (group, column) from their rowwise bits); off: bf16 (what the
              integration runs: ``grouped_mm(h, ...)`` on plain rows takes the bf16 GEMM)
  dh13_dgrad  the w1|w3 GEMMs' output gradients dh1, dh3 quantized rowwise (the dgrad's A)
  w13_dgrad   w1, w3 quantized along F per column of D (the dgrad's B)
  x_col       the wgrad's x: the rowwise bits rescaled per (group, column) (a second rounding)
  dh13_wgrad  the wgrad's dh1, dh3: rowwise, then rescaled per (group, column) (off: bf16)

Every product runs in float64 (``torch._scaled_grouped_mm`` is exact up to its fp32
accumulation). The reference is the same experts in float64 from the same bf16 inputs. Printed:
the SQNR of dw1, dw2, dw3 (each, and together as the torchtitan benchmark reports them) and of
dx, for the recipe as built, and with each switch turned off alone (the gain says what that
operand costs), plus candidate changes. ``--check`` first compares the emulation with mxcomm's
own ``grouped_mm`` (``_scaled_grouped_mm`` emulated): the same values.

Run: ``python bench/probe_wgrad.py [--rows-per-expert N] [--dim D] [--hidden F] [--experts G]``.
"""

import argparse
import math
import os
import sys

import torch

E4M3_MAX = 448.0
SEED = 4321
SWITCHES = ("x_wire", "w13_fwd", "bf16_acts", "dy_wire", "w2_fp8", "dh13_dgrad", "w13_dgrad",
            "x_col", "dh13_wgrad")


def pow2_scale(amax):
    """2^clamp(ceil(log2(amax / 448)), -126, 127), 2^-126 for amax 0 (mxcomm.rowwise's rule)."""
    e = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(-126, 127)
    return torch.where(amax == 0, torch.full_like(e, -126.0), e).exp2()


def e4m3(t):
    """Round-to-nearest-even to e4m3fn (saturating), as float64."""
    return t.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double()


def q_rows(t):
    """fp8 rowwise: (values as the GEMM sees them, e4m3 codes, row scales)."""
    s = pow2_scale(t.abs().amax(dim=-1))
    codes = e4m3(t / s[:, None])
    return codes * s[:, None], codes, s


def q_cols(t):
    """fp8 along dim -2 per column (a weight's B operand), values."""
    s = pow2_scale(t.abs().amax(dim=-2))
    return e4m3(t / s[..., None, :]) * s[..., None, :]


def q_group_cols(v, offs):
    """Values v (P, C) rescaled to one pow2 scale per (group, column) (the wgrad's operand
    conversion, ``mxcomm.colwise.fp8_rowwise_to_group_colwise``), values."""
    out = torch.empty_like(v)
    start = 0
    for end in offs:
        block = v[start:end]
        if end > start:
            s = pow2_scale(block.abs().amax(dim=0))
            out[start:end] = e4m3(block / s[None, :]) * s[None, :]
        start = end
    return out


def bf16(t):
    return t.to(torch.bfloat16).double()


def grouped(a, b, offs):
    """y[p] = a[p] @ b[g] for the rows of group g, float64."""
    out = torch.empty(a.shape[0], b.shape[-1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs):
        out[start:end] = a[start:end] @ b[g]
        start = end
    return out


def wgrad(a, b, offs):
    """dw[g] = a[g]^T @ b[g] per group, float64 (G, A, B)."""
    out = []
    start = 0
    for end in offs:
        out.append(a[start:end].T @ b[start:end])
        start = end
    return torch.stack(out)


def experts(x, w1, w2, w3, dy, offs, on, fused=False):
    """Forward and backward of the SwiGLU experts with the switches ``on`` (a set of names);
    returns {dx, dw1, dw2, dw3} as float64. ``fused``: the w1|w3 GEMMs as one GEMM (dgrad's
    A rowwise over [dh1 | dh3], its B along 2F)."""
    act = bf16 if "bf16_acts" in on else (lambda t: t)
    f = w1.shape[1]
    xr = q_rows(x)[0] if "x_wire" in on else x
    b1 = w1.transpose(-2, -1)  # (G, D, F)
    b3 = w3.transpose(-2, -1)
    if "w13_fwd" in on:
        b1, b3 = q_cols(b1), q_cols(b3)
    h1, h3 = act(grouped(xr, b1, offs)), act(grouped(xr, b3, offs))
    sig = torch.sigmoid(h1)
    s1 = act(h1 * sig)
    h = act(s1 * h3)
    w2_fp8 = "w2_fp8" in on
    hq = q_rows(h)[0] if w2_fp8 else h  # w2's forward GEMM reads it (its output is not needed)
    g = q_rows(dy)[0] if "dy_wire" in on else dy
    # w2's dgrad: dh = dy @ w2 (B = w2^T^T: w2 (G, D, F) along D per column of F)
    dh = act(grouped(g, q_cols(w2) if w2_fp8 else w2, offs))
    dw2 = wgrad(q_group_cols(g, offs) if w2_fp8 else g,
                q_group_cols(hq, offs) if w2_fp8 else h, offs)          # (G, D, F)
    # torch's bf16 backward of h = s1 * h3 and s1 = silu(h1)
    dh3 = act(dh * s1)
    ds1 = act(dh * h3)
    dh1 = act(ds1 * (sig * (1 + h1 * (1 - sig))))
    if fused:  # one rowwise scale over [dh1 | dh3], the dgrad's K = 2F
        both = torch.cat([dh1, dh3], dim=1)
        both_q = q_rows(both)[0]
        dh1q, dh3q = both_q[:, :f], both_q[:, f:]
        wt = torch.cat([w1, w3], dim=1)  # (G, 2F, D)
        dx = act(grouped(both_q if "dh13_dgrad" in on else both,
                         q_cols(wt) if "w13_dgrad" in on else wt, offs))
    else:
        dh1q, dh3q = q_rows(dh1)[0], q_rows(dh3)[0]
        wd1, wd3 = (q_cols(w1), q_cols(w3)) if "w13_dgrad" in on else (w1, w3)
        a1, a3 = (dh1q, dh3q) if "dh13_dgrad" in on else (dh1, dh3)
        dx = act(act(grouped(a1, wd1, offs)) + act(grouped(a3, wd3, offs)))
    xc = q_group_cols(xr, offs) if "x_col" in on else xr
    if "dh13_wgrad" in on:
        dh1w, dh3w = q_group_cols(dh1q, offs), q_group_cols(dh3q, offs)
    else:
        dh1w, dh3w = dh1, dh3
    dw1 = wgrad(dh1w, xc, offs)    # (G, F, D)
    dw3 = wgrad(dh3w, xc, offs)
    return {"dx": dx, "dw1": dw1, "dw2": dw2, "dw3": dw3}


def sqnr(ref, out):
    ref, out = list(ref), list(out)
    s = sum(float((r ** 2).sum()) for r in ref)
    n = sum(float(((r - o) ** 2).sum()) for r, o in zip(ref, out))
    return math.inf if n == 0 else 10 * math.log10(s / n)


def inputs(rows_per_expert, dim, hidden, groups, seed=SEED):
    """bf16 values (as float64) like the torchtitan benchmark's: x, dy N(0, 1); weights
    N(0, 1) / sqrt(fan-in); groups of rows_per_expert +- 25 %, a multiple of 32."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [32 * max(1, round(rows_per_expert * (0.75 + 0.5 * float(torch.rand(1, generator=gen)))
                                / 32)) for _ in range(groups)]
    offs = torch.tensor(sizes).cumsum(0).tolist()
    p = offs[-1]

    def randn(*shape, scale=1.0):
        return bf16(torch.randn(*shape, generator=gen, dtype=torch.float64) * scale)
    x, dy = randn(p, dim), randn(p, dim)
    w1 = randn(groups, hidden, dim, scale=dim ** -0.5)
    w3 = randn(groups, hidden, dim, scale=dim ** -0.5)
    w2 = randn(groups, dim, hidden, scale=hidden ** -0.5)
    return x, w1, w2, w3, dy, offs


def check_against_mxcomm(x, w1, w2, w3, dy, offs):
    """The emulation (w2 GEMM fp8, all switches on) against mxcomm's grouped_mm (w1 and w3 as
    two GEMMs) with ``torch._scaled_grouped_mm`` emulated in float64: max |difference| of each
    gradient over its max |value| (0: the same values)."""
    from mxcomm import _torch_gemm
    import mxcomm.torch as mt

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), "tests"))
    from reference_gemm import scaled_grouped_mm_float64 as emulated
    _torch_gemm.fp8_gemm_available = lambda device: True
    torch._scaled_grouped_mm = emulated
    o = torch.tensor(offs, dtype=torch.int32)
    xq = x.to(torch.bfloat16).requires_grad_()
    ws = [w.to(torch.bfloat16).requires_grad_() for w in (w1, w2, w3)]
    a1 = mt.grouped_mm(xq, ws[0].transpose(-2, -1), o, fp8=True, weight_cache=False)
    a3 = mt.grouped_mm(xq, ws[2].transpose(-2, -1), o, fp8=True, weight_cache=False)
    h = torch.nn.functional.silu(a1) * a3
    y = mt.grouped_mm(h, ws[1].transpose(-2, -1), o, fp8=True, weight_cache=False)
    g = _torch_gemm._fp8_operand_a(dy.to(torch.bfloat16))
    from mxcomm.formats import get_format
    from mxcomm.torch._quantized import _quantized_tensor
    y.backward(_quantized_tensor(g[0], g[1], get_format("fp8_rowwise")))
    mine = experts(x, w1, w2, w3, dy, offs, set(SWITCHES))
    got = {"dx": xq.grad, "dw1": ws[0].grad, "dw2": ws[1].grad, "dw3": ws[2].grad}
    # mxcomm returns bf16 gradients: the emulation's rounded alike
    return {k: float((got[k].double() - bf16(mine[k])).abs().max() / mine[k].abs().max())
            for k in got}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows-per-expert", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=896)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    cases = {"as built (w2 GEMM bf16)": set(SWITCHES) - {"w2_fp8"},
             "as built, w2 GEMM fp8": set(SWITCHES)}
    base = cases["as built (w2 GEMM bf16)"]
    for s in SWITCHES:
        if s in base:
            cases[f"  without {s}"] = base - {s}
    cases["w1|w3 wgrad bf16"] = base - {"dh13_wgrad", "x_col"}
    cases["combine_grad bf16"] = base - {"dy_wire"}
    cases["w1|w3 wgrad bf16 + combine_grad bf16"] = base - {"dh13_wgrad", "x_col", "dy_wire"}
    cases["combine_grad bf16, w2 GEMM fp8"] = set(SWITCHES) - {"dy_wire"}
    cases["w1|w3 fused (one GEMM)"] = ("fused", base)
    cases["w1|w3 fused, combine_grad bf16"] = ("fused", base - {"dy_wire"})
    cases["w1|w3 fused, wgrad bf16 + combine_grad bf16"] = (
        "fused", base - {"dh13_wgrad", "x_col", "dy_wire"})
    names = ("dw1", "dw2", "dw3")
    print(f"rows/expert ~{args.rows_per_expert}, D {args.dim}, F {args.hidden}, "
          f"G {args.experts}; SQNR dB vs float64, mean of {args.seeds} seeds")
    print(f"{'case':34s} {'dw1':>7s} {'dw2':>7s} {'dw3':>7s} {'all w':>7s} {'dx':>7s}")
    results = {k: [] for k in cases}
    for seed in range(args.seeds):
        x, w1, w2, w3, dy, offs = inputs(args.rows_per_expert, args.dim, args.hidden,
                                         args.experts, SEED + seed)
        if args.check and seed == 0:
            print("emulation vs mxcomm grouped_mm (max |diff| / max |ref|):",
                  check_against_mxcomm(x, w1, w2, w3, dy, offs))
        ref = experts(x, w1, w2, w3, dy, offs, set())
        for name, on in cases.items():
            fused = isinstance(on, tuple)
            got = experts(x, w1, w2, w3, dy, offs, on[1] if fused else on, fused=fused)
            results[name].append([sqnr([ref[k]], [got[k]]) for k in names] +
                                 [sqnr([ref[k] for k in names], [got[k] for k in names]),
                                  sqnr([ref["dx"]], [got["dx"]])])
    for name, rows in results.items():
        mean = [sum(r[i] for r in rows) / len(rows) for i in range(5)]
        print(f"{name:34s} " + " ".join(f"{v:7.2f}" for v in mean))


if __name__ == "__main__":
    main()
