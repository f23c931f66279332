"""A world of processes joined by torch.distributed (gloo, a FileStore), for tests that need no MPI.

``run_world(size, fn, *args)`` spawns ``size`` fresh processes (``multiprocessing`` spawn), joins
them in one gloo process group (``init_process_group`` over a FileStore in a temporary folder, as
``torchrun`` would over TCP), runs ``fn(rank, size, *args)`` in each and returns every rank's
result, in rank order. The processes run mxcomm's host backend (``MXCOMM_BACKEND=host``), unless
``gpu=True``: then rank r uses GPU r and the group is NCCL. A rank that raises fails the test
with its traceback; a world that does not finish within ``timeout`` seconds is killed and fails
the test, so a hung collective never stalls the suite. ``fn`` must be a module-level function (spawned processes import it by name).

``run_torchrun(args, timeout)`` runs ``torchrun --standalone --nproc-per-node 2 -m ARGS`` on the
host backend, killed whole (torchrun's workers with it) if it outlasts ``timeout``.
"""

import datetime
import os
import signal
import subprocess
import sys
import queue as queue_module
import tempfile
import time
import traceback

import pytest


def _child(rank, size, store, fn, args, results, gpu):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)  # several ranks share the CI machine's cores
    try:
        if gpu:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{store}",
                                rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=60))
        outcome = ("ok", fn(rank, size, *args))
    except BaseException:  # noqa: BLE001 (reported to the parent, which fails the test)
        outcome = ("error", traceback.format_exc())
    results.put((rank,) + outcome)
    results.close()
    results.join_thread()
    os._exit(0)  # no teardown: a rank may hold a timed-out (abandoned) gloo operation


def run_world(size, fn, *args, timeout=120.0, gpu=False):
    """Run ``fn(rank, size, *args)`` on ``size`` spawned ranks of one gloo (``gpu``: NCCL, one
    GPU per rank) group; their results.

    Raises (pytest failure): a rank raised (its traceback), died, or the world did not finish
    within ``timeout`` s.
    """
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    got, problems = {}, []
    saved = os.environ.get("MXCOMM_BACKEND")
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        procs = [ctx.Process(target=_child, args=(rank, size, store, fn, args, results, gpu),
                             daemon=True) for rank in range(size)]
        os.environ["MXCOMM_BACKEND"] = "cuda" if gpu else "host"  # inherited by the ranks
        try:
            for p in procs:
                p.start()
        finally:
            if saved is None:
                del os.environ["MXCOMM_BACKEND"]
            else:
                os.environ["MXCOMM_BACKEND"] = saved
        deadline = time.monotonic() + timeout
        while len(got) < size:
            left = deadline - time.monotonic()
            if left <= 0:
                problems.append(f"the world did not finish within {timeout:g} s; ranks "
                                f"{sorted(set(range(size)) - got.keys())} are missing")
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
                if dead:  # its result may still be in flight: drain for a second, then judge
                    try:
                        while True:
                            rank, status, value = results.get(timeout=1.0)
                            got[rank] = (status, value)
                    except queue_module.Empty:
                        pass
                    dead = [r for r in dead if r not in got]
                    if dead:
                        problems.append(f"ranks {dead} died without a result (exit codes "
                                        f"{[procs[r].exitcode for r in dead]})")
                        break
                continue
            got[rank] = (status, value)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    problems += [f"rank {r} raised:\n{value}" for r, (status, value) in sorted(got.items())
                 if status == "error"]
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    return [got[r][1] for r in range(size)]


def run_torchrun(args, timeout=180):
    """``torchrun --standalone --nproc-per-node 2 -m <args>`` with mxcomm's host backend, in its
    own session so a hung run is killed whole; returns ``(returncode, stdout, stderr)``, and
    fails the test when it does not finish within ``timeout`` seconds."""
    env = dict(os.environ, MXCOMM_BACKEND="host", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "-m", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"torchrun -m {' '.join(args[:3])} did not finish within {timeout} s")
    return proc.returncode, stdout, stderr
