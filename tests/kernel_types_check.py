"""Child process of tests/test_kernel_types.py: type every recorded kernel signature for the CUDA
target and lower it to LLVM IR (no GPU needed: only the last step, LLVM IR to PTX, needs the CUDA
libraries; the device functions a kernel calls are compiled for sm_90 without asking the driver).

    python tests/kernel_types_check.py SIGNATURES.json

SIGNATURES.json: ``{"mxcomm_dir": ..., "kernels_dir": ..., "signatures": [[module, attr,
[spec, ...]], ...], "require_ptx": bool, "ptxas": path or null}``, a spec ``["array", dtype,
ndim, layout]``, ``["int"]`` or ``["bool"]``. Prints one line per signature, ``ok`` (typed and
lowered; with NVVM also compiled to PTX, and with ptxas ``registers=N``, its registers per thread
on sm_90) or the error; exits 1 if any failed.

The simulator is off here (it is decided once, when numba is imported), and the package is set up
without running ``mxcomm/__init__`` (which would pick the host backend on a machine without a GPU):
``mxcomm._platform.backend`` answers ``"cuda"``, so the kernel modules take their GPU forms (inline
PTX helpers, hardware conversions) exactly as on a GPU.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
import types as pytypes


def main(path):
    spec = json.loads(open(path).read())
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    os.environ.pop("MXCOMM_BACKEND", None)
    package = pytypes.ModuleType("mxcomm")
    package.__path__ = [spec["mxcomm_dir"]]
    sys.modules["mxcomm"] = package
    platform = importlib.import_module("mxcomm._platform")
    platform.backend = lambda: "cuda"
    init = importlib.util.spec_from_file_location(
        "mxcomm.kernels", os.path.join(spec["kernels_dir"], "__init__.py"),
        submodule_search_locations=[spec["kernels_dir"]])
    kernels = importlib.util.module_from_spec(init)
    sys.modules["mxcomm.kernels"] = kernels
    init.loader.exec_module(kernels)
    from numba import config, cuda, types
    import numba.cuda.dispatcher as dispatcher
    assert not config.ENABLE_CUDASIM, "the simulator must be off in the type check"

    class Device:  # the device functions a kernel calls compile for this target: no driver
        compute_capability = (9, 0)

    dispatcher.get_current_device = Device

    def numba_type(s):
        if s[0] == "array":
            return types.Array(getattr(types, s[1]), s[2], s[3])
        return types.int64 if s[0] == "int" else types.boolean

    failed = 0
    for module, attr, args in spec["signatures"]:
        compiled = getattr(importlib.import_module(module), attr)
        signature = tuple(map(numba_type, args))
        try:
            ptx, _ = cuda.compile_ptx(compiled.py_func, signature, cc=(9, 0),
                                      launch_bounds=getattr(compiled, "launch_bounds", None))
        except Exception as exc:  # noqa: BLE001 (classified below)
            frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
            if "get_asm_strs" not in frames or spec.get("require_ptx"):
                failed += 1  # failed before the IR reached NVVM (or NVVM itself failed)
                first = (str(exc).strip().splitlines() or [""])[0]
                print(f"{module}.{attr}{signature}: {type(exc).__name__}: {first}")
                continue
            # typed and lowered to LLVM IR; PTX needs NVVM / NVRTC, absent here
            print(f"{module}.{attr}{signature}: ok")
            continue
        registers = _registers(ptx, spec.get("ptxas"))
        print(f"{module}.{attr}{signature}: ok" + (f" registers={registers}" if registers else ""))
    return 1 if failed else 0


def _registers(ptx, ptxas):
    """Registers per thread ptxas gives the kernel in ``ptx`` for sm_90, or None without ptxas."""
    if not ptxas:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90", "-v", path, "-o", os.devnull],
                             capture_output=True, text=True, timeout=300, check=True)
    return int(re.search(r"Used (\d+) registers", out.stderr).group(1))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
