"""The host backend against the CUDA kernels: the same seeded inputs through both, identical bits.

On a CPU the kernels run in Numba's CUDA simulator (tiny shapes: one Python call per CUDA thread);
on a GPU they run on it (``gpu``-marked tests, larger shapes). The float64 references of
tests/reference.py check the host backend directly in tests/test_mxfp8.py and tests/test_permute.py
(the public API runs there); here the kernels are held to the host backend, bit for bit.
"""

import ml_dtypes
import numpy as np
import pytest

from mxcomm import _platform
from mxcomm.mxfp8 import MXFP8Array, dequantize_mxfp8, quantize_mxfp8
from mxcomm.permutation import permute, permute_backward, unpermute, unpermute_backward
from reference import dequantize_mxfp8_ref, quantize_mxfp8_ref
from test_mxfp8 import random_blocks, special_blocks

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
MODES = ("rceil", "floor")
#: The host backend, and the backend running the CUDA kernels here.
BACKENDS = ("host", "cuda" if _platform.gpu_present() else "simulator")


def to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def bits(a):
    """The bit patterns of a host array (NaN payloads and signed zeros compared exactly)."""
    a = to_host(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize > 1 else a.view(np.uint8)


def run_both(use_backend, fn, *arrays):
    """``fn(*device arrays)`` on each backend of :data:`BACKENDS`: ``{backend: result}``, with
    every array of the result (MXFP8Array fields and tuples included) as host bits."""
    results = {}
    for name in BACKENDS:
        with use_backend(name) as xp:
            out = fn(*(xp.asarray(a) for a in arrays))
        results[name] = _host_bits(out)
    return results


def _host_bits(out):
    from mxcomm.formats import QuantizedArray
    if isinstance(out, QuantizedArray):
        return {"data": bits(out.data), "scales": bits(out.scales)}
    if isinstance(out, tuple):
        return tuple(_host_bits(o) for o in out)
    return bits(out)


def assert_identical(results):
    host, kernels = (results[name] for name in BACKENDS)
    _assert_same(host, kernels, "result")


def _assert_same(a, b, where):
    if isinstance(a, dict):
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, tuple):
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a.shape == b.shape, where
        bad = np.argwhere(a != b)
        assert bad.size == 0, f"{where}: host and kernels differ at {bad[:5].tolist()} " \
                              f"(host {a[tuple(bad[0])]:#x}, kernels {b[tuple(bad[0])]:#x})"


def random_bit_patterns(rng, shape, dtype):
    """Uniformly random bit patterns of ``dtype``: every exponent, subnormals, +-0, Inf and NaN
    (about one block in eight holds a non-finite value)."""
    uint = np.uint16 if dtype == BF16 else np.uint32
    info = np.iinfo(uint)
    return rng.integers(0, info.max, shape, dtype=uint, endpoint=True).view(dtype)


def quantize_inputs(rng, dtype):
    """Seeded (18, 64) inputs: blocks spanning 2^-120..2^120, random bit patterns, the special
    blocks of test_mxfp8 (zeros, -0, subnormals, 448 * 2^k, rounding edges, NaN, Inf), a row of
    zeros and a row of input subnormals."""
    tiny = 2.0 ** -133 if dtype == BF16 else 2.0 ** -149
    edge = np.stack([np.zeros(64), rng.integers(-3, 4, 64) * tiny]).astype(dtype)
    return np.concatenate([random_blocks(rng, 4, 64, dtype),
                           random_bit_patterns(rng, (4, 64), dtype),
                           special_blocks(dtype).reshape(-1, 64), edge])


# ---------------------------------------------------------------------------------------- MXFP8
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NaN/Inf arithmetic
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", MODES)
def test_quantize_identical(use_backend, rng, dtype, mode):
    x = quantize_inputs(rng, dtype)
    results = run_both(use_backend, lambda a: quantize_mxfp8(a, mode), x)
    assert_identical(results)
    # and both agree with the float64 reference on the blocks it defines (all of them)
    data, scales = quantize_mxfp8_ref(x, mode)
    np.testing.assert_array_equal(results["host"]["data"], data)
    np.testing.assert_array_equal(results["host"]["scales"], scales)


