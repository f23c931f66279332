"""A rank's own rows in an NCCL exchange (GPU only): sent to itself inside the NCCL group, or
copied outside it, and the medium exchange's quantize of every row or of the peers' rows only.

    mpirun -n W python bench/probe_self.py [dim] [iterations] [rows ...]

Uniform splits (rows / W to each rank, the rank itself included). Per size, device time of one
exchange (CUDA events around each, back to back; median over ``iterations`` after warm-up; the
slowest rank's), for rows of 2 bytes (bf16) and of 1 byte per element (fp8):

- ``nccl, self inside``: one NCCL group of send/recv to every rank, the rank itself included (how
  ``NcclCommunicator`` and torch's ``all_to_all_single`` move rows);
- ``nccl, peers only``: the same group without the rank itself (the own rows not moved);
- ``peers, then copy``: that group, then ``cudaMemcpyAsync`` of the own rows on the same stream;
- ``copy, then peers``: the copy first;
- ``peers + copy on a side stream``: the copy on a second stream, forked and joined by events;
- ``copy alone``.

Then the medium MXFP8 exchange's quantize (``mxfp8``, bf16 rows of width ``dim``): of every row,
and of the peers' rows only (``(W-1)/W`` of them). Last, ``mxcomm.torch.a2a_dispatch`` in MXFP8
with a layout (uniform counts), as a medium exchange (a communicator that takes every exchange as
medium) and staged (a communicator with both limits 0). Rank 0 prints a Markdown table.
"""

import statistics
import sys

import cupy
import numpy
import torch

import mxcomm.comm
from mxcomm._array import bfloat16
from mxcomm._driver import Words
from mxcomm.formats import get_format

dim = int(sys.argv[1]) if len(sys.argv) > 1 else 7168
iterations = int(sys.argv[2]) if len(sys.argv) > 2 else 30
sizes = [int(s) for s in sys.argv[3:]] or [4096, 16384, 32768, 65536]

comm = mxcomm.comm.init()
torch.cuda.set_device(comm.device)
W, rank = comm.size, comm.rank
main = torch.cuda.current_stream()
side = torch.cuda.Stream()
stream_ptr = main.cuda_stream
nccl = comm.nccl_comm(stream_ptr)
cuda_nccl = cupy.cuda.nccl
uint8 = cuda_nccl.NCCL_UINT8
runtime = cupy.cuda.runtime
fork, join = torch.cuda.Event(), torch.cuda.Event()


def group(send, recv, chunk, with_self):
    cuda_nccl.groupStart()
    for peer in range(W):
        if peer == rank and not with_self:
            continue
        nccl.send(send.data_ptr() + peer * chunk, chunk, uint8, peer, stream_ptr)
        nccl.recv(recv.data_ptr() + peer * chunk, chunk, uint8, peer, stream_ptr)
    cuda_nccl.groupEnd()


def copy_own(send, recv, chunk, stream):
    at = rank * chunk
    runtime.memcpyAsync(recv.data_ptr() + at, send.data_ptr() + at, chunk,
                        runtime.memcpyDeviceToDevice, stream)


def variants(send, recv, chunk):
    def peers_side():
        fork.record(main)
        side.wait_event(fork)
        group(send, recv, chunk, False)
        copy_own(send, recv, chunk, side.cuda_stream)
        join.record(side)
        main.wait_event(join)
    return {
        "nccl, self inside": lambda: group(send, recv, chunk, True),
        "nccl, peers only": lambda: group(send, recv, chunk, False),
        "peers, then copy": lambda: (group(send, recv, chunk, False),
                                     copy_own(send, recv, chunk, stream_ptr)),
        "copy, then peers": lambda: (copy_own(send, recv, chunk, stream_ptr),
                                     group(send, recv, chunk, False)),
        "peers + copy on a side stream": peers_side,
        "copy alone": lambda: copy_own(send, recv, chunk, stream_ptr),
    }


def timed(fn):
    """Median device ms of ``fn`` over ``iterations``, back to back, the slowest rank's."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iterations)]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    comm.barrier()
    for start, end in events:
        start.record(main)
        fn()
        end.record(main)
    torch.cuda.synchronize()
    mine = statistics.median(s.elapsed_time(e) for s, e in events)
    return float(comm.allgather(numpy.array([mine]), "probe").max())


fmt = get_format("mxfp8")
quantize = fmt.quantizer(bfloat16, dim, None, 1.0)

rows_out = []
for rows in sizes:
    per_peer = rows // W
    for width_bytes, name in ((2 * dim, "bf16"), (dim, "fp8")):
        chunk = per_peer * width_bytes
        send = torch.empty(W * chunk, dtype=torch.uint8, device="cuda").random_(0, 255)
        recv = torch.empty_like(send)
        for label, fn in variants(send, recv, chunk).items():
            rows_out.append((rows, name, label, timed(fn)))
        del send, recv
    x = torch.randn(rows, dim, device="cuda").to(torch.bfloat16)
    data = torch.empty(rows, dim, dtype=torch.uint8, device="cuda")
    scales = torch.empty(rows, dim // 32, dtype=torch.uint8, device="cuda")
    for label, n in (("quantize, every row", rows), ("quantize, the peers' rows", rows - per_peer)):
        xw = Words(x.data_ptr(), (n, dim), bfloat16)
        dw = Words(data.data_ptr(), (n, dim), numpy.dtype(fmt.element_dtype))
        sw = Words(scales.data_ptr(), (n, dim // 32), numpy.dtype(fmt.scale_dtype))
        rows_out.append((rows, "mxfp8", label,
                         timed(lambda: quantize(xw, dw, sw, n, stream_ptr))))
    del x, data, scales

import mxcomm.torch as mxt  # noqa: E402

staged = mxcomm.comm.init(small_exchange_bytes=0, medium_exchange_bytes=0)
medium = mxcomm.comm.init(small_exchange_bytes=0, medium_exchange_bytes=1 << 40)
counts = torch.full((8 * W,), 0, dtype=torch.int64)
for rows in sizes:
    counts.fill_(rows // (8 * W))
    x = torch.randn(rows, dim, device="cuda").to(torch.bfloat16)
    for label, c in (("a2a_dispatch, medium", medium), ("a2a_dispatch, staged", staged)):
        layout = mxt.exchange_layout(counts.cuda(), c)
        rows_out.append((rows, "mxfp8", label, timed(lambda: mxt.a2a_dispatch(x, layout))))
medium.close()
staged.close()

if rank == 0:
    print(f"## A rank's own rows in an NCCL exchange: {W} ranks, D = {dim}, "
          f"{torch.cuda.get_device_name()}, median of {iterations} back to back, slowest rank")
    print()
    print("| rows per rank | rows | variant | device ms |")
    print("| --- | --- | --- | --- |")
    for rows, name, label, ms in rows_out:
        print(f"| {rows} | {name} | {label} | {ms:.4f} |")
comm.close()
