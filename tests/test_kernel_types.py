"""Every CUDA kernel types and lowers for the CUDA target, with the argument types the GPU path
gives it.

The simulator runs the kernels as Python, so it accepts code numba's CUDA target rejects (e.g. a
shared array whose shape is not a compile-time constant): such a kernel passes every CPU test and
fails on its first GPU launch. Here the public functions run in the simulator once per kernel
with a recorder on :class:`mxcomm.kernels.Kernel` and :class:`mxcomm.kernels.Launch` (the numba
types ``_argument_type`` gives, which are what a GPU launch compiles), and a child process with the simulator off types each signature
for sm_90 and lowers it to LLVM IR, its device functions included (tests/kernel_types_check.py).
No GPU needed. Where the CUDA compiler wheels are installed (nvidia-cuda-nvcc-cu12 and
nvidia-cuda-nvrtc-cu12; .ci/run installs them) it also compiles each to PTX and reads ptxas's
registers per thread, which must not exceed the budget the launcher sizes its resident grid for;
without them that check skips, saying why.
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import mxcomm
from mxcomm import _driver, _platform, _row_moves, colwise, mxfp8, permutation, rowwise
from mxcomm.kernels import _launch, array_module

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 1234
BF16 = np.dtype(ml_dtypes.bfloat16)


def _spec(t):
    """A JSON spec of the numba type ``t`` (tests/kernel_types_check.py)."""
    from numba import types
    if isinstance(t, types.Array):
        return ["array", str(t.dtype), t.ndim, t.layout]
    return ["bool"] if t == types.boolean else ["int"]


def _all_kernels():
    """{Kernel: (module, attribute)} of every kernel module's kernels."""
    import importlib
    import pkgutil
    import mxcomm.kernels as package
    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"mxcomm.kernels.{info.name}")
        for attr, value in vars(module).items():
            if isinstance(value, _launch.Kernel):
                found.setdefault(value, (module.__name__, attr))
    return found


