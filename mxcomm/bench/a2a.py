"""``mpirun -n W python -m mxcomm.bench a2a``: all-to-all-v throughput, ours vs torch.distributed.

Three tables:

- ``alltoallv``: mxcomm's ``comm.alltoallv`` and ``torch.distributed.all_to_all_single`` on the same
  send buffer (torch tensors wrap the same memory through DLPack), nccl-tests columns: size (bytes
  sent per rank), count (elements per rank), type, time, algbw = size / time, busbw =
  algbw·(W−1)/W; ratio = our throughput / torch's (target >= 0.97).
- ``drop_in``: ``mxcomm.a2a.all_to_all_single(x, ..., precision)`` (bf16 in, bf16 out) on both
  transports of the MXFP8 exchange (``pull``: the dequantize reads the peers' memory in place,
  over NVLink; ``grouped``: one NCCL group) vs torch's bf16 ``all_to_all_single`` (target: MXFP8 >= 1.5x faster), with the
  SQNR of the output against the exact exchange.
- ``leak``: device memory in use before and after ``--leak-iters`` allocating ``alltoallv`` calls.

Two timings of every call, each the largest over ranks of each rank's median: ``ms``, the
iterations enqueued back to back after one barrier (throughput, as nccl-tests measures it: the
host's time per call overlaps the device's work), and ``sync_ms``, every iteration started after
a device synchronize and an MPI barrier (latency: the host's time per call is exposed).
"""

import numpy

from . import _report, _timing, _workload
from ..formats import sqnr

#: Rows per rank and row length by default: on a GPU, on a CPU (host backend), in the simulator.
GPU_ROWS, GPU_DIM = [16384, 65536, 131072], 7168
HOST_ROWS, HOST_DIM = [4096], 1024
SIM_ROWS, SIM_DIM = [64], 32
RATIO_TARGET = 0.97
DROP_IN_TARGET = 1.5
SPLIT_SEED = 2024
#: Display columns (of those the rows have: CPU rows have no ratio, target or verdict).
A2A_COLUMNS = ["size", "type", "splits", "ours_ms", "ours_busbw", "torch_ms", "torch_busbw",
               "ratio", "target", "ok", "exact"]
SYNC_COLUMNS = ["size", "type", "splits", "ours_sync_ms", "torch_sync_ms", "sync_ratio"]
DROP_COLUMNS = ["impl", "precision", "transport", "ms", "vs torch", "target", "sync_ms",
                "sync vs torch", "sqnr_db"]
LEAK_COLUMNS = ["op", "iters", "rows", "before_bytes", "after_bytes", "grew"]


def add_arguments(parser):
    """The ``a2a`` subcommand's options."""
    parser.add_argument("--rows", type=int, nargs="+", metavar="M",
                        help=f"rows per rank, > 0 (default {' '.join(map(str, GPU_ROWS))} on a "
                             f"GPU, {' '.join(map(str, HOST_ROWS))} on a CPU, "
                             f"{' '.join(map(str, SIM_ROWS))} in the simulator)")
    parser.add_argument("--dim", type=int, metavar="D",
                        help=f"elements per row, a multiple of 32 (default {GPU_DIM} on a GPU, "
                             f"{HOST_DIM} on a CPU, {SIM_DIM} in the simulator)")
    parser.add_argument("--types", nargs="+", default=["bf16", "uint8"], choices=["bf16", "uint8"],
                        help="element types of the alltoallv table (default bf16 uint8)")
    parser.add_argument("--splits", nargs="+", default=["uniform", "skewed"],
                        choices=["uniform", "skewed"],
                        help="split matrices (default uniform skewed; the drop-in uses the first)")
    parser.add_argument("--leak-iters", type=int, metavar="N",
                        help="alltoallv calls of the leak check, >= 0 (default 1000 on a GPU, 10 "
                             "on a CPU; 0 skips it)")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch.distributed columns")


