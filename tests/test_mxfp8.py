"""MXFP8 quantize / dequantize: bit-exact against the float64 reference, NaN/Inf blocks, errors."""

import ml_dtypes
import numpy as np
import pytest

from mxcomm.kernels import array_module
from mxcomm.kernels._fp8 import _e4m3_bits_py, e8m0_from_bf16_amax, e8m0_from_f32_amax
from mxcomm.mxfp8 import MXFP8Array, dequantize_mxfp8, quantize_mxfp8
from reference import dequantize_mxfp8_ref, quantize_mxfp8_ref, scale_ref

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
MODES = ("rceil", "floor")


def to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def to_device(a):
    return array_module().asarray(a)


def random_blocks(rng, m, d, dtype):
    """(m, d) values whose 32-element blocks each span a random exponent range in 2^-120..2^120."""
    blocks = m * d // 32
    center = rng.integers(-120, 121, size=(blocks, 1))
    spread = rng.integers(0, 20, size=(blocks, 1))
    exps = np.clip(center + rng.integers(-20, 21, size=(blocks, 32)) % (spread + 1), -120, 120)
    vals = rng.uniform(1, 2, size=(blocks, 32)) * np.exp2(exps) * rng.choice([-1.0, 1.0], size=(blocks, 32))
    return vals.reshape(m, d).astype(dtype)


def special_blocks(dtype):
    """One 32-element block per row: zeros, subnormals, 448 * 2^k, powers of two +- 1 ulp, -0, NaN, Inf."""
    ulp = 2.0 ** -7 if dtype == BF16 else 2.0 ** -23
    tiny = 2.0 ** -133 if dtype == BF16 else 2.0 ** -145  # subnormal in the input dtype
    k = np.arange(32) - 16
    rows = [
        np.zeros(32),
        -np.zeros(32),
        np.linspace(-3, 3, 32) * tiny,
        448.0 * np.exp2(k % 5 - 2) * np.where(k % 2, -1, 1),
        np.full(32, 448.0 * 2.0 ** 100),
        np.full(32, 448.0 * 2.0 ** -120),
        np.exp2(k) * (1 + ulp),
        np.exp2(k) * (1 - ulp / 2),
        np.r_[np.full(31, 1.0), 1.75 * (1 + ulp)],
        np.r_[np.full(31, 1.0), 1.75],
        np.r_[np.full(31, 1.0), 1.75 * (1 - ulp / 2)],
        np.r_[np.full(31, 3.0), np.nan],
        np.r_[np.nan, np.full(31, 3.0)],
        np.r_[np.full(16, 2.0), np.inf, np.full(15, 2.0)],
        np.r_[np.full(5, -np.inf), np.full(27, 1e-3)],
        np.exp2(-(np.arange(32) * 4.0)),  # a wide range: underflows to e4m3 zero and subnormals
    ]
    return np.array(rows).astype(dtype)


def assert_quantize_exact(x, mode):
    mx = quantize_mxfp8(to_device(x), mode)
    data_ref, scales_ref = quantize_mxfp8_ref(x, mode)
    np.testing.assert_array_equal(to_host(mx.scales), scales_ref)
    np.testing.assert_array_equal(to_host(mx.data), data_ref)
    return mx


# --- pure Python: the scalar helpers against the reference formulas ---------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_scale_formula_exhaustive_bf16(mode):
    bits = np.arange(0x7F80, dtype=np.uint32)  # every non-negative finite bf16
    amax = (bits.astype(np.uint16).view(BF16)).astype(np.float64)
    helper = e8m0_from_bf16_amax.py_func
    got = np.array([helper(np.uint32(b), mode == "rceil") for b in bits])
    np.testing.assert_array_equal(got, scale_ref(amax, mode))


