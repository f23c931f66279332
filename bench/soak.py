"""Soak (issue 14, item 6): N steps of random layouts through the layout path of the array API,
exchange_layout -> a2a_dispatch -> permute -> unpermute -> a2a_combine and the backwards
(a2a_combine_backward, a2a_dispatch_backward), once per precision in mxcomm.a2a.PRECISIONS.

    mpiexec -n 2 python bench/soak.py --calls 200            # CPU
    mpirun -n 2 python bench/soak.py --calls 10000           # 2 GPUs

Records calls, ranks, host RSS and (on a GPU) the CuPy pool's used bytes before and after, a hash
of every output (run twice with one seed: identical), and that a NaN in one token gives NaN in
exactly that token's 32-element blocks of the combine output (every precision).
"""

import argparse
import hashlib
import resource
import time

import numpy

import mxcomm
from mxcomm import comm as mxc
from mxcomm._array import bfloat16
from mxcomm._platform import gpu_arrays
from mxcomm.kernels import array_module
from mxcomm.a2a import (PRECISIONS, a2a_combine, a2a_combine_backward, a2a_dispatch,
                        a2a_dispatch_backward)
from mxcomm.layout import exchange_layout
from mxcomm.permutation import permute, unpermute

E_LOCAL = 2
D = 128


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2 ** 20


def pool_used():
    if not gpu_arrays():
        return 0
    import cupy
    return cupy.get_default_memory_pool().used_bytes()


def to_host(a):
    if hasattr(a, "dequantize"):
        a = a.dequantize()
    return a.get() if hasattr(a, "get") else numpy.asarray(a)


def counts_for(rng, w, step):
    """Every rank's counts: random, an empty rank, empty experts, one rank receiving everything."""
    e = w * E_LOCAL
    c = rng.integers(0, 6, size=(w, e))
    kind = step % 4
    if kind == 1:
        c[step % w] = 0
    elif kind == 2:
        c[:, rng.integers(0, e, size=e // 2)] = 0
    elif kind == 3:
        c[:] = 0
        c[:, (step % w) * E_LOCAL] = rng.integers(0, 8, size=w)
    return c


def step(comm, rng, s, precision, h, nan_token=None):
    xp = array_module()
    counts = counts_for(rng, comm.size, s)[comm.rank].astype(numpy.int32)
    layout = exchange_layout(xp.asarray(counts), comm)
    x = rng.standard_normal((layout.num_rows, D)).astype(numpy.float32)
    if nan_token is not None and layout.num_rows:
        x[nan_token % layout.num_rows, 3] = numpy.nan
    x = xp.asarray(x.astype(bfloat16))
    received = a2a_dispatch(x, layout, precision=precision)
    rows, indices, offsets = permute(received, layout, E_LOCAL)
    back = unpermute(rows, indices, layout)
    out = a2a_combine(back, layout, precision=precision)
    g = a2a_combine_backward(out, layout, precision=precision)
    gx = a2a_dispatch_backward(g, layout, precision=precision)
    for a in (received, back, out, g, gx):
        h.update(numpy.ascontiguousarray(to_host(a)).tobytes())
    return to_host(x), to_host(out)


def run(comm, calls, seed):
    h = hashlib.sha256()
    rng = numpy.random.default_rng(seed + comm.rank)
    for i in range(calls):
        step(comm, rng, i, PRECISIONS[i % len(PRECISIONS)], h)
    return h.hexdigest()


BLOCK = {"bf16": 1, "native": 1, "mxfp8": 32, "fp8_rowwise": D, "fp8_block128": 128,
         "fp8_block128_pow2": 128}  # elements sharing one scale (NaN spreads over them)


def nan_check(comm, seed):
    """NaN in one token -> NaN in exactly that token's scale blocks of the combined output (the
    element for bf16/native, 32 for mxfp8, the row for fp8_rowwise, 128 for fp8_block128*)."""
    exact = {}
    for p in PRECISIONS:
        g = BLOCK.get(p, 1)
        rng = numpy.random.default_rng(seed + comm.rank)
        x, out = step(comm, rng, 0, p, hashlib.sha256(), nan_token=1)
        want = numpy.isnan(x.astype(numpy.float32)).reshape(x.shape[0], -1, g).any(-1)
        want = numpy.repeat(want, g, axis=1)
        exact[p] = bool((numpy.isnan(out.astype(numpy.float32)) == want).all())
    return exact


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    comm = mxc.init()
    run(comm, 4 * len(PRECISIONS), args.seed)  # warm-up: staging and caches in place
    rss0, pool0, t0 = rss_mib(), pool_used(), time.perf_counter()
    first = run(comm, args.calls, args.seed)
    rss1, pool1, t1 = rss_mib(), pool_used(), time.perf_counter()
    second = run(comm, args.calls, args.seed)
    nan = nan_check(comm, args.seed)
    line = (f"rank {comm.rank}/{comm.size}: {args.calls} steps x 6 calls, precisions "
            f"{','.join(PRECISIONS)}; RSS {rss0:.1f} -> {rss1:.1f} MiB; pool {pool0} -> {pool1} B; "
            f"rerun identical {first == second} ({first[:12]}); NaN blocks exact {nan}; "
            f"{t1 - t0:.1f} s")
    for r in range(comm.size):
        comm.barrier() if hasattr(comm, "barrier") else None
        if r == comm.rank:
            print(line, flush=True)
    ok = first == second and all(nan.values())
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
