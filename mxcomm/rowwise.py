"""The fp8 rowwise format (e4m3fn elements, one power-of-two fp32 scale per row: the A operand of
Hopper's ``torch._scaled_grouped_mm``), and the permute's MXFP8 -> fp8 rowwise gather.

Glossary: M rows, D hidden (D % 16 == 0), N source rows, P permuted rows; ``x ~= e4m3 * scale``.
The launchers take checked arguments, a raw stream handle and ``share`` of the grid, and run the
host twin (``mxcomm._host``) on the host backend.
"""

import numpy

from .kernels import (UNBOUNDED, SizedLaunch, Words, address,  # first: decides simulator vs GPU
                      prepared, resident_launch, simulated, words)
from . import _host
from ._array import as_device_array, bfloat16, check_array, float32, out_pair, stream_ptr
from ._platform import host_backend
from .formats import (PER_ROW, Format, QuantizedArray, RowLaunch, quantize_pair, register,
                      register_conversion)
from .kernels import fp8_rowwise
from .kernels._launch import THREADS_PER_BLOCK
from .kernels._memory import PAIR_BYTES
from .kernels.fp8_rowwise import (ROWS_PER_BLOCK, dequantize_fp8_rowwise_bf16_kernel,
                                  dequantize_fp8_rowwise_f32_kernel,
                                  quantize_fp8_rowwise_bf16_kernel, quantize_fp8_rowwise_f32_kernel)
from .kernels.mx_rowwise import GATHER_REGISTERS, mx_to_rowwise_gather_kernel
from .mxfp8 import MXFP8Array

#: D must be a multiple of it for fp8 rowwise (torch._scaled_grouped_mm: K % 16 == 0).
ROWWISE_MULTIPLE = 16
#: The scale of a padding row written by mx_to_rowwise_permute (its elements are zeros).
PADDING_SCALE = _host.PADDING_SCALE

_U8, _U32, _U64 = (numpy.dtype(t) for t in (numpy.uint8, numpy.uint32, numpy.uint64))
_WARP = 32


def quantize_fp8_rowwise(x, *, out=None, stream=None):
    """fp8-rowwise-quantize the rows of ``x``: e4m3fn elements, one power-of-two fp32 scale per row.

    The A operand of SM90 ``torch._scaled_grouped_mm`` (aten/src/ATen/native/cuda/GroupedBlas.cpp
    ``_check_scales_fp8_rowwise``). With amax = max |x| over a row (bit-identical to float64):
      scale   = 2^clamp(ceil(log2(amax / 448)), -126, 127)   (amax = 0: 2^-126)
      element = round-to-nearest-even(x / scale) as e4m3fn, saturated to +-448.
    A row holding NaN or +-Inf gets scale NaN and elements 0x7F.

    Args:
        x: (M, D) bf16 or fp32 device array, C-contiguous, D % 16 == 0, address a multiple of 16
            bytes. Read.
        out: a (data, scales) pair, (M, D) uint8 and (M,) float32, C-contiguous, or None. Written.
        stream: the stream to launch on (None: CuPy's current); not synchronized.
    Returns:
        (data, scales): (M, D) uint8 e4m3fn bits and (M,) float32 scales.
    Raises:
        TypeError: ``x`` not a device array or not bf16/fp32; ``out`` not a pair, or of other
            dtypes.
        ValueError: ``x`` not 2-D, D % 16 != 0, not C-contiguous or misaligned; ``out`` of other
            shapes.
    """
    return quantize_pair(FP8_ROWWISE, x, out, stream)


def launch_quantize_fp8_rowwise(x, out, stream, share=1.0, scale_mode=None):
    """Quantize ``x`` (M, D) bf16/fp32 into the QuantizedArray ``out`` (``scale_mode`` unused).
    Returns ``out``."""
    m, d = x.shape
    if m == 0:
        return out
    if host_backend():
        _host.quantize_fp8_rowwise(x, out=(out.data, out.scales))
        return out
    _quantize_launch(d, x.dtype, share)(stream, m, x, out.data, out.scales)
    return out


