"""Where the host time of one layout-path call goes (GPU only, any number of ranks).

    mpirun -n W python bench/probe_host.py [rows] [dim] [calls]
    PROBE_CASES=mxfp8 ...: only the calls whose label contains it (with ranks sharing a GPU and
    nccl_init='lazy', the bf16 calls would need NCCL, which refuses that)
    PROBE_ABLATIONS=0: without the ablations (below)

For each call (array API and ``mxcomm.torch``, MXFP8 and bf16, dispatch and combine, given the
layout): the host time per call of ``calls`` calls enqueued back to back (wall clock, no profiler,
after warm-up), the Python function calls per call (``sys.setprofile``, a separate pass), and a
profiled pass (``_pieces.pieces``: cProfile's inclusive time of every library function entered,
about 0.5 us added per entry, so the pieces add up to a little more than the plain time). Then the
host cost of the CuPy, runtime and driver primitives the path is made of. Then ablations: the torch
calls' plain host time with one piece at a time replaced by a no-op (the driver's launch, the
QuantizedTensor, autograd's ``apply``, Python's garbage collector), then all of them, at the given
rows and at 1/16 of them, interleaved over PROBE_ROUNDS rounds (default 7): what each piece costs
inside the whole call, without timers. Rank 0 prints; bench/NOTES.md says what it found.
"""

import collections
import os
import statistics
import sys
import time

import cupy
import numpy
import torch

import mxcomm
import mxcomm.comm
import mxcomm.formats
import mxcomm.torch as mxt
from _pieces import pieces  # bench/, beside this script
from mxcomm._driver import PackedLaunch

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
dim = int(sys.argv[2]) if len(sys.argv) > 2 else 7168
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 300

comm = mxcomm.comm.init()
torch.cuda.set_device(comm.device)
cupy.cuda.Device(comm.device).use()
experts = comm.size * 8
out = print if comm.rank == 0 else (lambda *a, **k: None)
out(f"probe_host: {comm.size} ranks, {rows} x {dim} rows per rank, transport {comm.transport}, "
    f"{calls} calls per case")