def validate(args):
    """Check the shape options up front.

    Raises:
        ValueError: --rows not positive, --dim not a positive multiple of 32, --leak-iters < 0.
    """
    for m in args.rows or ():
        if m < 1:
            raise ValueError(f"--rows: expected positive values, got {m}")
    if args.dim is not None and (args.dim < 1 or args.dim % 32):
        raise ValueError(f"--dim: expected a positive multiple of 32 (MXFP8 blocks of 32 "
                         f"elements), got {args.dim}")
    if args.leak_iters is not None and args.leak_iters < 0:
        raise ValueError(f"--leak-iters: expected >= 0, got {args.leak_iters}")


def describe(args, rt):
    """The first line printed: what this run is, and what it is not."""
    head = f"mxcomm all-to-all, {rt.size} rank{'s' if rt.size > 1 else ''}"
    if rt.gpu:
        return (f"{head} on GPUs: CUDA-event throughput and latency of mxcomm vs "
                f"torch.distributed, the MXFP8 drop-in, exactness, a device-memory leak check.")
    host = "MPI" if rt.launcher == "mpi" else "torch.distributed"
    return (f"{head} on a CPU ({rt.backend} backend, {host} communicator vs gloo): exactness, "
            f"SQNR and host-clock times of this machine's {host}. Nothing here says anything "
            f"about GPUs.")


def _exact_sqnr(rt, ref, out):
    """``mxcomm.sqnr`` of ``out`` against ``ref`` (bf16 arrays), through torch when it is
    installed (CuPy does no bf16 arithmetic), else on host copies."""
    try:
        return sqnr(rt.to_torch(ref), rt.to_torch(out))
    except ImportError:
        asnumpy = getattr(rt.xp, "asnumpy", numpy.asarray)
        return sqnr(asnumpy(ref), asnumpy(out))