@pytest.mark.parametrize("mode", MODES)
def test_scale_formula_f32(rng, mode):
    edges = np.array([1.75 * 2.0 ** e * f for e in range(-149, 128, 7)
                      for f in (1 - 2.0 ** -24, 1, 1 + 2.0 ** -23)], dtype=np.float32)
    edges = edges[np.isfinite(edges)]
    bits = np.r_[rng.integers(0, 0x7F800000, 20000), edges.view(np.uint32), 0, 1, 0x7F7FFFFF]
    bits = bits.astype(np.uint32)
    helper = e8m0_from_f32_amax.py_func
    got = np.array([helper(np.uint32(b), mode == "rceil") for b in bits])
    np.testing.assert_array_equal(got, scale_ref(bits.view(np.float32).astype(np.float64), mode))


def test_e4m3_rounding_matches_ml_dtypes(rng):
    """The simulator's cvt.rn.satfinite.e4m3 stand-in: every bf16 value at several scales, random f32."""
    x = np.arange(1 << 16, dtype=np.uint16).view(BF16).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # inf * 2^-120 etc.
        x = np.concatenate([x * np.float32(s) for s in (1.0, 2.0 ** -120, 2.0 ** 7)]
                           + [rng.integers(0, 1 << 32, 50000, dtype=np.uint64).astype(np.uint32)
                              .view(np.float32)])
    got = np.array([_e4m3_bits_py(v) for v in x], dtype=np.uint8)
    with np.errstate(invalid="ignore"):
        want = np.clip(x.astype(np.float64), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    nan = np.isnan(x)
    want[nan] = 0x7F | (np.signbit(x[nan]).astype(np.uint8) << 7)
    np.testing.assert_array_equal(got, want)


# --- the public API (host backend on a CPU, kernels on a GPU) bit-exact against the reference ----
# tests/test_backends.py holds the CUDA kernels (in Numba's simulator on a CPU) to the host backend.

@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(6, 64), (3, 96)])
def test_quantize_random_bit_exact(rng, dtype, mode, shape):
    assert_quantize_exact(random_blocks(rng, *shape, dtype), mode)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", MODES)
def test_quantize_pipeline_shape_bit_exact(rng, dtype, mode):
    """A shape that means something (512 x 1024, 16384 blocks), with NaN/Inf and zero blocks."""
    x = random_blocks(rng, 512, 1024, dtype)
    x[7, 100], x[300, 1023], x[511, :64] = np.nan, -np.inf, 0
    assert_quantize_exact(x, mode)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", MODES)
def test_quantize_special_values(dtype, mode):
    x = special_blocks(dtype)
    mx = assert_quantize_exact(x, mode)
    nonfinite = ~np.isfinite(x.astype(np.float64)).all(axis=1)
    scales = to_host(mx.scales)[:, 0]
    assert (scales[nonfinite] == 0xFF).all() and (scales[~nonfinite] != 0xFF).all()
    assert (to_host(mx.data)[nonfinite] == 0x7F).all()
    assert (to_host(mx.data)[0:2] == [[0x00], [0x80]]).all()  # +0 and -0 keep their sign
    dq = to_host(mx.dequantize(dtype))
    assert np.isnan(dq[nonfinite].astype(np.float64)).all()
    assert not np.isnan(dq[~nonfinite].astype(np.float64)).any()


def test_quantize_nonfinite_block_is_confined(rng):
    x = random_blocks(rng, 4, 96, BF16)
    x[1, 40] = np.nan
    x[3, 95] = -np.inf
    dq = to_host(quantize_mxfp8(to_device(x)).dequantize()).astype(np.float64)
    nan = np.isnan(dq)
    want = np.zeros_like(nan)
    want[1, 32:64] = True
    want[3, 64:96] = True
    np.testing.assert_array_equal(nan, want)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_quantize_zero_rows(dtype):
    mx = quantize_mxfp8(to_device(np.zeros((0, 32), dtype)))
    assert mx.shape == (0, 32) and mx.scales.shape == (0, 1)
    assert dequantize_mxfp8(mx).shape == (0, 32)


