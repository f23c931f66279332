"""Host time of what a new layout costs (GPU only): the layout exchange and the first permute.

    mpirun -n W python bench/probe_layout.py [rows] [dim] [steps]

Per step, a new layout (counts drawn per step, ``rows`` per rank over 8 experts per rank):
- ``exchange_layout, idle device``: ``mxcomm.torch.exchange_layout`` after a device sync and a
  barrier (the pipeline benchmark's step starts so);
- ``exchange_layout after a busy kernel``: enqueued right after a kernel that keeps the device busy
  for ``BUSY_US`` (default 500) us, as in training, where the counts come at the end of the work
  before: the host time from the kernel's enqueue to the layout, minus the kernel's device time
  (CUDA events): what the host read of the counts adds beyond the work it waits for;
- ``permute, new layout`` / ``permute, same layout``: ``mxcomm.torch.permute`` of bf16 rows with
  the step's layout (the first call builds the index) and again (cached);
- ``unpermute``: ``mxcomm.torch.unpermute`` with the layout.
Medians over ``steps`` steps, the slowest rank's; rank 0 prints.
"""

import os
import statistics
import sys
import time

import numpy
import torch

import mxcomm.comm
import mxcomm.torch as mxt

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
dim = int(sys.argv[2]) if len(sys.argv) > 2 else 7168
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 50
busy_us = float(os.environ.get("BUSY_US", 500))

comm = mxcomm.comm.init()
torch.cuda.set_device(comm.device)
experts = 8 * comm.size
rng = numpy.random.default_rng(comm.rank)
x = torch.randn(rows + rows // 2, dim, device="cuda").to(torch.bfloat16)


def counts_of(step):
    c = rng.multinomial(rows, numpy.full(experts, 1 / experts))
    return torch.from_numpy(c).to("cuda")


def sync():
    torch.cuda.synchronize()
    comm.barrier()


# the busy kernel: torch.cuda._sleep(cycles), calibrated to busy_us
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
cycles = 100000
for _ in range(3):
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    cycles = int(cycles * busy_us / 1e3 / start.elapsed_time(end))

times = {k: [] for k in ("exchange_layout, idle device", "exchange_layout after a busy kernel",
                         "permute, new layout", "permute, same layout", "unpermute")}
for step in range(steps + 5):
    counts = counts_of(step)
    sync()
    t0 = time.perf_counter()
    layout = mxt.exchange_layout(counts, comm)
    idle = (time.perf_counter() - t0) * 1e6
    h = x[:layout.num_received]
    t0 = time.perf_counter()
    p, indices, _ = mxt.permute(h, layout, align=32)
    first = (time.perf_counter() - t0) * 1e6
    t0 = time.perf_counter()
    mxt.permute(h, layout, align=32)
    again = (time.perf_counter() - t0) * 1e6
    t0 = time.perf_counter()
    mxt.unpermute(p, indices, layout)
    back = (time.perf_counter() - t0) * 1e6
    counts = counts_of(step)
    sync()
    t0 = time.perf_counter()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    mxt.exchange_layout(counts, comm)
    busy = (time.perf_counter() - t0) * 1e6 - start.elapsed_time(end) * 1e3
    if step >= 5:
        for k, v in zip(times, (idle, busy, first, again, back)):
            times[k].append(v)

medians = [statistics.median(v) for v in times.values()]
worst = comm.allgather(numpy.array(medians), "probe").max(axis=0)
if comm.rank == 0:
    print(f"probe_layout: {comm.size} ranks, {rows} rows per rank, {experts} experts, D = {dim}, "
          f"{steps} steps, busy kernel {busy_us:g} us; host us, median, slowest rank")
    for k, v in zip(times, worst):
        print(f"  {k:40s} {v:9.1f}")
comm.close()
