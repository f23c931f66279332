"""Per-call host and device time of dispatch and combine through ``mxcomm.torch``.

For each number of rows per rank (uniform routing, D wide), every rank times, side by side in
one run:

- torch's ``all_to_all_single`` (bf16, torch.distributed), the baseline;
- ``mxcomm``'s bf16 ``alltoallv`` (the communicator alone, unchecked);
- ``mxcomm.torch.a2a_dispatch`` and ``a2a_combine`` given the layout, bf16 and MXFP8 (no host
  collective per call);
- the same dispatch with explicit splits (the validated path: one host allgather per call);
- dispatch and combine given a NEW layout on every call, with other row counts per peer (what a
  training step does: the routing, so the layout, changes every step and layer; nothing a call
  can cache per layout is reused). The layouts are exchanged before the timing;
- with ``--grouped``, where the communicator pulls from peer memory, the MXFP8 dispatch and
  combine again through a second communicator that never pulls (``peer_memory=False``: the
  ``grouped`` transport, quantize then one NCCL group): which transport costs the host less;
- where the communicator moves small exchanges unquantized or medium ones in one alltoallv
  (``small_exchange_bytes``, ``medium_exchange_bytes``, the defaults on GPUs), the MXFP8 dispatch
  and combine again through a communicator that stages every quantized exchange however small
  (both 0; "staged").

host us: wall clock of enqueueing one call, calls enqueued back to back (the host's cost; where
it exceeds the device's, the step waits for the host). device ms: CUDA events, back to back, the
median over calls. Numbers are the slowest rank's. Without a GPU this benchmark reports host time
on the CPU only, which says nothing about GPUs, and its default shapes are a CPU's (seconds on 2
cores; :data:`DEFAULTS`), as its first line says.
"""

import time

import numpy

from . import _report

#: (rows per rank, D, experts per rank) run by default: on a GPU; on a CPU in the host backend
#: (2 ranks on 2 cores in seconds: the GPU's shapes ran for more than 10 minutes there); in
#: Numba's CUDA simulator (tiny).
DEFAULTS = {"cuda": ((4096, 8192, 16384, 32768), 7168, 8),
            "host": ((512, 2048), 1024, 4),
            "simulator": ((64,), 64, 2)}


def _default_help(i):
    """The defaults of item ``i`` of :data:`DEFAULTS`, for --help."""
    where = {"cuda": "on a GPU", "host": "on a CPU", "simulator": "in the simulator"}
    return ", ".join(f"{' '.join(map(str, v[i])) if i == 0 else v[i]} {where[k]}"
                     for k, v in DEFAULTS.items())


def add_arguments(parser):
    parser.add_argument("--tokens", type=int, nargs="+", metavar="ROWS",
                        help=f"rows per rank (default: {_default_help(0)})")
    parser.add_argument("--dim", type=int, metavar="D",
                        help=f"row width in elements, a multiple of 32 (default: "
                             f"{_default_help(1)})")
    parser.add_argument("--experts", type=int, metavar="E_LOCAL",
                        help=f"experts per rank (default: {_default_help(2)})")
    parser.add_argument("--grouped", action="store_true",
                        help="also time the MXFP8 calls through a communicator with the grouped "
                             "transport (peer_memory=False), where the default one pulls")


def validate(args):
    """Check the options before anything runs (every rank checks the same arguments).

    Raises:
        ValueError: --tokens not positive, --dim not a positive multiple of 32, --experts < 1.
    """
    if args.tokens is not None and (not args.tokens or min(args.tokens) < 1):
        raise ValueError(f"--tokens: expected positive row counts, got {args.tokens}")
    if args.dim is not None and (args.dim < 32 or args.dim % 32):
        raise ValueError(f"--dim: expected a positive multiple of 32 (the MX block), got "
                         f"{args.dim}")
    if args.experts is not None and args.experts < 1:
        raise ValueError(f"--experts: expected >= 1, got {args.experts}")


def shape(args, backend):
    """``(rows per rank (tuple), D, experts per rank)``: the options, each missing one the
    default of ``backend`` (:data:`DEFAULTS`)."""
    tokens, dim, experts = DEFAULTS[backend]
    return (tuple(args.tokens) if args.tokens else tokens, args.dim or dim,
            args.experts or experts)


def describe(args, rt):
    """The first line printed: what this run is (its shapes, the backend's defaults for the
    options left out) and what it is not."""
    tokens, dim, experts = shape(args, rt.backend)
    head = (f"mxcomm latency: host and device time per dispatch/combine call, {rt.size} "
            f"rank{'s' if rt.size > 1 else ''}, rows per rank {' '.join(map(str, tokens))}, "
            f"D = {dim}, {experts} experts per rank")
    if rt.gpu:
        return f"{head}, GPU, CUDA events"
    sized = "" if args.tokens and args.dim and args.experts else \
        f" ({'CPU' if rt.backend == 'host' else 'simulator'}-sized defaults, seconds to run; a " \
        f"GPU's: {' '.join(map(str, DEFAULTS['cuda'][0]))} rows, D = {DEFAULTS['cuda'][1]})"
    return f"{head}{sized}, CPU: host timings only, nothing about GPUs"