counts_t = torch.full((experts,), rows // experts, dtype=torch.int64, device="cuda")
layout_t = mxt.exchange_layout(counts_t, comm)
counts_c = cupy.full((experts,), rows // experts, dtype=cupy.int32)
layout_c = mxcomm.exchange_layout(counts_c, comm)
x_t = torch.randn(rows, dim, device="cuda").to(torch.bfloat16)
x_c = cupy.from_dlpack(x_t)
y_t = torch.randn(layout_t.num_received, dim, device="cuda").to(torch.bfloat16)
y_c = cupy.from_dlpack(y_t)

cases = {
    "array dispatch mxfp8": lambda: mxcomm.a2a_dispatch(x_c, layout_c),
    "array dispatch bf16": lambda: mxcomm.a2a_dispatch(x_c, layout_c, precision="bf16"),
    "array combine mxfp8": lambda: mxcomm.a2a_combine(y_c, layout_c, precision="mxfp8"),
    "array combine bf16": lambda: mxcomm.a2a_combine(y_c, layout_c),
    "torch dispatch mxfp8": lambda: mxt.a2a_dispatch(x_t, layout_t),
    "torch dispatch bf16": lambda: mxt.a2a_dispatch(x_t, layout_t, precision="bf16"),
    "torch combine mxfp8": lambda: mxt.a2a_combine(y_t, layout_t, precision="mxfp8"),
    "torch combine bf16": lambda: mxt.a2a_combine(y_t, layout_t),
}


only = os.environ.get("PROBE_CASES")  # e.g. "mxfp8": the calls whose label contains it
if only:
    cases = {label: fn for label, fn in cases.items() if only in label}


def sync():
    torch.cuda.synchronize()
    comm.barrier()


def host_us(fn, n):
    """Host us per call, n calls back to back, median of 3 repeats."""
    times = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    sync()
    return statistics.median(times)


def single_us(fn, n=100):
    """Host us of one call enqueued on an idle device (after a sync and a barrier), median of
    ``n``: the host cost where back-to-back calls are held up by the device (two ranks
    time-slicing one GPU)."""
    times = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return statistics.median(times)


def python_calls(fn, n=20):
    """Python-level and C-level calls per call (sys.setprofile)."""
    tally = collections.Counter()

    def profile(frame, event, arg):
        tally[event] += 1
    sync()
    sys.setprofile(profile)
    for _ in range(n):
        fn()
    sys.setprofile(None)
    sync()
    return tally["call"] / n, tally["c_call"] / n


for label, fn in cases.items():
    for _ in range(20):
        fn()
    plain = host_us(fn, calls)
    single = single_us(fn)
    py, c = python_calls(fn)
    sync()
    timed = pieces(fn, calls)
    sync()
    out(f"\n=== {label}: {plain:.1f} us per call (plain); {py:.0f} Python calls + {c:.0f} C "
        f"calls per call; {single:.1f} us alone on an idle device")
    for piece, us, entries in timed:
        out(f"  {piece:60s} {us:8.2f} us/call  {entries:5.1f} x")

# ---------------------------------------------------------------------------- primitives
rt = cupy.cuda.runtime
stream = cupy.cuda.get_current_stream()
side = cupy.cuda.Stream(non_blocking=True)
event = rt.eventCreateWithFlags(2)
mem = cupy.cuda.memory.Memory(1 << 20)
a = cupy.empty((rows, dim), dtype=cupy.uint8)
t = torch.empty(rows, dim, dtype=torch.bfloat16, device="cuda")


def per_call(fn, n=2000):
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


nop = cupy.RawKernel('extern "C" __global__ void nop(unsigned long long a) {}', "nop")
nop_launch = PackedLaunch(nop.kernel, "Q")

class _Two(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, call):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Eight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b, c, d, e, f, g):
        return x

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * 7


t_grad = torch.empty(rows, dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
fp8 = torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device="cuda")
nccl_comm = comm.nccl_comm()
nccl_mod = cupy.cuda.nccl


def _empty_group():
    nccl_mod.groupStart()
    nccl_mod.groupEnd()


prims = {
    "autograd Function.apply, 2 arguments": lambda: _Two.apply(t_grad, (1, 2, 3, 4, 5, 6, 7)),
    "autograd Function.apply, 8 arguments": lambda: _Eight.apply(t_grad, 1, 2, 3, 4, 5, 6, 7),
    "QuantizedTensor unchecked, its scales from torch.empty": lambda: mxt._quantized_tensor(
        fp8, torch.empty(rows, dim // 32, dtype=torch.float8_e8m0fnu, device="cuda"),
        mxcomm.formats.get_format("mxfp8")),
    "tensor.data_ptr()": t.data_ptr,
    "NCCL groupStart + groupEnd, empty": _empty_group,
    "PackedLaunch of an empty kernel": lambda: nop_launch(1, 32, stream.ptr, (0,)),
    "cupy.empty((rows, dim), uint8)": lambda: cupy.empty((rows, dim), dtype=cupy.uint8),
    "cupy.ndarray view on a Memory": lambda: cupy.ndarray(
        (rows, dim), dtype=cupy.uint8, memptr=cupy.cuda.memory.MemoryPointer(mem, 0)),
    "a[i:j] (2-D slice)": lambda: a[10:200],
    "a.reshape(-1).view(uint64)": lambda: a.reshape(-1).view(numpy.uint64),
    "a.data.ptr": lambda: a.data.ptr,
    "a.flags.c_contiguous": lambda: a.flags.c_contiguous,
    "runtime.eventRecord": lambda: rt.eventRecord(event, stream.ptr),
    "runtime.streamWaitEvent": lambda: rt.streamWaitEvent(side.ptr, event, 0),
    "runtime.streamIsCapturing": lambda: rt.streamIsCapturing(stream.ptr),
    "runtime.memcpyAsync 256 B": lambda: rt.memcpyAsync(mem.ptr, mem.ptr + 4096, 256, 4,
                                                        stream.ptr),
    "runtime.memcpyAsync 256 B, device to device": lambda: rt.memcpyAsync(
        mem.ptr, mem.ptr + 4096, 256, 3, stream.ptr),
    "cupy.cuda.get_current_stream()": cupy.cuda.get_current_stream,
    "torch.cuda.current_stream()": torch.cuda.current_stream,
    "cupy.from_dlpack(torch tensor)": lambda: cupy.from_dlpack(t),
    "torch.from_dlpack(cupy array)": lambda: torch.from_dlpack(a),
    "torch.empty((rows, dim), bf16, cuda)": lambda: torch.empty(rows, dim, dtype=torch.bfloat16,
                                                               device="cuda"),
}
out("\n=== primitives (us per call)")
for label, fn in prims.items():
    out(f"  {label:45s} {per_call(fn):8.2f}")


# ---------------------------------------------------------------------------- ablations
# The plain host time of the torch layout-path calls with pieces replaced by no-ops, one piece
# at a time, then all of them: what each piece costs inside the whole call (no timers), and what
# is left. The results are wrong while a piece is off; nothing reads them. The variants run
# interleaved, PROBE_ROUNDS rounds of each (these hosts drift by tens of us between runs of the
# same code), and each piece's cost is the median over rounds of its difference to the plain
# call of the same round. Also at a row count whose device work is far below the host's.
def ablations():
    import gc

    class _Ctx:  # what the exchange Functions' forward uses of autograd's context
        def mark_non_differentiable(self, *tensors):
            pass

    def launch_without_driver(self, grid, block, stream, values, shared=0):
        self._pack_into(self._buffer, 0, *values)

    def apply_without_autograd(cls, x, call):
        return cls.forward(_Ctx(), x, call)

    class _NoGC:  # a patch target whose setattr switches Python's cyclic garbage collector
        pass

    ablated = {
        "driver's kernel launch": [(PackedLaunch, "__call__", launch_without_driver)],
        "QuantizedTensor": [(mxt, "_quantized_tensor",
                             lambda data, scales, fmt, cls=None, requires_grad=False: data)],
        "autograd Function.apply": [(mxt._A2A, "apply", classmethod(apply_without_autograd))],
        "Python's garbage collector": [(_NoGC, "off", True)],
    }
    ablated["all of the above"] = [p for patch in list(ablated.values()) for p in patch]
    missing = object()

    def patched(patch, fn, n):
        saved = []  # (owner, name, its own value or `missing`: inherited, deleted after)
        for owner, name, _ in patch:
            own = getattr(owner, "__dict__", None)  # None: an instance with __slots__
            saved.append((owner, name, getattr(owner, name) if own is None
                          else own.get(name, missing)))
        try:
            for owner, name, value in patch:
                setattr(owner, name, value)
            if getattr(_NoGC, "off", False):
                gc.disable()
            for _ in range(10):
                fn()
            return host_us(fn, n)
        finally:
            gc.enable()
            for owner, name, value in reversed(saved):
                if value is missing:
                    delattr(owner, name)
                else:
                    setattr(owner, name, value)

    rounds = int(os.environ.get("PROBE_ROUNDS", "7"))
    n = max(30, calls // 3)
    small_rows = max(comm.size * 8, rows // 16)
    counts_s = torch.full((experts,), small_rows // experts, dtype=torch.int64, device="cuda")
    layout_s = mxt.exchange_layout(counts_s, comm)
    x_s = torch.randn(layout_s.dispatch_plan.rows_sent, dim, device="cuda").to(torch.bfloat16)
    y_s = torch.randn(layout_s.num_received, dim, device="cuda").to(torch.bfloat16)
    variants = {"(none)": []}
    variants.update(ablated)
    for size, (x, y, lay) in ((rows, (x_t, y_t, layout_t)),
                              (layout_s.dispatch_plan.rows_sent, (x_s, y_s, layout_s))):
        calls_ = {
            "dispatch mxfp8": lambda: mxt.a2a_dispatch(x, lay),
            "dispatch bf16": lambda: mxt.a2a_dispatch(x, lay, precision="bf16"),
            "combine mxfp8": lambda: mxt.a2a_combine(y, lay, precision="mxfp8"),
            "combine bf16": lambda: mxt.a2a_combine(y, lay),
        }
        got = {(v, c): [] for v in variants for c in calls_}
        for _ in range(rounds):
            for label, patch in variants.items():
                for c, fn in calls_.items():
                    got[label, c].append(patched(patch, fn, n))
        out(f"\n=== ablations, {size} x {dim} rows per rank: torch layout-path host us per call "
            f"({n} calls back to back, median of 3) with one piece a no-op; the median over "
            f"{rounds} interleaved rounds, and (in brackets) the median of its difference to "
            f"the plain call of the same round")
        out(f"  {'piece off':42s}" + "".join(f"{c:>17s}" for c in calls_))
        for label in variants:
            cells = []
            for c in calls_:
                value = statistics.median(got[label, c])
                if label == "(none)":
                    cells.append(f"{value:17.1f}")
                    continue
                change = statistics.median(a - b for a, b in zip(got[label, c],
                                                                 got["(none)", c]))
                cells.append(f"{value:9.1f} ({change:+6.1f})")
            out(f"  {label:42s}" + "".join(cells))


if os.environ.get("PROBE_ABLATIONS", "1") != "0":
    ablations()
sync()
comm.close()
