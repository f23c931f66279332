"""MXFP8 (OCP Microscaling v1.0) arrays: bf16/fp32 rows to e4m3 data + e8m0 scales, and back.

Glossary: M rows, D hidden (a multiple of 32). One MX block is 32 consecutive elements of a row;
``data`` (M, D) uint8 holds e4m3fn bits, ``scales`` (M, D // 32) uint8 e8m0 bits (2^(s - 127),
0xFF = NaN). The ``launch_*`` functions take checked arguments, a raw stream handle and ``share``
of the grid, return ``out``, and run the host twin (``mxcomm._host``) on the host backend.
"""

import functools

import numpy

# .kernels first: it sets up the simulator before numba loads
from .kernels import UNBOUNDED, SizedLaunch, Words, array_module, launch_1d, prepared
from . import _host
from ._array import bfloat16, check_rows, float32
from ._platform import host_backend
from .formats import Format, QuantizedArray, RowLaunch, register, register_conversion
from .kernels._fp8 import MX_BLOCK
from .kernels._launch import RESIDENT_THREADS_PER_SM, THREADS_PER_BLOCK
from .kernels._memory import PAIR_BYTES
from .kernels.mx_dequantize import (GATHER_BLOCKS_PER_SM, dequantize_mxfp8_bf16_kernel,
                                    dequantize_mxfp8_f32_kernel, gather_dequantize_mxfp8_bf16_kernel,
                                    gather_round_trip_mxfp8_bf16_kernel,
                                    round_trip_mxfp8_bf16_kernel)
from .kernels.mx_quantize import (PAIRS_PER_THREAD, WARP, WORDS_PER_THREAD,
                                  gather_quantize_mxfp8_bf16_kernel, quantize_mxfp8_bf16_kernel,
                                  quantize_mxfp8_f32_kernel)

SCALE_MODES = ("rceil", "floor")
_U8, _U16, _U64 = (numpy.dtype(t) for t in (numpy.uint8, numpy.uint16, numpy.uint64))
_DTYPES = (bfloat16, float32)


class MXFP8Array(QuantizedArray):
    """An (M, D) MXFP8 tensor, the ``"mxfp8"`` case of :class:`~mxcomm.formats.QuantizedArray`
    (which says what it raises): ``data`` (M, D) uint8 e4m3fn bits, ``scales`` (M, D // 32) uint8
    e8m0 bits (2^(s - 127); 0xFF = NaN), both C-contiguous device arrays."""

    __slots__ = ()

    def __init__(self, data, scales):
        super().__init__(data, scales, MXFP8)


def quantize_mxfp8(x, scale_mode="rceil", *, out=None, stream=None):
    """MXFP8-quantize the rows of ``x`` in blocks of 32 (OCP Microscaling v1.0).

    With amax = max |x| over a block (exact arithmetic), the e8m0 scale is
      "floor" (OCP, torchao default):        s = clamp(floor(log2(amax)) - 8, -127, 127) + 127
      "rceil" (NVIDIA cuBLAS/TransformerEngine, torchao's EP default):
                                             s = clamp(ceil(log2(amax / 448)), -127, 127) + 127
    and each element is round-to-nearest-even(x / 2^(s - 127)) as e4m3fn, saturated to +-448.
    All-zero blocks give zeros (s = 0); a block holding NaN or +-Inf gets scale 0xFF and elements
    0x7F (dequantizes to NaN). Bit-identical to a float64 evaluation of these formulas.

    Args:
        x: (M, D) bf16 or fp32 device array, C-contiguous, D % 32 == 0, address a multiple of 8
            bytes. Read.
        scale_mode: "rceil" or "floor".
        out: an (M, D) MXFP8Array to write, or None to allocate. Written.
        stream: the stream to launch on (None: CuPy's current); not synchronized. On a CPU the work
            is done when the call returns.
    Returns:
        The MXFP8Array written.
    Raises:
        TypeError: ``x`` not a device array or not bf16/fp32; ``out`` not an MXFP8Array.
        ValueError: ``x`` not 2-D, D % 32 != 0, not C-contiguous or misaligned; unknown
            ``scale_mode``; ``out`` of another shape.
    """
    x = check_rows(x, "x", MX_BLOCK, _DTYPES)
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {SCALE_MODES}, got {scale_mode!r}")
    if out is not None and not isinstance(out, MXFP8Array):
        raise TypeError(f"out: expected an MXFP8Array or None, got {type(out).__name__}")
    return MXFP8.quantize(x, scale_mode=scale_mode, out=out, stream=stream)


def launch_quantize(x, out, stream, share=1.0, scale_mode="rceil"):
    """Quantize ``x`` (M, D) bf16/fp32, C-contiguous, into the MXFP8Array ``out``."""
    if x.size == 0:
        return out
    if host_backend():
        _host.quantize_mxfp8(x, out.data, out.scales, rceil=scale_mode == "rceil")
        return out
    _quantize_launch(x.dtype, scale_mode == "rceil", share)(stream, x.size // MX_BLOCK, x,
                                                            out.data, out.scales)
    return out


