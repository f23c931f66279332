"""Where a pipeline step's time goes: each forward stage's enqueue time (host) and device time,
per variant and iteration, beside the backward's; then rank 0's cProfile of a variant's steps.

    mpirun -n 2 python bench/profile_step.py [rows] [variants] [profiled variant|none]
        [--dim D] [--hidden H] [--iters N] [--routing uniform|topk] [--gc on|off]

The step is the pipeline benchmark's (``python -m mxcomm.bench pipeline``: the same stages, inputs
and routing, 8 experts per rank), each iteration after a device sync and a barrier as there.
"host" is the wall clock of enqueueing a stage; "device" the CUDA-event time from the end of the
stage before (or the iteration's start) to the end of this one. Per variant it prints the median
and 90th percentile of each over the iterations (the slowest rank's), then, per rank, the
forward's stages in its three slowest and three fastest iterations: a slow mode shows up in one
stage or in all, and where a stage's device time tracks its host time the device waited for the
host.

``--pieces``: then, per variant, the same steps again with a timer around each piece of the
layout, permute and exchange stages (where it is looked up; a wrapper adds ~0.3 us per entry):
us per step of each piece, inclusive, per rank, and how often ``NcclCommunicator.wait`` slept.
"""
import argparse
import cProfile
import gc
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
args = parser.parse_args()
if args.gc == "off":
    gc.disable()
rt = _runtime.Runtime()
rt.init_torch_distributed()
run = argparse.Namespace(warmup=5, iters=args.iters, routing=args.routing)
case = _pipeline._Case(run, rt, (args.rows, args.dim, args.hidden, 8))
import torch  # noqa: E402  (after the runtime chose the device)


def event():
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def step(stage_list, host, device):
    """One synced iteration; ``host`` and ``device``: {stage: [us or ms]} appended to."""
    x = case.x.detach().clone().requires_grad_(True)
    w = case.w.detach().clone().requires_grad_(True)
    state = case._state(x, w)
    if rt.gpu:
        torch.cuda.synchronize()
    rt.barrier()
    marks = [("start", event() if rt.gpu else None)]
    for stage in stage_list:
        t = time.perf_counter()
        state.update(stage.fn(state, *(state[k] for k in stage.inputs)))
        host.setdefault(stage.name, []).append((time.perf_counter() - t) * 1e6)
        marks.append((stage.name, event() if rt.gpu else None))
    t = time.perf_counter()
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
    stage_list = _moe.stages(variant, rt.comm, case.e_local, loop_gemm=case.loop_gemm)
    lists[variant.name] = stage_list
    host, device = {}, {}
    for i in range(5 + args.iters):
        step(stage_list, host, device) if i >= 5 else step(stage_list, {}, {})
    report(variant.name, host, device)


def pieces():
    """The pieces of the host path a step goes through (module docstring, ``--pieces``), each
    as ``(owner, attribute name)``; ones an older tree lacks are skipped."""
    import mxcomm.a2a as a2a
    import mxcomm.layout as layout
    import mxcomm.permutation as permutation
    import mxcomm.route as route
    import mxcomm.torch as mxt
    from mxcomm._driver import PackedLaunch
    from mxcomm.comm import Communicator, NcclCommunicator, Plan, _ipc, _pull, _sidechannel
    from mxcomm.kernels import _launch
    return [
        (mxt, "exchange_layout"), (mxt.TensorLayout, "__new__"), (layout, "exchange_layout"),
        (layout, "_local_counts"), (layout.Layout, "__new__"), (Plan, "__init__"),
        (Plan, "transposed"), (NcclCommunicator, "wait"),
        (_sidechannel.SideChannel, "allgather_bytes"),
        (_sidechannel.SideChannel, "allgather_array"), (_sidechannel.MpiSideChannel, "wait"),
        (mxt, "permute"), (mxt._Permute, "forward"), (permutation, "_permute"),
        (permutation, "_layout_index"), (permutation, "_layout"), (permutation, "_gather"),
        (mxt, "_index_tensors"), (mxt, "_inverse_index"), (mxt, "_folds_into_dispatch"),
        (mxt, "unpermute"), (permutation, "_unpermute"),
        (mxt, "_rows"), (mxt, "_wrap"), (mxt, "_tensor"), (mxt, "_array"),
        (mxt._Alloc, "__call__"), (_launch.Kernel, "_launch"), (_launch.SizedLaunch, "__call__"),
        (PackedLaunch, "__call__"),
        (mxt, "a2a_dispatch"), (mxt, "a2a_combine"), (mxt, "_exchange"),
        (mxt, "_exchange_direct"), (mxt, "_quantized_tensor"), (a2a, "_exchange"),
        (route, "run"), (route, "staged_kept"), (route, "staged_quantized"),
        (Communicator, "exchange"), (NcclCommunicator, "_move_rows"),
        (NcclCommunicator, "_record"), (_pull.PullTransport, "run"),
        (_pull.PullTransport, "_schedule"), (_pull._Schedule, "__init__"),
        (_ipc.CudaPeerMemory, "reserve"), (_ipc.CudaPeerMemory, "begin"),
        (_ipc.CudaPeerMemory, "signal_ready"), (_ipc.CudaPeerMemory, "await_ready"),
        (_ipc.CudaPeerMemory, "copy_all"), (_ipc.CudaPeerMemory, "end"),
    ]


def instrumented(stage_list):
    """``args.iters`` steps with a timer around each piece of :func:`pieces`; prints us per step
    of each, per rank."""
    import collections
    from _pieces import Pieces
    from mxcomm.comm import _watchdog
    timers = Pieces()
    timers.wrap(pieces())
    sleeps = collections.Counter()
    real_time = _watchdog.time

    class _Time:  # NcclCommunicator.wait's sleeps, counted
        monotonic = staticmethod(real_time.monotonic)

        @staticmethod
        def sleep(s):
            sleeps[s] += 1
            real_time.sleep(s)
    _watchdog.time = _Time
    try:
        for _ in range(args.iters):
            step(stage_list, {}, {})
    finally:
        _watchdog.time = real_time
        timers.unwrap()
    lines = [f"  rank {rt.rank}: us per step (inclusive), calls per step"]
    for label, ns in sorted(timers.totals.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {label:42s} {ns / args.iters / 1e3:9.1f} "
                     f"{timers.entries[label] / args.iters:6.1f}")
    lines.append(f"    NcclCommunicator.wait slept (s: times per step): "
                 f"{ {s: n / args.iters for s, n in sorted(sleeps.items())} }")
    return lines


if args.pieces:
    for name, stage_list in lists.items():
        mine = instrumented(stage_list)
        lines = sum(rt.allgather(mine), [])
        rt.print("\n".join([f"==== {name}: the host path's pieces, {args.iters} steps"] + lines))

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