def test_quantize_out(rng):
    x = random_blocks(rng, 2, 64, BF16)
    xp = array_module()
    out = MXFP8Array(xp.zeros((2, 64), "uint8"), xp.zeros((2, 2), "uint8"))
    assert quantize_mxfp8(to_device(x), "floor", out=out) is out
    np.testing.assert_array_equal(to_host(out.data), quantize_mxfp8_ref(x, "floor")[0])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # simulator: 448 * 2^127
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_dequantize_bit_exact(rng, dtype):
    m, d = 5, 64
    data = rng.integers(0, 256, (m, d), dtype=np.uint8)
    data[0, :32] = np.arange(32) * 8 + 7  # includes 0x7F and 0xFF (NaN)
    scales = rng.integers(0, 256, (m, d // 32), dtype=np.uint8)
    scales.flat[:6] = [0, 1, 127, 254, 255, 133]
    mx = MXFP8Array(to_device(data), to_device(scales))
    got = to_host(dequantize_mxfp8(mx, dtype))
    want = dequantize_mxfp8_ref(data, scales, dtype)
    uint = np.uint16 if dtype == BF16 else np.uint32
    np.testing.assert_array_equal(got.view(uint), want.view(uint))
    out = array_module().empty((m, d), dtype)
    assert mx.dequantize(dtype, out=out) is out


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_dequantize_every_byte_and_scale(rng, dtype):
    """Every (scale, e4m3 byte) pair: row s holds every byte once, in a random order, in 8 blocks
    of scale s."""
    data = np.stack([rng.permutation(256) for _ in range(256)]).astype(np.uint8)
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)
    got = to_host(dequantize_mxfp8(MXFP8Array(to_device(data), to_device(scales)), dtype))
    uint = np.uint16 if dtype == BF16 else np.uint32
    want = dequantize_mxfp8_ref(data, scales, dtype)
    np.testing.assert_array_equal(got.view(uint), want.view(uint))


@pytest.mark.parametrize("mode", MODES)
def test_roundtrip_error_bound(rng, mode):
    """|x - dq(q(x))| <= 2^-4 |x| where x / 2^(s-127) is an e4m3 normal (>= 2^-6) and not
    saturated: RNE with 3 mantissa bits; the dequantized value is exact in bf16. Floor mode
    saturates block maxima in (448, 512) * 2^(s-127) to 448: error <= 2^-3 |x| there."""
    x = random_blocks(rng, 4, 64, BF16)
    mx = quantize_mxfp8(to_device(x), mode)
    dq = to_host(mx.dequantize()).astype(np.float64)
    xf = x.astype(np.float64)
    unit = np.repeat(np.exp2(to_host(mx.scales).astype(np.float64) - 127), 32, axis=1)
    normal = np.abs(xf) >= unit * 2.0 ** -6
    err = np.abs(xf - dq)[normal] / np.abs(xf)[normal]
    bound = 2.0 ** -4 if mode == "rceil" else 2.0 ** -3
    assert normal.sum() > 100 and (err <= bound).all()
    assert (np.abs(xf - dq) <= unit * 2.0 ** -10 + np.abs(xf) * bound).all()  # subnormals: half-ulp 2^-10


# --- argument validation -----------------------------------------------------------------------------

def test_quantize_rejects_bad_input():
    xp = array_module()
    with pytest.raises(ValueError, match=r"x: expected a 2-D"):
        quantize_mxfp8(xp.zeros(64, BF16))
    with pytest.raises(ValueError, match=r"x: expected a 2-D"):
        quantize_mxfp8(xp.zeros((2, 2, 32), BF16))
    with pytest.raises(TypeError, match=r"x: expected dtype .*got float16"):
        quantize_mxfp8(xp.zeros((2, 32), np.float16))
    with pytest.raises(ValueError, match=r"x: .*multiple of 32, got D = 48"):
        quantize_mxfp8(xp.zeros((2, 48), BF16))
    with pytest.raises(ValueError, match=r"x: expected a C-contiguous"):
        quantize_mxfp8(xp.zeros((64, 64), BF16)[:, ::2])
    with pytest.raises(ValueError, match=r"scale_mode: expected one of .*got 'ceil'"):
        quantize_mxfp8(xp.zeros((2, 32), BF16), "ceil")
    with pytest.raises(TypeError, match=r"out: expected an MXFP8Array"):
        quantize_mxfp8(xp.zeros((2, 32), BF16), out=xp.zeros((2, 32), "uint8"))
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 32\), got \(1, 32\)"):
        quantize_mxfp8(xp.zeros((2, 32), BF16),
                       out=MXFP8Array(xp.zeros((1, 32), "uint8"), xp.zeros((1, 1), "uint8")))
    with pytest.raises(TypeError, match=r"x: expected a"):
        quantize_mxfp8([[1.0] * 32])


