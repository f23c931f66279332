"""Command line of ``python -m mxcomm.bench``: argparse subcommands, shared options, output files.

Each benchmark module provides ``add_arguments(parser)``, ``validate(args)`` (raises ValueError),
``describe(args, rt) -> str`` (the first line printed: what the run is and is not),
``measure(args, rt) -> (meta, tables)``, ``render(meta, tables) -> str``,
``markdown_sections(tables)`` and optionally ``plot(path, meta, tables)``,
``failed(tables) -> bool`` and ``verdict(meta, tables) -> str`` (the last line printed: what
passed and what failed); measuring never prints results.
"""

import argparse
import gc
import importlib
import importlib.util
import sys
import traceback

from . import _report

COMMANDS = {
    "kernels": "every format's quantize/dequantize, permute/unpermute: time and bandwidth (one "
               "process)",
    "a2a": "all-to-all-v: mxcomm vs torch.distributed, drop-in all_to_all_single, leak check",
    "pipeline": "MoE EP layer forward + backward: torch's bf16 vs mxcomm's recipes (the main "
                "benchmark)",
    "latency": "host and device time per dispatch/combine call through mxcomm.torch, vs torch",
    "torchtitan": "torchtitan's MoE layer (DeepSeek-V3 config) fwd + bwd: its bf16 and float8 "
                  "experts vs mxcomm's, eager and compiled",
    "calibrate": "measure each recipe's fwd + bwd per rows per rank and save the cost table "
                 "that the recipe auto reads",
}

#: Defaults of --iters/--warmup: on a GPU, and on a CPU (where only ``kernels`` times anything,
#: and ``a2a`` times the MPI exchange).
GPU_ITERS, GPU_WARMUP = 20, 5
CPU_ITERS, CPU_WARMUP = 3, 1


def build_parser():
    """The ``python -m mxcomm.bench`` parser with its subcommands (:data:`COMMANDS`)."""
    parser = argparse.ArgumentParser(
        prog="python -m mxcomm.bench",
        description="Benchmarks of mxcomm. Multi-rank ones run under mpirun or torchrun, one "
                    "process per GPU; without a GPU they run on the CPU (host backend, MPI or "
                    "torch.distributed communicator).")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{" + ",".join(COMMANDS) + "}")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"mxcomm.bench.{name}")
        p = sub.add_parser(name, help=help_text, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--iters", type=int, metavar="N",
                       help=f"timed iterations, >= 1 (default {GPU_ITERS} on a GPU, {CPU_ITERS} "
                            f"on a CPU)")
        p.add_argument("--warmup", type=int, metavar="N",
                       help=f"untimed iterations before them, >= 0 (default {GPU_WARMUP} on a GPU, "
                            f"{CPU_WARMUP} on a CPU)")
        p.add_argument("--json", metavar="PATH",
                       help="also write every number and the metadata as JSON to PATH")
        p.add_argument("--markdown", metavar="PATH", help="also write a Markdown report to PATH")
        p.add_argument("--gc", choices=("on", "off"), default="on",
                       help="Python's automatic garbage collection while measuring: on (default), "
                            "or off after one collection (gc.disable(), as torchtitan's trainer "
                            "runs; cyclic garbage then waits for the end of the run)")
        if name != "kernels":
            p.add_argument("--peer-memory", choices=("auto", "on", "off"), default="auto",
                           help="the communicator's peer_memory (mxcomm.comm.init): auto "
                                "(default: pull from the peers' memory where every rank is on "
                                "one node and can), on (require it: across nodes the hier "
                                "transport), off (never: the grouped transport, one NCCL group "
                                "per exchange)")
            p.add_argument("--small-exchange-bytes", type=int, metavar="BYTES",
                           help="the communicator's small_exchange_bytes (mxcomm.comm.init): "
                                "quantized exchanges in which no rank sends more bytes of rows "
                                "to its peers move them unquantized and quantize on arrival; 0 "
                                "never (default: the backend's)")
            p.add_argument("--medium-exchange-bytes", type=int, metavar="BYTES",
                           help="the communicator's medium_exchange_bytes (mxcomm.comm.init): "
                                "quantized exchanges kept quantized, not small, in which no rank "
                                "sends more bytes of rows to its peers are quantized, then moved "
                                "in one alltoallv instead of staged; 0 never (default: the "
                                "backend's)")
        module.add_arguments(p)
    return parser


def validate(args, module):
    """Check the options shared by every benchmark, then the module's own.

    Raises:
        ValueError: a bad value, with a message naming the option; --plot without matplotlib.
    """
    if args.iters is not None and args.iters < 1:
        raise ValueError(f"--iters: expected >= 1, got {args.iters}")
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup: expected >= 0, got {args.warmup}")
    for name in ("small_exchange_bytes", "medium_exchange_bytes"):
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise ValueError(f"--{name.replace('_', '-')}: expected >= 0, got {value}")
    if getattr(args, "plot", None) and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot: needs matplotlib, which is not installed (pip install "
                         "matplotlib, or leave --plot out)")
    module.validate(args)


