"""What the forward's chunked overlap could buy, measured with the public primitives before the
library builds it (issue 43; docs/design.md, "The forward, designed (not built)").

    mpirun -n W python bench/probe_chunks.py [rows] [dim] [hidden] [experts] [iterations] [chunks]

Defaults: 131072 rows per rank, 7168 -> 2048, 8 experts per rank, 20 iterations, 2 chunks. One
EP layer in the recipe ``fp8_rowwise``'s formats, through ``mxcomm.torch``'s primitives
(``exchange_layout``; ``a2a_dispatch`` fp8 rowwise with a bf16 gradient, landing in permute's
order; ``grouped_mm``; ``a2a_combine`` bf16 with an fp8 rowwise gradient), uniform routing, in
three schedules:

- ``1 chunk``: the layer as ``ExpertParallel`` runs it, every op on one stream;
- ``C chunks, 1 stream``: the rows split into C token blocks (each block's rows sorted by expert,
  as a router run per block would give them), each block a whole layer, one after another: the
  chunking's own cost, nothing overlapped;
- ``C chunks, 2 streams``: the same blocks, the exchanges on a side stream (``dispatch 0 |
  dispatch 1 | combine 0 | combine 1``, each combine waiting for its GEMM) and the GEMMs on the
  main stream (each waiting for its dispatch): block c's GEMM runs beside block c+1's dispatch
  and block c-1's combine. The backward inherits the streams (autograd runs each op's backward
  on the stream of its forward), so the combine gradients and dispatch gradients of one block
  run beside the GEMM backward of another.

Chunks by token block rather than by expert group (the design's choice, which keeps each expert's
GEMM whole): only this needs no library change. Every layout is exchanged before any data moves
(its host sync would otherwise wait for the side stream). The schedules alternate, one iteration
each after 3 warm-up rounds, each after a device sync and a barrier; CUDA events on the main
stream (on a CPU: host clocks, the wiring only). Rank 0 prints the medians of the slowest rank
and whether each schedule's outputs and input gradients equal the first's in the same iteration,
every iteration (bit for bit; else the largest difference, in how many iterations, and where the
first differing input-gradient rows lie: by token block and the rank of their expert, and the
first runs by expert with their positions), and
writes the table to
``$PROBE_MARKDOWN`` where set. ``PROBE_PEER_MEMORY=off``: the exchanges over NCCL (the grouped
transport, whose kernels hold SMs for the whole exchange) instead of peer-memory pulls (copy
engines): the GEMM's slowdown beside each. ``PROBE_CUPY_POOL=off``: CuPy's memory pool off (a
diagnostic: no block of CuPy's pool is handed out again while a stream may still use it).
``PROBE_DISPATCH_GRAD`` (default ``bf16``, the recipe's since 2026-11-28; ``mxfp8`` before),
``PROBE_COMBINE_GRAD`` (``fp8_rowwise``) and ``PROBE_GEMM`` (``fp8``, or ``bf16``: the grouped
GEMM on the dequantized rows): one step's format changed at a time, to find which step a
difference between the schedules comes from.
"""

import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

import mxcomm.comm
import mxcomm.torch as mt

ROWS, DIM, HIDDEN, E_LOCAL, ITERS, CHUNKS = (list(map(int, sys.argv[1:7])) +
                                             [131072, 7168, 2048, 8, 20, 2][len(sys.argv[1:7]):])
WARMUP = 3
ALIGN = 32