def _host_and_device(fn, rt, iters, warmup, comms=None):
    """(host us per call: median, mean; device ms per call; host collectives per call):
    ``iters`` calls enqueued back to back after ``warmup`` untimed ones. The median of the
    calls' own enqueue times is the host's cost of a call; the mean also carries what stalls the
    host now and then (garbage collection, a thread switch)."""
    import torch
    for _ in range(warmup):
        fn()
    rt.barrier()
    if rt.gpu:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
    comms = comms or (rt.comm,)
    collectives = sum(c.host_collectives for c in comms)
    marks = [time.perf_counter()]
    for _ in range(iters):
        fn()
        marks.append(time.perf_counter())
    host_mean_us = (marks[-1] - marks[0]) / iters * 1e6
    host_us = float(numpy.median(numpy.diff(marks))) * 1e6
    per_call = (sum(c.host_collectives for c in comms) - collectives) / iters
    if rt.gpu:
        end.record()
        end.synchronize()
        device_ms = start.elapsed_time(end) / iters
    else:
        device_ms = float("nan")
    for c in comms:
        c.wait()
    return rt.allreduce_max([host_us, host_mean_us, device_ms, per_call])


def measure(args, rt):
    import torch
    import torch.distributed as dist

    import mxcomm.torch as mxt
    rt.init_torch_distributed()
    comm = rt.comm
    w = rt.size
    tokens, dim, experts = shape(args, rt.backend)
    grouped = staged = None
    if getattr(args, "grouped", False) and comm.transport == "pull":
        grouped = rt.new_comm(peer_memory=False, small_exchange_bytes=0,
                              medium_exchange_bytes=0)
    if comm.small_exchange_bytes or comm.medium_exchange_bytes:
        staged = rt.new_comm(small_exchange_bytes=0, medium_exchange_bytes=0)
    comms = tuple(c for c in (comm, grouped, staged) if c is not None)
    device = rt.torch_device()
    rows_out = []
    for rows in tokens:
        rt.log(f"latency: {rows} rows x {dim}")
        e = w * experts
        counts = torch.full((e,), rows // e, dtype=torch.int64)
        counts[: rows % e] += 1
        layout = mxt.exchange_layout(counts.to(device), comm)
        gen = torch.Generator(device="cpu").manual_seed(1234 + rt.rank)
        x = torch.randn(rows, dim, generator=gen).to(device, torch.bfloat16)
        y = torch.randn(layout.num_received, dim, generator=gen).to(device, torch.bfloat16)
        splits_in, splits_out = layout.input_splits, layout.output_splits
        out_t = torch.empty(layout.num_received, dim, dtype=torch.bfloat16, device=device)
        x_arr = mxt._array(x, "x")
        cases = {
            "torch all_to_all_single bf16": lambda: dist.all_to_all_single(
                out_t, x, splits_out, splits_in),
            "mxcomm alltoallv bf16": lambda: comm.alltoallv(
                x_arr, splits_in, splits_out, stream=mxt._stream(x), validate=False),
            "dispatch bf16 (layout)": lambda: mxt.a2a_dispatch(x, layout, precision="bf16"),
            "dispatch mxfp8 (layout)": lambda: mxt.a2a_dispatch(x, layout),
            "combine bf16 (layout)": lambda: mxt.a2a_combine(y, layout),
            "combine mxfp8 (layout)": lambda: mxt.a2a_combine(y, layout, precision="mxfp8"),
            "dispatch mxfp8 (splits, voted)": lambda: mxt.a2a_dispatch(
                x, splits_in, splits_out, comm),
        }
        fresh = _fresh_layouts(mxt, comm, device, rows, e, args.iters + args.warmup)
        y_max = torch.randn(max(lay.num_received for lay in fresh), dim, generator=gen
                            ).to(device, torch.bfloat16)

        cases.update({
            "dispatch bf16 (new layout)": _each_layout(
                fresh, lambda lay: mxt.a2a_dispatch(x, lay, precision="bf16")),
            "dispatch mxfp8 (new layout)": _each_layout(
                fresh, lambda lay: mxt.a2a_dispatch(x, lay)),
            "combine bf16 (new layout)": _each_layout(
                fresh, lambda lay: mxt.a2a_combine(y_max[:lay.num_received], lay)),
            "combine mxfp8 (new layout)": _each_layout(
                fresh, lambda lay: mxt.a2a_combine(y_max[:lay.num_received], lay,
                                                   precision="mxfp8")),
        })
        for tag, other in (("grouped", grouped), ("staged", staged)):
            if other is None:
                continue
            o_layout = mxt.exchange_layout(counts.to(device), other)
            o_fresh = _fresh_layouts(mxt, other, device, rows, e, args.iters + args.warmup)

            cases.update({
                f"dispatch mxfp8 (layout, {tag})": lambda lay=o_layout: mxt.a2a_dispatch(x, lay),
                f"combine mxfp8 (layout, {tag})": lambda lay=o_layout: mxt.a2a_combine(
                    y, lay, precision="mxfp8"),
                f"dispatch mxfp8 (new layout, {tag})": _each_layout(
                    o_fresh, lambda lay: mxt.a2a_dispatch(x, lay)),
                f"combine mxfp8 (new layout, {tag})": _each_layout(
                    o_fresh, lambda lay: mxt.a2a_combine(y_max[:lay.num_received], lay,
                                                         precision="mxfp8")),
            })
        for name, fn in cases.items():
            host_us, host_mean_us, device_ms, per_call = _host_and_device(
                fn, rt, args.iters, args.warmup, comms)
            rows_out.append({"rows": rows, "dim": dim, "call": name,
                             "host_us": round(host_us, 1), "host_mean_us": round(host_mean_us, 1),
                             "device_ms": device_ms,
                             "host_collectives_per_call": per_call})
    for other in comms[1:]:
        other.close()
    notes = ["host us: wall clock of enqueueing one call, calls back to back: the median over "
             "calls (host mean: the mean, stalls of the host included)",
             "device ms: CUDA events around the calls back to back, per call",
             "slowest rank of each figure; host coll./call: host collectives per call"]
    if grouped is not None:
        notes.append("(grouped): through a second communicator with peer_memory=False (the "
                     "grouped transport: quantize, one NCCL group); the others pull")
    if staged is not None:
        notes.append(f"(staged): through a second communicator with small_exchange_bytes=0 "
                     f"and medium_exchange_bytes=0 (every quantized exchange staged and pulled, "
                     f"however small); the others move exchanges of at most "
                     f"{comm.small_exchange_bytes} bytes per rank to its peers unquantized and "
                     f"quantize on arrival, and quantize those kept quantized of at most "
                     f"{comm.medium_exchange_bytes} bytes before one alltoallv")
    if not rt.gpu:
        notes.append("CPU: host timings of the host backend, nothing about GPUs")
    meta = _report.metadata("latency", w, {"rows_per_rank": list(tokens), "dim": dim,
                                          "experts_per_rank": experts}, notes,
                            run=describe(args, rt), iters=args.iters, warmup=args.warmup)
    return meta, {"latency": rows_out}


def _each_layout(layouts, call):
    """A call of ``call(layout)`` taking the next of ``layouts`` each time."""
    it = iter(layouts)
    return lambda: call(next(it))


def _fresh_layouts(mxt, comm, device, rows, experts, n):
    """``n`` layouts of ``rows`` rows per rank, each with other counts per peer: layout ``i``
    moves ``i + 1`` rows of every rank from its first global expert to its last (other ranks), so
    the rows sent to each peer differ from call to call while M stays ``rows``."""
    import torch
    base = torch.full((experts,), rows // experts, dtype=torch.int64)
    base[: rows % experts] += 1
    layouts = []
    for i in range(n):
        counts = base.clone()
        k = min(i + 1, int(counts[0]))
        counts[0] -= k
        counts[-1] += k
        layouts.append(mxt.exchange_layout(counts.to(device), comm))
    return layouts


COLUMNS = ["rows", "call", "host us", "host mean", "device ms", "vs torch", "host coll./call"]


def _display(tables):
    rows = tables["latency"]
    base = {r["rows"]: r["device_ms"] for r in rows if r["call"].startswith("torch")}
    shown = []
    for r in rows:
        ms = r["device_ms"]
        timed = ms == ms and ms > 0
        shown.append({"rows": r["rows"], "call": r["call"], "host us": r["host_us"],
                      "host mean": r.get("host_mean_us", "-"),
                      "device ms": ms if timed else "-",
                      "vs torch": _report.speedup(base.get(r["rows"], float("nan")) / ms)
                      if timed else "-",
                      "host coll./call": r["host_collectives_per_call"]})
    return [("per call, back to back: host = wall clock of enqueueing one call; device = CUDA "
             "events; slowest rank", shown, COLUMNS)]


def render(meta, tables):
    """Text report of :func:`measure`'s result."""
    sections = [(c, _report.format_table(r, cols)) for c, r, cols in _display(tables)]
    return _report.render_text("mxcomm latency benchmark", meta, sections)


def markdown_sections(tables):
    """``(caption, rows, columns)`` for ``--markdown``."""
    return _display(tables)


def failed(tables):
    return any(numpy.isnan(r["host_us"]) for r in tables["latency"])
