"""Formats as one abstraction (mxcomm.formats): the registry, each Format's shape, quantize and
dequantize through the Format bit-exact against the float64 references, SQNR against bf16, the
generic QuantizedArray, permute/unpermute of every format (data + scales together, the padding
scale), and the MXFP8 -> fp8 rowwise conversion in the permute against a NumPy reference."""

import ml_dtypes
import numpy as np
import pytest

import mxcomm
from mxcomm.formats import PER_ROW, QuantizedArray, format_names, get_format
from mxcomm import sqnr
from mxcomm.kernels import array_module
from mxcomm.mxfp8 import MXFP8Array
from mxcomm.permutation import permute, unpermute, unpermute_backward
from reference import permute_ref, quantize_mxfp8_ref, dequantize_mxfp8_ref, unpermute_ref
from reference_fp8 import (dequantize_scaled_ref, mx_to_rowwise_ref, quantize_fp8_block128_ref,
                           quantize_fp8_rowwise_ref)

BF16 = np.dtype(ml_dtypes.bfloat16)
QUANTIZED = ("mxfp8", "fp8_rowwise", "fp8_block128", "fp8_block128_pow2")


def to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def to_device(a):
    return array_module().asarray(a)


def quantize_ref(name, x):
    """(data, scales) of the float64 reference quantizer of format ``name``."""
    if name == "mxfp8":
        return quantize_mxfp8_ref(x, "rceil")
    if name == "fp8_rowwise":
        return quantize_fp8_rowwise_ref(x)
    return quantize_fp8_block128_ref(x, "pow2" if name.endswith("pow2") else "plain")


def dequantize_ref(name, data, scales):
    if name == "mxfp8":
        return dequantize_mxfp8_ref(data, scales)
    block = data.shape[1] if name == "fp8_rowwise" else 128
    return dequantize_scaled_ref(data, scales, block)


def test_registry_and_shapes():
    assert format_names() == ("bf16", "native", "mxfp8", "fp8_rowwise", "fp8_block128",
                              "fp8_block128_pow2")
    table = {  # name: (quantized, scale dtype, granularity, D multiple, bytes per row at D=256)
        "bf16": (False, None, None, 1, 512),
        "native": (False, None, None, 1, 512),  # bf16 input; fp32 input: 1024
        "mxfp8": (True, np.uint8, 32, 32, 256 + 8),
        "fp8_rowwise": (True, np.float32, PER_ROW, 16, 256 + 4),
        "fp8_block128": (True, np.float32, 128, 128, 256 + 8),
        "fp8_block128_pow2": (True, np.float32, 128, 128, 256 + 8),
    }
    for name, (quantized, scale_dtype, block, multiple, nbytes) in table.items():
        f = get_format(name)
        assert get_format(f) is f and f.name == name
        assert f.quantized == quantized
        assert (f.scale_dtype is None) if scale_dtype is None else f.scale_dtype == scale_dtype
        assert f.scale_block == block and f.d_multiple == multiple
        assert f.bytes_per_row(256) == nbytes
    assert get_format("native").bytes_per_row(256, np.float32) == 1024
    assert get_format("fp8_rowwise").scales_shape(5, 64) == (5,)
    assert get_format("fp8_block128").scales_shape(5, 256) == (5, 2)
    assert get_format("mxfp8").padding_scale == 0 and get_format("fp8_rowwise").padding_scale == 1
    with pytest.raises(ValueError, match="precision: expected one of 'bf16', 'native', 'mxfp8', "
                                         "'fp8_rowwise', 'fp8_block128', 'fp8_block128_pow2', "
                                         "got 'fp4'"):
        get_format("fp4")
    with pytest.raises(ValueError, match="D = 96 is not a multiple of 128"):
        get_format("fp8_block128").check_input(np.zeros((2, 96), np.float32))


