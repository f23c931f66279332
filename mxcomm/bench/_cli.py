"""Command line of ``python -m mxcomm.bench``: argparse subcommands, shared options, output files.

Each benchmark module provides ``add_arguments(parser)``, ``measure(args, rt) -> (meta, tables)``,
``render(meta, tables) -> str`` and ``markdown_sections(tables)``; measuring never prints results.
"""

import argparse
import importlib
import sys
import traceback

from . import _report

COMMANDS = {
    "kernels": "MXFP8 quantize/dequantize and permute/unpermute bandwidth (single process)",
    "a2a": "all-to-all-v: mxcomm vs torch.distributed, drop-in all_to_all_single, leak check",
    "pipeline": "MoE EP pipeline forward + backward: bf16 vs MXFP8 (the main benchmark)",
}

#: Defaults of --iters/--warmup: on a GPU, and under the CPU simulator (tiny shapes, slow kernels).
GPU_ITERS, GPU_WARMUP = 20, 5
SIM_ITERS, SIM_WARMUP = 1, 1


def build_parser():
    """The ``python -m mxcomm.bench`` parser with its three subcommands."""
    parser = argparse.ArgumentParser(
        prog="python -m mxcomm.bench",
        description="Benchmarks of mxcomm. Multi-rank ones run under mpirun, one process per GPU.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{kernels,a2a,pipeline}")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"mxcomm.bench.{name}")
        p = sub.add_parser(name, help=help_text, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--iters", type=int, help=f"timed iterations (default {GPU_ITERS} on a GPU, "
                       f"{SIM_ITERS} on the CPU simulator)")
        p.add_argument("--warmup", type=int, help=f"untimed warm-up iterations first (default "
                       f"{GPU_WARMUP} on a GPU, {SIM_WARMUP} on the CPU simulator)")
        p.add_argument("--json", metavar="PATH", help="write every number and the metadata as JSON")
        p.add_argument("--markdown", metavar="PATH", help="write a short Markdown report")
        module.add_arguments(p)
    return parser


def _apply_defaults(args, simulated):
    if args.iters is None:
        args.iters = SIM_ITERS if simulated else GPU_ITERS
    if args.warmup is None:
        args.warmup = SIM_WARMUP if simulated else GPU_WARMUP
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit(f"--iters must be >= 1 and --warmup >= 0, got {args.iters}, {args.warmup}")


def main(argv=None):
    """Parse ``argv``, run one benchmark, print (rank 0) and write the requested files.

    A failure on any rank prints its traceback and aborts the MPI job, so no rank waits forever
    in a collective its peer never reaches.
    """
    args = build_parser().parse_args(argv)
    from ._runtime import Runtime  # after parsing: --help needs no MPI or device
    module = importlib.import_module(f"mxcomm.bench.{args.command}")
    rt = Runtime(need_comm=args.command != "kernels")
    try:
        _apply_defaults(args, rt.simulated)
        rt.log(f"{args.command}: world size {rt.size}, "
               f"{'CPU simulator' if rt.simulated else 'GPU'}, {args.iters} iters after "
               f"{args.warmup} warm-up")
        meta, tables = module.measure(args, rt)
        if rt.rank == 0:
            title = f"mxcomm {args.command} benchmark"
            print(module.render(meta, tables), flush=True)
            if args.json:
                _report.write_json(args.json, meta, tables)
            if args.markdown:
                _report.write_markdown(args.markdown, title, meta, module.markdown_sections(tables))
            if getattr(args, "plot", None):
                module.plot(args.plot, meta, tables)
        rt.close()
    except BaseException:
        if rt.size > 1:
            traceback.print_exc()
            sys.stderr.flush()
            rt.mpi_comm.Abort(1)
        raise
    return 0