def _ptxas():
    """The ptxas of the CUDA compiler wheel (nvidia-cuda-nvcc-cu12: NVVM and ptxas; .ci/run
    installs it with NVRTC), or None where it is not installed: then the check stops at LLVM IR
    and the register check skips."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except ModuleNotFoundError:  # no ``nvidia`` package at all: find_spec imports the parent
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "bin", "ptxas")
    return path if os.access(path, os.X_OK) else None


def _register_budgets():
    """{kernel: registers per thread its launcher sizes the resident grid for}
    (``kernels.resident_launch``): more would leave part of the grid to a second wave."""
    from mxcomm.kernels import fp8_block, fp8_rowwise, mx_rowwise
    return {"quantize_fp8_rowwise_bf16_kernel": fp8_rowwise.QUANTIZE_REGISTERS,
            "quantize_fp8_rowwise_f32_kernel": fp8_rowwise.QUANTIZE_REGISTERS,
            "dequantize_fp8_rowwise_bf16_kernel": fp8_rowwise.DEQUANTIZE_REGISTERS,
            "dequantize_fp8_rowwise_f32_kernel": fp8_rowwise.DEQUANTIZE_REGISTERS,
            "quantize_fp8_block128_bf16_kernel": fp8_block.QUANTIZE_BF16_REGISTERS,
            "quantize_fp8_block128_f32_kernel": fp8_block.QUANTIZE_F32_REGISTERS,
            "dequantize_fp8_block128_bf16_kernel": fp8_block.DEQUANTIZE_REGISTERS,
            "dequantize_fp8_block128_f32_kernel": fp8_block.DEQUANTIZE_REGISTERS,
            "mx_to_rowwise_gather_kernel": mx_rowwise.GATHER_REGISTERS}


def _exercise(xp, rng):
    """Launch every kernel once, tiny shapes, through the public functions."""
    for dtype in (BF16, np.float32):
        x = xp.asarray(rng.standard_normal((4, 128)).astype(dtype))
        for fmt in ("mxfp8", "fp8_rowwise", "fp8_block128"):
            q = mxcomm.formats.get_format(fmt).quantize(x)
            q.dequantize(dtype)
    mx = mxfp8.quantize_mxfp8(xp.asarray(rng.standard_normal((4, 64)).astype(BF16)))
    counts = xp.asarray(np.array([1, 2, 0, 1], dtype=np.int32))
    permuted, indices, offsets = permutation.permute(mx, counts, 2, 16)
    permutation.permute(mx, counts, 2, 16, out_format="fp8_rowwise")
    permutation.permute(mx, counts, 2, 16, out_format="bf16")
    permutation.unpermute(xp.asarray(rng.standard_normal((len(indices), 64)).astype(BF16)),
                          indices, 4)
    _row_moves.pad_rows((permuted.data, permuted.scales), mxcomm.formats.get_format("mxfp8"),
                         indices, 0)
    data, scales = rowwise.quantize_fp8_rowwise(xp.asarray(
        rng.standard_normal((32, 32)).astype(BF16)))
    colwise.fp8_rowwise_to_group_colwise(data, scales,
                                             xp.asarray(np.array([20, 32], np.int32)))
    colwise.quantize_fp8_rowwise_transposed(xp.asarray(
        rng.standard_normal((2, 16, 32)).astype(BF16)))
    rows = xp.asarray(np.array([3, 0, 2], np.int32))
    mxfp8.launch_quantize_gather(xp.asarray(rng.standard_normal((4, 64)).astype(BF16)), rows,
                                 mxfp8.MXFP8Array(xp.empty((3, 64), np.uint8),
                                                  xp.empty((3, 2), np.uint8)), 0)
    y = xp.asarray(rng.standard_normal((4, 64)).astype(BF16))
    mxfp8.launch_round_trip(y, None, xp.empty((4, 64), BF16), 0)
    mxfp8.launch_round_trip(y, rows, xp.empty((3, 64), BF16), 0)


@pytest.fixture(scope="module")
def type_check(tmp_path_factory):
    """Every kernel's signatures, recorded from the public functions in the simulator, typed and
    lowered for sm_90 in a child process (tests/kernel_types_check.py), once for the module.

    Returns a namespace: ``kernels`` ({Kernel: (module, attribute)}), ``seen`` (the recorded
    ``(kernel, specs)``), ``signatures``, ``ptxas`` (None without the compiler wheel) and the
    child's ``out`` (``subprocess.CompletedProcess``).
    """
    from numba import config
    if not config.ENABLE_CUDASIM:
        pytest.skip("on a GPU every kernel compiles in the gpu tests")
    seen = {}
    original = _launch.Kernel.__getitem__

    def recording(self, launch):
        run = original(self, launch)

        def call(*args):
            specs = [_spec(_launch._argument_type(a)) for a in args]
            seen.setdefault((self, json.dumps(specs)), specs)
            return run(*args)
        return call

    prepare = _launch.Launch.__init__

    def preparing(self, kernel, config, *args):  # a prepared launch compiles its placeholders
        specs = [_spec(_launch._argument_type(a)) for a in args]
        seen.setdefault((kernel, json.dumps(specs)), specs)
        prepare(self, kernel, config, *args)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(_launch.Kernel, "__getitem__", recording)
        m.setattr(_launch.Launch, "__init__", preparing)
        m.setattr(_platform, "backend", lambda: "simulator")  # conftest's use_backend, once
        _launch.clear_prepared()  # launches prepared by earlier tests would not be seen
        _exercise(array_module(), np.random.default_rng(SEED))
    kernels = _all_kernels()
    signatures = [[*kernels[kernel], specs] for (kernel, _), specs in seen.items()]
    ptxas = _ptxas()
    path = tmp_path_factory.mktemp("kernel_types") / "signatures.json"
    path.write_text(json.dumps({
        "mxcomm_dir": os.path.dirname(mxcomm.__file__),
        "kernels_dir": os.path.dirname(_launch.__file__),
        "signatures": signatures, "require_ptx": ptxas is not None, "ptxas": ptxas}))
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM",
                                                             "MXCOMM_BACKEND")}
    out = subprocess.run([sys.executable, os.path.join(HERE, "kernel_types_check.py"), str(path)],
                         capture_output=True, text=True, timeout=600, env=env)
    return SimpleNamespace(kernels=kernels, seen=seen, signatures=signatures, ptxas=ptxas,
                           out=out)


def test_every_kernel_types_for_the_cuda_target(type_check):
    kernels, out = type_check.kernels, type_check.out
    missed = sorted(f"{m}.{a}" for k, (m, a) in kernels.items()
                    if k not in {kernel for kernel, _ in type_check.seen})
    assert not missed, f"kernels this test does not launch (add them to _exercise): {missed}"
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(": ok") == len(type_check.signatures) >= len(kernels), \
        out.stdout + out.stderr


def test_every_kernel_fits_its_register_budget(type_check):
    if type_check.ptxas is None:
        pytest.skip("ptxas not installed (the CUDA compiler wheel nvidia-cuda-nvcc-cu12, which "
                    ".ci/run installs): registers per thread not checked")
    out = type_check.out
    assert out.returncode == 0, out.stdout + out.stderr
    used = {}
    for line in out.stdout.splitlines():
        name = line.split("(", 1)[0].rsplit(".", 1)[-1]
        used[name] = max(used.get(name, 0), int(line.rsplit("registers=", 1)[1]))
    over = {name: (used[name], budget) for name, budget in _register_budgets().items()
            if used[name] > budget}
    assert not over, (f"kernels using more registers per thread than the budget their grids are "
                      f"sized for (ptxas, sm_90: used, budget): {over}")


def test_a_missing_compiler_wheel_means_no_register_check(monkeypatch):
    """Without any ``nvidia`` package, ``importlib.util.find_spec("nvidia.cuda_nvcc")`` raises
    (it imports the parent): the helper answers None, as where the parent exists without it."""
    import importlib.util
    find_spec = importlib.util.find_spec

    def missing(name, package=None):
        if name == "nvidia" or name.startswith("nvidia."):
            if name != "nvidia":
                raise ModuleNotFoundError("No module named 'nvidia'", name="nvidia")
            return None
        return find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", missing)
    assert _ptxas() is None
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, package=None: None if name.startswith("nvidia") else
                        find_spec(name, package))  # the namespace, without the compiler wheel
    assert _ptxas() is None


# ------------------------------------------------------------------ launch arguments by address
class _DeviceArrayLike:
    """What the launcher reads of a CuPy array, from a NumPy one (``data.ptr`` and the rest)."""

    def __init__(self, a):
        self.size, self.itemsize, self.shape, self.strides = a.size, a.itemsize, a.shape, a.strides
        self.dtype, self.ndim, self.flags = a.dtype, a.ndim, a.flags
        self.data = type("Pointer", (), {"ptr": a.__array_interface__["data"][0]})()


@pytest.mark.parametrize("rows", [False, True])
def test_words_launch_like_the_array_view_they_replace(rows):
    """A ``Words`` (the GPU's launch argument by address) gives the same numba type, cache key,
    ABI layout and ABI values as the CuPy view it replaces (``reshape(-1).view`` or, per row,
    ``view``), so the same compiled function gets the same parameters."""
    a = np.random.default_rng(0).integers(0, 255, (6, 32), dtype=np.uint8)
    word = np.dtype(np.uint64)
    view = a.view(word) if rows else a.reshape(-1).view(word)
    ptr = a.__array_interface__["data"][0]
    w = _launch.Words(ptr, view.shape, word)
    like = _DeviceArrayLike(view)
    assert _launch._argument_type(w) == _launch._argument_type(like)
    assert _launch._argument_key(w) == _launch._argument_key(like)
    assert _launch._abi_format(w) == _launch._abi_format(like)
    assert _launch._abi_values([w, 3]) == _launch._abi_values([like, 3])
    assert w.size == view.size and w.ndim == view.ndim
    np.testing.assert_array_equal(_launch.words(a, word, "a", rows=rows), view)  # simulator


def test_words_rejects_misaligned_arrays():
    raw = np.zeros(112, dtype=np.uint8)
    at = -raw.ctypes.data % 16  # raw[at:] starts 16-byte aligned
    word = np.dtype(np.uint64)
    with pytest.raises(ValueError, match=r"x: expected an address and row size aligned to 8 "
                                         r"bytes \(8-byte words\), got address 0x"):
        _launch.words(raw[at + 1:at + 65], word, "x")
    with pytest.raises(ValueError, match=r"y: .* aligned to 8 bytes .* 12 bytes per row"):
        _launch.words(raw[at:at + 72].reshape(6, 12), word, "y", rows=True)
    # kernels that load word pairs (16 bytes) ask for 16: an 8-byte aligned array is not enough
    with pytest.raises(ValueError, match=r"z: expected an address and row size aligned to 16 "
                                         r"bytes \(8-byte words, loaded 2 at a time\)"):
        _launch.words(raw[at + 8:at + 72].reshape(2, 32), word, "z", rows=True, align=16)
    with pytest.raises(ValueError, match=r"z: .* 16 bytes .* 24 bytes per row"):
        _launch.words(raw[at:at + 96].reshape(4, 24), word, "z", rows=True, align=16)
    assert _launch.words(raw[at:at + 64].reshape(2, 32), word, "z", rows=True,
                         align=16).shape == (2, 4)


# ----------------------------------------------------------------------------- prepared launches
class _RecordingKernel:
    """What a :class:`~mxcomm.kernels.Launch` reads of a Kernel on a GPU (no dispatcher, a
    compiled launcher per argument kinds), with a launcher that records its calls."""

    def __init__(self, parameters):
        self.parameters = parameters
        self._dispatcher = None
        self.calls = []
        self.shared_allowed = []

    def _function(self, args):
        self.key = tuple(map(_launch._argument_key, args))
        kernel = self

        class Function:  # what PackedLaunch offers a Launch
            def __call__(self, blocks, threads, stream, values, shared):
                kernel.calls.append((blocks, threads, stream, list(values), shared))

            def allow_shared(self, nbytes):
                kernel.shared_allowed.append(nbytes)

        return Function()


def test_prepared_launch_fills_in_the_addresses_the_generic_launch_packs():
    """A prepared launch's parameters are exactly the generic launch's (numba's ABI of each
    argument) for the arrays it is called with: the addresses of CuPy-like arrays, ``Words`` or
    ints written into the data field of each placeholder, the fixed ints and bools as given; the
    prepared values are not changed by a call."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 255, (4, 64), dtype=np.uint8)
    out = np.zeros((4, 16), dtype=np.uint32)
    u64, u32 = np.dtype(np.uint64), np.dtype(np.uint32)
    args = (_launch.Words(0, (32,), u64), 7, _launch.Words(0, (4, 16), u32), True)
    kernel = _RecordingKernel(("x", "n", "out", "flag"))
    launch = _launch.Launch(kernel, (3, 64, 99), *args)
    x_like, out_like = _DeviceArrayLike(x.reshape(-1).view(u64)), _DeviceArrayLike(out)
    launch(5, x_like, out_like)
    launch(6, _launch.Words(0x1000, (32,), u64), 0x2000)
    want = _launch._abi_values([x_like, 7, out_like, True])
    assert kernel.calls[0] == (3, 64, 5, want, 0)
    second = list(want)
    second[4], second[7 + 1 + 4] = 0x1000, 0x2000  # data fields: x at 4, out after x (7) and n
    assert kernel.calls[1] == (3, 64, 6, second, 0)
    assert kernel.key == tuple(map(_launch._argument_key, [x_like, 7, out_like, True]))
    assert kernel.shared_allowed == []
    _launch.Launch(kernel, (3, 64, 99, 4096), *args)(7, x_like, out_like)  # dynamic shared memory
    assert kernel.calls[2] == (3, 64, 7, want, 4096)
    assert kernel.shared_allowed == [4096]  # the function's cap is asked for (grown past 48 KiB)


@pytest.mark.parametrize("units", [1, 5, 1000, 123457])
def test_sized_launch_packs_what_a_launch_of_that_size_packs(units):
    """A sized launch, prepared once per unit of work, packs for a call of ``units`` units exactly
    the parameters the generic launch packs for arrays of that size (numba's ABI of full-size
    ``Words``: nitems, shape, strides, addresses), with the fixed ints and bools as given; its grid
    covers ``ceil(units * num / den)`` threads up to its cap, at least one block."""
    u64, u32, u8 = np.dtype(np.uint64), np.dtype(np.uint32), np.dtype(np.uint8)
    kernel = _RecordingKernel(("x", "n", "rows", "scales", "flag"))
    # per unit: 8 words of x, one row of 16 u32, one scale byte; 4 threads per 3 units; cap 40
    launch = _launch.SizedLaunch(kernel, (40, 64, 0), (4, 3), _launch.Words(0, (8,), u64), 7,
                                 _launch.Words(0, (1, 16), u32), _launch.Words(0, (1,), u8), True)
    launch(9, units, 0x1000, 0x2000, 0x3000)
    full = [_launch.Words(0x1000, (8 * units,), u64), 7, _launch.Words(0x2000, (units, 16), u32),
            _launch.Words(0x3000, (units,), u8), True]
    blocks, threads, stream, values, shared = kernel.calls[-1]
    assert (threads, stream, shared) == (64, 9, 0)
    assert values == _launch._abi_values(full)
    assert blocks == max(1, min(40, -(-(-(-units * 4 // 3)) // 64)))
    assert kernel.key == tuple(map(_launch._argument_key, full))  # the same compiled function
    launch(9, 2, 0x1000, 0x2000, 0x3000)  # the prepared values are not changed by a call
    assert kernel.calls[-1][3] == _launch._abi_values(
        [_launch.Words(0x1000, (16,), u64), 7, _launch.Words(0x2000, (2, 16), u32),
         _launch.Words(0x3000, (2,), u8), True])
    with pytest.raises(ValueError, match="one row"):
        _launch.SizedLaunch(kernel, (40, 64, 0), (1, 1), _launch.Words(0, (2, 16), u32))
    # several counts: a placeholder paired with an index scales with that count; the first
    # drives the grid (a gather of P rows from a source of N)
    gather = _launch.SizedLaunch(kernel, (40, 64, 0), (64, 1), _launch.Words(0, (1,), u32),
                                 (_launch.Words(0, (1, 16), u32), 1),
                                 _launch.Words(0, (1, 16), u32))
    gather(3, (units, 7), 0x1000, 0x2000, 0x3000)
    blocks, _, _, values, _ = kernel.calls[-1]
    assert values == _launch._abi_values([_launch.Words(0x1000, (units,), u32),
                                          _launch.Words(0x2000, (7, 16), u32),
                                          _launch.Words(0x3000, (units, 16), u32)])
    assert blocks == min(40, units)
    # an integer argument given per call: ``(None, i)`` is count i of each call, packed where
    # the generic launch packs that int (the permute index's received rows)
    index = _launch.SizedLaunch(kernel, (40, 64, 0), (1, 1), (_launch.Words(0, (1,), u32), 1),
                                3, (None, 2), _launch.Words(0, (1,), u32))
    index(4, (units, 5, 12345), 0x1000, 0x2000)
    assert kernel.calls[-1][3] == _launch._abi_values(
        [_launch.Words(0x1000, (5,), u32), 3, 12345, _launch.Words(0x2000, (units,), u32)])
    assert kernel.key == tuple(map(_launch._argument_key, [_launch.Words(0, (1,), u32), 3, 0,
                                                           _launch.Words(0, (1,), u32)]))
    index(4, (units, 5, 7), 0x1000, 0x2000)  # another value, the same prepared launch
    assert kernel.calls[-1][3][8] == 7  # after the counts Words (7 values) and the fixed 3


def test_row_range_views_rows_by_address():
    """``row_range`` of a device array is a Words at the rows' address with the rows' shape; of a
    NumPy array, the slice itself."""
    a = np.arange(24, dtype=np.float32).reshape(6, 4)
    np.testing.assert_array_equal(_driver.row_range(a, 2, 5), a[2:5])
    like = _DeviceArrayLike(a)
    w = _driver.row_range(like, 2, 5)
    base = a.__array_interface__["data"][0]
    assert (w.ptr, w.shape, w.dtype) == (base + 2 * 16, (3, 4), a.dtype)
    v = _driver.row_range(_DeviceArrayLike(a.reshape(-1)), 3, 7)
    assert (v.ptr, v.shape) == (base + 12, (4,))
    assert _driver.address(_driver.row_range(w, 1, 2)) == base + 3 * 16


def test_prepared_launch_rejects_misaligned_arrays():
    kernel = _RecordingKernel(("x", "out"))
    u64 = np.dtype(np.uint64)
    launch = _launch.Launch(kernel, (1, 32), _launch.Words(0, (4,), u64),
                            _launch.Words(0, (4,), u64))
    with pytest.raises(ValueError, match=r"out: expected an address aligned to 8 bytes "
                                         r"\(8-byte words\), got 0x1004"):
        launch(0, 0x2000, 0x1004)
    pairs = _launch.Launch(kernel, (1, 32), _launch.Words(0, (4,), u64, 16),
                           _launch.Words(0, (4,), u64))
    with pytest.raises(ValueError, match=r"x: expected an address aligned to 16 bytes "
                                         r"\(8-byte words, loaded 2 at a time\), got 0x2008"):
        pairs(0, 0x2008, 0x1008)
    assert not kernel.calls
    pairs(0, 0x2010, 0x1008)
    assert len(kernel.calls) == 1


# ------------------------------------------------------------------ row loads without index wrap
def test_memory_helpers_in_the_simulator_refuse_negative_indices():
    """kernels._memory's GPU forms do not wrap a negative index around (they would read out of
    bounds), so their simulator twins refuse one: a kernel misusing them fails in CI."""
    from numba import cuda
    from mxcomm.kernels import _memory, simulated
    if not simulated():
        pytest.skip("the simulator twins (the GPU forms are checked by the kernels' GPU tests)")
    words = np.arange(8, dtype=np.uint64).reshape(2, 4)
    out = np.zeros(2, dtype=np.uint64)

    @cuda.jit
    def pair(words, row, col, out):
        out[0], out[1] = _memory.load_pair(words, row, col)

    pair[1, 1](words, 1, 1, out)
    assert out.tolist() == [6, 7]
    with pytest.raises(IndexError, match="negative index -1"):
        pair[1, 1](words, 1, -1, out)
