"""``mpirun -n W python -m mxcomm.bench calibrate``: measure the cost table ``"auto"`` reads.

For one shape (--dim, --hidden, --experts per rank) and a grid of rows per rank (--tokens), the
whole EP layer forward + backward of every recipe the devices run (``mxcomm.recipes``; the fp8
GEMM recipe on SM90 only), each as ``ExpertParallel`` runs it by default (the fp8 GEMM's recipes
with the backward overlap), uniform routing, with the pipeline benchmark's machinery: its inputs,
its stages per recipe, its end-to-end timing (each iteration after a barrier, CUDA events on a
GPU, the host clock on a CPU; the recipes interleaved, one iteration of each in turn; the median
of --iters after --warmup, the max over ranks). Rank 0 writes the medians as a cost table
(``mxcomm.recipes.save_table``, JSON) to --out, by default to the per-user cache
(``mxcomm.recipes.cache_path``: keyed by the device name, the world size and the dims), where
``"auto"`` finds it (lookup order: an explicit table, ``$MXCOMM_COST_TABLE``, this cache, the
built-in table; docs/design.md, "How auto predicts").

The report shows the table and what ``"auto"`` chooses from it at each point. On a CPU the
table describes the host backend (its device is ``"cpu"``), which ``"auto"`` on the CPU then
reads: a test of the machinery, not a GPU's costs.
"""

import os

from . import _moe, _report
from . import pipeline as _pipeline

#: Rows per rank measured by default: on a GPU, on a CPU.
GPU_ROWS = (4096, 8192, 16384, 32768, 65536, 131072)
HOST_ROWS = (256, 1024)
#: (dim, hidden, experts per rank) by default: on a GPU (the DeepSeek-V3 layer), on a CPU.
GPU_SHAPE = (7168, 2048, 8)
HOST_SHAPE = (256, 128, 2)


def add_arguments(parser):
    """The ``calibrate`` subcommand's options."""
    parser.add_argument("--tokens", type=int, nargs="+", metavar="M",
                        help=f"rows per rank to measure, > 0, at least two (default: "
                             f"{' '.join(map(str, GPU_ROWS))} on a GPU, "
                             f"{' '.join(map(str, HOST_ROWS))} on a CPU)")
    parser.add_argument("--dim", type=int, metavar="D",
                        help=f"model dim, a multiple of 32 (default {GPU_SHAPE[0]} on a GPU, "
                             f"{HOST_SHAPE[0]} on a CPU)")
    parser.add_argument("--hidden", type=int, metavar="H",
                        help=f"expert GEMM output dim, a multiple of 32 (default {GPU_SHAPE[1]} "
                             f"on a GPU, {HOST_SHAPE[1]} on a CPU)")
    parser.add_argument("--experts", type=int, metavar="E_LOCAL",
                        help=f"experts per rank, > 0 (default {GPU_SHAPE[2]} on a GPU, "
                             f"{HOST_SHAPE[2]} on a CPU)")
    parser.add_argument("--out", metavar="PATH",
                        help="write the table here (default: the per-user cache, "
                             "mxcomm.recipes.cache_path, where auto finds it)")


def validate(args):
    """Check the options before anything runs (every rank checks the same arguments).

    Raises:
        ValueError: fewer than two or repeated --tokens, a size not positive, --dim or --hidden
            not a multiple of 32.
    """
    if args.tokens is not None:
        if len(args.tokens) < 2 or len(set(args.tokens)) != len(args.tokens):
            raise ValueError(f"--tokens: expected two or more different row counts (a table "
                             f"interpolates between them), got {args.tokens}")
    for name, values, block in (("--tokens", args.tokens or (), 1), ("--dim", [args.dim], 32),
                                ("--hidden", [args.hidden], 32),
                                ("--experts", [args.experts], 1)):
        for v in values:
            if v is not None and (v < 1 or v % block):
                raise ValueError(f"{name}: expected positive multiples of {block}, got {v}")


def _plan(args, rt):
    """``(rows, dim, hidden, experts)`` of this run, the defaults of the machine filled in."""
    dim, hidden, experts = GPU_SHAPE if rt.gpu else HOST_SHAPE
    rows = sorted(args.tokens or (GPU_ROWS if rt.gpu else HOST_ROWS))
    return rows, args.dim or dim, args.hidden or hidden, args.experts or experts


def describe(args, rt):
    """The first line printed."""
    where = "GPUs (CUDA events)" if rt.gpu else "a CPU (host backend, host clock: the " \
        "machinery's test, not a GPU's costs)"
    return (f"mxcomm calibrate, {rt.size} rank{'s' if rt.size > 1 else ''} on {where}: "
            f"forward + backward of each recipe per rows per rank, saved as the cost table "
            f"auto reads.")


