"""Where a pipeline step's host time goes: each forward stage's enqueue time and the backward's,
per variant, beside the step's device time; then rank 0's cProfile of a variant's steps.

    mpirun -n 2 python bench/profile_step.py [rows] [variants] [profiled variant]

The step is the pipeline benchmark's (``python -m mxcomm.bench pipeline``: the same stages, inputs
and routing, D = 7168, H = 2048, 8 experts per rank, uniform routing), each iteration after a device
sync and a barrier as there. "host" is the wall clock of enqueueing (the median over iterations);
where the device waits for the host, the step's device time is the host's.
"""
import argparse
import cProfile
import pstats
import time

import numpy

from mxcomm.bench import _moe, _runtime
from mxcomm.bench import pipeline as _pipeline

parser = argparse.ArgumentParser()
parser.add_argument("rows", type=int, nargs="?", default=4096)
parser.add_argument("variants", nargs="?", default="mxfp8")
parser.add_argument("profiled", nargs="?", default="mxfp8")
parser.add_argument("--iters", type=int, default=30)
parser.add_argument("--routing", default="uniform")
args = parser.parse_args()
rt = _runtime.Runtime()
rt.init_torch_distributed()
run = argparse.Namespace(warmup=5, iters=args.iters, routing=args.routing)
case = _pipeline._Case(run, rt, (args.rows, 7168, 2048, 8))
import torch  # noqa: E402  (after the runtime chose the device)


def step(stage_list, timed):
    """One synced iteration; ``timed``: {stage: [host us]} filled."""
    x = case.x.detach().clone().requires_grad_(True)
    w = case.w.detach().clone().requires_grad_(True)
    state = case._state(x, w)
    if rt.gpu:
        torch.cuda.synchronize()
    rt.barrier()
    start = torch.cuda.Event(enable_timing=True) if rt.gpu else None
    middle = torch.cuda.Event(enable_timing=True) if rt.gpu else None
    end = torch.cuda.Event(enable_timing=True) if rt.gpu else None
    if rt.gpu:
        start.record()
    for stage in stage_list:
        t = time.perf_counter()
        state.update(stage.fn(state, *(state[k] for k in stage.inputs)))
        timed.setdefault(stage.name, []).append((time.perf_counter() - t) * 1e6)
    if rt.gpu:
        middle.record()
    t = time.perf_counter()
    state["out"].backward(case.grad_out)
    timed.setdefault("backward (all)", []).append((time.perf_counter() - t) * 1e6)
    if rt.gpu:
        end.record()
        end.synchronize()
        timed.setdefault("device fwd ms", []).append(start.elapsed_time(middle))
        timed.setdefault("device bwd ms", []).append(middle.elapsed_time(end))


lists = {}
for variant in _pipeline.parse_variants(args.variants):
    stage_list = _moe.stages(variant, rt.comm, case.e_local, loop_gemm=case.loop_gemm)
    lists[variant.name] = stage_list
    timed = {}
    for i in range(5 + args.iters):
        step(stage_list, timed if i >= 5 else {})
    medians = {k: float(numpy.median(v)) for k, v in timed.items()}
    worst = rt.allreduce_max(list(medians.values()))
    if rt.rank == 0:
        print(f"==== {variant.name}, {args.rows} rows per rank, {rt.size} ranks: host us per stage "
              f"(median of {args.iters}, slowest rank)")
        for (name, _), value in zip(medians.items(), worst):
            print(f"  {name:24s} {value:10.1f}")

profiled = lists.get(args.profiled)
if profiled is not None:
    profiler = cProfile.Profile()
    for i in range(5 + args.iters):
        if i == 5:
            profiler.enable()
        step(profiled, {})
    profiler.disable()
    if rt.rank == 0:
        print(f"==== cProfile of {args.iters} {args.profiled} steps (rank 0)")
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(60)
rt.barrier()