class _Bench:
    """Shared state of one ``a2a`` run: runtime, clock, iteration counts, torch availability."""

    def __init__(self, args, rt):
        self.args, self.rt = args, rt
        self.clock = _timing.Clock(rt.clock_kind)
        self.use_torch = not args.no_torch
        if self.use_torch:
            rt.init_torch_distributed()

    def time(self, fn):
        """``(back-to-back Stats, synced Stats)`` of ``fn``, each the slowest rank's."""
        kw = {"iters": self.args.iters, "warmup": self.args.warmup, "before": self.rt.barrier}
        stream = _timing.measure_back_to_back(fn, self.clock, **kw)
        synced = _timing.measure(fn, self.clock, **kw)
        return tuple(_timing.max_over_ranks(s, self.rt.allreduce_max) for s in (stream, synced))

    def splits(self, rows, kind):
        matrix = _workload.split_matrix(self.rt.size, rows, kind, seed=SPLIT_SEED)
        return _workload.rank_splits(matrix, self.rt.rank)

    def payload(self, rows, dim, dtype, seed):
        if dtype == "bf16":
            return self.rt.random_bf16((rows, dim), seed)
        return self.rt.random_bytes((rows, dim), seed)

    def torch_a2a(self, t_out, t_in, send, recv):
        import torch.distributed as dist
        return lambda: dist.all_to_all_single(t_out, t_in, output_split_sizes=recv,
                                              input_split_sizes=send)

    # -------------------------------------------------------------------------------- tables
    def alltoallv_rows(self, rows_list, dim):
        rt, comm, out_rows = self.rt, self.rt.comm, []
        for rows in rows_list:
            for dtype in self.args.types:
                x = self.payload(rows, dim, dtype, seed=100 + rt.rank)
                item = 2 if dtype == "bf16" else 1
                size = rows * dim * item
                for kind in self.args.splits:
                    rt.log(f"alltoallv {dtype} {rows}x{dim} {kind}")
                    send, recv = self.splits(rows, kind)
                    out = rt.xp.empty((sum(recv), dim), dtype=x.dtype)
                    ours, ours_sync = self.time(lambda: comm.alltoallv(x, send, recv, out=out))
                    row = {"size": size, "count": rows * dim, "type": dtype, "splits": kind,
                           "rows": rows, "dim": dim}
                    algbw = _workload.gbps(size, ours.median)
                    row.update(ours.as_dict("ours_"), ours_algbw=algbw,
                               ours_busbw=_workload.busbw(algbw, rt.size),
                               **ours_sync.as_dict("ours_sync_"))
                    if self.use_torch:
                        ref = rt.xp.empty_like(out)
                        fn = self.torch_a2a(rt.to_torch(ref), rt.to_torch(x), send, recv)
                        theirs, theirs_sync = self.time(fn)
                        t_algbw = _workload.gbps(size, theirs.median)
                        ratio = theirs.median / ours.median
                        same = bool(rt.xp.array_equal(out.view(numpy.uint8), ref.view(numpy.uint8)))
                        row.update(theirs.as_dict("torch_"), torch_algbw=t_algbw,
                                   torch_busbw=_workload.busbw(t_algbw, rt.size), same_output=same,
                                   exact="yes" if same else "no",
                                   **theirs_sync.as_dict("torch_sync_"))
                        if rt.gpu:  # throughput ratios of a CPU's MPI and gloo mean nothing here
                            row.update(ratio=ratio, target=RATIO_TARGET,
                                       ok="yes" if ratio >= RATIO_TARGET and same else "no",
                                       sync_ratio=theirs_sync.median / ours_sync.median)
                        del ref
                    out_rows.append(row)
                    del out
                del x
        return out_rows

    def drop_in_rows(self, rows, dim):
        """torch's bf16 exchange, then mxcomm's drop-in in MXFP8 on both transports and in bf16."""
        from mxcomm.a2a import all_to_all_single
        rt = self.rt
        kind = self.args.splits[0]
        send, recv = self.splits(rows, kind)
        x = rt.random_bf16((rows, dim), seed=200 + rt.rank)
        exact = rt.xp.empty((sum(recv), dim), dtype=x.dtype)
        rt.comm.alltoallv(x, send, recv, out=exact)
        out_rows, torch_ms, torch_sync_ms = [], float("nan"), float("nan")
        base = {"rows": rows, "dim": dim, "splits": kind}
        if self.use_torch:
            rt.log(f"drop-in torch bf16 {rows}x{dim}")
            ref = rt.xp.empty_like(exact)
            stats, synced = self.time(self.torch_a2a(rt.to_torch(ref), rt.to_torch(x), send,
                                                     recv))
            torch_ms, torch_sync_ms = stats.median, synced.median
            out_rows.append({"impl": "torch", "precision": "bf16", "transport": "c10d", **base,
                             **stats.as_dict(), "speedup_vs_torch": 1.0, "target": "",
                             "sync_ms": synced.median, "sync_speedup": 1.0,
                             "sqnr_db": _exact_sqnr(rt, exact, ref)})
            del ref
        grouped = rt.new_comm(peer_memory=False) \
            if rt.comm.transport != "grouped" else rt.comm
        runs = [("mxfp8", rt.comm), ("bf16", rt.comm)]
        if grouped is not rt.comm:
            runs.insert(1, ("mxfp8", grouped))
        for precision, comm in runs:
            transport = comm.transport if precision == "mxfp8" else "alltoallv"
            rt.log(f"drop-in mxcomm {precision} ({transport}) {rows}x{dim}")
            fn = lambda: all_to_all_single(x, recv, send, comm, precision=precision)  # noqa: E731
            stats, synced = self.time(fn)
            out = fn()
            rt.sync()
            out_rows.append({"impl": "mxcomm", "precision": precision, "transport": transport,
                             **base, **stats.as_dict(), "speedup_vs_torch": torch_ms / stats.median,
                             "target": DROP_IN_TARGET if precision == "mxfp8" else "",
                             "sync_ms": synced.median,
                             "sync_speedup": torch_sync_ms / synced.median,
                             "sqnr_db": _exact_sqnr(rt, exact, out)})
            del out
        if grouped is not rt.comm:
            grouped.close()
        return out_rows

    def leak_rows(self, rows, dim, iters):
        rt, comm = self.rt, self.rt.comm
        send, recv = self.splits(rows, "skewed")
        x = rt.random_bf16((rows, dim), seed=300 + rt.rank)
        rt.log(f"leak check: {iters} alltoallv calls, {rows}x{dim} bf16")
        comm.alltoallv(x, send, recv)  # first call: pools and caches settle
        rt.barrier()
        before = rt.memory_used()
        for _ in range(iters):
            comm.alltoallv(x, send, recv)
        rt.barrier()
        after = rt.memory_used()
        before, after = rt.allreduce_max([before, after])
        # Host RSS (the CPU path) moves by pages for reasons of its own: allow 1 MiB there.
        slack = 0 if rt.gpu else (1 << 20)
        return [{"op": "alltoallv (out=None)", "iters": iters, "rows": rows, "before_bytes": int(before),
                 "after_bytes": int(after), "grew": "yes" if after > before + slack else "no"}]