def _device(rt):
    """This rank's device name as tables record it."""
    if not rt.gpu:
        return "cpu"
    import torch
    return torch.cuda.get_device_name(rt.torch_device())


def _device_class(rt):
    from mxcomm.torch import fp8_gemm_available
    return "sm90" if fp8_gemm_available(rt.torch_device()) else ("cuda" if rt.gpu else "cpu")


def measure(args, rt):
    """Measure every runnable recipe at each rows per rank; rank 0 writes the table.

    Returns:
        ``(meta, tables)``: ``tables["calibration"]`` one row per rows per rank (``<recipe>_ms``
        each, the total's median, max over ranks; ``auto``: the recipe the table chooses
        there); ``meta["table"]`` the table as written, ``meta["table_path"]`` where.
    Raises:
        RuntimeError: the ranks run different devices (one table describes one device).
    """
    from mxcomm import recipes
    rt.init_torch_distributed()
    rows, dim, hidden, e_local = _plan(args, rt)
    device = _device(rt)
    names = rt.allgather(device)
    if len(set(names)) > 1:
        raise RuntimeError(f"calibrate: the ranks run different devices ({names}); a table "
                           f"describes one")
    device_class = _device_class(rt)
    chosen = [r for r in (recipes.get_recipe(n) for n in recipes.recipe_names()[1:])
              if recipes.runnable(r, device_class)]
    args.routing = "uniform"  # the table's rows per rank: every rank sends and receives them
    nodes = rt.comm.node_count  # each recipe as the group's nodes run it
    times = {r.name: [] for r in chosen}
    for m in rows:
        case = _pipeline._Case(args, rt, (m, dim, hidden, e_local))
        # each recipe as ExpertParallel runs it by default (the fp8 GEMM's with the overlap)
        stage_lists = {r.name: _moe.stages(_moe.from_recipe(r.for_nodes(nodes),
                                                            overlap=r.gemm == "fp8"),
                                           rt.comm, e_local, loop_gemm=case.loop_gemm)
                       for r in chosen}
        rt.log(f"calibrate {case.label}: {', '.join(stage_lists)}")
        for name, (_, _, total) in case.end_to_end(stage_lists, interleave=True).items():
            times[name].append(round(total.median, 4))
        del case
    table = recipes.CostTable(
        rows=tuple(rows), ms={k: tuple(v) for k, v in times.items()}, ref_dim=dim,
        ref_hidden=hidden, device=device, world_size=rt.size, experts_per_rank=e_local,
        source=f"python -m mxcomm.bench calibrate, {rt.size} x {device}, {e_local} experts per "
               f"rank, uniform routing, median of {args.iters} after {args.warmup} warm-up, "
               f"{_report.git_commit() or 'no commit'}")
    path = args.out or recipes.cache_path(device, rt.size, dim, hidden)
    if rt.rank == 0:
        recipes.save_table(table, path)
    rt.barrier()  # written before any rank goes on to read it
    chooser = recipes.Chooser(dim, hidden, device=device_class, table=table)
    result = [{"rows": m, **{f"{k}_ms": v[i] for k, v in times.items()},
               "auto": chooser.for_rows(m).name} for i, m in enumerate(rows)]
    notes = [f"recipes the devices run ({device_class}): {', '.join(times)}; uniform routing; "
             f"each total the median of {args.iters} after {args.warmup} warm-up, the recipes "
             f"interleaved, max over ranks",
             f"auto: the recipe mxcomm.recipes.Chooser picks from this table (bf16 unless "
             f"another is predicted 2 % faster)"]
    meta = _report.metadata("calibrate", rt.size, [{"tokens": rows, "dim": dim, "hidden": hidden,
                                                    "experts_per_rank": e_local}], notes,
                            run=describe(args, rt), iters=args.iters, warmup=args.warmup,
                            table=table.to_dict(), table_path=os.fspath(path))
    return meta, {"calibration": result}


def _columns(rows):
    return list(rows[0]) if rows else []


def render(meta, tables):
    """Text report: the measured table and auto's answer per row count."""
    rows = tables["calibration"]
    return _report.render_text("mxcomm calibrate", meta, [
        ("fwd + bwd of the whole EP layer per recipe (ms), and auto's choice from this table",
         _report.format_table(rows, _columns(rows))),
        (f"table written to {meta['table_path']}", "")])


def markdown_sections(tables):
    """``(caption, rows, columns)`` for ``--markdown``."""
    rows = tables["calibration"]
    return [("fwd + bwd per recipe (ms), and auto's choice", rows, _columns(rows))]
