"""The fp8 1x128 block format: e4m3fn elements, one fp32 scale per 128 elements of a row.

Glossary: M rows, D hidden (D % 128 == 0); data (M, D) uint8 bits, scales (M, D // 128) float32,
row-major, ``x ~= e4m3 * scale``: DeepSeek-V3's activation format (DeepEP's fp8 dispatch; DeepGEMM
wants the scales transposed, M-major and TMA-aligned: a copy for its adapter to make). Rules and
sources: ``kernels.fp8_block``. The ``launch_*`` functions take checked arguments and run the host
twin (``mxcomm._host``) on the host backend.
"""

import numpy

from .kernels import (UNBOUNDED, SizedLaunch, Words,  # first: decides simulator vs GPU
                      prepared, resident_launch)
from . import _host
from ._array import bfloat16, float32
from ._platform import host_backend
from .formats import Format, QuantizedArray, RowLaunch, quantize_pair, register
from .kernels import fp8_block
from .kernels._launch import THREADS_PER_BLOCK
from .kernels.fp8_block import (FP8_BLOCK, UNITS_PER_THREAD, WORDS_PER_THREAD,
                                dequantize_fp8_block128_bf16_kernel,
                                dequantize_fp8_block128_f32_kernel,
                                quantize_fp8_block128_bf16_kernel, quantize_fp8_block128_f32_kernel)

#: Scale modes of fp8 block128: "plain" amax / 448 (DeepSeek-V3, DeepEP's default), "pow2" (UE8M0).
BLOCK_SCALE_MODES = _host.BLOCK_SCALE_MODES
#: The scale of a padding row (its elements are zeros).
PADDING_SCALE = _host.PADDING_SCALE

_U8, _U32, _U64 = (numpy.dtype(t) for t in (numpy.uint8, numpy.uint32, numpy.uint64))


def quantize_fp8_block128(x, scale_mode="plain", *, out=None, stream=None):
    """Quantize the rows of ``x`` in blocks of 128: e4m3fn elements, one fp32 scale per block.

    With amax = max |x| over a block (sources in ``kernels.fp8_block``):
      "plain" (DeepSeek-V3, DeepGEMM's ``per_token_cast_to_fp8``): scale = fl32(max(amax, 448 *
          2^-126) / 448), element = RNE_e4m3(fl32(x * fl32(1 / scale)));
      "pow2" (DeepGEMM's UE8M0): scale = 2^clamp(ceil(log2(amax / 448)), -126, 127).
    Elements saturate to +-448. A block holding NaN or +-Inf gets scale NaN and elements 0x7F.

    Arguments, result and errors as :func:`mxcomm.rowwise.quantize_fp8_rowwise`, but for
    ``scales`` (M, D // 128) float32, D % 128 == 0, ``x`` 8-byte aligned, and ``scale_mode``
    ("plain" or "pow2"; ValueError otherwise).
    """
    if scale_mode not in BLOCK_SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {BLOCK_SCALE_MODES}, got {scale_mode!r}")
    return quantize_pair(FP8_BLOCK128_POW2 if scale_mode == "pow2" else FP8_BLOCK128, x, out,
                         stream)


def _launch_quantize(scale_mode):
    """``Format._quantize`` of the block128 format of ``scale_mode``."""
    def launch(x, out, stream, share, _):
        if not x.size:
            return
        if host_backend():
            _host.quantize_fp8_block128(x, scale_mode, out=(out.data, out.scales))
            return
        _block_quantize_launch(x.dtype, scale_mode == "pow2", share)(
            stream, x.size // FP8_BLOCK, x, out.data, out.scales)
    return launch


@prepared
def _block_quantize_launch(dtype, pow2, share):
    """Block128 quantize of ``dtype`` rows, per 128-element block."""
    if dtype == bfloat16:
        kernel, registers = quantize_fp8_block128_bf16_kernel, fp8_block.QUANTIZE_BF16_REGISTERS
    else:
        kernel, registers = quantize_fp8_block128_f32_kernel, fp8_block.QUANTIZE_F32_REGISTERS
    data = Words(0, (FP8_BLOCK // 8,), _U64)  # units of 8 elements
    config = resident_launch(UNBOUNDED, THREADS_PER_BLOCK, registers, 0, share)
    return SizedLaunch(kernel, config, (data.size, UNITS_PER_THREAD),
                       Words(0, (FP8_BLOCK * dtype.itemsize // 8,), _U64), data,
                       Words(0, (1,), _U32), pow2)


def dequantize_fp8_block128(data, scales, dtype=bfloat16, *, out=None, stream=None):
    """Decode fp8 block128 rows: x = e4m3 * its block's scale in fp32, round-to-nearest-even to
    bf16; NaN canonical. As :func:`mxcomm.rowwise.dequantize_fp8_rowwise` (arguments, result,
    errors) but for ``scales`` (M, D // 128) float32 and D % 128 == 0.
    """
    return QuantizedArray(data, scales, FP8_BLOCK128).dequantize(dtype, out=out, stream=stream)


def _launch_dequantize(q, out, stream, share):
    """``Format._dequantize`` of the block128 formats."""
    if not out.size:
        return
    if host_backend():
        _host.dequantize_fp8_block128(q.data, q.scales, out.dtype, out=out)
        return
    _block_dequantize_launch(out.dtype, share)(stream, out.size // FP8_BLOCK, q.data, q.scales, out)


@prepared
def _block_dequantize_launch(dtype, share):
    """Block128 dequantize into ``dtype``, per 128-element block."""
    data = Words(0, (FP8_BLOCK // 8,), _U64)
    kernel = dequantize_fp8_block128_bf16_kernel if dtype == bfloat16 else \
        dequantize_fp8_block128_f32_kernel
    config = resident_launch(UNBOUNDED, THREADS_PER_BLOCK, fp8_block.DEQUANTIZE_REGISTERS, 0,
                              share)
    return SizedLaunch(kernel, config, (data.size, WORDS_PER_THREAD), data, Words(0, (1,), _U32),
                       Words(0, (FP8_BLOCK * dtype.itemsize // 8,), _U64))


def _register(name, scale_mode, source):
    """Register the block128 Format of ``scale_mode``, whose launches fix it."""
    def quantizer(dtype, width, _, share):  # the sized launch (None on the host: the general)
        if host_backend():
            return None
        return RowLaunch(_block_quantize_launch(dtype, scale_mode == "pow2", share),
                         width // FP8_BLOCK)

    return register(Format(name, "e4m3fn", _U8, float32, FP8_BLOCK, FP8_BLOCK, PADDING_SCALE, (),
                           source, _launch_quantize(scale_mode), _launch_dequantize,
                           input_align=8, _quantizer=quantizer))


#: ``"fp8_block128"`` and ``"fp8_block128_pow2"`` (``mxcomm.formats``).
FP8_BLOCK128 = _register("fp8_block128", "plain",
                         "DeepSeek-V3 / DeepEP dispatch: scale = amax / 448")
FP8_BLOCK128_POW2 = _register(
    "fp8_block128_pow2", "pow2",
    "DeepGEMM UE8M0 / DeepEP round_scale: scale = 2^ceil(log2(amax / 448))")