def test_check_input_names_a_misaligned_address():
    """The quantize kernels load 8 (MXFP8, 1x128) or 16 bytes (rowwise) at a time: rows whose
    address is not a multiple of that are refused up front, naming the argument and the need."""
    raw = np.zeros(512 + 32, np.uint8)
    at = -raw.ctypes.data % 16 + 8  # 8-byte aligned, not 16

    def rows(offset, d):
        return raw[offset:offset + 512].view(np.float32).reshape(512 // 4 // d, d)

    get_format("mxfp8").check_input(rows(at, 64))
    get_format("fp8_block128").check_input(rows(at, 128))
    get_format("bf16").check_input(rows(at + 4, 64))  # unscaled: no quantize kernel
    with pytest.raises(ValueError, match=r"x on rank 1: the rows start at address 0x[0-9a-f]+, "
                                         r"not a multiple of 16 bytes, which the 'fp8_rowwise' "
                                         r"quantize kernel needs"):
        get_format("fp8_rowwise").check_input(rows(at, 64), "x on rank 1")
    with pytest.raises(ValueError, match=r"not a multiple of 8 bytes, which the 'mxfp8'"):
        get_format("mxfp8").check_input(rows(at + 4, 64))
    get_format("fp8_rowwise").check_input(rows(at - 8, 64))


def test_registry_is_filled_by_the_format_modules():
    """mxcomm.formats imports no format module: each registers its own formats (a name only
    once), and the permute's conversion is the fp8 formats module's."""
    import ast
    import inspect
    from mxcomm import formats, mxfp8, rowwise
    tree = ast.parse(inspect.getsource(formats))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"_array", "kernels"}, imported
    assert get_format("mxfp8") is mxfp8.MXFP8
    row = mxfp8.MXFP8.view(np.zeros((1, 32), np.uint8), np.zeros((1, 1), np.uint8))
    assert type(row) is mxfp8.MXFP8Array and row.format is mxfp8.MXFP8
    assert get_format("fp8_rowwise") is rowwise.FP8_ROWWISE
    assert formats.conversion(mxfp8.MXFP8, rowwise.FP8_ROWWISE) is rowwise._mx_to_rowwise
    with pytest.raises(ValueError, match="'fp8_rowwise' is registered already"):
        formats.register(formats.Format("fp8_rowwise", "e4m3fn", np.uint8))
    assert format_names().count("fp8_rowwise") == 1


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "fp32"])
def test_quantize_dequantize_bit_exact(rng, name, dtype):
    """Format.quantize / QuantizedArray.dequantize (host backend here) against the references,
    with a zero row and a row holding Inf."""
    x = (rng.standard_normal((5, 256)) * np.exp2(rng.integers(-20, 20, (5, 1)))).astype(dtype)
    x[1] = 0
    x[3, 7] = np.inf
    fmt = get_format(name)
    q = fmt.quantize(to_device(x))
    assert isinstance(q, QuantizedArray) and q.format is fmt
    assert isinstance(q, MXFP8Array) == (name == "mxfp8")
    data_ref, scales_ref = quantize_ref(name, x)
    np.testing.assert_array_equal(to_host(q.data), data_ref)
    np.testing.assert_array_equal(to_host(q.scales).view(np.uint8),
                                  np.asarray(scales_ref).view(np.uint8))
    dq = to_host(q.dequantize())
    np.testing.assert_array_equal(dq.view(np.uint16),
                                  dequantize_ref(name, data_ref, scales_ref).view(np.uint16))
    assert np.isnan(dq[3].astype(np.float32)).any() and not np.isnan(dq[[0, 1, 2, 4]]).any()


def test_sqnr_against_bf16(rng):
    """Each format's round trip of Gaussian bf16 rows, against the bf16 rows: MXFP8 and 1x128 at
    least e4m3's ~31 dB; per row (one scale for 1024 values) lower but above 28 dB."""
    x = rng.standard_normal((256, 1024)).astype(BF16)
    got = {}
    for name in QUANTIZED:
        got[name] = sqnr(x, to_host(get_format(name).quantize(to_device(x)).dequantize()))
    assert got["mxfp8"] >= 30 and got["fp8_block128"] >= 30 and got["fp8_block128_pow2"] >= 30
    assert got["fp8_rowwise"] >= 28
    assert got["fp8_block128"] >= got["fp8_block128_pow2"] - 0.01  # plain scales fit tighter


