"""Every format through the EP token path on arrays, at any world size (run at 2 and 3 ranks):
dispatch (explicit splits and the layout path), permute, unpermute, combine, their backwards and
the drop-in move data and scales exactly as the reference quantizer's bits moved by an index
reference; "native" moves fp32 exactly; "bf16" is unchanged bit for bit.

Run: ``mpiexec -n 2 python -m pytest -q --with-mpi -m mpi tests/test_formats_ep.py`` (and ``-n 3``).
"""

import numpy
import pytest

from mxcomm import comm as mxc
from mxcomm.a2a import (a2a_combine, a2a_combine_backward, a2a_dispatch, a2a_dispatch_backward,
                        all_to_all_single)
from mxcomm.formats import get_format
from mxcomm.layout import exchange_layout
from mxcomm.permutation import permute, unpermute
from reference import permute_ref
from test_ep import (BF16, E_LOCAL, SETUPS, all_routed, bits, layout_ref, move_ref, to_device,
                     to_host)
from test_formats import dequantize_ref, quantize_ref

D = 128         # a multiple of every format's (block128)
ALIGN = 16      # SM90 fp8 grouped GEMM group multiple
QUANTIZED = ("mxfp8", "fp8_rowwise", "fp8_block128", "fp8_block128_pow2")

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=list(SETUPS), ids=list(SETUPS))
def comm(request):
    peer_memory, small, medium = SETUPS[request.param]
    c = mxc.init(timeout=60.0, peer_memory=peer_memory, small_exchange_bytes=small,
                 medium_exchange_bytes=medium)
    yield c
    c.close()


@pytest.fixture(scope="module")
def routed(comm):
    return all_routed(comm.size, D)


def received_ref(name, routed, me):
    """(data, scales) rank ``me`` receives in the dispatch direction: every rank's rows
    quantized by the reference, moved by the splits."""
    splits = [layout_ref(routed, r)[1] for r in range(len(routed))]
    quantized = [quantize_ref(name, r.x) for r in routed]
    return (move_ref([q[0] for q in quantized], splits, me),
            move_ref([q[1] for q in quantized], splits, me))


def assert_rows(q, data, scales):
    numpy.testing.assert_array_equal(to_host(q.data), data)
    numpy.testing.assert_array_equal(to_host(q.scales).view(numpy.uint8),
                                     numpy.ascontiguousarray(scales).view(numpy.uint8))


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("path", ["splits", "layout"])
def test_dispatch_permute_combine(comm, routed, name, path):
    """dispatch -> permute -> unpermute -> combine in ``name``, and combine's backward."""
    me = comm.rank
    fmt = get_format(name)
    group, input_splits, output_splits = layout_ref(routed, me)
    x = to_device(routed[me].x)
    if path == "layout":
        layout = exchange_layout(to_device(routed[me].counts), comm)
        args, counts = (layout,), layout
    else:
        args, counts = (input_splits, output_splits, comm), to_device(group)
    received = a2a_dispatch(x, *args, precision=name)
    data_ref, scales_ref = received_ref(name, routed, me)
    assert received.format is fmt
    assert_rows(received, data_ref, scales_ref)

    permuted, indices, _ = permute(received, counts, E_LOCAL, ALIGN)
    pdata, idx, _ = permute_ref(data_ref, group, E_LOCAL, ALIGN)
    numpy.testing.assert_array_equal(to_host(indices), idx)
    pscales = numpy.where((idx < 0).reshape((-1,) + (1,) * (scales_ref.ndim - 1)),
                          numpy.array(fmt.padding_scale, scales_ref.dtype),
                          scales_ref[numpy.maximum(idx, 0)] if len(scales_ref) else
                          numpy.zeros((len(idx),) + scales_ref.shape[1:], scales_ref.dtype))
    assert_rows(permuted, pdata, pscales)
    back = unpermute(permuted, indices, received.shape[0])
    assert_rows(back, data_ref, scales_ref)

    # combine in the format: the received rows dequantized, returned to their senders
    y = back.dequantize()
    out = a2a_combine(y, *args, precision=name)
    splits = [layout_ref(routed, r) for r in range(comm.size)]
    # rank r sends its received rows back: segment s of rank r goes to rank s
    ys = []
    for r in range(comm.size):
        d, s = received_ref(name, routed, r)
        yr = dequantize_ref(name, d, s)
        ys.append(dequantize_ref(name, *quantize_ref(name, yr)))
    expected = move_ref(ys, [sp[2] for sp in splits], me)
    numpy.testing.assert_array_equal(bits(out), expected.view(numpy.uint16))

    # combine's backward in the format: the dispatch direction, still quantized
    g = a2a_combine_backward(x, *args, precision=name)
    assert_rows(g, data_ref, scales_ref)
    # dispatch's backward in the format: the combine direction, dequantized
    dx = a2a_dispatch_backward(received.dequantize(), *args, precision=name)
    assert bits(dx).shape == (routed[me].x.shape[0], D)
    numpy.testing.assert_array_equal(bits(dx), expected.view(numpy.uint16))


@pytest.mark.parametrize("name", QUANTIZED)
def test_drop_in(comm, routed, name):
    """all_to_all_single in ``name``: the reference round trip of each row, moved."""
    me = comm.rank
    _, input_splits, output_splits = layout_ref(routed, me)
    out = all_to_all_single(to_device(routed[me].x), output_splits, input_splits, comm, name)
    data, scales = received_ref(name, routed, me)
    numpy.testing.assert_array_equal(bits(out),
                                     dequantize_ref(name, data, scales).view(numpy.uint16))


def test_native_fp32_exact_and_bf16_unchanged(comm, routed):
    """"native" moves fp32 rows bit for bit (NaN payloads and subnormals included); "bf16"
    moves bf16 rows bit for bit and rounds fp32 to bf16 as before."""
    me = comm.rank
    _, input_splits, output_splits = layout_ref(routed, me)
    splits = [layout_ref(routed, r)[1] for r in range(comm.size)]
    f32 = []
    for r, rt in enumerate(routed):
        v = rt.x.astype(numpy.float32) * numpy.float32(1 + 2.0 ** -20)  # not bf16-representable
        if len(v):
            v.view(numpy.uint32)[0, 0] = 0x7FC01234   # a NaN payload
            v.view(numpy.uint32)[-1, -1] = 0x00000003  # a subnormal
        f32.append(v)
    for fn in (a2a_dispatch, a2a_combine_backward):
        out = fn(to_device(f32[me]), input_splits, output_splits, comm, "native")
        assert to_host(out).dtype == numpy.float32
        numpy.testing.assert_array_equal(to_host(out).view(numpy.uint32),
                                         move_ref(f32, splits, me).view(numpy.uint32))
    out = all_to_all_single(to_device(f32[me]), output_splits, input_splits, comm, "native")
    numpy.testing.assert_array_equal(to_host(out).view(numpy.uint32),
                                     move_ref(f32, splits, me).view(numpy.uint32))
    out = a2a_dispatch(to_device(routed[me].x), input_splits, output_splits, comm, "bf16")
    numpy.testing.assert_array_equal(bits(out), move_ref([r.x for r in routed], splits, me)
                                     .view(numpy.uint16))
    out = a2a_dispatch(to_device(f32[me]), input_splits, output_splits, comm, "bf16")
    assert to_host(out).dtype == BF16
    numpy.testing.assert_array_equal(
        bits(out), move_ref([v.astype(BF16) for v in f32], splits, me).view(numpy.uint16))
