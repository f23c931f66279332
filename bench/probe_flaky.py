"""The 4-rank GPU test that failed only inside the whole suite
(``tests/test_recipes.py::test_gpu_backward_that_starts_in_mxcomm``), its body under each
communicator configuration, so one run says which configuration and which way of running it
changes the gradients (bench/NOTES.md, 2026-11-27, "the flaky 4-rank test").

    mpirun -n W python bench/probe_flaky.py [repeats] [recipe]

The body: ``ExpertParallel(recipe=...)`` dispatch, ``grouped_mm``, combine, then the backward, on
the test's seeded rows (tests/test_recipes.py's ``_routed``, 256-510 rows per rank, D 64, H 32).
Each repeat runs it four ways: forward in a fresh thread or in this one, times backward started
by ``out.backward(grad)`` (in mxcomm's combine) or by a torch op (``(out.float() *
grad.float()).sum()``); the test compares the two fresh-thread ways. Every run's input and weight
gradients are compared with the first run of the first configuration, bit for bit.

Configurations, in this order (those emulating nodes last: ``init("nccl", node_size=k)`` exports
``NCCL_HOSTID=node<k>`` for the process, undone here after each):

- ``pull``: ``init()``, one node, small and medium exchanges on (the test's file alone);
- ``pull-staged``: both limits 0: one node, every quantized exchange staged over CUDA IPC;
- ``hier-1``: ``node_size=1, peer_memory=True``: every rank its own node, so the ``hier``
  transport with both limits 0 and NCCL over its network transport: what the whole GPU suite
  ran after tests/test_nodes.py left ``NCCL_HOSTID=node<rank>`` set (``hier`` was then the
  default across nodes);
- ``hier-2``: ``node_size=2, peer_memory=True`` (4 ranks and more).

``PROBE_CONFIGS`` (comma-separated names) picks some. Each rank prints one line per run that
differs (which gradient, how many elements, NaNs, the largest difference, the first rows); rank 0
ends with a table of differing runs per configuration and way, over all ranks. Runs on a CPU too
(host backend under mpiexec; ``hier`` over MPI shared windows), where nothing should differ.
"""

import os
import sys
import threading

import numpy
import torch
from mpi4py import MPI

import mxcomm.torch as mt
from mxcomm import comm as mxc

SEED, E_LOCAL, D, H, ALIGN = 4321, 2, 64, 32, 16  # tests/test_recipes.py's
NODE_ENV = ("NCCL_HOSTID", "MXCOMM_NODE_SIZE")
CONFIGS = {"pull": {}, "pull-staged": dict(small_exchange_bytes=0, medium_exchange_bytes=0),
           "hier-1": dict(node_size=1, peer_memory=True),
           "hier-2": dict(node_size=2, peer_memory=True)}
WAYS = [(thread, direct) for thread in (True, False) for direct in (True, False)]