def test_quantized_array_validation():
    f = get_format("fp8_rowwise")
    xp = array_module()
    with pytest.raises(ValueError, match=r"scales: expected shape \(2,\)"):
        QuantizedArray(xp.zeros((2, 32), np.uint8), xp.zeros((2, 1), np.float32), f)
    with pytest.raises(TypeError, match="scales: expected dtype float32"):
        QuantizedArray(xp.zeros((2, 32), np.uint8), xp.zeros(2, np.uint8), f)
    with pytest.raises(ValueError, match="multiple of 16"):
        QuantizedArray(xp.zeros((2, 24), np.uint8), xp.zeros(2, np.float32), f)
    with pytest.raises(TypeError, match="quantized Format"):
        QuantizedArray(xp.zeros((2, 32), np.uint8), xp.zeros(2, np.float32), get_format("bf16"))
    # the public MXFP8 names are the mxfp8 case of the generic container
    mx = mxcomm.quantize_mxfp8(xp.ones((2, 64), BF16))
    assert isinstance(mx, QuantizedArray) and mx.format is get_format("mxfp8")
    assert get_format("mxfp8").wrap(mx.data, mx.scales).__class__ is MXFP8Array


@pytest.mark.parametrize("name", QUANTIZED)
def test_permute_moves_data_and_scales(rng, name):
    """permute / unpermute / unpermute_backward of quantized rows: data and scales move exactly
    as the index reference moves the rows; padding rows get data 0 and the format's padding
    scale; unpermute restores the received rows."""
    e_local, align, d = 2, 8, 256
    counts = np.array([3, 0, 2, 4], np.int32)  # 2 source ranks x 2 experts
    x = rng.standard_normal((int(counts.sum()), d)).astype(BF16)
    fmt = get_format(name)
    q = fmt.quantize(to_device(x))
    data, scales = to_host(q.data), to_host(q.scales)
    permuted, indices, offsets = permute(q, to_device(counts), e_local, align)
    assert permuted.format is fmt
    data_ref, idx_ref, offsets_ref = permute_ref(data, counts, e_local, align)
    np.testing.assert_array_equal(to_host(indices), idx_ref)
    np.testing.assert_array_equal(to_host(offsets), offsets_ref)
    np.testing.assert_array_equal(to_host(permuted.data), data_ref)
    pad = idx_ref < 0
    got_scales = to_host(permuted.scales)
    np.testing.assert_array_equal(got_scales[~pad], scales[idx_ref[~pad]])
    assert pad.any() and (got_scales[pad] == fmt.padding_scale).all()
    assert (to_host(permuted.dequantize())[pad].astype(np.float32) == 0).all()
    back = unpermute(permuted, indices, x.shape[0])
    assert back.format is fmt
    np.testing.assert_array_equal(to_host(back.data), data)
    np.testing.assert_array_equal(to_host(back.scales), scales)
    again = unpermute_backward(back, indices)
    np.testing.assert_array_equal(to_host(again.data), to_host(permuted.data))
    np.testing.assert_array_equal(to_host(again.scales), got_scales)
    np.testing.assert_array_equal(
        to_host(unpermute(permuted.dequantize(), indices, x.shape[0])).view(np.uint16),
        unpermute_ref(to_host(permuted.dequantize()), idx_ref, x.shape[0]).view(np.uint16))


