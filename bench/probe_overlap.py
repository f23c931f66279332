"""One EP layer's backward with and without the overlap, as a timeline of its two streams.

    mpirun -n W python bench/probe_overlap.py [rows] [dim] [hidden] [experts] [iterations]

Defaults: 131072 rows per rank, 7168 -> 2048, 8 experts per rank, 20 iterations. The layer is
``ExpertParallel(recipe="fp8_rowwise", overlap=...)``, ``grouped_mm`` of the dispatched rows with
(E_local, D, H) weights, and the combine; uniform routing (each rank's rows split evenly over the
W * E_local experts). The two variants alternate, one iteration each, after 3 warm-up pairs; each
iteration starts after a device sync and a barrier. Times, in ms from the backward's start (CUDA
events; on a CPU, host clocks after each step: the wiring only, nothing to read):

- ``combine grad``: the combine's gradient delivered (a hook on the GEMM's output);
- ``dgrad``: the dgrad's end, the mark the side stream waits for (overlap only);
- ``gemm bwd``: everything the GEMM's backward enqueued on the main stream (a hook on the rows:
  the wgrad's end);
- ``exchange begin`` / ``end``: the dispatch gradient's exchange on the side stream (overlap
  only: events around it on that stream);
- ``input grad``: the input gradient, joined to the main stream (a hook on x);
- ``backward``: the end of ``backward()``'s work.

``PROBE_DISPATCH_GRAD=mxfp8`` runs both with the dispatch gradient in MXFP8 (the recipe's until
2026-11-28; its other directions unchanged): a quantize before the pulls and a dequantize after,
on SMs beside the wgrad, where the recipe's bf16 gradient is copy-engine pulls only.
``PROBE_PEER_MEMORY=off`` moves the exchanges over NCCL (the grouped transport), whose kernels
hold SMs for the whole exchange: the wgrad's slowdown beside them against beside the pulls
(``on``/``auto``: the pull transport where peer memory works).

Rank 0 prints a Markdown table of the medians, the slowest rank's of each, and writes it to
``$PROBE_MARKDOWN`` where set (docs/design.md,
"Overlap": the timeline this checks; bench/NOTES.md, 2026-11-27: the prediction).
"""

import dataclasses
import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

import mxcomm.comm
import mxcomm.torch as mt
from mxcomm import _torch_overlap

ROWS, DIM, HIDDEN, E_LOCAL, ITERS = (list(map(int, sys.argv[1:6])) +
                                     [131072, 7168, 2048, 8, 20][len(sys.argv[1:6]):])
WARMUP = 3
COLUMNS = ("forward", "combine grad", "dgrad", "gemm bwd", "exchange begin", "exchange end",
           "input grad", "backward")


class Clock:
    """Timestamps on the current stream: CUDA events on a GPU, host times after a sync on a
    CPU (there every op has finished when the next is called)."""

    def __init__(self, gpu):
        self.gpu = gpu

    def mark(self):
        if not self.gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end):
        return start.elapsed_time(end) if self.gpu else (end - start) * 1e3