def launch_quantize_gather(x, rows, out, stream, share=1.0, scale_mode="rceil"):
    """Quantize rows ``rows`` (R,) int32 of ``x`` (M, D) bf16, C-contiguous, 16-byte aligned rows,
    into ``out`` (R, D), each row exactly as :func:`launch_quantize` does."""
    count, d = out.shape
    if count == 0 or d == 0:
        return out
    if host_backend():  # the rows gathered first
        picked = numpy.ascontiguousarray(numpy.asarray(x)[numpy.asarray(rows)])
        return launch_quantize(picked, out, stream, share, scale_mode)
    _quantize_gather_launch(d, scale_mode == "rceil", share)(stream, (count, x.shape[0]), rows, x,
                                                              out.data, out.scales)
    return out


@prepared
def _quantize_gather_launch(d, rceil, share):
    """Gather-quantize of bf16 rows of width ``d``; counts: output rows, then input rows."""
    pairs = d // 8
    return SizedLaunch(gather_quantize_mxfp8_bf16_kernel, launch_1d(UNBOUNDED, share=share),
                       (pairs, PAIRS_PER_THREAD), Words(0, (1,), numpy.dtype(numpy.int32)),
                       (Words(0, (1, d // 4), _U64, PAIR_BYTES), 1),  # loaded in pairs
                       Words(0, (pairs,), _U64), Words(0, (d // MX_BLOCK,), _U8), rceil)


@prepared
def _quantize_launch(dtype, rceil, share):
    """Quantize of ``dtype`` rows, per MX block."""
    x = Words(0, (MX_BLOCK * dtype.itemsize // 8,), _U64)
    scales = Words(0, (1,), _U8)
    # bf16: pairs of input words (8 elements) -> 8 e4m3 bytes (uint64); fp32: 2 -> 2 bytes (uint16)
    if dtype == bfloat16:
        kernel, data = quantize_mxfp8_bf16_kernel, Words(0, (MX_BLOCK // 8,), _U64)
        per_unit = (data.size, PAIRS_PER_THREAD)
    else:
        kernel, data = quantize_mxfp8_f32_kernel, Words(0, (MX_BLOCK // 2,), _U16)
        per_unit = (x.size, WORDS_PER_THREAD)
    return SizedLaunch(kernel, launch_1d(UNBOUNDED, share=share), per_unit, x, data, scales,
                       rceil)


def launch_round_trip(x, rows, out, stream, share=1.0, scale_mode="rceil"):
    """bf16 rows through MXFP8 and back in one pass: ``out`` (R, D) bf16 is bit for bit
    :func:`launch_quantize` then :func:`launch_dequantize` of row r of ``x`` (``rows`` None) or row
    ``rows[r]`` (``rows`` (R,) int32). ``x`` (M, D) bf16 C-contiguous (16-byte aligned rows with
    ``rows``); ``out`` C-contiguous, 16-byte aligned (else ValueError on a GPU)."""
    count, d = out.shape
    if count == 0 or d == 0:
        return out
    rceil = scale_mode == "rceil"
    if host_backend():  # the rows gathered first, quantized, then decoded
        picked = numpy.asarray(x) if rows is None else \
            numpy.ascontiguousarray(numpy.asarray(x)[numpy.asarray(rows)])
        return launch_dequantize(launch_quantize(picked, MXFP8.empty(count, d), stream, share,
                                                 scale_mode), out, stream)
    if rows is None:
        _round_trip_launch(rceil, share)(stream, out.size // MX_BLOCK, x, out)
    else:
        _gather_round_trip_launch(d, rceil, share)(stream, (count, x.shape[0]), rows, x, out)
    return out


@prepared
def _round_trip_launch(rceil, share):
    """bf16 -> MXFP8 -> bf16, per MX block."""
    words = MX_BLOCK * 2 // 8
    return SizedLaunch(round_trip_mxfp8_bf16_kernel, launch_1d(UNBOUNDED, share=share),
                       (MX_BLOCK // 8, PAIRS_PER_THREAD), Words(0, (words,), _U64),
                       Words(0, (words,), _U64, PAIR_BYTES), rceil)  # stored in pairs


@prepared
def _gather_round_trip_launch(d, rceil, share):
    """Gathered round trip of rows of width ``d``; counts: output rows, then input rows."""
    return SizedLaunch(gather_round_trip_mxfp8_bf16_kernel, launch_1d(UNBOUNDED, share=share),
                       (d // 8, PAIRS_PER_THREAD), Words(0, (1,), numpy.dtype(numpy.int32)),
                       (Words(0, (1, d // 4), _U64, PAIR_BYTES), 1),  # loaded in pairs
                       Words(0, (d // 4,), _U64, PAIR_BYTES), rceil)  # stored in pairs


def dequantize_mxfp8(mx, dtype=bfloat16, *, out=None, stream=None):
    """Decode an MXFP8Array: x = e4m3 * 2^(s - 127) (OCP Microscaling v1.0), exact in f32, then
    round-to-nearest-even to bf16. Scale 0xFF or a NaN element gives the canonical quiet NaN.

    Args:
        mx: (M, D) MXFP8Array. Read.
        dtype: bf16 (``mxcomm.bfloat16``, default) or fp32.
        out: (M, D) ``dtype`` C-contiguous device array, or None to allocate. Written.
        stream: the stream to launch on (None: CuPy's current); not synchronized. On a CPU the work
            is done when the call returns.
    Returns:
        ``out``: (M, D) ``dtype``.
    Raises:
        TypeError: ``mx`` is not an MXFP8Array; ``dtype`` not bf16/fp32; ``out`` of another dtype.
        ValueError: ``out`` of another shape or not C-contiguous.
    """
    if not isinstance(mx, MXFP8Array):
        raise TypeError(f"mx: expected an MXFP8Array, got {type(mx).__name__}")
    return mx.dequantize(dtype, out=out, stream=stream)


def launch_dequantize(mx, out, stream, share=1.0):
    """Decode ``mx`` (M, D) into ``out`` (M, D) bf16/fp32, C-contiguous."""
    if out.size == 0:
        return out
    if host_backend():
        _host.dequantize_mxfp8(mx.data, mx.scales, out)
        return out
    _dequantize_launch(out.dtype, share)(stream, out.size // MX_BLOCK, mx.data, mx.scales, out)
    return out


@prepared
def _dequantize_launch(dtype, share):
    """Dequantize into ``dtype``, per MX block."""
    kernel = dequantize_mxfp8_bf16_kernel if dtype == bfloat16 else dequantize_mxfp8_f32_kernel
    data = Words(0, (MX_BLOCK // 8,), _U64)
    return SizedLaunch(kernel, launch_1d(UNBOUNDED, share=share), (data.size, WORDS_PER_THREAD),
                       data, Words(0, (1,), _U8),
                       Words(0, (MX_BLOCK * dtype.itemsize // 8,), _U64))


def launch_gather_dequantize(mx, indices, out, stream):
    """Row p of ``out`` (P, D) bf16 = row ``indices[p]`` of ``mx`` (N, D) dequantized, zeros where
    the index is < 0 or >= N; one pass. ``indices`` (P,) int32 and ``out`` C-contiguous;
    ``mx.data`` and ``out`` 16-byte aligned (else ValueError on a GPU)."""
    p, d = out.shape
    if p == 0 or d == 0:
        return out
    if host_backend():  # gathered first: padding rows of zero bits decode to +0
        picked = MXFP8.empty(p, d)
        _host.gather_rows(indices, (mx.data, mx.scales), (picked.data, picked.scales))
        return launch_dequantize(picked, out, stream)
    _gather_dequantize_launch(d)(stream, (p, mx.shape[0]), indices, mx.data, mx.scales, out)
    return out


@prepared
def _gather_dequantize_launch(d):
    """MXFP8 -> bf16 gather of rows of width ``d``; counts: P (a warp per row), then N."""
    # one warp per row (the simulator's blocks are one warp), GATHER_BLOCKS_PER_SM blocks per SM
    share = GATHER_BLOCKS_PER_SM * THREADS_PER_BLOCK / RESIDENT_THREADS_PER_SM + 1e-9
    return SizedLaunch(gather_dequantize_mxfp8_bf16_kernel,
                       launch_1d(UNBOUNDED, threads=THREADS_PER_BLOCK, share=share), (WARP, 1),
                       Words(0, (1,), numpy.dtype(numpy.int32)),
                       (Words(0, (1, d // 8), _U64, PAIR_BYTES), 1),  # loaded in pairs
                       (Words(0, (1, d // MX_BLOCK), _U8), 1),
                       Words(0, (1, d // 4), _U64, PAIR_BYTES))  # stored in pairs


def _mx_to_bf16(x, indices, stream, alloc):
    """The permute's MXFP8 -> bf16 gather (``mxcomm.formats.conversion``)."""
    out = (alloc or array_module().empty)((indices.shape[0], x.shape[1]), bfloat16)
    return launch_gather_dequantize(x, indices, out, stream)


def _quantizer(dtype, width, scale_mode, share):
    """``Format._quantizer`` of MXFP8: the host twin itself, or the kernel's sized launch."""
    if host_backend():
        return functools.partial(_host.quantize_mxfp8, rceil=scale_mode == "rceil")
    return RowLaunch(_quantize_launch(dtype, scale_mode == "rceil", share), width // MX_BLOCK)


def _round_tripper(width, scale_mode):
    """``Format._round_tripper`` of MXFP8: the sized launch (None on the host: the general)."""
    if host_backend():
        return None
    return RowLaunch(_round_trip_launch(scale_mode == "rceil", 1.0), width // MX_BLOCK)


#: The ``"mxfp8"`` Format (registered with ``mxcomm.formats`` when this module is imported).
MXFP8 = register(Format("mxfp8", "e4m3fn", _U8, _U8, MX_BLOCK, MX_BLOCK, 0, SCALE_MODES,
                        "OCP MX v1.0", launch_quantize, launch_dequantize, MXFP8Array,
                        input_align=8, _quantize_gather=launch_quantize_gather,
                        _round_trip=launch_round_trip, _quantizer=_quantizer,
                        _round_tripper=_round_tripper))
register_conversion("mxfp8", "bf16", _mx_to_bf16)
