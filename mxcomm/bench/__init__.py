"""Benchmarks of mxcomm: ``python -m mxcomm.bench {kernels,a2a,pipeline}``.

- ``kernels``: MXFP8 quantize/dequantize and permute/unpermute bandwidth against a device copy.
- ``a2a``: all-to-all-v throughput, mxcomm's communicator vs ``torch.distributed`` (nccl-tests
  columns), the drop-in ``all_to_all_single``, and a memory-leak check.
- ``pipeline``: the MoE expert-parallel token path forward and backward, bf16 vs MXFP8 (the seed's
  table), per stage and in total.

Run the multi-rank ones under ``mpirun -n W`` (one process per GPU). Without a GPU they run tiny
shapes in Numba's CUDA simulator over the MPI backend (the CI smoke test).
"""

from ._cli import main

__all__ = ["main"]