def main():
    peer = os.environ.get("PROBE_PEER_MEMORY", "auto")
    comm = mxcomm.comm.init(peer_memory={"auto": None, "on": True, "off": False}[peer])
    gpu = getattr(comm, "device", None) is not None
    if gpu:
        torch.cuda.set_device(comm.device)
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    world, rank = comm.size, comm.rank
    clock = Clock(gpu)
    experts = world * E_LOCAL
    if ROWS % experts:
        raise SystemExit(f"rows ({ROWS}) must be a multiple of W * E_local ({experts})")
    gen = torch.Generator(device=device).manual_seed(7 + rank)
    x0 = torch.randn(ROWS, DIM, generator=gen, device=device, dtype=torch.bfloat16)
    grad = torch.randn(ROWS, HIDDEN, generator=gen, device=device, dtype=torch.bfloat16)
    w = (torch.randn(E_LOCAL, DIM, HIDDEN, generator=gen, device=device) * DIM ** -0.5
         ).to(torch.bfloat16).requires_grad_()
    counts = torch.full((experts,), ROWS // experts, dtype=torch.int32, device=device)
    layers = {name: mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL,
                                      recipe="fp8_rowwise", gemm_fallback=not gpu,
                                      overlap=name == "overlap")
              for name in ("no overlap", "overlap")}
    dgrad = os.environ.get("PROBE_DISPATCH_GRAD")
    if dgrad:  # a probe's override of the pinned recipe; no public recipe has it
        for ep in layers.values():
            ep._pinned = dataclasses.replace(ep._pinned, dispatch_grad=dgrad)
    marks = {}
    _instrument(clock, marks)
    times = {name: [] for name in layers}
    for i in range(WARMUP + ITERS):
        for name, ep in layers.items():
            marks.clear()
            x = x0.detach().requires_grad_()
            w.grad = None
            if gpu:
                torch.cuda.synchronize()
            MPI.COMM_WORLD.Barrier()
            start = clock.mark()
            rows, offs, handle = ep.dispatch(x, counts)
            y = mt.grouped_mm(rows, w, offs)
            out = ep.combine(y, handle)
            for key, t in (("combine grad", y), ("gemm bwd", rows), ("input grad", x)):
                t.register_hook(_marker(clock, marks, key))
            marks["forward"] = clock.mark()
            marks["start"] = clock.mark()
            out.backward(grad)
            marks["backward"] = clock.mark()
            if gpu:
                torch.cuda.synchronize()
            if i >= WARMUP:
                times[name].append({key: clock.ms(start if key == "forward" else marks["start"],
                                                  marks[key])
                                    for key in COLUMNS if key in marks})
    medians = {name: {key: statistics.median(r[key] for r in rows_)
                      for key in COLUMNS if key in rows_[0]}
               for name, rows_ in times.items()}
    every = MPI.COMM_WORLD.gather(medians, root=0)
    if rank == 0:
        slowest = {name: {key: max(m[name][key] for m in every) for key in medians[name]}
                   for name in medians}
        where = f"{world} x {torch.cuda.get_device_name()}" if gpu else f"{world} CPU ranks"
        recipe = "fp8_rowwise" + (f", dispatch_grad {dgrad}" if dgrad else "")
        lines = [f"# The backward's timeline, {recipe}, {ROWS} rows x {DIM} -> {HIDDEN}, "
                 f"{E_LOCAL} experts per rank, {where}, transport {comm.transport}", "",
                 f"ms from the backward's start (forward: from the dispatch's); median of "
                 f"{ITERS} after {WARMUP}, the slowest rank's; commit "
                 f"{os.environ.get('MXCOMM_COMMIT', 'unknown')}; counters: "
                 f"{', '.join(f'{k}={v}' for k, v in _counters(layers['overlap']).items())}",
                 "", "| variant | " + " | ".join(COLUMNS) + " |",
                 "|" + " --- |" * (len(COLUMNS) + 1)]
        for name, row in slowest.items():
            cells = [f"{row[key]:.3f}" if key in row else "" for key in COLUMNS]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print("\n".join(lines))
        if os.environ.get("PROBE_MARKDOWN"):
            with open(os.environ["PROBE_MARKDOWN"], "w") as f:
                f.write("\n".join(lines) + "\n")
    comm.close()


def _marker(clock, marks, key):
    def hook(grad):
        marks[key] = clock.mark()
    return hook


def _instrument(clock, marks):
    """Timestamps at the overlap's own points: after the dgrad's mark (on the stream
    ``grouped_mm``'s backward runs on) and around the side stream's exchange."""
    mark, run_beside = _torch_overlap._Slot.mark, _torch_overlap._Slot.run_beside

    def timed_mark(self, t, event=None):
        mark(self, t, event)
        marks.setdefault("dgrad", clock.mark())  # the first mark of a step: grouped_mm's

    def timed_run_beside(self, grad, work):
        def timed():
            marks.setdefault("exchange begin", clock.mark())
            out = work()
            marks["exchange end"] = clock.mark()
            return out
        return run_beside(self, grad, timed)

    _torch_overlap._Slot.mark = timed_mark
    _torch_overlap._Slot.run_beside = timed_run_beside


def _counters(ep):
    return {"beside": ep.overlap.beside, "behind": ep.overlap.behind}


if __name__ == "__main__":
    main()