def _quantize_gathered(x, rows, mode):
    """The MXFP8 quantize of rows ``rows`` of ``x``, gathered in the kernel's loads
    (``launch_quantize_gather``), and the same rows gathered first, then quantized."""
    from mxcomm import mxfp8
    from mxcomm.kernels import array_module
    xp = array_module()
    out = MXFP8Array(xp.empty((rows.shape[0], x.shape[1]), np.uint8),
                     xp.empty((rows.shape[0], x.shape[1] // 32), np.uint8))
    mxfp8.launch_quantize_gather(x, rows, out, 0, scale_mode=mode)
    return out, quantize_mxfp8(xp.ascontiguousarray(x[rows]), mode)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NaN/Inf arithmetic
@pytest.mark.parametrize("mode", MODES)
def test_quantize_gathered_identical(use_backend, rng, mode):
    """Rows picked by an index (repeated, out of order, a subset) quantized in one pass: the
    rows' quantization, bit for bit, on the host backend and on the kernels."""
    x = quantize_inputs(rng, BF16)
    rows = rng.permutation(x.shape[0])[:13].astype(np.int32)
    rows[3] = rows[7]
    results = run_both(use_backend, lambda a, r: _quantize_gathered(a, r, mode), x, rows)
    for name in BACKENDS:
        _assert_same(*results[name], name)
    assert_identical(results)


def _round_trips(x, rows, mode):
    """bf16 rows through MXFP8 and back in one pass (``launch_round_trip``: all rows of ``x``,
    and rows ``rows`` gathered in the loads, written into the middle of a larger array), beside
    the two passes they stand for (quantize then dequantize, of the rows gathered first)."""
    from mxcomm import mxfp8
    from mxcomm._driver import row_range
    from mxcomm.kernels import array_module
    xp = array_module()
    whole = xp.empty_like(x)
    mxfp8.launch_round_trip(x, None, whole, 0, scale_mode=mode)
    padded = xp.zeros((rows.shape[0] + 4, x.shape[1]), x.dtype)
    mxfp8.launch_round_trip(x, rows, row_range(padded, 2, 2 + rows.shape[0]), 0,
                           scale_mode=mode)
    return (whole, padded[2:-2], dequantize_mxfp8(quantize_mxfp8(x, mode)),
            dequantize_mxfp8(quantize_mxfp8(xp.ascontiguousarray(x[rows]), mode)))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NaN/Inf arithmetic
@pytest.mark.parametrize("mode", MODES)
def test_round_trip_identical(use_backend, rng, mode):
    """The one-pass round trip (the quantized exchanges' own rows) equals quantize then
    dequantize bit for bit, contiguous and gathered (repeated, out of order, a subset), on the
    host backend and on the kernels, over every kind of block (NaN/Inf blocks give NaN)."""
    x = quantize_inputs(rng, BF16)
    rows = rng.permutation(x.shape[0])[:13].astype(np.int32)
    rows[3] = rows[7]
    results = run_both(use_backend, lambda a, r: _round_trips(a, r, mode), x, rows)
    for name in BACKENDS:
        whole, gathered, two_pass, two_pass_gathered = results[name]
        _assert_same(whole, two_pass, f"{name} contiguous")
        _assert_same(gathered, two_pass_gathered, f"{name} gathered")
    assert_identical(results)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator: 448 * 2^127 overflows
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_dequantize_identical(use_backend, rng, dtype):
    data = rng.integers(0, 256, (6, 64), dtype=np.uint8)
    data[0, :32] = np.arange(32) * 8 + 7              # 0x07 .. 0xFF: NaN bytes 0x7F and 0xFF
    data[1, :32] = np.arange(32)                     # zero and every subnormal, then normals
    scales = rng.integers(0, 256, (6, 2), dtype=np.uint8)
    scales.flat[:8] = [0, 1, 9, 10, 246, 247, 254, 255]  # subnormal f32 2^-127, the bf16-exact
    #                                                    range's edges, Inf products, NaN scale
    results = run_both(use_backend,
                       lambda d, s: dequantize_mxfp8(MXFP8Array(d, s), dtype), data, scales)
    assert_identical(results)
    want = dequantize_mxfp8_ref(data, scales, dtype)
    np.testing.assert_array_equal(results["host"], bits(want))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("mode", MODES)
def test_roundtrip_identical(use_backend, rng, mode):
    """quantize -> dequantize to both dtypes, the MXFP8 values never leaving the backend."""
    x = random_blocks(rng, 3, 64, BF16)
    x[1, 7] = np.nan
    results = run_both(use_backend, lambda a: tuple(
        quantize_mxfp8(a, mode).dequantize(dtype) for dtype in (BF16, F32)), x)
    assert_identical(results)


PREPARED = [("mxfp8", "rceil"), ("mxfp8", "floor"), ("fp8_rowwise", None),
            ("fp8_block128", None), ("fp8_block128_pow2", None)]


def check_prepared(use_backend, rng, name, mode, width, special, rows):
    """A format's launches prepared for a signature (``Format.quantizer``, ``round_tripper``:
    the direct calls' sized launches and their units per row on the kernels, the general
    launchers on the host backend) give the bits of the format's public quantize and of
    quantize then dequantize, on both backends; 0 rows write nothing."""
    from mxcomm.formats import get_format
    fmt = get_format(name)
    for dtype in (BF16, F32):
        x = np.concatenate([np.resize(quantize_inputs(rng, dtype), (special, width)),  # cycled
                            random_blocks(rng, rows, width, dtype)])

        def prepared(a):
            from mxcomm.kernels import array_module
            xp = array_module()
            n = a.shape[0]
            data = xp.full((n, width), 0xAB, np.uint8)
            scales = xp.zeros(fmt.scales_shape(n, width), fmt.scale_dtype)
            quantize = fmt.quantizer(dtype, width, mode)
            quantize(a, data, scales, 0, 0)
            assert (to_host(data) == 0xAB).all(), "0 rows wrote"
            quantize(a, data, scales, n, 0)
            out = (fmt.view(data, scales), fmt.quantize(a, scale_mode=mode))
            round_trip = fmt.round_tripper(width, mode)
            if dtype == BF16 and round_trip is not None:
                trip = xp.empty((n, width), BF16)
                round_trip(a, trip, n, 0)
                out += (trip, fmt.quantize(a, scale_mode=mode).dequantize(BF16))
            return out

        results = run_both(use_backend, prepared, x)
        for backend in BACKENDS:
            got = results[backend]
            _assert_same(got[0], got[1], f"{backend} {dtype} quantize")
            if len(got) > 2:
                _assert_same(got[2], got[3], f"{backend} round trip")
        assert (len(results["host"]) > 2) == (name == "mxfp8" and dtype == BF16)
        assert_identical(results)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NaN/Inf arithmetic
@pytest.mark.parametrize("name,mode", PREPARED)
def test_prepared_quantizers_identical(use_backend, rng, name, mode):
    check_prepared(use_backend, rng, name, mode, 128, 3, 1)  # the simulator: a few rows


# ------------------------------------------------------------------------------------ permutation
def random_counts(rng, ranks, e_local, high=5):
    counts = rng.integers(0, high, ranks * e_local).astype(np.int32)
    counts[rng.integers(0, ranks * e_local)] = 0     # an expert receiving nothing from a rank
    if ranks > 1:                                    # a rank sending nothing at all
        r = rng.integers(0, ranks)
        counts[r * e_local:(r + 1) * e_local] = 0
    return counts


@pytest.mark.parametrize("ranks,e_local,align,dtype,row", [
    (2, 2, 4, BF16, (32,)),
    (3, 2, 8, np.float32, (3,)),     # odd row bytes
    (1, 3, 1, BF16, (3,)),           # no padding
    (2, 1, 32, np.uint8, (5,)),
    (2, 2, 4, np.int32, ()),         # 1-D rows
])
def test_permute_identical(use_backend, rng, ranks, e_local, align, dtype, row):
    counts = random_counts(rng, ranks, e_local)
    m = int(counts.sum())
    x = (rng.standard_normal((m,) + row) * 100).astype(dtype)

    def steps(x, counts):
        permuted, indices, offsets = permute(x, counts, e_local, align)
        return (permuted, indices, offsets, unpermute(permuted, indices, m),
                permute_backward(permuted, indices, m), unpermute_backward(x, indices))

    assert_identical(run_both(use_backend, steps, x, counts))


@pytest.mark.parametrize("ranks,e_local,align", [(2, 2, 4), (3, 2, 8), (1, 3, 1), (2, 4, 32)])
def test_permute_index_and_its_inverse_identical(use_backend, rng, ranks, e_local, align):
    """The permute index, group offsets and inverse index (received row -> permuted row) of one
    launch: the same on each backend, and the inverse undoes the index (one empty expert)."""
    counts = random_counts(rng, ranks, e_local)
    counts[1] = 0
    m = int(counts.sum())
    p = -(-(m + e_local * align) // align) * align

    def index(counts):
        from mxcomm.permutation import _layout
        return _layout(counts, e_local, align, m, p, None)

    results = run_both(use_backend, index, counts)
    assert_identical(results)
    indices, _, inverse = (a.view(np.int32) for a in results["host"])
    assert sorted(inverse.tolist()) == sorted(np.flatnonzero(indices >= 0).tolist())
    np.testing.assert_array_equal(indices[inverse], np.arange(m))


def test_permute_mxfp8_identical(use_backend, rng):
    counts = random_counts(rng, 2, 2)
    m = int(counts.sum())
    x = random_blocks(rng, m, 64, BF16)

    def steps(x, counts):
        permuted, indices, offsets = permute(quantize_mxfp8(x), counts, 2, 4)  # few padding rows
        back = unpermute(permuted, indices, m)
        return (permuted, indices, offsets, back, unpermute_backward(back, indices),
                permuted.dequantize())

    assert_identical(run_both(use_backend, steps, x, counts))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NaN/Inf arithmetic
def test_permute_mxfp8_to_bf16_identical(use_backend, rng):
    """The permute's MXFP8 -> bf16 conversion (gather and dequantize in one pass) equals the
    dequantize of the permuted MXFP8 rows bit for bit (padding rows 0, NaN and Inf blocks, every
    scale), on each backend, and the backends agree; counts naming more rows than were received
    give zero rows."""
    counts = np.array([5, 0, 7, 6, 3, 0], np.int32)  # 21 rows named, 18 received
    x = quantize_inputs(rng, BF16)

    def steps(x, counts):
        mx = quantize_mxfp8(x)
        fused, indices, _ = permute(mx, counts, 3, 4, out_format="bf16")
        separate = permute(mx, counts, 3, 4)[0].dequantize()
        return fused, separate, indices

    results = run_both(use_backend, steps, x, counts)
    for name in BACKENDS:
        fused, separate, indices = results[name]
        np.testing.assert_array_equal(fused, separate)
        assert (fused[indices.view(np.int32) < 0] == 0).all()
    assert_identical(results)


def test_permute_counts_beyond_rows_identical(use_backend, rng):
    """Counts naming more rows than received: the extra rows get index -1 and zero rows."""
    counts = np.array([3, 0, 2, 4], np.int32)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    assert_identical(run_both(use_backend, lambda x, c: permute(x, c, 2, 4), x, counts))


def test_unpermute_with_padding_and_out_of_range_indices(use_backend, rng):
    """-1 and indices >= num_rows are dropped by unpermute and give zero rows in its backward."""
    y = rng.standard_normal((8, 6)).astype(np.float32)
    g = rng.standard_normal((5, 6)).astype(np.float32)
    idx = np.array([3, -1, 0, 2, 7, 1, -1, 4], np.int32)
    results = run_both(use_backend, lambda y, g, i: (unpermute(y, i, 5), unpermute_backward(g, i)),
                       y, g, idx)
    assert_identical(results)


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8_rowwise"])
def test_pad_rows_identical(use_backend, rng, fmt):
    """The padding fill of an exchange landing in permuted order (``_row_moves.pad_rows``):
    rows of index -1 get zeros and the padding scale, every other row keeps its bytes, on each
    backend."""
    from mxcomm.formats import get_format
    from mxcomm._row_moves import pad_rows
    f = get_format(fmt)
    idx = np.array([3, -1, 0, 2, -1, 1, -1, 4], np.int32)
    data = rng.integers(0, 256, (8, 64), dtype=np.uint8)
    scales = rng.integers(0, 256, (8, 2), dtype=np.uint8) if fmt == "mxfp8" else \
        rng.standard_normal((8, 1)).astype(np.float32)

    def fill(d, s, i):
        pad_rows((d, s), f, i, 0)
        return d, s

    results = run_both(use_backend, fill, data, scales, idx)
    assert_identical(results)
    d, s = results[BACKENDS[0]]
    pad = idx < 0
    assert not d[pad].any() and np.array_equal(d[~pad], data[~pad])
    want_pad = np.asarray(f.padding_scale, scales.dtype).view(s.dtype)
    assert np.all(s[pad] == want_pad) and np.array_equal(s[~pad], bits(scales)[~pad])


def test_strided_indices_move_the_rows_of_their_contiguous_copy(use_backend, rng):
    """Indices that are a strided view (the kernels take contiguous ones: a copy is made on the
    call's stream) move exactly the rows the same indices move when contiguous, on each backend."""
    y = rng.standard_normal((8, 6)).astype(np.float32)
    g = rng.standard_normal((5, 6)).astype(np.float32)
    idx = np.array([3, -1, 0, 2, 7, 1, -1, 4], np.int32)
    spread = np.repeat(idx, 2)  # idx at the even positions

    def both(y, g, i):
        return (unpermute(y, i, 5), unpermute_backward(g, i))

    want = run_both(use_backend, both, y, g, idx)
    got = run_both(use_backend, lambda y, g, s: both(y, g, s[::2]), y, g, spread)
    for name in BACKENDS:
        _assert_same(want[name], got[name], name)


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name,mode", PREPARED)
def test_gpu_prepared_quantizers_identical_large(use_backend, rng, name, mode):
    check_prepared(use_backend, rng, name, mode, 7168, 7, 600)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_quantize_identical_large(use_backend, rng, dtype, mode):
    x = np.concatenate([random_blocks(rng, 512, 7168, dtype),
                        random_bit_patterns(rng, (512, 7168), dtype)])
    assert_identical(run_both(use_backend, lambda a: quantize_mxfp8(a, mode), x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_gpu_dequantize_identical_large(use_backend, rng, dtype):
    data = rng.integers(0, 256, (1024, 7168), dtype=np.uint8)
    scales = rng.integers(0, 256, (1024, 7168 // 32), dtype=np.uint8)
    assert_identical(run_both(use_backend,
                              lambda d, s: dequantize_mxfp8(MXFP8Array(d, s), dtype), data, scales))


@pytest.mark.gpu
def test_gpu_quantize_gathered_identical_large(use_backend, rng):
    """The gather quantize at the dispatch gradient's width: equal to gathering then quantizing
    on the GPU, and to the host backend, bit for bit."""
    x = np.concatenate([random_blocks(rng, 700, 7168, BF16),
                        random_bit_patterns(rng, (300, 7168), BF16)])
    rows = rng.permutation(1000)[:777].astype(np.int32)
    results = run_both(use_backend, lambda a, r: _quantize_gathered(a, r, "rceil"), x, rows)
    _assert_same(*results[BACKENDS[1]], BACKENDS[1])
    assert_identical(results)


@pytest.mark.gpu
def test_gpu_round_trip_identical_large(use_backend, rng):
    """The one-pass round trip at the dispatch gradient's width on the GPU: equal to quantize
    then dequantize there (contiguous and gathered), and to the host backend, bit for bit."""
    x = np.concatenate([random_blocks(rng, 700, 7168, BF16),
                        random_bit_patterns(rng, (300, 7168), BF16)])
    rows = rng.permutation(1000)[:777].astype(np.int32)
    results = run_both(use_backend, lambda a, r: _round_trips(a, r, "rceil"), x, rows)
    whole, gathered, two_pass, two_pass_gathered = results[BACKENDS[1]]
    _assert_same(whole, two_pass, "contiguous")
    _assert_same(gathered, two_pass_gathered, "gathered")
    assert_identical(results)


@pytest.mark.gpu
def test_gpu_permute_mxfp8_to_bf16_identical_large(use_backend, rng):
    """The MXFP8 -> bf16 gather on the GPU: equal to the permute then the dequantize there, and
    to the host backend, bit for bit (7168-wide rows, a rank sending nothing, padding)."""
    counts = random_counts(rng, 2, 8, high=200)
    m = int(counts.sum())
    x = random_blocks(rng, m, 7168, BF16)

    def steps(x, counts):
        mx = quantize_mxfp8(x)
        fused = permute(mx, counts, 8, 32, out_format="bf16")[0]
        return fused, permute(mx, counts, 8, 32)[0].dequantize()

    results = run_both(use_backend, steps, x, counts)
    np.testing.assert_array_equal(*results[BACKENDS[1]])
    assert_identical(results)


@pytest.mark.gpu
def test_gpu_permute_identical_large(use_backend, rng):
    counts = random_counts(rng, 4, 8, high=300)
    m = int(counts.sum())
    x = random_blocks(rng, m, 2048, BF16)

    def steps(x, counts):
        mx = quantize_mxfp8(x)
        permuted, indices, offsets = permute(mx, counts, 8, 32)
        return permuted, indices, offsets, unpermute(permuted, indices, m), permute(x, counts, 8)[0]

    assert_identical(run_both(use_backend, steps, x, counts))


def test_simulated_shared_arrays_are_one_per_block_when_threads_interleave(use_backend, rng,
                                                                           monkeypatch):
    """tests/conftest.py's lock on the simulator's shared-array lookup: with the window between
    its lookup and its store widened (a sleep in the simulator's ``numpy.empty``), every thread of
    a block still gets the same array, so the rowwise quantize (a ``lanes_max`` through a shared
    array) stays bit-exact; without the lock each thread got its own array and every launch
    gave NaN or wrong rows."""
    if not _platform.kernels_simulated():
        pytest.skip("the CUDA kernels run on the GPU here")
    import time
    import types

    from numba.cuda.simulator import kernelapi

    from mxcomm.rowwise import quantize_fp8_rowwise
    from reference_fp8 import quantize_fp8_rowwise_ref

    def empty(*args, **kwargs):
        time.sleep(0.001)  # the GIL goes to the block's other threads here
        return np.empty(*args, **kwargs)

    slow = types.SimpleNamespace(**{name: getattr(np, name) for name in dir(np)
                                    if not name.startswith("__")})
    slow.empty = empty
    monkeypatch.setattr(kernelapi, "np", slow)
    x = (rng.standard_normal((2, 64)) * 100).astype(np.float32).astype(BF16)
    want = quantize_fp8_rowwise_ref(x)
    with use_backend("simulator"):
        for _ in range(3):
            data, scales = quantize_fp8_rowwise(x)
            np.testing.assert_array_equal(data, want[0])
            np.testing.assert_array_equal(scales.view(np.uint32), want[1].view(np.uint32))
