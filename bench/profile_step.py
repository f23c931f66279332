"""Where a pipeline step's time goes: each forward stage's enqueue time (host) and device time,
per variant and iteration, beside the backward's; then rank 0's cProfile of a variant's steps.

    mpirun -n 2 python bench/profile_step.py [rows] [variants] [profiled variant|none]
        [--dim D] [--hidden H] [--iters N] [--routing uniform|topk] [--gc on|off]
        [--peer-memory auto|on|off] [--pieces] [--trace DIR [--trace-steps N]]

The step is the pipeline benchmark's (``python -m mxcomm.bench pipeline``: the same stages, inputs
and routing, 8 experts per rank), each iteration after a device sync and a barrier as there.
"host" is the wall clock of enqueueing a stage; "device" the CUDA-event time from the end of the
stage before (or the iteration's start) to the end of this one. Per variant it prints the median
and 90th percentile of each over the iterations (the slowest rank's), then, per rank, the
forward's stages in its three slowest and three fastest iterations: a slow mode shows up in one
stage or in all, and where a stage's device time tracks its host time the device waited for the
host.

``--trace DIR``: then, per variant, ``--trace-steps`` steps under torch.profiler (CPU and CUDA
activity): rank r's chrome trace in ``DIR/trace_<variant>_r<r>.json.gz`` (perfetto opens it), and
per rank the last step's forward and backward as timelines (``_timeline.timeline``: each
stage's host and device spans, the device's idle time waiting for the host or on a stream, event
or peer, the host's synchronizations, every device operation with its launch).

``--pieces``: then, per variant, the same steps again under cProfile: us per step of each library
function entered (and ``time.sleep``), inclusive, and its calls per step, per rank.
"""
import argparse
import contextlib
import cProfile
import gc
import gzip
import json
import os
import pstats
import time

import numpy

from mxcomm.bench import _moe, _runtime
from mxcomm.bench import pipeline as _pipeline

parser = argparse.ArgumentParser()
parser.add_argument("rows", type=int, nargs="?", default=4096)
parser.add_argument("variants", nargs="?", default="mxfp8")
parser.add_argument("profiled", nargs="?", default="mxfp8")
parser.add_argument("--dim", type=int, default=7168)
parser.add_argument("--hidden", type=int, default=2048)
parser.add_argument("--iters", type=int, default=30)
parser.add_argument("--routing", default="uniform")
parser.add_argument("--gc", choices=("on", "off"), default="on")
parser.add_argument("--pieces", action="store_true")
parser.add_argument("--peer-memory", choices=("auto", "on", "off"), default="auto")
parser.add_argument("--trace", metavar="DIR")
parser.add_argument("--trace-steps", type=int, default=3)
args = parser.parse_args()
if args.gc == "off":
    gc.disable()
rt = _runtime.Runtime(peer_memory={"auto": None, "on": True, "off": False}[args.peer_memory])
rt.init_torch_distributed()
run = argparse.Namespace(warmup=5, iters=args.iters, routing=args.routing)
case = _pipeline._Case(run, rt, (args.rows, args.dim, args.hidden, 8))
import torch  # noqa: E402  (after the runtime chose the device)


def event():
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def step(stage_list, host, device, mark=lambda name: contextlib.nullcontext()):
    """One synced iteration; ``host`` and ``device``: {stage: [us or ms]} appended to; ``mark``:
    a context manager per name, around the forward and each stage (``--trace``'s annotations)."""
    x = case.x.detach().clone().requires_grad_(True)
    w = case.w.detach().clone().requires_grad_(True)
    state = case._state(x, w)
    if rt.gpu:
        torch.cuda.synchronize()
    rt.barrier()
    marks = [("start", event() if rt.gpu else None)]
    with mark("forward"):
        for stage in stage_list:
            t = time.perf_counter()
            with mark("stage:" + stage.name):
                state.update(stage.fn(state, *(state[k] for k in stage.inputs)))
            host.setdefault(stage.name, []).append((time.perf_counter() - t) * 1e6)
            marks.append((stage.name, event() if rt.gpu else None))
    t = time.perf_counter()
    with mark("backward"):
        state["out"].backward(case.grad_out)
    host.setdefault("backward", []).append((time.perf_counter() - t) * 1e6)
    if not rt.gpu:
        return
    marks.append(("backward", event()))
    marks[-1][1].synchronize()
    for (_, a), (name, b) in zip(marks, marks[1:]):
        device.setdefault(name, []).append(a.elapsed_time(b))
    device.setdefault("forward", []).append(marks[0][1].elapsed_time(marks[-2][1]))