def routed(rank, world, device, tokens_max=256):
    """tests/test_recipes.py's ``_routed``: rows sorted by expert, counts, output gradient,
    weights; seeded per rank; the last expert receives nothing."""
    rng = numpy.random.default_rng(SEED + rank)
    experts = world * E_LOCAL
    m = int(rng.integers(tokens_max // 2, tokens_max)) * 2
    dest = numpy.sort(rng.integers(0, experts - 1, m))
    counts = numpy.bincount(dest, minlength=experts).astype(numpy.int32)
    x = torch.from_numpy(rng.standard_normal((m, D)).astype(numpy.float32)).to(torch.bfloat16)
    grad = torch.from_numpy(rng.standard_normal((m, H)).astype(numpy.float32)).to(torch.bfloat16)
    w = torch.from_numpy((rng.standard_normal((E_LOCAL, D, H)) / 8).astype(numpy.float32))
    return (x.to(device), torch.from_numpy(counts).to(device), grad.to(device),
            w.to(torch.bfloat16).to(device))


def one_run(comm, device, recipe, thread, direct):
    """(x.grad, w.grad) of one forward and backward, as the test runs them."""
    ep = mt.ExpertParallel(comm=comm, num_local_experts=E_LOCAL, recipe=recipe, align=ALIGN,
                           gemm_fallback=True)
    x, counts, grad, w = routed(comm.rank, comm.size, device)
    xa, wa = (t.detach().clone().requires_grad_() for t in (x, w))
    box = {}

    def run():
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            rows, offs, handle = ep.dispatch(xa, counts)
            out = ep.combine(mt.grouped_mm(rows, wa, offs), handle)
            if direct:
                out.backward(grad.to(out.dtype))
            else:
                (out.float() * grad.float()).sum().backward()
            box["grads"] = (xa.grad.clone(), wa.grad.clone())
        except Exception as exc:  # noqa: BLE001 (reported, then raised on this thread)
            box["error"] = exc

    if thread:
        t = threading.Thread(target=run)
        t.start()
        t.join(120)
    else:
        run()
    if "error" in box:
        raise box["error"]
    if "grads" not in box:
        raise TimeoutError(f"rank {comm.rank}: the run did not finish within 120 s")
    return box["grads"]


def differences(got, want):
    """A text per gradient that differs from ``want`` (bit for bit), or an empty list."""
    texts = []
    for name, a, b in zip(("x.grad", "w.grad"), got, want):
        if torch.equal(a.view(torch.int16), b.view(torch.int16)):
            continue
        diff = (a.float() - b.float()).abs()
        flat = diff.reshape(diff.shape[0], -1)
        rows = torch.nonzero((flat != 0) | flat.isnan()).flatten().unique()
        texts.append(f"{name}: {int(((diff != 0) | diff.isnan()).sum())} of {diff.numel()} "
                     f"differ, NaN {int(a.isnan().sum())} here / {int(b.isnan().sum())} first, "
                     f"max {diff.nan_to_num(float('inf')).max().item():.3g}, rows "
                     f"{rows[:8].tolist()} of {a.shape[0]}")
    return texts


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    recipe = sys.argv[2] if len(sys.argv) > 2 else "mxfp8"
    names = os.environ.get("PROBE_CONFIGS", ",".join(CONFIGS)).split(",")
    world = MPI.COMM_WORLD
    me = world.Get_rank()
    reference, counted = None, {}
    for name in names:
        options = CONFIGS[name]
        if options.get("node_size", 1) >= world.Get_size() and "node_size" in options:
            continue  # one node: the same as pull-staged
        saved = {key: os.environ.pop(key, None) for key in NODE_ENV}
        try:
            comm = mxc.init(timeout=60.0, **options)
            device = torch.device("cpu") if getattr(comm, "device", None) is None else \
                torch.device("cuda", comm.device)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            where = f"{name} ({comm.transport}, small {comm.small_exchange_bytes}, " \
                    f"medium {comm.medium_exchange_bytes}, NCCL_HOSTID " \
                    f"{os.environ.get('NCCL_HOSTID')})"
            for repeat in range(repeats):
                for thread, direct in WAYS:
                    grads = one_run(comm, device, recipe, thread, direct)
                    if reference is None:
                        reference = grads
                    way = f"{'fresh thread' if thread else 'this thread'}, " \
                          f"{'from mxcomm' if direct else 'from a torch op'}"
                    texts = differences(grads, reference)
                    counted.setdefault((name, way), 0)
                    if texts:
                        counted[(name, way)] += 1
                        print(f"rank {me} {where} repeat {repeat}, {way}: " + "; ".join(texts),
                              flush=True)
            comm.close()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    table = world.gather(counted, root=0)
    if me == 0:
        print(f"\n{recipe}, {world.Get_size()} ranks, {repeats} repeats: runs differing from "
              f"the first (per rank, ranks 0..{world.Get_size() - 1})")
        print("| configuration | way | differing runs per rank |\n| --- | --- | --- |")
        for key in counted:
            print(f"| {key[0]} | {key[1]} | {[t.get(key, 0) for t in table]} |")


if __name__ == "__main__":
    main()