def test_permute_mx_to_rowwise(rng):
    """permute(mx, counts, ..., out_format="fp8_rowwise"): the MXFP8 rows gathered and rescaled
    to one power-of-two scale per row, bit for bit the NumPy reference; padding rows scale 1.0;
    and the result is what quantizing the bf16 rows rowwise gives (rceil MXFP8 of the same rows
    has the same row scale), within one e4m3 rounding."""
    e_local, align, d = 2, 16, 128
    counts = np.array([2, 5, 0, 3], np.int32)
    x = (rng.standard_normal((int(counts.sum()), d))
         * np.exp2(rng.integers(-6, 6, (1, d)))).astype(BF16)
    mx = mxcomm.quantize_mxfp8(to_device(x))
    out, indices, _ = permute(mx, to_device(counts), e_local, align, out_format="fp8_rowwise")
    assert out.format is get_format("fp8_rowwise")
    idx = to_host(indices)
    data_ref, scales_ref = mx_to_rowwise_ref(to_host(mx.data), to_host(mx.scales), idx)
    np.testing.assert_array_equal(to_host(out.data), data_ref)
    np.testing.assert_array_equal(to_host(out.scales), scales_ref)
    assert (to_host(out.scales)[idx < 0] == 1.0).all()
    direct = get_format("fp8_rowwise").quantize(to_device(x))
    keep = idx >= 0
    np.testing.assert_array_equal(to_host(out.scales)[keep], to_host(direct.scales)[idx[keep]])
    converted = to_host(out.dequantize()).astype(np.float64)[keep]
    assert sqnr(x[idx[keep]], converted) > 25
    with pytest.raises(ValueError, match="cannot convert fp8_rowwise rows to 'mxfp8'"):
        permute(direct, to_device(counts), e_local, align, out_format="mxfp8")
    with pytest.raises(ValueError, match="out_format: expected one of"):
        permute(mx, to_device(counts), e_local, align, out_format="fp16")


@pytest.mark.parametrize("name", QUANTIZED)
def test_format_launchers_pick_the_kernels(rng, use_backend, name):
    """The Format's launchers run the CUDA kernels (Numba's simulator here, the GPU's there) and
    the host twins, bit-identical on the same tiny input (quantize, dequantize, and a permute
    with padding)."""
    from mxcomm import _platform
    kernels = "cuda" if _platform.backend() == "cuda" else "simulator"
    x = rng.standard_normal((2, 128)).astype(BF16)
    counts = np.array([1, 1], np.int32)
    got = {}
    for backend in ("host", kernels):
        with use_backend(backend) as xp:
            q = get_format(name).quantize(xp.asarray(x))
            p, _, _ = permute(q, xp.asarray(counts), 1, 4)
            got[backend] = [to_host(a) for a in (q.data, q.scales, q.dequantize(), p.data,
                                                  p.scales)]
    for h, k in zip(got["host"], got[kernels]):
        np.testing.assert_array_equal(np.ascontiguousarray(h).view(np.uint8),
                                      np.ascontiguousarray(k).view(np.uint8))


def test_as_device_array_is_the_one_acceptance():
    """_array.as_device_array by request: host arrays pass through zero-copy (the same object,
    or a view of the same memory), device-only objects are refused on the host naming the
    argument, and a torch bf16 tensor is refused with a pointer to mxcomm.torch."""
    from mxcomm._array import as_device_array
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert as_device_array(x, "x", device=False) is x
    class HostLike:
        __array_interface__ = x.__array_interface__
    viewed = as_device_array(HostLike(), "x", device=False)
    assert np.shares_memory(viewed, x) and (viewed == x).all()

    class DeviceOnly:
        __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (0, False),
                                    "version": 3}
    with pytest.raises(TypeError, match=r"x on rank 0: expected a host array .*DeviceOnly"):
        as_device_array(DeviceOnly(), "x on rank 0", device=False)
    with pytest.raises(TypeError, match=r"y: expected a host array .*list"):
        as_device_array([1.0], "y", device=False)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"t: cannot view torch.Tensor .*mxcomm.torch"):
        as_device_array(torch.zeros(2, dtype=torch.bfloat16), "t", device=False)


@pytest.mark.gpu
def test_as_device_array_refuses_host_arrays_for_the_device():
    from mxcomm._array import as_device_array
    cupy = pytest.importorskip("cupy")
    x = cupy.zeros((2, 3), cupy.float32)
    assert as_device_array(x, "x", device=True) is x
    with pytest.raises(TypeError, match=r"x: expected a CUDA device array .*ndarray"):
        as_device_array(np.zeros(3), "x", device=True)