def main():
    peer = os.environ.get("PROBE_PEER_MEMORY", "auto")
    if os.environ.get("PROBE_CUPY_POOL") == "off":  # every CuPy allocation its own cudaMalloc
        import cupy
        cupy.cuda.set_allocator(None)
    comm = mxcomm.comm.init(peer_memory={"auto": None, "on": True, "off": False}[peer])
    gpu = getattr(comm, "device", None) is not None
    if gpu:
        torch.cuda.set_device(comm.device)
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    world, rank = comm.size, comm.rank
    experts = world * E_LOCAL
    if ROWS % (experts * CHUNKS):
        raise SystemExit(f"rows ({ROWS}) must be a multiple of W * E_local * chunks "
                         f"({experts * CHUNKS})")
    gen = torch.Generator(device=device).manual_seed(11 + rank)
    per = ROWS // (experts * CHUNKS)  # rows per expert and block
    # block c's rows: per rows of each expert, sorted by expert; the whole layer's rows are
    # the blocks' rows of expert 0, then expert 1, ...
    blocks = [torch.randn(ROWS // CHUNKS, DIM, generator=gen, device=device,
                          dtype=torch.bfloat16) for _ in range(CHUNKS)]
    grads = [torch.randn(ROWS // CHUNKS, HIDDEN, generator=gen, device=device,
                         dtype=torch.bfloat16) for _ in range(CHUNKS)]
    w = (torch.randn(E_LOCAL, DIM, HIDDEN, generator=gen, device=device) * DIM ** -0.5
         ).to(torch.bfloat16).requires_grad_()
    whole_x = _interleave(blocks, experts)
    whole_g = _interleave(grads, experts)
    counts_whole = torch.full((experts,), per * CHUNKS, dtype=torch.int32, device=device)
    counts_block = torch.full((experts,), per, dtype=torch.int32, device=device)
    side = torch.cuda.Stream() if gpu else None
    schedules = {
        "1 chunk": lambda: _layer([whole_x], [whole_g], counts_whole, w, comm, None),
        f"{CHUNKS} chunks, 1 stream": lambda: _layer(blocks, grads, counts_block, w, comm, None),
        f"{CHUNKS} chunks, 2 streams": lambda: _layer(blocks, grads, counts_block, w, comm, side),
    }
    times = {name: [] for name in schedules}
    diffs = {name: [0.0, 0.0] for name in schedules}  # largest |difference| from 1 chunk's
    missed = {name: 0 for name in schedules}  # iterations that differ from 1 chunk's
    where = {}  # name -> the first differing iteration's rows, by block and the expert's rank
    for i in range(WARMUP + ITERS):
        reference = None
        for name, run in schedules.items():
            if gpu:
                torch.cuda.synchronize()
            MPI.COMM_WORLD.Barrier()
            start = _mark(gpu)
            outs, dxs, fwd = run()
            end = _mark(gpu)
            if gpu:
                torch.cuda.synchronize()
            if i >= WARMUP:
                times[name].append((_ms(gpu, start, fwd), _ms(gpu, start, end)))
            got = [_interleave(t, experts) for t in (outs, dxs)]
            if reference is None:
                reference = got
                continue
            rows = [(a != b).any(dim=1) for a, b in zip(got, reference)]
            if any(bool(r.any()) for r in rows):
                missed[name] += 1
                for k, (a, b) in enumerate(zip(got, reference)):
                    diffs[name][k] = max(diffs[name][k], float((a.float() - b.float()).abs().max()))
                where.setdefault(name, (i, _rows_by_block(rows[1], experts, per)))
    medians = {name: [statistics.median(t[k] for t in rows) for k in (0, 1)]
               for name, rows in times.items()}
    every = MPI.COMM_WORLD.gather((medians, diffs, missed, where), root=0)
    if rank == 0:
        where = f"{world} x {torch.cuda.get_device_name()}" if gpu else f"{world} CPU ranks"
        lines = [f"# The forward's chunked overlap, probed: fp8_rowwise (dispatch gradient "
                 f"{DISPATCH_GRAD}, combine gradient {COMBINE_GRAD}, {'fp8' if FP8_GEMM else 'bf16'} "
                 f"GEMM), {ROWS} rows x {DIM} -> "
                 f"{HIDDEN}, {E_LOCAL} experts per rank, {where}, transport {comm.transport}", "",
                 f"ms, median of {ITERS} after {WARMUP}, the slowest rank's; commit "
                 f"{os.environ.get('MXCOMM_COMMIT', 'unknown')}", "",
                 "| schedule | forward | forward + backward | vs 1 chunk | output, input grad vs "
                 "1 chunk |", "| --- | --- | --- | --- | --- |"]
        base = max(m["1 chunk"][1] for m, *_ in every)
        for name in schedules:
            fwd = max(m[name][0] for m, *_ in every)
            both = max(m[name][1] for m, *_ in every)
            diff = [max(d[name][k] for _, d, *_ in every) for k in (0, 1)]
            same = ", ".join("equal" if x == 0 else f"max |diff| {x:.3g}" for x in diff)
            worst = max(c[name] for _, _, c, _ in every)
            if worst:
                same += f" (in {worst} of {WARMUP + ITERS} iterations on the worst rank)"
            lines.append(f"| {name} | {fwd:.3f} | {both:.3f} | {base / both:.3f}x | {same} |")
        for r, (_, _, _, w) in enumerate(every):
            for name, (i, blocks) in w.items():
                lines.append(f"- rank {r}, {name}: first difference at iteration {i}; input "
                             f"gradient rows that differ, by (block, rank of their expert): "
                             f"{blocks[0]}; the first runs (block, expert, rows, first and last "
                             f"position in the run): {blocks[1]}")
        print("\n".join(lines))
        if os.environ.get("PROBE_MARKDOWN"):
            with open(os.environ["PROBE_MARKDOWN"], "w") as f:
                f.write("\n".join(lines) + "\n")
    comm.close()