def report(name, host, device):
    keys = list(device) if rt.gpu else []
    stats = []
    for k in host:
        stats += [numpy.median(host[k]), numpy.percentile(host[k], 90)]
    for k in keys:
        stats += [numpy.median(device[k]), numpy.percentile(device[k], 90)]
    worst = rt.allreduce_max([float(v) for v in stats])
    lines = [f"==== {name}, {args.rows}x{args.dim}->{args.hidden} rows per rank, {rt.size} ranks, "
             f"gc {args.gc}: median / p90 of {args.iters} iterations, slowest rank"]
    for i, k in enumerate(host):
        lines.append(f"  host us   {k:16s} {worst[2 * i]:10.1f} {worst[2 * i + 1]:10.1f}")
    off = 2 * len(host)
    for i, k in enumerate(keys):
        lines.append(f"  device ms {k:16s} {worst[off + 2 * i]:10.3f} "
                     f"{worst[off + 2 * i + 1]:10.3f}")
    if rt.gpu:  # per rank: the forward's stages in the slowest and fastest iterations
        order = numpy.argsort(device["forward"])
        stages = [k for k in keys if k not in ("backward", "forward")]
        mine = [f"  rank {rt.rank} iterations (forward ms | device ms per stage | host us per "
                f"stage), stages {' '.join(stages)}"]
        for i in list(order[-3:][::-1]) + list(order[:3]):
            dev = " ".join(f"{device[k][i]:.3f}" for k in stages)
            hst = " ".join(f"{host[k][i]:.0f}" for k in stages)
            mine.append(f"    it {i:3d} fwd {device['forward'][i]:.3f} | {dev} | {hst}")
        lines += sum(rt.allgather(mine), [])
    else:
        rt.allgather([])
    rt.print("\n".join(lines))


lists = {}
for variant in _pipeline.parse_variants(args.variants):
    # a recipe as the pipeline runs it on these nodes (its dispatch gradient across nodes)
    variant = _moe.resolve(variant, None, 0, 0, None, None, rt.comm.node_count)
    stage_list = _moe.stages(variant, rt.comm, case.e_local, loop_gemm=case.loop_gemm)
    lists[variant.name] = stage_list
    host, device = {}, {}
    for i in range(5 + args.iters):
        step(stage_list, host, device) if i >= 5 else step(stage_list, {}, {})
    report(variant.name, host, device)


def instrumented(stage_list):
    """``args.iters`` steps under cProfile (``_pieces.pieces``); the us per step of each library
    function entered, inclusive, and its calls per step, per rank."""
    from _pieces import pieces
    timed = pieces(lambda: step(stage_list, {}, {}), args.iters)
    lines = [f"  rank {rt.rank}: us per step (inclusive), calls per step"]
    for label, us, entries in timed:
        lines.append(f"    {label:60s} {us:9.1f} {entries:6.1f}")
    return lines


if args.pieces:
    for name, stage_list in lists.items():
        mine = instrumented(stage_list)
        lines = sum(rt.allgather(mine), [])
        rt.print("\n".join([f"==== {name}: the host path's pieces, {args.iters} steps"] + lines))

def traced(name, stage_list):
    """``args.trace_steps`` steps under torch.profiler; this rank's trace written, its last
    step's forward and backward timelines returned as lines."""
    from _timeline import timeline
    activities = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if rt.gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.trace_steps):
            step(stage_list, {}, {}, mark=torch.profiler.record_function)
    path = os.path.join(args.trace, f"trace_{name}_r{rt.rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(path)
    return [f"  rank {rt.rank}: " + line
            for phase in ("forward", "backward") for line in timeline(events, phase)]


if args.trace:
    os.makedirs(args.trace, exist_ok=True)
    for name, stage_list in lists.items():
        lines = sum(rt.allgather(traced(name, stage_list)), [])
        rt.print("\n".join([f"==== {name}: the last of {args.trace_steps} traced steps, forward "
                            f"and backward (us from each one's start)"] + lines))

profiled = lists.get(args.profiled)
if profiled is not None:
    profiler = cProfile.Profile()
    for i in range(5 + args.iters):
        if i == 5:
            profiler.enable()
        step(profiled, {}, {})
    profiler.disable()
    if rt.rank == 0:
        print(f"==== cProfile of {args.iters} {args.profiled} steps (rank 0)")
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(60)
rt.barrier()