@prepared
def _quantize_launch(d, dtype, share):
    """Rowwise quantize of ``dtype`` rows of width ``d``, a warp per row."""
    if dtype == bfloat16:  # units of 8 elements -> one uint64 of e4m3
        kernel, data = quantize_fp8_rowwise_bf16_kernel, Words(0, (1, d // 8), _U64)
    else:  # units of 4 elements -> one uint32
        kernel, data = quantize_fp8_rowwise_f32_kernel, Words(0, (1, d // 4), _U32)
    # ROWS_PER_BLOCK rows per block; up to STASH_BLOCK_BYTES of each row stay in shared memory
    # between the passes (the rest is re-read)
    units = data.shape[1]
    rows = 1 if simulated() else ROWS_PER_BLOCK  # the simulator's blocks are one warp
    stash_units = min(units, fp8_rowwise.STASH_BLOCK_BYTES // (rows * fp8_rowwise.STASH_UNIT_BYTES))
    threads = _WARP * rows
    shared = rows * stash_units * fp8_rowwise.STASH_UNIT_BYTES
    config = resident_launch(UNBOUNDED, threads, fp8_rowwise.QUANTIZE_REGISTERS, 0, share,
                              shared)
    return SizedLaunch(kernel, config[:3] + (shared,), (_WARP, 1),  # a warp per row
                       Words(0, (1, d * dtype.itemsize // 8), _U64, PAIR_BYTES),  # pair loads
                       data, Words(0, (1,), _U32), stash_units)


def dequantize_fp8_rowwise(data, scales, dtype=bfloat16, *, out=None, stream=None):
    """Decode fp8 rowwise rows: x = e4m3 * scale in fp32, round-to-nearest-even to bf16; NaN
    canonical. Any fp32 scales are accepted.

    Args:
        data: (M, D) uint8 e4m3fn bits, C-contiguous, D % 16 == 0. Read.
        scales: (M,) float32, C-contiguous. Read.
        dtype: bf16 (``mxcomm.bfloat16``, default) or fp32.
        out: (M, D) ``dtype`` C-contiguous device array, or None to allocate. Written.
        stream: the stream to launch on (None: CuPy's current); not synchronized.
    Returns:
        ``out``: (M, D) ``dtype``.
    Raises:
        TypeError: ``data``/``scales`` not device arrays or of other dtypes; ``dtype`` not
            bf16/fp32; ``out`` of another dtype.
        ValueError: ``data`` not 2-D, D % 16 != 0, or not C-contiguous; ``scales`` or ``out`` of
            another shape or not C-contiguous.
    """
    return QuantizedArray(data, scales, FP8_ROWWISE).dequantize(dtype, out=out, stream=stream)


def _launch_dequantize(q, out, stream, share):
    """``Format._dequantize`` of fp8 rowwise."""
    if out.size == 0:
        return
    if host_backend():
        _host.dequantize_fp8_rowwise(q.data, q.scales, out.dtype, out=out)
        return
    m, d = q.shape
    _dequantize_launch(d, out.dtype, share)(stream, m, q.data, q.scales, out)


@prepared
def _dequantize_launch(d, dtype, share):
    """Rowwise dequantize of rows of width ``d`` into ``dtype``, per row."""
    words = d // 8
    kernel = dequantize_fp8_rowwise_bf16_kernel if dtype == bfloat16 else \
        dequantize_fp8_rowwise_f32_kernel
    config = resident_launch(UNBOUNDED, THREADS_PER_BLOCK, fp8_rowwise.DEQUANTIZE_REGISTERS, 0,
                              share)
    return SizedLaunch(kernel, config, (words, fp8_rowwise.WORDS_PER_THREAD),
                       Words(0, (words,), _U64), Words(0, (1,), _U32),
                       Words(0, (words * dtype.itemsize,), _U64), words)


def mx_to_rowwise_permute(mx, permuted_indices, *, out=None, stream=None):
    """Gather MXFP8 rows by ``permuted_indices`` into fp8 rowwise rows, in one pass.

    Row p is source row permuted_indices[p], its blocks rescaled to the row's largest block scale
    (at least 2^-126), one rounding per element (the rule: ``kernels.mx_rowwise``). Padding rows
    (index < 0 or >= N) get zeros and scale 1.0; a row with a NaN block gets scale NaN, elements
    0x7F.

    Args:
        mx: (N, D) MXFP8Array, the received rows; data address a multiple of 16 bytes. Read.
        permuted_indices: (P,) int32 device array, C-contiguous: source row or -1 (from
            ``mxcomm.permute``). Read.
        out: a (data, scales) pair, (P, D) uint8 and (P,) float32, C-contiguous, data address a
            multiple of 16 bytes, or None to allocate. Written.
        stream: the stream to launch on (None: CuPy's current); not synchronized.
    Returns:
        (data, scales): (P, D) uint8 e4m3fn bits and (P,) float32 power-of-two row scales, ready
        for ``torch._scaled_grouped_mm`` with the permute's ``group_offsets``.
    Raises:
        TypeError: ``mx`` not an MXFP8Array; ``permuted_indices`` not an int32 device array;
            ``out`` not a pair, or of other dtypes.
        ValueError: ``permuted_indices`` not 1-D or not C-contiguous; ``out`` of other shapes;
            ``mx.data`` or the out data misaligned.
    """
    if not isinstance(mx, MXFP8Array):
        raise TypeError(f"mx: expected an MXFP8Array, got {type(mx).__name__}")
    indices = as_device_array(permuted_indices, "permuted_indices")
    if indices.ndim != 1:
        raise ValueError(f"permuted_indices: expected a 1-D array, "
                         f"got shape {tuple(indices.shape)}")
    indices = check_array(indices, "permuted_indices", numpy.dtype(numpy.int32), indices.shape)
    p = indices.shape[0]
    data, scales = out_pair(out, (p, mx.shape[1]), (p,), stream)
    for a, name in ((mx.data, "mx.data"), (data, "out[0] (data)")):
        if a.size and address(a) % PAIR_BYTES:
            raise ValueError(f"{name}: expected an address that is a multiple of {PAIR_BYTES} "
                             f"bytes (the gather moves 16 bytes at a time), got {address(a):#x}")
    return launch_mx_to_rowwise_permute(mx, indices, data, scales, stream_ptr(stream))


def launch_mx_to_rowwise_permute(mx, indices, data, scales, stream, share=1.0):
    """Rows ``indices`` (P,) int32 of ``mx`` (N, D) into ``data`` (P, D) uint8 and ``scales`` (P,)
    float32. Returns (data, scales)."""
    p = indices.shape[0]
    if p == 0:
        return data, scales
    if host_backend():
        return _host.mx_to_rowwise_permute(mx, indices, out=(data, scales))
    out_words = words(data, _U64, "out data", rows=True, align=PAIR_BYTES)  # stored in pairs
    threads = _WARP * ROWS_PER_BLOCK  # one warp per row
    mx_to_rowwise_gather_kernel[resident_launch(-(-p // ROWS_PER_BLOCK) * threads, threads,
                                                 GATHER_REGISTERS, stream, share)](
        indices, words(mx.data, _U64, "mx.data", rows=True, align=PAIR_BYTES), mx.scales, out_words,
        words(scales, _U32, "scales"))
    return data, scales


def _quantizer(dtype, width, scale_mode, share):
    """``Format._quantizer`` of fp8 rowwise: the sized launch, per row (None on the host)."""
    return None if host_backend() else RowLaunch(_quantize_launch(width, dtype, share), 1)


#: ``"fp8_rowwise"`` (``mxcomm.formats``).
FP8_ROWWISE = register(Format(
    "fp8_rowwise", "e4m3fn", _U8, float32, PER_ROW, ROWWISE_MULTIPLE, PADDING_SCALE, (),
    "SM90 torch._scaled_grouped_mm's A operand (fp32 row scales, K % 16)",
    launch_quantize_fp8_rowwise, _launch_dequantize, input_align=PAIR_BYTES,
    _quantizer=_quantizer))


def _mx_to_rowwise(x, indices, stream, alloc):
    """The permute's MXFP8 -> fp8 rowwise gather (``mxcomm.formats.conversion``)."""
    out = FP8_ROWWISE.empty(indices.shape[0], x.shape[1], alloc)
    launch_mx_to_rowwise_permute(x, indices, out.data, out.scales, stream)
    return out


register_conversion("mxfp8", "fp8_rowwise", _mx_to_rowwise)
