"""fp8 rowwise / 1x128 block formats and the MXFP8 -> rowwise permute: kernels (simulator, tiny
shapes) and NumPy host implementations bit-exact against the float64 references; interop with torch
renditions of DeepGEMM's and torchao's casts; SQNR of the MXFP8 -> rowwise conversion; errors."""

import ml_dtypes
import numpy as np
import pytest

from mxcomm import _host, sqnr
from mxcomm.block128 import dequantize_fp8_block128, quantize_fp8_block128
from mxcomm.colwise import fp8_rowwise_to_group_colwise, quantize_fp8_rowwise_transposed
from mxcomm.rowwise import dequantize_fp8_rowwise, mx_to_rowwise_permute, quantize_fp8_rowwise
from mxcomm.kernels import address, array_module
from mxcomm.mxfp8 import MXFP8Array
from reference import permute_ref, quantize_mxfp8_ref
from reference_fp8 import (dequantize_scaled_ref, group_colwise_ref, mx_to_rowwise_ref,
                           quantize_fp8_block128_ref, quantize_fp8_rowwise_ref)

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
DTYPES = pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
MODES = ("plain", "pow2")


class HostMX:
    """MXFP8 rows on the host (NumPy ``data`` and ``scales``), for the host implementations."""

    def __init__(self, data, scales):
        self.data, self.scales = data, scales


def to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def to_device(a):
    return array_module().asarray(a)


