"""Benchmarks of mxcomm: ``python -m mxcomm.bench {kernels,a2a,pipeline,latency,torchtitan,calibrate}``.

- ``kernels``: MXFP8 quantize/dequantize and permute/unpermute bandwidth against a device copy.
- ``a2a``: all-to-all-v throughput, mxcomm's communicator vs ``torch.distributed`` (nccl-tests
  columns), the drop-in ``all_to_all_single``, and a memory-leak check.
- ``pipeline``: the MoE expert-parallel token path forward and backward, bf16 vs MXFP8: timings
  per stage and in total on GPUs; everywhere, the bytes on the wire, the SQNR of every variant and
  the exactness of every step's data movement.
- ``latency``: host and device time per dispatch/combine call through ``mxcomm.torch``, vs torch.
- ``torchtitan``: torchtitan 0.3's own MoE layer (DeepSeek-V3 671B config), forward and backward,
  its bf16 and float8 experts against mxcomm's integration, eager and compiled: tokens/s, peak
  memory, SQNR.
- ``calibrate``: each recipe's forward + backward at a grid of rows per rank on this machine,
  saved as the cost table ``"auto"`` reads (``mxcomm.recipes``).

Run the multi-rank ones under ``mpirun -n W`` or ``torchrun --nproc-per-node W`` (one process per
GPU; ``python -m`` becomes ``torchrun ... -m``). Without a GPU they run on the CPU in the host
backend over the MPI (or, under torchrun, torch.distributed) communicator, time nothing that would
speak for a GPU, and say so in their first line (``pipeline`` is the CI smoke run).
"""

from ._cli import main

__all__ = ["main"]
