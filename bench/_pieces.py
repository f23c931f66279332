"""Where a host path's time goes, for the bench scripts (``probe_host.py``, ``profile_step.py``):
cProfile's inclusive time and calls of every function of the library (``mxcomm/`` but its
benchmarks, ``comm/``, ``kernels/``) that some calls enter, found by file, so no private name is
named here. cProfile adds about 0.5 us per entry."""

import cProfile
import os
import pstats

_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
_LIBRARY = tuple(os.path.join(_ROOT, name) + os.sep for name in ("mxcomm", "comm", "kernels"))
_BENCH = os.path.join(_ROOT, "mxcomm", "bench") + os.sep


def pieces(fn, n):
    """Run ``fn()`` ``n`` times under cProfile; return ``[(label, us per call, entries per
    call), ...]`` of the library's functions (and ``time.sleep``), most inclusive time first."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        fn()
    profiler.disable()
    rows = []
    for (path, line, name), (_, calls, _, cumtime, _) in pstats.Stats(profiler).stats.items():
        real = os.path.realpath(path)
        if name == "<built-in method time.sleep>" or \
                (real.startswith(_LIBRARY) and not real.startswith(_BENCH)):
            label = f"{os.path.relpath(real, _ROOT)}:{name}" if path != "~" else name
            rows.append((label, cumtime / n * 1e6, calls / n))
    return sorted(rows, key=lambda row: -row[1])