def _apply_defaults(args, gpu):
    if args.iters is None:
        args.iters = GPU_ITERS if gpu else CPU_ITERS
    if args.warmup is None:
        args.warmup = GPU_WARMUP if gpu else CPU_WARMUP


def _rank():
    """This process's rank: ``RANK`` under torchrun, else MPI's (initializes MPI)."""
    from ._runtime import launched_by_torchrun
    if launched_by_torchrun():
        import os
        return int(os.environ.get("RANK", "0"))
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


def main(argv=None):
    """Parse ``argv``, run one benchmark, print (rank 0) and write the requested files.

    Bad options end the run on every rank (each checks the same arguments) with one line on
    stderr and exit status 2, before anything is measured. A failure while measuring prints its
    traceback and aborts the job (MPI's abort, or an exit that torchrun answers by stopping the
    others), so no rank waits forever in a collective its peer never reaches.

    Returns:
        0, or 1 when the benchmark reports a failed check (``failed(tables)``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(f"mxcomm.bench.{args.command}")
    try:
        validate(args, module)
    except ValueError as e:
        if _rank() == 0:
            print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 2
    from ._runtime import Runtime  # after parsing: --help needs no MPI or device
    peer_memory = {"auto": None, "on": True, "off": False}[getattr(args, "peer_memory", "auto")]
    rt = Runtime(need_comm=args.command != "kernels", peer_memory=peer_memory,
                 small_exchange_bytes=getattr(args, "small_exchange_bytes", None),
                 medium_exchange_bytes=getattr(args, "medium_exchange_bytes", None))
    try:
        _apply_defaults(args, rt.gpu)
        rt.print(module.describe(args, rt))
        collecting = gc.isenabled()
        if args.gc == "off":
            gc.collect()
            gc.disable()
        try:
            meta, tables = module.measure(args, rt)
        finally:
            if collecting:
                gc.enable()
        if args.gc == "off":
            meta["notes"].append("Python's automatic garbage collection off while measuring "
                                 "(--gc off: gc.disable() after one collection, as torchtitan's "
                                 "trainer runs)")
        meta["gc"] = args.gc
        if rt.comm is not None:
            meta["transport"] = rt.comm.transport
            meta["nodes"] = list(rt.comm.nodes)
            if rt.comm.node_count > 1:
                how = ("peer memory inside a node, the backend between nodes"
                       if rt.comm.transport == "hier" else
                       f"every exchange through the {rt.comm.transport} transport")
                meta["notes"].append(f"nodes {list(rt.comm.nodes)} (node of each rank): {how}")
            if peer_memory is not None:
                meta["notes"].append(f"--peer-memory {args.peer_memory}: the communicator's "
                                     f"exchanges use the {rt.comm.transport} transport")
            meta["small_exchange_bytes"] = rt.comm.small_exchange_bytes
            if rt.comm.small_exchange_bytes:
                meta["notes"].append(
                    f"small exchanges: quantized exchanges in which no rank sends more than "
                    f"{rt.comm.small_exchange_bytes} bytes of rows to its peers move them "
                    f"unquantized and quantize on arrival (same results; small_exchange_bytes)")
            meta["medium_exchange_bytes"] = rt.comm.medium_exchange_bytes
            if rt.comm.medium_exchange_bytes:
                meta["notes"].append(
                    f"medium exchanges: quantized exchanges kept quantized (dispatch, combine "
                    f"gradient), not small, in which no rank sends more than "
                    f"{rt.comm.medium_exchange_bytes} bytes of rows to its peers are quantized, "
                    f"then moved in one alltoallv instead of staged (same results; "
                    f"medium_exchange_bytes)")
        if rt.rank == 0:
            print(module.render(meta, tables), flush=True)
            written = []
            if args.json:
                _report.write_json(args.json, meta, tables)
                written.append(args.json)
            if args.markdown:
                _report.write_markdown(args.markdown, f"mxcomm {args.command} benchmark", meta,
                                       module.markdown_sections(tables))
                written.append(args.markdown)
            if getattr(args, "plot", None):
                module.plot(args.plot, meta, tables)
                written.append(args.plot)
            for path in written:
                print(f"wrote {path}", flush=True)
            if hasattr(module, "verdict"):
                print(module.verdict(meta, tables), flush=True)
        rt.close()
    except BaseException:
        if rt.size > 1:
            traceback.print_exc()
            sys.stderr.flush()
            rt.abort()
        raise
    failed = getattr(module, "failed", None)
    return 1 if failed is not None and failed(tables) else 0
