"""The one decision of where array work runs (``mxcomm._platform``, ``MXCOMM_BACKEND``)."""

import os
import re
import subprocess
import sys

import pytest

from mxcomm import _platform
from mxcomm.kernels import array_module, simulated


def run_python(code, backend):
    """Run ``code`` in a fresh interpreter with ``MXCOMM_BACKEND=backend`` (None: unset)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MXCOMM_BACKEND", "NUMBA_ENABLE_CUDASIM")}
    if backend is not None:
        env["MXCOMM_BACKEND"] = backend
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)


def test_this_process_follows_the_decision():
    backend = _platform.backend()
    assert backend in ("cuda", "host", "simulator")
    assert _platform.gpu_arrays() == (backend == "cuda") == (array_module().__name__ == "cupy")
    assert _platform.host_backend() == (backend == "host")
    assert simulated() == _platform.kernels_simulated() == (backend != "cuda")
    if not _platform.gpu_present():
        assert backend != "cuda"


def test_platform_is_a_leaf():
    """The module deciding imports nothing but the standard library (no numba, no CuPy)."""
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('alone', {_platform.__file__!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "print(m.backend(), sorted(k for k in sys.modules if k.split('.')[0] in "
            "('numba', 'cupy', 'numpy', 'mxcomm')))")
    out = run_python(code, "host")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "host []"


@pytest.mark.skipif(_platform.gpu_present(), reason="the default on a CPU")
def test_default_on_a_cpu_is_the_host_backend_with_simulated_kernels():
    out = run_python("import mxcomm, mxcomm._platform as p, mxcomm.kernels as k, os; "
                     "print(p.backend(), k.simulated(), os.environ['NUMBA_ENABLE_CUDASIM'])", None)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["host", "True", "1"]


@pytest.mark.skipif(_platform.gpu_present(), reason="a CPU-only check")
def test_simulator_backend_routes_the_api_through_the_kernels():
    code = ("import numpy, ml_dtypes, mxcomm, mxcomm._platform as p, mxcomm._host as h\n"
            "h.quantize_mxfp8 = None  # the host backend must not be called\n"
            "x = numpy.ones((2, 32), ml_dtypes.bfloat16)\n"
            "mx = mxcomm.quantize_mxfp8(x)\n"
            "print(p.backend(), int(mx.data[0, 0]), int(mx.scales[0, 0]))")
    out = run_python(code, "simulator")
    assert out.returncode == 0, out.stderr
    # rceil: s = ceil(log2(1 / 448)) = -8, biased 119; 1.0 / 2^-8 = 256 = e4m3 0x78
    assert out.stdout.split() == ["simulator", str(0x78), str(127 - 8)]


@pytest.mark.parametrize("value,error", [
    ("gpu", "ValueError: MXCOMM_BACKEND: expected one of auto, cuda, host, simulator, got 'gpu'"),
    ("cuda", "RuntimeError: MXCOMM_BACKEND=cuda, but no CUDA device is present"),
])
def test_bad_backend_is_a_clear_error(value, error):
    if value == "cuda" and _platform.gpu_present():
        pytest.skip("a CUDA device is present")
    out = run_python("import mxcomm", value)
    assert out.returncode != 0 and error in out.stderr
    # raised where the backend is decided, first thing at import: no frame of another module
    frames = re.findall(r'File "([^"]+)", line \d+', out.stderr)
    package = os.path.dirname(os.path.abspath(_platform.__file__))
    assert frames == ["<string>", os.path.join(package, "__init__.py"),
                      os.path.join(package, "_platform.py")], out.stderr
