"""Where one expert-parallel step waits for the host: its host syncs and its host time.

    mpirun -n 2 python bench/probe_syncs.py [rows] [recipe] [iters]   (GPU only)

One step is ``ExpertParallel(recipe=...)``'s dispatch, ``mxcomm.torch.grouped_mm``, combine and
the backward, on ``rows`` rows per rank (uniform routing, 7168 -> 2048, 8 experts per rank), as
a user's layer runs it. Printed by rank 0, after warm-up:

- the step's host time (wall clock of enqueueing forward + backward, no sync inside the
  timing) against its device time (CUDA events), the medians of ``iters`` steps, each after a
  device sync and a barrier: where host > device the GPU waited for the host;
- every synchronizing torch operation in one step (``torch.cuda.set_sync_debug_mode("warn")``),
  with the library frames that called it;
- the 25 functions of one step's forward, and of its backward (on autograd's device thread),
  with the most own host time (cProfile, C functions included: CuPy's and the driver's
  synchronizing calls appear by name).
"""

import cProfile
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings

import torch
from mpi4py import MPI

import mxcomm.comm
import mxcomm.torch as mt

ROWS, RECIPE, ITERS = 16384, "fp8_rowwise", 20
DIM, HIDDEN, E_LOCAL = 7168, 2048, 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the repository's


def main():
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else ROWS
    recipe = sys.argv[2] if len(sys.argv) > 2 else RECIPE
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else ITERS
    comm = mxcomm.comm.init()
    torch.cuda.set_device(comm.device)
    device = torch.device("cuda", comm.device)
    experts = comm.size * E_LOCAL
    gen = torch.Generator(device=device).manual_seed(11 + comm.rank)
    x0 = torch.randn(rows, DIM, generator=gen, device=device, dtype=torch.bfloat16)
    grad = torch.randn(rows, HIDDEN, generator=gen, device=device, dtype=torch.bfloat16)
    w = (torch.randn(E_LOCAL, DIM, HIDDEN, generator=gen, device=device) * DIM ** -0.5
         ).to(torch.bfloat16).requires_grad_()
    counts = torch.full((experts,), rows // experts, dtype=torch.int32, device=device)
    ep = mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, recipe=recipe)

    def step(profiles=None):
        x = x0.detach().requires_grad_()
        if profiles:
            profiles[0].enable()
        rows_, offs, handle = ep.dispatch(x, counts)
        out = ep.combine(mt.grouped_mm(rows_, w, offs), handle)
        if profiles:  # the backward runs on autograd's device thread: profiled there
            profiles[0].disable()
            out.register_hook(lambda g: profiles[1].enable())
            x.register_hook(lambda g: profiles[1].disable())
        (out.float() * grad.float()).sum().backward()
        w.grad = None

    host, dev = [], []
    for i in range(3 + iters):
        torch.cuda.synchronize()
        MPI.COMM_WORLD.Barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        step()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= 3:
            host.append((t1 - t0) * 1e3)
            dev.append(start.elapsed_time(end))
    host_ms = max(MPI.COMM_WORLD.allgather(statistics.median(host)))
    dev_ms = max(MPI.COMM_WORLD.allgather(statistics.median(dev)))

    torch.cuda.synchronize()
    MPI.COMM_WORLD.Barrier()
    syncs = []

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f"{_short(f.filename)}:{f.lineno} {f.name}"
                  for f in traceback.extract_stack()[:-1] if f.filename.startswith(ROOT)]
        syncs.append(f"{str(message).splitlines()[0][:80]} <- " + " <- ".join(frames[::-1][:6]))
    shown = warnings.showwarning
    warnings.showwarning = record
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        step()
        torch.cuda.set_sync_debug_mode(0)
    warnings.showwarning = shown

    torch.cuda.synchronize()
    MPI.COMM_WORLD.Barrier()
    profiles = (cProfile.Profile(), cProfile.Profile())
    step(profiles)
    torch.cuda.synchronize()
    texts = [_table(pstats.Stats(profile)) for profile in profiles]

    if comm.rank == 0:
        print(f"# {recipe}, {rows} rows per rank, {comm.size} ranks: host {host_ms:.3f} ms, "
              f"device {dev_ms:.3f} ms per step (medians of {iters}, slowest rank)")
        print(f"## synchronizing torch operations in one step: {len(syncs)}")
        for s in syncs:
            print("-", s)
        for name, text in zip(("forward", "backward"), texts):
            print(f"## one step's {name} under cProfile (us; its overhead included)")
            print(text)
    comm.close()


def _short(path):
    """``path`` from the repository's root or from site-packages, where it is under one."""
    return path.split("site-packages" + os.sep)[-1].replace(ROOT, "")


def _table(stats, top=25):
    """The ``top`` functions by own time and by inclusive time, in us, with their calls."""
    rows = [(f"{_short(file)}:{line}({name})",
             calls, own * 1e6, inclusive * 1e6)
            for (file, line, name), (_, calls, own, inclusive, _) in stats.stats.items()]
    total = sum(r[2] for r in rows)
    out = [f"total own time {total:.0f} us in {sum(r[1] for r in rows)} calls"]
    for key, title in ((2, "own"), (3, "inclusive")):
        out.append(f"by {title} time: calls, own us, inclusive us, function")
        for r in sorted(rows, key=lambda r: -r[key])[:top]:
            out.append(f"  {r[1]:5d} {r[2]:8.0f} {r[3]:8.0f}  {r[0]}")
    return "\n".join(out)


if __name__ == "__main__":
    main()