def bits(a):
    """The bit patterns of a float array (NaN payloads compare exactly)."""
    a = to_host(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same(got, want):
    """(data, scales) pairs or arrays, bit for bit."""
    if isinstance(want, tuple):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(bits(g), bits(w))
    else:
        np.testing.assert_array_equal(bits(got), bits(want))


def random_rows(rng, m, d, dtype):
    """(m, d) values: each row around a random binade in 2^-120..2^120, its elements spread over
    up to 24 binades below it (so rows hold e4m3 subnormals and values that round to zero)."""
    center = rng.integers(-110, 121, size=(m, 1))
    spread = rng.integers(0, 25, size=(m, 1))
    exps = np.clip(center - rng.integers(0, 25, size=(m, d)) % (spread + 1), -120, 120)
    vals = rng.uniform(1, 2, size=(m, d)) * np.exp2(exps) * rng.choice([-1.0, 1.0], size=(m, d))
    return vals.astype(dtype)


def special_rows(dtype, d=128):
    """One row of ``d`` elements per case: zeros, -0, input subnormals, 448 * 2^k, the 1.75
    thresholds of the scale, +-1 ulp around powers of two, below the 2^-126 scale clamp, the
    dtype's largest finite, one huge value over tiny ones, NaN and Inf."""
    ulp = 2.0 ** -7 if dtype == BF16 else 2.0 ** -23
    tiny = 2.0 ** -133 if dtype == BF16 else 2.0 ** -145
    big = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max) if dtype == BF16 else 3.4028234663852886e38
    k = np.arange(d) - d // 2
    ones = np.ones(d - 1)
    rows = [
        np.zeros(d),
        -np.zeros(d),
        np.linspace(-3, 3, d) * tiny,
        448.0 * np.exp2(k % 5 - 2) * np.where(k % 2, -1, 1),
        np.full(d, 448.0 * 2.0 ** 100),
        np.full(d, -448.0 * 2.0 ** -120),
        np.exp2(k % 40 - 125.0),                       # amax below 448 * 2^-126: the clamp
        np.exp2(k % 24) * (1 + ulp),
        np.exp2(k % 24) * (1 - ulp / 2),
        np.r_[ones, 1.75 * (1 + ulp)],
        np.r_[ones, 1.75],
        np.r_[ones, -1.75 * (1 - ulp / 2)],
        np.r_[np.full(d - 1, 2.0 ** -30), big],
        np.r_[2.0 ** 100, -np.exp2(-np.arange(d - 1) * 0.5)],  # signed zeros after rounding
        np.exp2(-(np.arange(d) * 1.5)),
        np.r_[np.full(d - 1, 3.0), np.nan],
        np.r_[np.nan, np.full(d - 1, 3.0)],
        np.r_[np.full(d // 2, 2.0), np.inf, np.full(d // 2 - 1, 2.0)],
        np.r_[np.full(5, -np.inf), np.full(d - 5, 1e-3)],
    ]
    return np.array(rows).astype(dtype)


#: The special rows the simulator runs (each row costs it a few barriers): every kernel branch.
KERNEL_SPECIALS = [0, 1, 2, 6, 9, 10, 12, 13, 15, 17]


def mixed_rows(rng, dtype, m=6, d=128, specials=slice(None)):
    """``m`` random rows, then the special rows (all 19, or those listed in ``specials``)."""
    return np.concatenate([random_rows(rng, m, d, dtype), special_rows(dtype, d)[specials]])


def block_test_data(rng, dtype, m=4):
    """(m + 19, 256) rows of two 128-blocks: random, and two different special cases per row."""
    s = special_rows(dtype)
    pairs = np.concatenate([s, np.roll(s, 3, 0)], axis=1)
    return np.concatenate([random_rows(rng, m, 256, dtype), pairs])


def random_fp8(rng, m, d):
    """(m, d) random e4m3 bytes, NaN bytes (0x7F, 0xFF) included."""
    data = rng.integers(0, 256, (m, d), dtype=np.uint8)
    data[0, :16] = np.arange(16) * 16 + 15  # 0x0F ... 0xFF: includes 0x7F and 0xFF
    return data


def random_scales(rng, shape):
    """Random fp32 scales (powers of two and not) with 0, subnormal, huge, Inf, NaN, negative."""
    s = (rng.uniform(0.5, 2.0, shape) * np.exp2(rng.integers(-130, 128, shape))).astype(np.float32)
    special = np.array([np.inf, np.nan, 2.0 ** -140, 0.0, 2.0 ** 127, -3.5, 1.0, 2.0 ** -126],
                       np.float32)
    flat = s.reshape(-1)
    flat[:8] = special[:flat.size]
    return s


# --- pure Python: host implementations against the references --------------------------------

@DTYPES
def test_host_rowwise_bit_exact(rng, dtype):
    x = np.concatenate([mixed_rows(rng, dtype, 40, 256), random_rows(rng, 8, 4096, dtype)[:, :256]])
    data, scales = _host.quantize_fp8_rowwise(x)
    assert_same((data, scales), quantize_fp8_rowwise_ref(x))
    nonfinite = ~np.isfinite(x.astype(np.float64)).all(axis=1)
    assert np.isnan(scales[nonfinite]).all() and (data[nonfinite] == 0x7F).all()
    assert np.isfinite(scales[~nonfinite]).all()
    assert (np.frexp(scales[~nonfinite])[0] == 0.5).all()  # powers of two
    assert (scales[~nonfinite] >= 2.0 ** -126).all()
    out = (np.empty_like(data), np.empty_like(scales))
    got = _host.quantize_fp8_rowwise(x, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert_same(out, (data, scales))


@DTYPES
@pytest.mark.parametrize("mode", MODES)
def test_host_block128_bit_exact(rng, dtype, mode):
    x = np.concatenate([block_test_data(rng, dtype, 40), random_rows(rng, 8, 512, dtype)[:, :256]])
    data, scales = _host.quantize_fp8_block128(x, mode)
    assert_same((data, scales), quantize_fp8_block128_ref(x, mode))
    assert scales.shape == (x.shape[0], 2)


@DTYPES
def test_host_dequantize_bit_exact(rng, dtype):
    data = random_fp8(rng, 16, 256)
    row_scales = random_scales(rng, 16)
    block_scales = random_scales(rng, (16, 2))
    with np.errstate(over="ignore", invalid="ignore"):
        assert_same(_host.dequantize_fp8_rowwise(data, row_scales, dtype),
                    dequantize_scaled_ref(data, row_scales, 256, dtype))
        assert_same(_host.dequantize_fp8_block128(data, block_scales, dtype),
                    dequantize_scaled_ref(data, block_scales, 128, dtype))


def mx_test_rows(rng, m=12, d=256):
    """MXFP8 rows: quantized random rows ("rceil" and "floor"), a row of random bytes with NaN
    bytes, all-zero scales, and a row with a NaN block."""
    x = random_rows(rng, m, d, BF16)
    x[1, 40] = np.nan
    data_r, scales_r = quantize_mxfp8_ref(x[: m // 2], "rceil")
    data_f, scales_f = quantize_mxfp8_ref(x[m // 2:], "floor")
    data = np.concatenate([data_r, data_f, random_fp8(rng, 2, d)])
    scales = np.concatenate([scales_r, scales_f,
                             rng.integers(0, 255, (1, d // 32), dtype=np.uint8),  # no 0xFF
                             np.zeros((1, d // 32), np.uint8)])
    return data, scales


def test_host_mx_to_rowwise_bit_exact(rng):
    data, scales = mx_test_rows(rng)
    n = data.shape[0]
    indices = np.r_[rng.permutation(n), -1, -1, n, n + 7, 3].astype(np.int32)
    got = _host.mx_to_rowwise_permute(HostMX(data, scales), indices)
    assert_same(got, mx_to_rowwise_ref(data, scales, indices))
    assert (got[1][indices < 0] == 1.0).all() and (got[0][indices < 0] == 0).all()


def test_mx_to_rowwise_matches_direct_rowwise(rng):
    """For "rceil" MXFP8 the converted row scales are exactly those of quantizing the row directly,
    blocks at the row's scale keep their bytes, and the elements differ from direct quantization
    only in the e4m3 subnormal range of the row scale (rescaling a normal e4m3 by 2^-k is exact)."""
    x = random_rows(rng, 64, 512, BF16)
    data, scales = quantize_mxfp8_ref(x, "rceil")
    conv_data, conv_scales = _host.mx_to_rowwise_permute(HostMX(data, scales),
                                                         np.arange(64, dtype=np.int32))
    direct_data, direct_scales = quantize_fp8_rowwise_ref(x)
    assert_same(conv_scales, direct_scales)
    top = np.repeat(scales == scales.max(axis=1, keepdims=True), 32, axis=1)
    np.testing.assert_array_equal(conv_data[top], data[top])
    differ = conv_data != direct_data
    assert differ.any() and ((direct_data[differ] & 0x7F) <= 0x08).all()  # |q| <= 2^-6


def test_mx_to_rowwise_sqnr():
    """SQNR against the bf16 rows of MXFP8 ("rceil") -> rowwise equals that of quantizing the rows
    directly to 0.01 dB (measured: equal to 1e-4 dB at 1024 x 7168 on Gaussian, outlier-channel and
    Student-t rows). Gaussian rows, and rows with 1% outlier channels (x30)."""
    rng = np.random.default_rng(7)
    m, d = 128, 2048
    gauss = rng.standard_normal((m, d))
    outliers = gauss * np.where(rng.random(d) < 0.01, 30.0, 1.0)
    for x64 in (gauss, outliers):
        x = x64.astype(BF16)
        ref = x.astype(np.float64)
        direct = _host.dequantize_fp8_rowwise(*_host.quantize_fp8_rowwise(x), np.float32)
        conv = _host.dequantize_fp8_rowwise(
            *_host.mx_to_rowwise_permute(HostMX(*quantize_mxfp8_ref(x, "rceil")),
                                         np.arange(m, dtype=np.int32)), np.float32)
        s_direct, s_conv = sqnr(ref, direct), sqnr(ref, conv)
        assert s_direct >= 31.0 and abs(s_direct - s_conv) <= 0.01, (s_direct, s_conv)


# --- interop: torch renditions of the casts real users run --------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_block128_matches_deepgemm_cast(rng, mode):
    """DeepGEMM's per_token_cast_to_fp8 (deep_gemm/utils/math.py): sf = amax.clamp(1e-4) / 448,
    ceil_to_ue8m0(sf) for UE8M0, x * (1.0 / sf) cast to e4m3fn; bit-identical where amax >= 1e-4."""
    torch = pytest.importorskip("torch")
    x = random_rows(rng, 32, 512, BF16)
    x[np.abs(x.astype(np.float64)).reshape(32, 4, 128).max(-1).repeat(128, 1) < 1e-4] = 1.0
    xt = torch.from_numpy(x.view(np.uint16).astype(np.int16)).view(torch.bfloat16).view(32, 4, 128)
    sf = xt.abs().float().amax(dim=2).clamp(1e-4) / 448.0
    if mode == "pow2":
        b = sf.view(torch.int)
        exp = ((b >> 23) & 0xFF) + (b & 0x7FFFFF).bool().int()
        sf = (exp.clamp(1, 254) << 23).view(torch.float)
    want = (xt * (1.0 / sf.unsqueeze(2))).to(torch.float8_e4m3fn).view(torch.uint8).view(32, 512)
    data, scales = _host.quantize_fp8_block128(x, mode)
    np.testing.assert_array_equal(data, want.numpy())
    np.testing.assert_array_equal(scales, sf.numpy())


def test_rowwise_matches_torchao_pow2_cast(rng):
    """torchao's rowwise fp8 cast with round_scales_to_power_of_2 (scale = 448 / amax rounded down
    to a power of two, data = (x * scale).clamp(-448, 448).to(e4m3fn), GEMM scale = 1 / scale);
    bit-identical for rows with amax >= 1e-12, where torchao clamps amax to 1e-12."""
    torch = pytest.importorskip("torch")
    x = random_rows(rng, 128, 256, BF16)
    x = x[np.abs(x.astype(np.float64)).max(axis=1) >= 1e-12]
    xt = torch.from_numpy(x.astype(np.float32))
    amax = xt.abs().amax(dim=1, keepdim=True).double().clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2((448.0 / amax).float())))
    want = (xt * scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    data, scales = _host.quantize_fp8_rowwise(x)
    np.testing.assert_array_equal(data, want.numpy())
    np.testing.assert_array_equal(scales, scale.reciprocal().reshape(-1).numpy())


# --- simulator: kernels bit-exact on tiny shapes ----------------------------------------------

@pytest.fixture
def kernels(use_backend):
    """Run the public functions on the CUDA kernels: the GPU's, else Numba's simulator (the
    launchers would pick the host twins on a CPU)."""
    from mxcomm import _platform
    name = "cuda" if _platform.backend() == "cuda" else "simulator"
    with use_backend(name) as xp:
        yield xp


@DTYPES
def test_rowwise_kernels_bit_exact(kernels, rng, dtype):
    x = mixed_rows(rng, dtype, 2, 64, KERNEL_SPECIALS)
    data, scales = quantize_fp8_rowwise(to_device(x))
    assert_same((data, scales), quantize_fp8_rowwise_ref(x))
    assert_same((data, scales), _host.quantize_fp8_rowwise(x))
    dq = dequantize_fp8_rowwise(data, scales, dtype)
    assert_same(dq, dequantize_scaled_ref(to_host(data), to_host(scales), 64, dtype))
    nonfinite = ~np.isfinite(x.astype(np.float64)).all(axis=1)
    assert np.isnan(to_host(dq)[nonfinite].astype(np.float64)).all()
    assert not np.isnan(to_host(dq)[~nonfinite].astype(np.float64)).any()


@DTYPES
@pytest.mark.parametrize("steps", [2, 3])
def test_rowwise_kernels_long_rows(kernels, rng, dtype, steps):
    """Rows longer than one step of a (simulated, 32-thread) warp, 32 x 4 units of 16 bytes: 2 or
    3 steps per pass; three rows, one with an Inf, so the row loop goes on past a NaN row."""
    d = {(BF16, 2): 1040, (F32, 2): 528, (BF16, 3): 2064, (F32, 3): 1040}[dtype, steps]
    x = random_rows(rng, 3, d, dtype)
    x[1, d - 5] = np.inf
    data, scales = quantize_fp8_rowwise(to_device(x))
    assert_same((data, scales), quantize_fp8_rowwise_ref(x))
    assert_same(dequantize_fp8_rowwise(data, scales, dtype),
                dequantize_scaled_ref(to_host(data), to_host(scales), d, dtype))


@DTYPES
def test_rowwise_kernels_partial_stash(kernels, rng, monkeypatch, dtype):
    """A row longer than the shared memory stash: its first units encoded from the stash, the
    rest read again (within one step and in a step of their own)."""
    from mxcomm.kernels import clear_prepared, fp8_rowwise
    monkeypatch.setattr(fp8_rowwise, "STASH_BLOCK_BYTES", 100 * fp8_rowwise.STASH_UNIT_BYTES)
    clear_prepared()
    try:
        d = 1040 if dtype == BF16 else 528  # 130 or 132 units of 16 bytes: 100 stashed
        x = random_rows(rng, 2, d, dtype)
        assert_same(quantize_fp8_rowwise(to_device(x)), quantize_fp8_rowwise_ref(x))
    finally:
        clear_prepared()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # simulator: 448 * 2^127
@DTYPES
def test_dequantize_kernels_bit_exact(kernels, rng, dtype):
    data = random_fp8(rng, 3, 256)
    row_scales, block_scales = random_scales(rng, 3), random_scales(rng, (3, 2))
    with np.errstate(over="ignore", invalid="ignore"):
        assert_same(dequantize_fp8_rowwise(to_device(data), to_device(row_scales), dtype),
                    dequantize_scaled_ref(data, row_scales, 256, dtype))
        assert_same(dequantize_fp8_block128(to_device(data), to_device(block_scales), dtype),
                    dequantize_scaled_ref(data, block_scales, 128, dtype))


@pytest.mark.parametrize("dtype, mode, part", [(BF16, "plain", 0), (BF16, "pow2", 1),
                                               (F32, "plain", 2), (F32, "pow2", 3)],
                         ids=["bf16-plain", "bf16-pow2", "fp32-plain", "fp32-pow2"])
def test_block128_kernels_bit_exact(kernels, rng, dtype, mode, part):
    """Each case runs a quarter of the special block pairs (all of them run on the host)."""
    x = np.ascontiguousarray(block_test_data(rng, dtype, 1)[part::4])
    data, scales = quantize_fp8_block128(to_device(x), mode)
    assert_same((data, scales), quantize_fp8_block128_ref(x, mode))
    assert_same((data, scales), _host.quantize_fp8_block128(x, mode))
    assert_same(dequantize_fp8_block128(data, scales, dtype),
                dequantize_scaled_ref(to_host(data), to_host(scales), 128, dtype))


def test_block128_nonfinite_block_is_confined(kernels, rng):
    x = random_rows(rng, 2, 256, BF16)
    x[1, 200] = np.inf
    data, scales = quantize_fp8_block128(to_device(x))
    nan = np.isnan(to_host(dequantize_fp8_block128(data, scales)).astype(np.float64))
    want = np.zeros_like(nan)
    want[1, 128:] = True
    np.testing.assert_array_equal(nan, want)


def test_mx_to_rowwise_kernel_bit_exact(kernels, rng):
    data, scales = mx_test_rows(rng, 8, 128)
    n = data.shape[0]
    indices = np.r_[rng.permutation(n), -1, n + 2, 0].astype(np.int32)
    got = mx_to_rowwise_permute(MXFP8Array(to_device(data), to_device(scales)), to_device(indices))
    assert_same(got, mx_to_rowwise_ref(data, scales, indices))
    assert_same(got, _host.mx_to_rowwise_permute(HostMX(data, scales), indices))


def test_mx_to_rowwise_kernel_permute_layout(kernels, rng):
    """The indices of mxcomm's permute (expert-major, padded groups), rows of several steps."""
    x = random_rows(rng, 3, 2304, BF16)
    data, scales = quantize_mxfp8_ref(x, "rceil")
    _, indices, _ = permute_ref(np.arange(3), [2, 0, 0, 1], 2, 2)
    got = mx_to_rowwise_permute(MXFP8Array(to_device(data), to_device(scales)), to_device(indices))
    assert_same(got, mx_to_rowwise_ref(data, scales, indices))


def test_mx_to_rowwise_kernel_every_byte_and_shift(kernels, rng):
    """Every e4m3 byte (zeros, subnormals, normals, NaN) rescaled by every shift n = r - s from 0
    to 35, against the float64 reference: exact results, results rounded below e4m3's normal
    range or flushed to zero, NaN bytes kept."""
    perm = rng.permutation(256).astype(np.uint8)
    rows, scales = [], []
    for n in range(36):
        for shift in (0, 32):  # the row's first block keeps scale r: roll its bytes into the rest
            rows.append(np.roll(perm, shift))
            scales.append([200] + [200 - n] * 7)
    data = np.array(rows, np.uint8)
    scales = np.array(scales, np.uint8)
    indices = np.arange(len(rows), dtype=np.int32)
    got = mx_to_rowwise_permute(MXFP8Array(to_device(data), to_device(scales)), to_device(indices))
    assert_same(got, mx_to_rowwise_ref(data, scales, indices))


def test_mx_to_rowwise_kernel_long_rows(kernels, rng):
    """Rows of three steps of a (simulated, 32-thread) warp: the scales' max over several
    lanes' blocks, then the words streamed in steps."""
    data, scales = mx_test_rows(rng, 2, 4160)  # 520 words; a step is 32 x 8
    indices = np.array([1, -1, 0, 3, 2], np.int32)
    got = mx_to_rowwise_permute(MXFP8Array(to_device(data), to_device(scales)), to_device(indices))
    assert_same(got, mx_to_rowwise_ref(data, scales, indices))


def test_quantize_out_and_empty(kernels, rng):
    dtype = BF16
    xp = array_module()
    x = random_rows(rng, 2, 128, dtype)
    out = (xp.zeros((2, 128), np.uint8), xp.zeros(2, np.float32))
    got = quantize_fp8_rowwise(to_device(x), out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert_same(out, quantize_fp8_rowwise_ref(x))
    out = (xp.zeros((2, 128), np.uint8), xp.zeros((2, 1), np.float32))
    assert quantize_fp8_block128(to_device(x), "pow2", out=out)[1] is out[1]
    assert_same(out, quantize_fp8_block128_ref(x, "pow2"))
    dq = xp.empty((2, 128), dtype)
    assert dequantize_fp8_block128(*out, dtype, out=dq) is dq
    for empty in (np.zeros((0, 128), dtype),):
        d, s = quantize_fp8_rowwise(to_device(empty))
        assert d.shape == (0, 128) and s.shape == (0,)
        d, s = quantize_fp8_block128(to_device(empty))
        assert d.shape == (0, 128) and s.shape == (0, 1)
        assert dequantize_fp8_rowwise(d, xp.zeros(0, np.float32)).shape == (0, 128)
    mx = MXFP8Array(xp.zeros((2, 64), np.uint8), xp.zeros((2, 2), np.uint8))
    d, s = mx_to_rowwise_permute(mx, xp.zeros(0, np.int32))
    assert d.shape == (0, 64) and s.shape == (0,)


# --- argument validation ----------------------------------------------------------------------

def test_rejects_bad_input():
    xp = array_module()
    x = xp.zeros((2, 128), BF16)
    with pytest.raises(ValueError, match=r"x: expected a 2-D"):
        quantize_fp8_rowwise(xp.zeros(128, BF16))
    with pytest.raises(TypeError, match=r"x: expected dtype .*got float16"):
        quantize_fp8_rowwise(xp.zeros((2, 128), np.float16))
    with pytest.raises(ValueError, match=r"x: .*multiple of 16, got D = 40"):
        quantize_fp8_rowwise(xp.zeros((2, 40), BF16))
    with pytest.raises(ValueError, match=r"x: .*multiple of 128, got D = 96"):
        quantize_fp8_block128(xp.zeros((2, 96), BF16))
    with pytest.raises(ValueError, match=r"x: expected a C-contiguous"):
        quantize_fp8_rowwise(xp.zeros((2, 256), BF16)[:, ::2])
    with pytest.raises(ValueError, match=r"scale_mode: expected one of .*got 'rceil'"):
        quantize_fp8_block128(x, "rceil")
    with pytest.raises(TypeError, match=r"out: expected a \(data, scales\) pair"):
        quantize_fp8_rowwise(x, out=xp.zeros((2, 128), np.uint8))
    with pytest.raises(ValueError,
                       match=r"out\[1\] \(scales\): expected shape \(2,\), got \(2, 1\)"):
        quantize_fp8_rowwise(x, out=(xp.zeros((2, 128), np.uint8), xp.zeros((2, 1), np.float32)))
    with pytest.raises(TypeError, match=r"out\[0\] \(data\): expected dtype uint8, got int8"):
        quantize_fp8_block128(x, out=(xp.zeros((2, 128), np.int8), xp.zeros((2, 1), np.float32)))
    data = xp.zeros((2, 128), np.uint8)
    with pytest.raises(TypeError, match=r"scales: expected dtype float32, got float64"):
        dequantize_fp8_rowwise(data, xp.zeros(2, np.float64))
    with pytest.raises(ValueError, match=r"scales: expected shape \(2, 1\), got \(2,\)"):
        dequantize_fp8_block128(data, xp.zeros(2, np.float32))
    with pytest.raises(TypeError, match=r"dtype: expected bfloat16 or float32, got float16"):
        dequantize_fp8_rowwise(data, xp.zeros(2, np.float32), np.float16)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 128\), got \(2, 64\)"):
        dequantize_fp8_rowwise(data, xp.zeros(2, np.float32), out=xp.zeros((2, 64), BF16))
    mx = MXFP8Array(xp.zeros((2, 64), np.uint8), xp.zeros((2, 2), np.uint8))
    with pytest.raises(TypeError, match=r"mx: expected an MXFP8Array"):
        mx_to_rowwise_permute(data, xp.zeros(4, np.int32))
    with pytest.raises(TypeError, match=r"permuted_indices: expected dtype int32, got int64"):
        mx_to_rowwise_permute(mx, xp.zeros(4, np.int64))
    with pytest.raises(ValueError, match=r"permuted_indices: expected a 1-D array"):
        mx_to_rowwise_permute(mx, xp.zeros((2, 2), np.int32))
    # the rowwise kernels move 16 bytes at a time: an address 8 bytes off is refused up front
    raw = xp.zeros(2 * 128 * 2 + 32, np.uint8)
    at = -address(raw) % 16 + 8
    with pytest.raises(ValueError, match=r"x: the rows start at address 0x[0-9a-f]+, not a "
                                         r"multiple of 16 bytes"):
        quantize_fp8_rowwise(raw[at:at + 512].view(BF16).reshape(2, 128))
    with pytest.raises(ValueError, match=r"mx.data: expected an address that is a multiple of "
                                         r"16 bytes"):
        mx_to_rowwise_permute(MXFP8Array(raw[at:at + 128].reshape(2, 64), mx.scales),
                              xp.zeros(4, np.int32))
    with pytest.raises(ValueError, match=r"out\[0\] \(data\): expected an address that is a "
                                         r"multiple of 16 bytes"):
        mx_to_rowwise_permute(mx, xp.zeros(2, np.int32),
                              out=(raw[at:at + 128].reshape(2, 64), xp.zeros(2, np.float32)))


def grouped_rowwise_rows(rng, p, d, ends):
    """fp8 rowwise rows (data, scales) of random rows spanning 2^-120..2^120 (each group's rows
    of very different magnitudes, so columns rescale), with a zero row, a padding row (scale 1.0,
    zeros) and, in the second group, a NaN row."""
    x = random_rows(rng, p, d, F32)
    x[1] = 0
    data, scales = quantize_fp8_rowwise_ref(x)
    data[2], scales[2] = 0, 1.0
    if len(ends) > 1 and ends[1] - ends[0] > 1:
        data[ends[0] + 1, 3] = 0x7F   # a NaN element: NaN in column 3 of group 1 only
    return data, scales


GROUP_CASES = pytest.mark.parametrize("p, d, ends", [
    (40, 32, [13, 13, 30]),          # an empty group; rows past the last group
    (67, 48, [0, 5, 66, 67]),        # an empty first group; a group longer than a tile
    (16, 16, [16]),
], ids=["empty-middle", "long", "one"])


@GROUP_CASES
def test_host_group_colwise_bit_exact(rng, p, d, ends):
    data, scales = grouped_rowwise_rows(rng, p, d, ends)
    ends = np.array(ends, dtype=np.int32)
    assert_same(_host.fp8_rowwise_to_group_colwise(data, scales, ends)[:2],
                group_colwise_ref(data, scales, ends)[:2])
    np.testing.assert_array_equal(_host.fp8_rowwise_to_group_colwise(data, scales, ends)[2],
                                  group_colwise_ref(data, scales, ends)[2])


@GROUP_CASES
def test_group_colwise_kernels_bit_exact(kernels, rng, p, d, ends):
    data, scales = grouped_rowwise_rows(rng, p, d, ends)
    ends = np.array(ends, dtype=np.int32)
    got = fp8_rowwise_to_group_colwise(to_device(data), to_device(scales), to_device(ends))
    want = group_colwise_ref(data, scales, ends)
    assert_same(got[:2], want[:2])
    np.testing.assert_array_equal(to_host(got[2]), want[2])


def test_group_colwise_amax_atomic_chunks(kernels, rng):
    """The amax kernel in chunks smaller than the rows (its GPU configuration: keys merged by
    atomic max across threads), against the exclusive configuration the simulator launches."""
    from mxcomm.kernels.fp8_colwise import group_colwise_amax_kernel
    from mxcomm.kernels import launch_1d
    xp = kernels
    ends = np.array([5, 5, 21, 40], dtype=np.int32)
    data, scales = grouped_rowwise_rows(rng, 40, 16, ends)
    keys = []
    for chunk in (8, 40):
        k = xp.zeros((4, 16), np.uint32)
        group_colwise_amax_kernel[launch_1d(-(-40 // chunk) * 2)](
            to_device(data).view(np.uint64), to_device(scales).view(np.uint32), to_device(ends),
            k, chunk)
        keys.append(to_host(k))
    np.testing.assert_array_equal(keys[0], keys[1])
    assert (keys[1][[0, 2, 3]] > 0).all() and (keys[1][1] == 0).all()  # group 1 is empty


def f16_path_quads(data, scales, ends, want_scales):
    """The fraction of (position quad, 4 columns) units of the encode kernel, rows present, whose
    every rescale exponent r - s lies in its f16 range (FAST_K_MIN..FAST_K_MAX): how much of a
    test's data that path takes (computed here from the data, independently of the kernel)."""
    from mxcomm.kernels.fp8_colwise_encode import FAST_K_MAX, FAST_K_MIN
    r = np.frexp(scales.astype(np.float64))[1] - 1                        # row exponents
    s = np.frexp(want_scales.astype(np.float64))[1] - 1                   # (G, D)
    fast = total = 0
    start = 0
    for g, end in enumerate(ends):
        for q in range(start, end, 4):
            for c in range(0, s.shape[1], 4):
                k = r[q:min(q + 4, end), None] - s[g][None, c:c + 4]
                fast += bool(np.isfinite(want_scales[g, c:c + 4]).all()
                             and (k >= FAST_K_MIN).all() and (k <= FAST_K_MAX).all())
                total += 1
        start = end
    return fast / max(total, 1)


@pytest.mark.parametrize("spread", [0, 7, 20])
def test_group_colwise_f16_path_bit_exact(kernels, rng, spread):
    """Every e4m3 byte value (subnormals, zeros, both signs; no NaN; columns half zeros, and
    columns all zero in a group) under row scales 2^r with r
    spread over 2 ``spread`` + 1 binades: with spread 0 and 7 the encode's f16 path takes most
    of the quads, with 20 its per-byte f32 path most of them; the amax keys' plain-word and
    exact cases alike. Kernels against the float64 reference."""
    p, d = 70, 64
    data = rng.integers(0, 0x7F, (p, d), dtype=np.uint8) | (
        rng.integers(0, 2, (p, d), dtype=np.uint8) << 7)
    data[:, :8] = rng.integers(0x08, 0x7F, (p, 8), dtype=np.uint8)   # words of plain bytes
    data[:, 16:32][rng.random((p, 16)) < 0.5] = 0                      # ReLU-like zeros
    data[9:52, 8:16] = 0                                               # zero columns of group 2
    scales = np.exp2(rng.integers(-spread, spread + 1, p)).astype(F32)
    ends = np.array([9, 9, 52, 68], dtype=np.int32)                   # rows 68, 69: no group
    want = group_colwise_ref(data, scales, ends)
    share = f16_path_quads(data, scales, ends, want[1])
    assert share > 0.8 if spread < 20 else share < 0.5   # all-zero columns: the f32 path
    got = fp8_rowwise_to_group_colwise(to_device(data), to_device(scales), to_device(ends))
    assert_same(got[:2], want[:2])
    np.testing.assert_array_equal(to_host(got[2]), want[2])


def test_group_colwise_amax_keys_order_subnormals_exactly(kernels):
    """A column whose largest value is an e4m3 subnormal of a row with a larger scale, against
    normals of rows with smaller scales (the integer keys rank subnormals by value): every
    mantissa (a column each, and its negative), every scale offset (a group each)."""
    shifts, mants = range(0, 12), np.arange(1, 8)
    data = np.zeros((2 * len(shifts), 16), np.uint8)
    data[0::2, :7] = mants                   # the subnormals, in rows of scale 1
    data[1::2, :7] = 0x08 + (mants % 8)      # normals, in rows `shift` binades down
    data[:, 8:15] = data[:, :7] | 0x80
    scales = np.array([s for shift in shifts for s in (1.0, 2.0 ** -shift)], F32)
    ends = np.arange(2, data.shape[0] + 1, 2, dtype=np.int32)    # each pair its own group
    got = fp8_rowwise_to_group_colwise(to_device(data), to_device(scales), to_device(ends))
    want = group_colwise_ref(data, scales, ends)
    assert_same(got[:2], want[:2])


def test_group_colwise_keeps_the_operands_sqnr(rng):
    """Rows quantized rowwise, then rescaled per (group, column): the wgrad operand is as close to
    the bf16 rows as quantizing each group's columns directly (power-of-two scales on both
    axes), and a grouped x^T @ g from it as close as from the rowwise rows."""
    x = rng.standard_normal((512, 64)).astype(BF16)
    ends = np.array([100, 100, 300, 512], dtype=np.int32)
    data, scales = quantize_fp8_rowwise_ref(x)
    data_t, scales_t, aligned = _host.fp8_rowwise_to_group_colwise(data, scales, ends)
    xf = x.astype(np.float64)
    start, position, got, direct = 0, 0, [], []
    for k, end in enumerate(ends):
        cols = data_t[:, position:position + end - start].view(ml_dtypes.float8_e4m3fn)
        got.append(cols.astype(np.float64).T * scales_t[k].astype(np.float64))
        if end > start:
            q, s = quantize_fp8_rowwise_ref(np.ascontiguousarray(x[start:end].T))  # columns
            direct.append((q.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * s[:, None]).T)
        position, start = aligned[k], end
    got, direct = np.concatenate(got), np.concatenate(direct)
    rowwise = data.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * scales[:, None]
    assert abs(sqnr(xf, got) - sqnr(xf, direct)) < 0.3
    assert abs(sqnr(xf, got) - sqnr(xf, rowwise)) < 0.3
    assert sqnr(xf, got) > 28


def test_group_colwise_rejects_bad_input(kernels):
    xp = kernels
    data, scales = xp.zeros((32, 32), np.uint8), xp.ones(32, np.float32)
    ends = xp.asarray(np.array([32], np.int32))
    with pytest.raises(ValueError, match="group_ends: expected a 1-D array of G >= 1"):
        fp8_rowwise_to_group_colwise(data, scales, ends[:0])
    with pytest.raises(TypeError, match="group_ends: expected dtype int32"):
        fp8_rowwise_to_group_colwise(data, scales, ends.astype(np.int64))
    with pytest.raises(ValueError, match="scales: expected shape"):
        fp8_rowwise_to_group_colwise(data, scales[:31], ends)
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_rowwise_to_group_colwise(data[:, :24], scales, ends)


def test_group_colwise_refuses_outputs_past_the_encode_kernels_reach(kernels, monkeypatch):
    """The bound on the output (the encode kernel indexes int32 words) holds on both entries: the
    checked public function and the fp8 wgrad's unchecked one, before anything is launched."""
    from mxcomm import colwise
    xp = kernels
    data, scales = xp.zeros((32, 32), np.uint8), xp.ones(32, np.float32)
    ends = xp.asarray(np.array([32], np.int32))
    words = colwise.group_colwise_positions(32, 1) * 32 // 4
    monkeypatch.setattr(colwise, "ENCODE_MAX_WORDS", words - 1)
    for convert in (lambda: fp8_rowwise_to_group_colwise(data, scales, ends),
                    lambda: colwise._to_group_colwise(data, scales, ends, None)):
        with pytest.raises(ValueError, match=f"above the {4 * (words - 1)} the encode kernel"):
            convert()
    monkeypatch.setattr(colwise, "ENCODE_MAX_WORDS", words)
    assert fp8_rowwise_to_group_colwise(data, scales, ends)[0].shape == (32, words * 4 // 32)


# --- bf16 matrices quantized along their columns, transposed (the dgrad's weight operand) ------

def transposed_test_matrices(rng, b, r, c, specials=KERNEL_SPECIALS):
    """(b, r, c) bf16: random columns spanning 2^-120..2^120 and, as columns, the special rows
    (zeros, subnormals, the scale thresholds, NaN, Inf: ``special_rows`` of length r)."""
    x = np.swapaxes(random_rows(rng, b * c, r, BF16).reshape(b, c, r), 1, 2).copy()
    s = special_rows(BF16, r)[specials].T  # (r, specials) columns
    for i in range(min(c, s.shape[1])):
        x[i % b, :, c - 1 - i] = s[:, i]
    return x


def transposed_ref(x):
    """The float64 reference: rowwise quantization of the transposed matrices."""
    b, r, c = x.shape
    data, scales = quantize_fp8_rowwise_ref(np.swapaxes(x, 1, 2).reshape(b * c, r))
    return data.reshape(b, c, r), scales.reshape(b, c)


def test_host_rowwise_transposed_bit_exact(rng):
    x = transposed_test_matrices(rng, 3, 128, 48, slice(None))
    assert_same(_host.quantize_fp8_rowwise_transposed(x), transposed_ref(x))


@pytest.mark.parametrize("b, r, c", [(2, 32, 48), (1, 80, 144)])  # tiles cut in rows, columns
def test_rowwise_transposed_kernels_bit_exact(kernels, rng, b, r, c):
    x = transposed_test_matrices(rng, b, r, c)
    data, scales = quantize_fp8_rowwise_transposed(to_device(x))
    assert data.shape == (b, c, r) and scales.shape == (b, c)
    assert_same((data, scales), transposed_ref(x))
    nan_cols = ~np.isfinite(x.astype(np.float64)).all(axis=1)
    assert nan_cols.any() and np.isnan(to_host(scales)[nan_cols]).all()


def test_gemm_operands_are_made_in_torchs_memory(kernels, rng):
    """The fp8 GEMM's conversions write into arrays torch allocated (``_torch_arrays._Alloc``:
    its caching allocator is ordered on torch's stream and a CUDA graph's under capture, CuPy's
    pool is neither), bit for bit what they write into the array module's."""
    torch = pytest.importorskip("torch")
    from mxcomm import _platform, colwise
    from mxcomm._torch_arrays import _Alloc
    device = torch.device("cuda" if _platform.backend() == "cuda" else "cpu")
    data, scales = grouped_rowwise_rows(rng, 48, 32, [16, 40])
    ends = to_device(np.array([16, 40], dtype=np.int32))
    x = to_device(transposed_test_matrices(rng, 2, 32, 48))
    for convert, args in ((colwise._to_group_colwise,
                           (to_device(data), to_device(scales), ends, None)),
                          (colwise._transposed, (x, None))):
        alloc = _Alloc(device)
        got, want = convert(*args, alloc), convert(*args)
        for a, w in zip(got, want):
            t = alloc.tensor(a)  # the tensor behind the array: one memory
            assert t.device == device and t.data_ptr() == address(a)
            np.testing.assert_array_equal(to_host(a), to_host(w))


def test_rowwise_transposed_amax_atomic_chunks(kernels, rng):
    """The amax kernel in chunks smaller than the rows (its GPU configuration: keys merged by
    atomic max across threads), against the exclusive configuration the simulator launches."""
    from mxcomm.kernels.fp8_transpose import transpose_amax_kernel
    from mxcomm.kernels import launch_1d
    xp = kernels
    x = transposed_test_matrices(rng, 2, 48, 16)
    words = to_device(x).reshape(96, 16).view(np.uint64)
    keys = []
    for chunk in (16, 48):
        k = xp.zeros(32, np.uint32)
        transpose_amax_kernel[launch_1d(2 * -(-48 // chunk) * 4)](words, 48, k, chunk)
        keys.append(to_host(k))
    np.testing.assert_array_equal(keys[0], keys[1])
    want = (bits(x).astype(np.uint32) & 0x7FFF).max(axis=1).reshape(32)
    np.testing.assert_array_equal(keys[1], want)


def test_rowwise_transposed_rejects_bad_input(kernels):
    xp = kernels
    x = xp.zeros((2, 32, 48), BF16)
    with pytest.raises(ValueError, match=r"expected a 3-D \(B, R, C\) array"):
        quantize_fp8_rowwise_transposed(x[0])
    with pytest.raises(TypeError, match="expected dtype bfloat16"):
        quantize_fp8_rowwise_transposed(x.astype(np.float32))
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_fp8_rowwise_transposed(x[:, :24])
    with pytest.raises(ValueError, match="C-contiguous"):
        quantize_fp8_rowwise_transposed(xp.swapaxes(xp.zeros((2, 48, 32), BF16), 1, 2))


# --- GPU: larger shapes against the same references ------------------------------------------

@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize("m, d", [(4093, 7168), (1001, 48), (37, 2064), (9, 24576)])
def test_gpu_rowwise_large_bit_exact(rng, dtype, m, d):
    """Row counts that leave warps of the last CUDA block without a row; rows narrower than a
    warp's units; a width that is not a multiple of a pass; rows of many passes."""
    x = random_rows(rng, m, d, dtype)
    x[5, d // 2] = np.nan
    x[m - 3, d - 1] = -np.inf
    x[min(17, m - 1)] = 0
    data, scales = quantize_fp8_rowwise(to_device(x))
    assert_same((data, scales), quantize_fp8_rowwise_ref(x))
    assert_same(dequantize_fp8_rowwise(data, scales, dtype),
                dequantize_scaled_ref(to_host(data), to_host(scales), d, dtype))


@pytest.mark.gpu
@DTYPES
@pytest.mark.parametrize("mode", MODES)
def test_gpu_block128_large_bit_exact(rng, dtype, mode):
    x = random_rows(rng, 4096, 7168, dtype)
    x[5, 100] = np.nan
    x[17, :256] = 0
    data, scales = quantize_fp8_block128(to_device(x), mode)
    assert_same((data, scales), quantize_fp8_block128_ref(x, mode))
    assert_same(dequantize_fp8_block128(data, scales, dtype),
                dequantize_scaled_ref(to_host(data), to_host(scales), 128, dtype))


@pytest.mark.gpu
def test_gpu_dequantize_large_bit_exact(rng):
    data = rng.integers(0, 256, (2048, 7168), dtype=np.uint8)
    row_scales, block_scales = random_scales(rng, 2048), random_scales(rng, (2048, 56))
    with np.errstate(over="ignore", invalid="ignore"):
        for dtype in (BF16, F32):
            assert_same(dequantize_fp8_rowwise(to_device(data), to_device(row_scales), dtype),
                        dequantize_scaled_ref(data, row_scales, 7168, dtype))
            assert_same(dequantize_fp8_block128(to_device(data), to_device(block_scales), dtype),
                        dequantize_scaled_ref(data, block_scales, 128, dtype))


@pytest.mark.gpu
def test_gpu_group_colwise_large_bit_exact(rng):
    """Groups of a permute (padded to 16, one empty) over many tiles and chunks: kernels against
    the host twin everywhere, against the column-by-column reference on a few columns."""
    counts = rng.multinomial(3000, np.ones(8) / 8)
    counts[5] = 0
    ends = np.cumsum(-(-counts // 16) * 16).astype(np.int32)
    p, d = int(ends[-1]) + 7, 2064
    data, scales = grouped_rowwise_rows(rng, p, d, ends)
    got = fp8_rowwise_to_group_colwise(to_device(data), to_device(scales), to_device(ends))
    want = _host.fp8_rowwise_to_group_colwise(data, scales, ends)
    assert_same(got[:2], want[:2])
    np.testing.assert_array_equal(to_host(got[2]), want[2])
    cols = [0, 3, 1000, d - 1]
    ref = group_colwise_ref(np.ascontiguousarray(data[:, cols]), scales, ends)
    np.testing.assert_array_equal(to_host(got[0])[cols], ref[0])


@pytest.mark.gpu
def test_gpu_mx_to_rowwise_long_rows_bit_exact(rng):
    """Rows of many steps (D = 36864: 4608 words, 18 steps of a warp's 256)."""
    data, scales = mx_test_rows(rng, 6, 36864)
    indices = np.r_[rng.permutation(data.shape[0]), -1].astype(np.int32)
    got = mx_to_rowwise_permute(MXFP8Array(to_device(data), to_device(scales)), to_device(indices))
    assert_same(got, mx_to_rowwise_ref(data, scales, indices))


@pytest.mark.gpu
def test_gpu_mx_to_rowwise_large_bit_exact(rng):
    x = random_rows(rng, 2048, 7168, BF16)
    x[3, 1000] = np.nan
    data, scales = quantize_mxfp8_ref(x, "rceil")
    counts = rng.multinomial(2048, np.ones(16) / 16)  # 2 ranks x 8 local experts
    _, indices, _ = permute_ref(np.arange(2048), counts, 8, 16)
    got = mx_to_rowwise_permute(MXFP8Array(to_device(data), to_device(scales)), to_device(indices))
    assert_same(got, _host.mx_to_rowwise_permute(HostMX(data, scales), indices))
    odd = indices[:2041]  # the last CUDA block's warps partly without a row
    assert_same(mx_to_rowwise_permute(MXFP8Array(to_device(data), to_device(scales)),
                                      to_device(odd)),
                _host.mx_to_rowwise_permute(HostMX(data, scales), odd))
    sub = np.r_[np.flatnonzero(indices == 3), np.arange(0, len(indices), 97)]
    assert_same((to_host(got[0])[sub], to_host(got[1])[sub]),
                mx_to_rowwise_ref(data, scales, indices[sub]))


@pytest.mark.gpu
@pytest.mark.parametrize("b, r, c", [(8, 2048, 7168), (3, 5120, 1040), (2, 48, 16)])
def test_gpu_rowwise_transposed_large_bit_exact(rng, b, r, c):
    """The dgrad weight shapes (G, N, K), a width that cuts the last tile, one tiny matrix."""
    x = np.swapaxes(random_rows(rng, b * c, r, BF16).reshape(b, c, r), 1, 2).copy()
    x[0, 7, 5] = np.nan
    x[b - 1, r - 1, c - 1] = -np.inf
    x[b - 1, :, 3] = 0
    got = quantize_fp8_rowwise_transposed(to_device(x))
    assert_same(got, _host.quantize_fp8_rowwise_transposed(x))