def measure(args, rt):
    """Run the all-to-all benchmarks; returns ``(meta, tables)``."""
    default_rows, default_dim = {"cuda": (GPU_ROWS, GPU_DIM), "host": (HOST_ROWS, HOST_DIM)}.get(
        rt.backend, (SIM_ROWS, SIM_DIM))
    rows_list = args.rows or default_rows
    dim = args.dim or default_dim
    bench = _Bench(args, rt)
    tables = {"alltoallv": bench.alltoallv_rows(rows_list, dim)}
    tables["drop_in"] = bench.drop_in_rows(max(rows_list), dim)
    leak_iters = args.leak_iters if args.leak_iters is not None else (1000 if rt.gpu else 10)
    tables["leak"] = bench.leak_rows(min(rows_list), dim, leak_iters) if leak_iters > 0 else []
    notes = ["time = max over ranks of each rank's median; ms: iterations enqueued back to back "
             "(throughput, as nccl-tests); sync_ms: every iteration after a device sync + MPI "
             "barrier (latency)", "size = bytes sent per rank; algbw = size/time (GB = 1e9); "
             "busbw = algbw*(W-1)/W; ratio = torch_ms/ours_ms",
             f"split matrices built from seed {SPLIT_SEED} on every rank (skewed: Dirichlet(1) rows)"]
    if not bench.use_torch:
        notes.append("torch.distributed columns skipped (--no-torch)")
    elif not rt.gpu:
        notes.append(f"CPU: mxcomm uses its {type(rt.comm).__name__}, torch.distributed uses "
                     f"gloo; host clock, no ratios or targets (they are about GPUs)")
    if not rt.gpu:
        notes.append("leak check on the CPU: host RSS, not device memory")
    meta = _report.metadata("a2a", rt.size, {"rows_per_rank": rows_list, "dim": dim,
                                             "types": args.types, "splits": args.splits},
                            notes, run=describe(args, rt), iters=args.iters, warmup=args.warmup,
                            leak_iters=leak_iters)
    return meta, tables


def _present(rows, columns):
    """The ``columns`` the first of ``rows`` has (all of them for no rows)."""
    return [c for c in columns if not rows or c in rows[0]]


def _display(tables):
    a2a = tables["alltoallv"]
    gpu = bool(a2a) and "ratio" in a2a[0]
    drop = [dict(r, **{"vs torch": _report.speedup(r["speedup_vs_torch"]),
                       "sync vs torch": _report.speedup(r["sync_speedup"])})
            for r in tables["drop_in"]]
    drop_cols = DROP_COLUMNS if gpu else [c for c in DROP_COLUMNS
                                          if c not in ("vs torch", "target", "sync vs torch")]
    shape = f"{tables['drop_in'][0]['rows']} x {tables['drop_in'][0]['dim']}" \
        if tables["drop_in"] else ""
    return [("alltoallv, iterations back to back (nccl-tests columns: size in bytes per rank; ms; "
             "busbw GB/s)", a2a, _present(a2a, A2A_COLUMNS)),
            ("alltoallv, every iteration synchronized (ms)", a2a, _present(a2a, SYNC_COLUMNS)),
            (f"drop-in all_to_all_single, {shape} rows per rank, vs torch bf16", drop, drop_cols),
            ("leak check", tables["leak"], LEAK_COLUMNS)]


def render(meta, tables):
    """Text report of :func:`measure`'s result."""
    sections = [(c, _report.format_table(r, cols)) for c, r, cols in _display(tables)]
    return _report.render_text("mxcomm all-to-all benchmark", meta, sections)


def markdown_sections(tables):
    """``(caption, rows, columns)`` for ``--markdown``."""
    return _display(tables)