def test_mxfp8array_validation():
    xp = array_module()
    with pytest.raises(TypeError, match=r"data: expected dtype uint8.*got int8"):
        MXFP8Array(xp.zeros((2, 32), np.int8), xp.zeros((2, 1), "uint8"))
    with pytest.raises(TypeError, match=r"scales: expected dtype uint8"):
        MXFP8Array(xp.zeros((2, 32), "uint8"), xp.zeros((2, 1), np.float32))
    with pytest.raises(ValueError, match=r"data: expected a 2-D"):
        MXFP8Array(xp.zeros(32, "uint8"), xp.zeros((1, 1), "uint8"))
    with pytest.raises(ValueError, match=r"data: .*multiple of 32, got D = 40"):
        MXFP8Array(xp.zeros((2, 40), "uint8"), xp.zeros((2, 1), "uint8"))
    with pytest.raises(ValueError, match=r"scales: expected shape \(2, 2\).*got \(2, 1\)"):
        MXFP8Array(xp.zeros((2, 64), "uint8"), xp.zeros((2, 1), "uint8"))
    mx = MXFP8Array(xp.zeros((2, 64), "uint8"), xp.zeros((2, 2), "uint8"))
    assert mx.shape == (2, 64)


def test_dequantize_rejects_bad_input():
    xp = array_module()
    mx = MXFP8Array(xp.zeros((2, 64), "uint8"), xp.zeros((2, 2), "uint8"))
    with pytest.raises(TypeError, match=r"mx: expected an MXFP8Array"):
        dequantize_mxfp8(xp.zeros((2, 64), "uint8"))
    with pytest.raises(TypeError, match=r"dtype: expected bfloat16 or float32, got float16"):
        dequantize_mxfp8(mx, np.float16)
    with pytest.raises(TypeError, match=r"out: expected dtype float32, got bfloat16"):
        dequantize_mxfp8(mx, np.float32, out=xp.zeros((2, 64), BF16))
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 64\), got \(2, 32\)"):
        dequantize_mxfp8(mx, out=xp.zeros((2, 32), BF16))
    with pytest.raises(ValueError, match=r"out: expected a C-contiguous"):
        dequantize_mxfp8(mx, out=xp.zeros((2, 128), BF16)[:, ::2])


# --- GPU: large shapes --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_quantize_large_bit_exact(rng, dtype, mode):
    x = random_blocks(rng, 8192, 7168, dtype)
    x[5, 100] = np.nan
    x[8000, 7000] = np.inf
    x[17, :64] = 0
    mx = assert_quantize_exact(x, mode)
    got = to_host(mx.dequantize(dtype))
    want = dequantize_mxfp8_ref(to_host(mx.data), to_host(mx.scales), dtype)
    uint = np.uint16 if dtype == BF16 else np.uint32
    np.testing.assert_array_equal(got.view(uint), want.view(uint))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_gpu_dequantize_large_bit_exact(rng, dtype):
    data = rng.integers(0, 256, (8192, 7168), dtype=np.uint8)
    scales = rng.integers(0, 256, (8192, 7168 // 32), dtype=np.uint8)
    got = to_host(dequantize_mxfp8(MXFP8Array(to_device(data), to_device(scales)), dtype))
    want = dequantize_mxfp8_ref(data, scales, dtype)
    uint = np.uint16 if dtype == BF16 else np.uint32
    np.testing.assert_array_equal(got.view(uint), want.view(uint))
