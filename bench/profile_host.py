"""Profile the host path of layout-path calls through mxcomm.torch (rank 0's cProfile), with the
distribution of the calls' own enqueue times.

    mpirun -n 2 python bench/profile_host.py [rows] [dim] [calls] [fresh]

With ``fresh``, every call gets a new layout with other counts per peer (as in training, where the
routing changes every step); the layouts are exchanged before the profile.
"""
import cProfile
import pstats
import sys
import time

import torch

import mxcomm.comm
import mxcomm.torch as mxt
from mxcomm.bench.latency import _fresh_layouts

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
dim = int(sys.argv[2]) if len(sys.argv) > 2 else 7168
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 300
comm = mxcomm.comm.init()
torch.cuda.set_device(comm.device)
e = comm.size * 8
counts = torch.full((e,), rows // e, dtype=torch.int64, device="cuda")  # rows % e == 0 here
fresh = len(sys.argv) > 4 and sys.argv[4] == "fresh"


def layouts():
    """The same layout every call, or (fresh) a new one each call with other counts per peer
    (the latency benchmark's, ``mxcomm.bench.latency._fresh_layouts``)."""
    if not fresh:
        layout = mxt.exchange_layout(counts, comm)
        while True:
            yield layout
    yield from _fresh_layouts(mxt, comm, "cuda", rows, e, calls + 20)


x = torch.randn(rows, dim, device="cuda").to(torch.bfloat16)
y = torch.randn(2 * rows, dim, device="cuda").to(torch.bfloat16)
for name, call in (("dispatch mxfp8", lambda lay: mxt.a2a_dispatch(x, lay)),
                   ("dispatch bf16", lambda lay: mxt.a2a_dispatch(x, lay, precision="bf16")),
                   ("combine mxfp8", lambda lay: mxt.a2a_combine(y[:lay.num_received], lay,
                                                                 precision="mxfp8"))):
    it = layouts()

    def fn():
        call(next(it))
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    comm.barrier()
    profiler = cProfile.Profile()
    marks = [time.perf_counter()]
    profiler.enable()
    for _ in range(calls):
        fn()
        marks.append(time.perf_counter())
    profiler.disable()
    each = sorted((b - a) * 1e6 for a, b in zip(marks, marks[1:]))
    torch.cuda.synchronize()
    comm.barrier()
    if comm.rank == 0:
        # A call that blocks (a host sync) shows as one C function with most of the tottime;
        # Python's own overhead as many small lines.
        print(f"==== {name}{' (new layout per call)' if fresh else ''}: us per call (profiled): mean {sum(each) / calls:.1f}, min "
              f"{each[0]:.1f}, median {each[calls // 2]:.1f}, max {each[-1]:.1f}")
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(45)
comm.close()
