"""Bytes for bytes: mxcomm's exchanges against torch's ``all_to_all_single`` moving the same bytes
(GPU only; issue 43: across emulated nodes the pipeline's fp8 exchanges took 10-22 % longer than
torch's bf16 exchange scaled by bytes).

    mpirun -n W python bench/probe_wire.py [--rows 16384 131072] [--iters 10] [--peer-memory auto]

The pipeline's shapes (D 7168, H 2048, 8 experts, uniform counts, groups padded to 32 rows), one
mxcomm communicator, forward only. Per size, interleaved (each iteration runs every variant once,
CUDA events around each call on torch's current stream, back to back), median over iterations,
the slowest rank's:

- ``torch bf16 x``: ``all_to_all_single`` of the (M, D) bf16 rows: the pipeline's bf16 dispatch;
- ``torch bytes of fp8_rowwise x``: the same splits, uint8 rows of fp8_rowwise's bytes (D + 4);
- ``comm.alltoallv bytes of fp8_rowwise x``: those uint8 rows through the communicator's NCCL group
  (into a given array, or into one it allocates), and through ``alltoallv_plan`` with and without
  the call header (eight words each rank sends each peer before the rows);
- ``mxcomm bf16 dispatch``: ``a2a_dispatch(x, layout, "bf16")`` (torch bf16 x's bytes);
- ``mxcomm fp8_rowwise dispatch`` and ``..., permute_align 32`` (the pipeline's fused dispatch);
- ``torch bf16 u`` / ``mxcomm bf16 combine`` / ``..., permute_align 32``: the combine's (M, H) rows.

Rank 0 prints a Markdown table, with each time over its torch row of the same bytes.
"""

import argparse
import statistics

import numpy
import torch
import torch.distributed as dist

import mxcomm.comm
import mxcomm.torch as mxt

p = argparse.ArgumentParser()
p.add_argument("--rows", type=int, nargs="+", default=[16384, 131072])
p.add_argument("--iters", type=int, default=10)
p.add_argument("--peer-memory", choices=["auto", "on", "off"], default="auto")
args = p.parse_args()

D, H, E, ALIGN = 7168, 2048, 8, 32
comm = mxcomm.comm.init(peer_memory={"auto": None, "on": True, "off": False}[args.peer_memory])
torch.cuda.set_device(comm.device)


def _init():
    import os
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=comm.rank, world_size=comm.size,
                            device_id=torch.device("cuda", torch.cuda.current_device()))


_init()
W = comm.size
stream = torch.cuda.current_stream()


def torch_a2a(t, out, send, recv):
    dist.all_to_all_single(out, t, recv, send)


calls = [0]


def plan_call(cb, chb, send, header):
    """``comm.alltoallv_plan`` of uniform counts (every rank sends ``send``), with the call header
    (a plan with a layout number and a call number, as a layout's exchanges) or without."""
    plan = mxcomm.comm.Plan(comm.rank, [list(send)] * W)
    if header:
        calls[0] += 1
        plan.generation, plan.calls = 1 << 20, calls[0]
    else:
        plan.calls = None
    comm.alltoallv_plan((cb,), (chb,), plan, stream.cuda_stream)


def variants(M):
    counts = torch.full((E,), M // E, dtype=torch.int32, device="cuda")
    layout = mxt.exchange_layout(counts, comm)
    _, send, recv = layout
    send, recv = [int(v) for v in send], [int(v) for v in recv]
    n_recv = sum(recv)
    x = torch.randn(M, D, device="cuda").to(torch.bfloat16)
    hx = torch.empty(n_recv, D, dtype=torch.bfloat16, device="cuda")
    row8 = D + 4  # fp8_rowwise: e4m3 elements and one fp32 scale a row
    b = torch.randint(0, 255, (M, row8), dtype=torch.uint8, device="cuda")
    hb = torch.empty(n_recv, row8, dtype=torch.uint8, device="cuda")
    p_rows, _, _ = mxt.a2a_dispatch(x, layout, precision="bf16", permute_align=ALIGN)
    u = torch.randn(n_recv, H, device="cuda").to(torch.bfloat16)
    y_ = torch.randn(p_rows.shape[0], H, device="cuda").to(torch.bfloat16)
    out_u = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
    import cupy
    cb, chb = cupy.from_dlpack(b), cupy.from_dlpack(hb)
    ptr = stream.cuda_stream
    return {
        "torch bf16 x": ("x", lambda: torch_a2a(x, hx, send, recv)),
        "torch bytes of fp8_rowwise x": ("b", lambda: torch_a2a(b, hb, send, recv)),
        "comm.alltoallv bytes of fp8_rowwise x": ("b", lambda: comm.alltoallv(
            cb, send, recv, out=chb, stream=ptr)),
        "comm.alltoallv bytes of fp8_rowwise x, out allocated": ("b", lambda: comm.alltoallv(
            cb, send, recv, stream=ptr)),
        "comm.alltoallv_plan bytes of fp8_rowwise x, no call header": ("b", lambda: plan_call(
            cb, chb, send, False)),
        "comm.alltoallv_plan bytes of fp8_rowwise x, call header": ("b", lambda: plan_call(
            cb, chb, send, True)),
        "mxcomm bf16 dispatch": ("x", lambda: mxt.a2a_dispatch(x, layout, precision="bf16")),
        "mxcomm fp8_rowwise dispatch": ("b", lambda: mxt.a2a_dispatch(
            x, layout, precision="fp8_rowwise")),
        "mxcomm fp8_rowwise dispatch, permute_align 32": ("b", lambda: mxt.a2a_dispatch(
            x, layout, precision="fp8_rowwise", permute_align=ALIGN)),
        "torch bf16 u": ("u", lambda: torch_a2a(u, out_u, recv, send)),
        "mxcomm bf16 combine": ("u", lambda: mxt.a2a_combine(u, layout, precision="bf16")),
        "mxcomm bf16 combine, permute_align 32": ("u", lambda: mxt.a2a_combine(
            y_, layout, precision="bf16", permute_align=ALIGN)),
    }


rows_out = []
with torch.no_grad():
    for M in args.rows:
        vs = variants(M)
        times = {name: [] for name in vs}
        for _ in range(2):
            for _, fn in vs.values():
                fn()
        torch.cuda.synchronize()
        comm.barrier()
        names = list(vs)
        for it in range(args.iters):
            order = names[it % len(names):] + names[:it % len(names)]
            marks = []
            for name in order:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                vs[name][1]()
                end.record(stream)
                marks.append((name, start, end))
            torch.cuda.synchronize()
            for name, start, end in marks:
                times[name].append(start.elapsed_time(end))
        mine = numpy.array([statistics.median(times[n]) for n in names])
        worst = comm.allgather(mine, "probe_wire").max(axis=0)
        by = dict(zip(names, worst))
        ref = {"x": by["torch bf16 x"], "b": by["torch bytes of fp8_rowwise x"],
               "u": by["torch bf16 u"]}
        for n, ms in zip(names, worst):
            rows_out.append((M, n, ms, ms / ref[vs[n][0]]))
        del vs
        torch.cuda.empty_cache()

if comm.rank == 0:
    print(f"## Bytes for bytes: {W} ranks, nodes {comm.nodes}, --peer-memory {args.peer_memory}, "
          f"{torch.cuda.get_device_name()}, median of {args.iters}, slowest rank")
    print()
    print("| rows per rank | variant | device ms | over torch, same bytes |")
    print("| --- | --- | --- | --- |")
    for M, n, ms, r in rows_out:
        print(f"| {M} | {n} | {ms:.3f} | {r:.3f} |")
dist.destroy_process_group()
comm.close()
