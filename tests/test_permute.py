"""permute / unpermute and their backward helpers: exact equality with the loop reference."""

import ml_dtypes
import numpy as np
import pytest

from mxcomm.kernels import array_module
from mxcomm.mxfp8 import MXFP8Array, quantize_mxfp8
from mxcomm.permutation import permute, permute_backward, unpermute, unpermute_backward
from reference import dequantize_mxfp8_ref, gather_ref, permute_ref, unpermute_ref

BF16 = np.dtype(ml_dtypes.bfloat16)


def to_host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def to_device(a):
    return array_module().asarray(a)


def random_counts(rng, ranks, e_local, high=4):
    """Rank-major counts with zero-count experts and, when ranks > 1, a rank sending nothing."""
    counts = rng.integers(0, high, ranks * e_local).astype(np.int32)
    counts[rng.integers(0, ranks * e_local)] = 0
    if ranks > 1:
        r = rng.integers(0, ranks)
        counts[r * e_local:(r + 1) * e_local] = 0
    return counts


def bits(a):
    a = to_host(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


def check_permute(x, counts, e_local, align):
    permuted, indices, offsets = permute(to_device(x), to_device(counts), e_local, align)
    want, want_idx, want_off = permute_ref(x, counts, e_local, align)
    np.testing.assert_array_equal(to_host(indices), want_idx)
    np.testing.assert_array_equal(to_host(offsets), want_off)
    np.testing.assert_array_equal(bits(permuted), bits(want))
    return permuted, indices


@pytest.mark.parametrize("ranks,e_local,align,dtype,row", [
    (2, 2, 4, BF16, (16,)),       # 32-byte rows: uint64 words
    (3, 2, 8, np.float32, (3,)),   # 12-byte rows: uint32 words
    (1, 3, 1, BF16, (3,)),         # 6-byte rows: uint16 words, no padding
    (2, 1, 32, np.uint8, (5,)),    # 5-byte rows: bytes
    (2, 2, 4, np.int32, ()),       # 1-D input: one 4-byte element per row
    (2, 1, 4, np.uint8, (1030,)),  # long rows: the unrolled row copy, then its tail
])
def test_permute_exact(rng, ranks, e_local, align, dtype, row):
    counts = random_counts(rng, ranks, e_local)
    m = int(counts.sum())
    x = (rng.standard_normal((m,) + row) * 100).astype(dtype)
    permuted, indices = check_permute(x, counts, e_local, align)
    back = unpermute(permuted, indices, m)
    np.testing.assert_array_equal(bits(back), bits(x))
    np.testing.assert_array_equal(bits(permute_backward(permuted, indices, m)), bits(x))
    np.testing.assert_array_equal(bits(unpermute_backward(to_device(x), indices)), bits(permuted))


def test_permute_layout_example():
    """The docstring's example: counts [2, 1, 0, 3], W = 2, E_local = 2, align = 4."""
    x = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    permuted, indices, offsets = permute(to_device(x), to_device(np.array([2, 1, 0, 3], np.int32)), 2, 4)
    np.testing.assert_array_equal(to_host(indices), [0, 1, -1, -1, 2, 3, 4, 5] + [-1] * 8)
    np.testing.assert_array_equal(to_host(offsets), [4, 8])
    assert (to_host(permuted)[8:] == 0).all() and (to_host(permuted)[2:4] == 0).all()


def test_permute_nothing_received(rng):
    counts = np.zeros(4, np.int32)
    x = np.zeros((0, 32), BF16)
    permuted, _ = check_permute(x, counts, 2, 32)
    assert permuted.shape == (64, 32)
    assert unpermute(permuted, to_device(np.full(64, -1, np.int32)), 0).shape == (0, 32)


def test_permute_mxfp8_keeps_scales_with_rows(rng):
    counts = random_counts(rng, 2, 2)
    m = int(counts.sum())
    x = (rng.standard_normal((m, 64)) * np.exp2(rng.integers(-20, 20, (m, 1)))).astype(BF16)
    mx = quantize_mxfp8(to_device(x))
    permuted, indices, offsets = permute(mx, to_device(counts), 2, 4)
    assert isinstance(permuted, MXFP8Array) and permuted.shape == (indices.shape[0], 64)
    want_data, want_idx, _ = permute_ref(to_host(mx.data), counts, 2, 4)
    want_scales = permute_ref(to_host(mx.scales), counts, 2, 4)[0]
    np.testing.assert_array_equal(to_host(indices), want_idx)
    np.testing.assert_array_equal(to_host(permuted.data), want_data)
    np.testing.assert_array_equal(to_host(permuted.scales), want_scales)
    dq = to_host(permuted.dequantize()).astype(np.float64)
    pad = want_idx < 0
    assert (dq[pad] == 0).all()
    np.testing.assert_array_equal(dq[~pad], to_host(mx.dequantize()).astype(np.float64)[want_idx[~pad]])
    back = unpermute(permuted, indices, m)
    np.testing.assert_array_equal(to_host(back.data), to_host(mx.data))
    np.testing.assert_array_equal(to_host(back.scales), to_host(mx.scales))
    again = unpermute_backward(back, indices)
    np.testing.assert_array_equal(to_host(again.data), want_data)
    np.testing.assert_array_equal(to_host(again.scales), want_scales)


def test_permute_mxfp8_to_bf16_matches_reference(rng):
    """``out_format="bf16"``: the permuted rows dequantized in the gather equal the float64
    reference decode of the gathered MXFP8 rows (padding rows 0); plain bf16 rows with
    ``out_format="bf16"`` move as they are; plain rows cannot become another dtype."""
    counts = random_counts(rng, 2, 2)
    m = int(counts.sum())
    x = (rng.standard_normal((m, 64)) * np.exp2(rng.integers(-20, 20, (m, 1)))).astype(BF16)
    mx = quantize_mxfp8(to_device(x))
    got, indices, _ = permute(mx, to_device(counts), 2, 4, out_format="bf16")
    assert got.dtype == BF16 and got.shape == (indices.shape[0], 64)
    want_idx = permute_ref(x, counts, 2, 4)[1]
    want = np.zeros((want_idx.shape[0], 64), BF16)
    keep = want_idx >= 0
    want[keep] = dequantize_mxfp8_ref(to_host(mx.data)[want_idx[keep]],
                                      to_host(mx.scales)[want_idx[keep]])
    np.testing.assert_array_equal(bits(got), bits(want))
    plain, _, _ = permute(to_device(x), to_device(counts), 2, 4, out_format="bf16")
    np.testing.assert_array_equal(bits(plain), bits(permute_ref(x, counts, 2, 4)[0]))
    with pytest.raises(ValueError, match="cannot convert plain rows to 'bf16'"):
        permute(to_device(x.astype(np.float32)), to_device(counts), 2, 4, out_format="bf16")


def test_unpermute_scatter_matches_reference(rng):
    y = rng.standard_normal((8, 6)).astype(np.float32)
    idx = np.array([3, -1, 0, 2, -1, 1, -1, 4], np.int32)
    got = unpermute(to_device(y), to_device(idx), 5)
    np.testing.assert_array_equal(to_host(got), unpermute_ref(y, idx, 5))
    np.testing.assert_array_equal(to_host(unpermute_backward(to_device(to_host(got)), to_device(idx))),
                                  gather_ref(to_host(got), idx))


def test_permute_rejects_bad_input():
    xp = array_module()
    x = xp.zeros((4, 32), BF16)
    counts = xp.array([1, 1, 1, 1], np.int32)
    with pytest.raises(TypeError, match=r"num_tokens_per_expert_group: expected dtype int32, got int64"):
        permute(x, xp.array([1, 1, 1, 1]), 2)
    with pytest.raises(ValueError, match=r"num_tokens_per_expert_group: expected a 1-D"):
        permute(x, counts.reshape(2, 2), 2)
    with pytest.raises(ValueError, match=r"num_tokens_per_expert_group: .*multiple of "
                                         r"num_local_experts = 3, got 4"):
        permute(x, counts, 3)
    with pytest.raises(ValueError, match=r"num_local_experts: expected an int >= 1, got 0"):
        permute(x, counts, 0)
    with pytest.raises(TypeError, match=r"num_local_experts: expected an int, got float"):
        permute(x, counts, 2.0)
    with pytest.raises(ValueError, match=r"align: expected an int >= 1, got 0"):
        permute(x, counts, 2, align=0)
    with pytest.raises(ValueError, match=r"x: expected a C-contiguous"):
        permute(xp.zeros((4, 64), BF16)[:, ::2], counts, 2)
    with pytest.raises(TypeError, match=r"x: expected a"):
        permute("rows", counts, 2)


def test_unpermute_rejects_bad_input():
    xp = array_module()
    y = xp.zeros((8, 32), BF16)
    with pytest.raises(TypeError, match=r"permuted_indices: expected dtype int32, got int64"):
        unpermute(y, xp.zeros(8, np.int64), 4)
    with pytest.raises(ValueError, match=r"permuted_indices: expected a 1-D"):
        unpermute(y, xp.zeros((8, 1), np.int32), 4)
    with pytest.raises(ValueError, match=r"permuted_indices: expected length 8 .*got 7"):
        unpermute(y, xp.zeros(7, np.int32), 4)
    with pytest.raises(ValueError, match=r"num_rows: expected an int >= 0, got -1"):
        unpermute(y, xp.zeros(8, np.int32), -1)
    with pytest.raises(TypeError, match=r"permuted_indices: expected dtype int32"):
        unpermute_backward(y, xp.zeros(8, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("mxfp8", [False, True], ids=["bf16", "mxfp8"])
def test_gpu_permute_medium(rng, mxfp8):
    ranks, e_local, d = 4, 8, 2048
    counts = rng.integers(0, 300, ranks * e_local).astype(np.int32)
    counts[[3, 17]] = 0
    m = int(counts.sum())
    x = rng.standard_normal((m, d)).astype(BF16)
    xd = quantize_mxfp8(to_device(x)) if mxfp8 else to_device(x)
    permuted, indices, offsets = permute(xd, to_device(counts), e_local, 32)
    host = (to_host(xd.data), to_host(xd.scales)) if mxfp8 else (x,)
    got = (permuted.data, permuted.scales) if mxfp8 else (permuted,)
    for h, g in zip(host, got):
        want, want_idx, want_off = permute_ref(h, counts, e_local, 32)
        np.testing.assert_array_equal(bits(g), bits(want))
    np.testing.assert_array_equal(to_host(indices), want_idx)
    np.testing.assert_array_equal(to_host(offsets), want_off)
    back = unpermute(permuted, indices, m)
    for h, g in zip(host, (back.data, back.scales) if mxfp8 else (back,)):
        np.testing.assert_array_equal(bits(g), bits(h))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_rowwise", "fp8_block128"])
def test_gpu_permute_on_a_stream_gives_padding_rows_their_scale(rng, fmt):
    """On a non-blocking stream, the padding rows of a permute of fp32-scaled rows get the
    padding scale 1.0 after the gather wrote their zeros (the fill once ran on CuPy's current
    stream instead, racing the gather), on every one of many calls."""
    import cupy
    from mxcomm.formats import get_format
    f = get_format(fmt)
    counts = cupy.asarray(np.array([300, 0, 17, 1, 250, 3], np.int32))
    x = f.quantize(cupy.asarray(rng.standard_normal((571, 256)).astype(np.float32)))
    stream = cupy.cuda.Stream(non_blocking=True)
    for _ in range(20):
        permuted, indices, _ = permute(x, counts, 2, 32, stream=stream)
        stream.synchronize()
        pad = cupy.asnumpy(indices) < 0
        scales = cupy.asnumpy(permuted.scales).reshape(len(pad), -1)
        assert pad.any() and np.all(scales[pad] == 1.0)
        assert not cupy.asnumpy(permuted.data)[pad].any()


def test_on_stream_makes_one_wrapper_per_stream_and_skips_the_current_one(monkeypatch):
    """``on_stream`` (the primitives' and the NCCL communicator's): no stream, or CuPy's current
    one, gives no context; another stream gives one CuPy stream over its handle, made once and
    reused, however the stream is named (a raw handle or an object with ``ptr``)."""
    import sys
    import types
    from mxcomm import _array, _driver
    current = types.SimpleNamespace(ptr=7)
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(get_current_stream=lambda: current)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(_array, "gpu_arrays", lambda: True)
    monkeypatch.setattr(_array, "_STREAMS", {})
    made = []
    monkeypatch.setattr(_driver, "external_stream", lambda ptr: made.append(ptr) or ("on", ptr))
    assert _array.on_stream(None) is _array.on_stream(7) is _array._NO_STREAM
    first = _array.on_stream(9)
    assert first == ("on", 9) and _array.on_stream(types.SimpleNamespace(ptr=9)) is first
    assert _array.on_stream(11) == ("on", 11) and made == [9, 11]


@pytest.mark.gpu
def test_gpu_arrays_come_from_the_stream_their_kernels_run_on(rng):
    """Every array the primitives take from CuPy's pool (results and scratch) is allocated while
    their stream is CuPy's current one. CuPy's pool hands a freed block out again to allocations
    under the stream it was allocated under, so a temporary allocated under another stream could
    be handed out while the kernels still use it. An allocator that notes CuPy's current stream
    records every allocation of: quantize, dequantize, permute (its index, scratch and rows),
    unpermute, permute's backward, the MXFP8 -> fp8 rowwise permute and the fp8 wgrad's colwise
    conversion, each given a non-blocking stream."""
    import cupy
    from mxcomm import colwise, formats, rowwise
    stream = cupy.cuda.Stream(non_blocking=True)
    counts = to_device(np.array([300, 0, 17, 1, 250, 3], np.int32))
    x = to_device(rng.standard_normal((571, 256)).astype(BF16))
    mx = quantize_mxfp8(x)
    rows = formats.get_format("fp8_rowwise").quantize(x)
    ends = to_device(np.array([100, 300, 571], np.int32))
    every_row = to_device(np.arange(571, dtype=np.int32))
    calls = {
        "quantize": lambda: formats.get_format("fp8_rowwise").quantize(x, stream=stream),
        "dequantize": lambda: mx.dequantize(stream=stream),
        "permute": lambda: permute(mx, counts, 2, 32, stream=stream),
        "permute to rowwise": lambda: permute(mx, counts, 2, 32, out_format="fp8_rowwise",
                                              stream=stream),
        "unpermute and permute_backward": lambda: [
            f(p, i, 571, stream=stream) for p, i, _ in [permute(x, counts, 2, 32, stream=stream)]
            for f in (unpermute, permute_backward)],
        "mx_to_rowwise_permute": lambda: rowwise.mx_to_rowwise_permute(mx, every_row,
                                                                        stream=stream),
        "colwise": lambda: colwise.fp8_rowwise_to_group_colwise(rows.data, rows.scales, ends,
                                                               stream=stream),
    }
    pool = cupy.get_default_memory_pool()
    for name, call in calls.items():
        call()  # first: what a first launch prepares and keeps is not this test's concern
        stream.synchronize()
        seen = []

        def recording(nbytes, seen=seen):
            seen.append(cupy.cuda.get_current_stream().ptr)
            return pool.malloc(nbytes)

        with cupy.cuda.using_allocator(recording):
            call()
        stream.synchronize()
        assert seen and set(seen) == {stream.ptr}, name