def _layer(xs, grads, counts, w, comm, side):
    """Forward and backward of the blocks ``xs``: one after another (``side`` None), or overlapped
    on ``side`` and the current stream. Returns (outputs, the forward's end mark)."""
    gpu = side is not None or xs[0].is_cuda
    inputs = [x.detach().requires_grad_() for x in xs]
    w.grad = None
    layouts = [mt.exchange_layout(counts, comm) for _ in xs]  # every host sync first
    if side is None:
        outs = []
        for x, layout in zip(inputs, layouts):
            rows, _, offs = _dispatch(x, layout)
            outs.append(_combine(_gemm(rows, w, offs), layout))
    else:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        dispatched, landed, outs = [], [], []
        with torch.cuda.stream(side):
            for x, layout in zip(inputs, layouts):
                dispatched.append(_dispatch(x, layout))
                landed.append(_record(side))
        ys, done = [], []
        for (rows, _, offs), event in zip(dispatched, landed):
            main.wait_event(event)
            ys.append(_gemm(rows, w, offs))
            done.append(_record(main))
        with torch.cuda.stream(side):
            for y, event, layout in zip(ys, done, layouts):
                side.wait_event(event)
                outs.append(_combine(y, layout))
        main.wait_stream(side)
    fwd = _mark(gpu)
    torch.autograd.backward(outs, grads)
    if side is not None:  # the backward's side-stream work (its exchanges) ends the step too
        torch.cuda.current_stream().wait_stream(side)
    return [o.detach() for o in outs], [x.grad for x in inputs], fwd


# the path's formats and GEMM, each changeable to find which step a difference comes from
DISPATCH_GRAD = os.environ.get("PROBE_DISPATCH_GRAD", "bf16")
COMBINE_GRAD = os.environ.get("PROBE_COMBINE_GRAD", "fp8_rowwise")
FP8_GEMM = os.environ.get("PROBE_GEMM", "fp8") == "fp8"


def _dispatch(x, layout):
    return mt.a2a_dispatch(x, layout, precision="fp8_rowwise", grad_precision=DISPATCH_GRAD,
                           permute_align=ALIGN)


def _gemm(rows, w, offs):
    return mt.grouped_mm(rows, w, offs) if FP8_GEMM else mt.grouped_mm(rows, w, offs, fp8=False)


def _combine(y, layout):
    return mt.a2a_combine(y, layout, precision="bf16", grad_precision=COMBINE_GRAD,
                          permute_align=ALIGN)


def _interleave(blocks, experts):
    """The whole layer's rows, sorted by expert, from blocks each sorted by expert (equal runs)."""
    if len(blocks) == 1:
        return blocks[0]
    runs = [b.view(experts, -1, b.shape[-1]) for b in blocks]
    return torch.cat(runs, dim=1).reshape(-1, blocks[0].shape[-1])


def _rows_by_block(differ, experts, per):
    """Where the boolean (rows,) ``differ`` (the whole layer's order: expert-major, each expert's
    rows block after block) is set: ``{(block, rank of the expert): rows}``, then the first 8
    (block, expert) runs as ``(block, expert, rows, first and last position in the run)``."""
    runs = differ.view(experts, CHUNKS, per)
    counts = runs.sum(dim=2).view(-1, E_LOCAL, CHUNKS).sum(dim=1)
    by_rank = {(c, r): int(counts[r, c]) for r in range(counts.shape[0]) for c in range(CHUNKS)
               if int(counts[r, c])}
    detail = []
    for e, c in runs.any(dim=2).nonzero().tolist()[:8]:
        at = runs[e, c].nonzero().flatten()
        detail.append((c, e, int(at.numel()), int(at[0]), int(at[-1])))
    return by_rank, detail


def _record(stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _mark(gpu):
    if not gpu:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _ms(gpu, start, end):
    return start.elapsed_time(end) if gpu else (end - start) * 1e3


if __name__ == "__main__":
    main()
