"""Count the library's Python function entries of one ``ExpertParallel`` training step.

Run: ``mpiexec -n 2 python bench/ep_calls.py [rows] [dim] [hidden]`` (CPU, host backend, MPI).

One step of ``mxcomm.torch.ExpertParallel(recipe="fp8_rowwise")``: ``dispatch``, one
``grouped_mm``, ``combine``, and the backward of all three, with SM90's fp8 grouped GEMM
emulated (tests/reference_gemm.py) so that the fp8 GEMM path runs as on a GPU. Two steps warm
up (the layout's caches, the weight cache), then one is counted by ``walk.walk`` (entries into
``mxcomm/``, ``comm/``, ``kernels/``), rank 0 half a second late as there. Rank 0 prints the
entries per function, most first, and the total: a host-time proxy for the GPU path, whose
Python structure the host backend shares above the kernels.
"""

import collections
import os
import sys
import time

import torch

from walk import ROOT, walk

sys.path.insert(0, os.path.join(ROOT, "tests"))
from reference_gemm import scaled_grouped_mm_float64  # noqa: E402


def main():
    import mxcomm.comm
    import mxcomm.torch as mxt
    from mxcomm import _torch_gemm

    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    dim = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    hidden = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    _torch_gemm.fp8_gemm_available = lambda device: True
    torch._scaled_grouped_mm = scaled_grouped_mm_float64
    comm = mxcomm.comm.init("mpi")
    e_local = 2
    ep = mxt.ExpertParallel(comm=comm, num_local_experts=e_local, recipe="fp8_rowwise",
                            gemm_fallback=True)
    torch.manual_seed(comm.rank)
    counts = torch.full((e_local * comm.size,), rows // (e_local * comm.size), dtype=torch.int32)
    x = torch.randn(int(counts.sum()), dim, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(e_local, dim, hidden) * dim ** -0.5).bfloat16().requires_grad_()
    grad = torch.randn(x.shape[0], hidden, dtype=torch.bfloat16)

    def step():
        got, offsets, handle = ep.dispatch(x, counts)
        ep.combine(mxt.grouped_mm(got, w, offsets), handle).backward(grad)

    for _ in range(2):
        step()
    comm.barrier()
    if comm.rank == 0:
        time.sleep(0.5)
    entries, _, _ = walk(step)
    if comm.rank == 0:
        print(f"ExpertParallel fp8_rowwise, {comm.size} ranks, {rows} rows, D {dim}, H {hidden}")
        for (f, name), n in collections.Counter(entries).most_common():
            print(f"{n:4d}  {f}:{name}")
        print(f"entries {len(entries)}")
    comm.close()


if __name__ == "__main__":
    main()
