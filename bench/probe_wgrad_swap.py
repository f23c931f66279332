"""Is the fp8 weight gradient of ``grouped_mm`` the same bits whichever way the weight is stored?

A weight stored (G, K, N) gets dw = x^T @ grad; one stored (G, N, K) (torchtitan's and the
pipeline's, handed over transposed) gets (grad^T @ x)^T, the GEMM's operands swapped
(docs/design.md, "The experts' GEMMs"). Both orders are run on the same quantized rows and
compared bit for bit, with fast accumulation on and off. Needs an SM90 GPU, one process:

    python bench/probe_wgrad_swap.py
"""

import numpy
import torch

import mxcomm.torch as mt
from mxcomm import _torch_gemm


def wgrads(a, s, w, offs, grad, fast):
    """The fp8 weight gradient, (G, K, N), with ``w`` stored (G, K, N) and stored (G, N, K)."""
    out = {}
    for stored in ("(G, K, N)", "(G, N, K)"):
        x = mt.QuantizedTensor(a, s, "fp8_rowwise").requires_grad_(True)
        if stored == "(G, K, N)":
            leaf = weight = w.clone().requires_grad_(True)
        else:
            leaf = w.transpose(-2, -1).contiguous().requires_grad_(True)
            weight = leaf.transpose(-2, -1)
        mt.grouped_mm(x, weight, offs, fp8=True, wgrad="fp8", fast_accum=fast).backward(grad)
        out[stored] = (leaf.grad if leaf is weight else leaf.grad.transpose(-2, -1)).contiguous()
    return out


def main():
    torch.manual_seed(1)
    for k, n, sizes in [(1024, 512, [1000, 0, 37, 2999, 5]), (7168, 2048, [4096] * 8),
                        (1024, 512, [512] * 32)]:
        ends = numpy.cumsum(sizes)
        offs = torch.tensor(ends, device="cuda", dtype=torch.int32)
        rows = int(ends[-1])
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(len(sizes), k, n, device="cuda") / k ** 0.5).to(torch.bfloat16)
        grad = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        a, s = _torch_gemm.quantize_rows_pow2(x)
        for fast in (True, False):
            g = list(wgrads(a, s, w, offs, grad, fast).values())
            bits = [t.view(torch.int16) for t in g]
            print(f"k {k} n {n} groups {len(sizes)} fast_accum {fast}: wgrad bit-identical "
                  f"{torch.equal(*bits)}, max |diff| {(g[0].float() - g[1].float()).abs().max().item():.3g}, "
                  f"fraction differing {(bits[0] != bits[1]).float().mean().item():.4f}", flush=True)


if __name__ == "__main__":
    main()
