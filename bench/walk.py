"""Count the library's Python function entries of one MXFP8 staged dispatch through mxcomm.torch.

Run: ``mpiexec -n 2 python bench/walk.py [rows] [dim]`` (CPU, host backend, MPI communicator).

One ``mxcomm.torch.a2a_dispatch(x, layout)`` (precision ``"mxfp8"``; the host backend's staged
route) is made twice to warm up, then, after a barrier and with rank 0 half a second late (so
that its waits for the peers succeed at once and the count does not depend on timing), once
under ``sys.setprofile``: every ``call`` event whose
code lives in the library (``mxcomm/`` but ``mxcomm/bench/``, ``comm/``, ``kernels/``) counts as
an entry. Rank 0 prints the files and the entries per function, the totals, and the callbacks up:
entries of an ``mxcomm/`` function made from a ``comm/`` or ``kernels/`` frame, apart from those
into the leaves that docs/design.md lets ``comm/`` and ``kernels/`` import (``_platform``,
``_driver``, ``_array``), which it counts on their own.
"""

import collections
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
LIBRARY = [os.path.join(ROOT, name) + os.sep for name in ("mxcomm", "comm", "kernels")]
EXCLUDED = os.path.join(ROOT, "mxcomm", "bench") + os.sep
LEAVES = tuple(os.path.join("mxcomm", name) for name in ("_platform.py", "_driver.py", "_array.py"))


def library_file(code):
    """The file of ``code`` relative to the repository, or None outside the library."""
    path = os.path.realpath(code.co_filename)
    if path.startswith(EXCLUDED) or not any(path.startswith(p) for p in LIBRARY):
        return None
    return os.path.relpath(path, ROOT)


def _name(code):
    """The function's qualified name (Python 3.11+), else its name."""
    return getattr(code, "co_qualname", code.co_name)


def walk(call):
    """``(entries, callbacks, leaves)`` of one ``call()``: ``[(file, function), ...]`` in call
    order, and the entries into ``mxcomm/`` made from a ``comm/`` or ``kernels/`` frame (into
    its leaves, and into the rest)."""
    entries, callbacks, leaves = [], [], []

    def profile(frame, event, arg):
        if event != "call":
            return
        where = library_file(frame.f_code)
        if where is None:
            return
        entries.append((where, _name(frame.f_code)))
        caller = frame.f_back
        up = library_file(caller.f_code) if caller is not None else None
        if where.startswith("mxcomm") and up is not None and not up.startswith("mxcomm"):
            (leaves if where in LEAVES else callbacks).append(
                f"{up}:{_name(caller.f_code)} -> {where}:{_name(frame.f_code)}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entries, callbacks, leaves


def main():
    import mxcomm.comm
    import mxcomm.torch as mxt

    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    dim = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    comm = mxcomm.comm.init("mpi")
    experts = 2 * comm.size
    torch.manual_seed(comm.rank)
    counts = torch.full((experts,), rows // experts, dtype=torch.int32)
    x = torch.randn(int(counts.sum()), dim, dtype=torch.bfloat16)
    layout = mxt.exchange_layout(counts, comm)
    for _ in range(2):
        mxt.a2a_dispatch(x, layout)
    comm.barrier()
    if comm.rank == 0:  # the measured rank comes last, so it never waits in a spin loop
        time.sleep(0.5)
    entries, callbacks, leaves = walk(lambda: mxt.a2a_dispatch(x, layout))
    if comm.rank == 0:
        files = collections.Counter(f for f, _ in entries)
        functions = collections.Counter(entries)
        print(f"transport {comm.transport}, {comm.size} ranks, {rows} rows of D = {dim}")
        for (f, name), n in functions.items():
            print(f"{n:4d}  {f}:{name}")
        print(f"files {len(files)}, entries {len(entries)}, callbacks up {len(callbacks)}, "
              f"calls into the leaves {len(leaves)}")
        for line in sorted(set(callbacks)):
            print(f"  up: {line}")
        for line in sorted(set(leaves)):
            print(f"  leaf: {line}")
    comm.close()


if __name__ == "__main__":
    main()
