"""fp8 rowwise and 1x128 block formats (e4m3fn + fp32 scales); MXFP8 -> fp8 rowwise in the permute.

Glossary: M rows, D hidden, N source rows, P permuted rows. fp8 has no CuPy dtype: e4m3fn data are
uint8 bit arrays, as in ``mxcomm.mxfp8``; scales are float32 arrays, ``x ~= e4m3 * scale``.

    format         data                  scales                             D
    fp8 rowwise    (M, D) uint8, e4m3    (M,) float32, powers of two        D % 16 == 0
    fp8 block128   (M, D) uint8, e4m3    (M, D // 128) float32, row-major   D % 128 == 0

fp8 rowwise is the A operand of Hopper's ``torch._scaled_grouped_mm`` as it stands (the rowwise
recipe, aten/src/ATen/native/cuda/GroupedBlas.cpp ``_check_scales_fp8_rowwise``): float32 scales,
1-D, contiguous, one per row of the (M, K) row-major e4m3fn operand, K % 16 == 0, offsets int32.
fp8 block128 is DeepSeek-V3's activation format (DeepEP's fp8 dispatch, DeepGEMM's SM90 GEMMs;
DeepGEMM wants the scales transposed, M-major and TMA-aligned: a copy for its adapter to make).
The exact formulas, NaN/Inf rules and sources are in the docstrings of ``kernels.fp8_rowwise``,
``kernels.fp8_block`` and ``kernels.mx_rowwise``; in short, with amax = max |x| over a row / block:

    rowwise, block128 "pow2":  scale = 2^clamp(ceil(log2(amax / 448)), -126, 127),
                               element = RNE(x / scale)
    block128 "plain":          scale = fl32(max(amax, 448 * 2^-126) / 448),
                               element = RNE(fl32(x * fl32(1 / scale)))
    non-finite row / block:    scale NaN, elements 0x7F (every element dequantizes to NaN)

Every public function has a NumPy host implementation, ``_host_<name>``, bit-identical to its
kernels (tested): vectorized, on NumPy arrays. The ``launch_*`` functions are the only places that
choose: the host twin where ``mxcomm._platform.host_backend()``, else the kernel. The formats
themselves (:data:`FP8_ROWWISE`, :data:`FP8_BLOCK128`, :data:`FP8_BLOCK128_POW2`) and the MXFP8 ->
rowwise conversion of the permute are registered with ``mxcomm.formats`` when this module is
imported.
"""

import ml_dtypes
import numpy

from .kernels import (UNBOUNDED, SizedLaunch, Words, address, array_module,  # first: decides
                      launch_1d, prepared, simulated, words)  # simulator vs GPU before numba loads
from ._array import as_device_array, bfloat16, check_rows, float32, stream_ptr
from ._platform import host_backend
from .formats import PER_ROW, Format, register, register_conversion
from .kernels import fp8_block, fp8_colwise, fp8_rowwise, fp8_transpose
from .kernels._launch import RESIDENT_BLOCKS_PER_SM, RESIDENT_THREADS_PER_SM, THREADS_PER_BLOCK
from .kernels._memory import PAIR_BYTES
from .kernels.fp8_block import (FP8_BLOCK, UNITS_PER_THREAD, WORDS_PER_THREAD,
                                dequantize_fp8_block128_bf16_kernel,
                                dequantize_fp8_block128_f32_kernel,
                                quantize_fp8_block128_bf16_kernel, quantize_fp8_block128_f32_kernel)
from .kernels.fp8_rowwise import (ROWS_PER_BLOCK, dequantize_fp8_rowwise_bf16_kernel,
                                  dequantize_fp8_rowwise_f32_kernel,
                                  quantize_fp8_rowwise_bf16_kernel, quantize_fp8_rowwise_f32_kernel)
from .kernels.fp8_colwise import (GROUP_ALIGN, group_colwise_amax_kernel,
                                  group_colwise_encode_kernel, group_colwise_scales_kernel)
from .kernels.fp8_transpose import transpose_amax_kernel, transpose_encode_kernel
from .kernels.mx_rowwise import GATHER_REGISTERS, mx_to_rowwise_gather_kernel
from .mxfp8 import MXFP8Array

#: D must be a multiple of it for fp8 rowwise (torch._scaled_grouped_mm: K % 16 == 0).
ROWWISE_MULTIPLE = 16
#: Scale modes of fp8 block128: "plain" amax / 448 (DeepSeek-V3, DeepEP's default), "pow2" (UE8M0).
BLOCK_SCALE_MODES = ("plain", "pow2")
#: The scale of a padding row written by mx_to_rowwise_permute (its elements are zeros).
PADDING_SCALE = 1.0

_DTYPES = (bfloat16, float32)
_U8 = numpy.dtype(numpy.uint8)
_U16 = numpy.dtype(numpy.uint16)
_U32 = numpy.dtype(numpy.uint32)
_U64 = numpy.dtype(numpy.uint64)
_WARP = 32
#: Hopper's (sm_90) register file and warp slots per multiprocessor; registers are allocated per
#: warp in units of 256 (8 per thread).
_REGISTERS_PER_SM = 65536
_WARPS_PER_SM = 64
#: Hopper's shared memory per multiprocessor and what the driver reserves of it per block.
_SHARED_PER_SM = 228 * 1024
_SHARED_RESERVED = 1024


# ---------------------------------------------------------------------------------------------
# Validation and views.
# ---------------------------------------------------------------------------------------------

def _check_array(a, name, dtype, shape, convert=as_device_array):
    """``a`` as an array (``convert``: a device array by default) of exactly ``dtype`` and
    ``shape``, C-contiguous."""
    a = convert(a, name)
    if a.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {a.dtype}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {a.strides}")
    return a


def _host_array(a, name):
    """``a`` as a NumPy array (the host implementations' ``convert``)."""
    return numpy.asarray(a)


def _out_pair(out, data_shape, scales_shape):
    """(data uint8, scales float32) to write: allocated when ``out`` is None, else validated."""
    if out is None:
        xp = array_module()
        return xp.empty(data_shape, dtype=_U8), xp.empty(scales_shape, dtype=float32)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out: expected a (data, scales) pair or None, got {type(out).__name__}")
    return (_check_array(out[0], "out[0] (data)", _U8, data_shape),
            _check_array(out[1], "out[1] (scales)", float32, scales_shape))


def _out_dtype(dtype):
    """``dtype`` as a NumPy dtype, bf16 or fp32."""
    try:
        dtype = numpy.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype: expected bfloat16 or float32, got {dtype!r}") from None
    if dtype not in _DTYPES:
        raise TypeError(f"dtype: expected bfloat16 or float32, got {dtype}")
    return dtype


def _out_array(out, shape, dtype):
    """The (M, D) ``dtype`` output: allocated when ``out`` is None, else validated."""
    if out is None:
        return array_module().empty(shape, dtype=dtype)
    return _check_array(out, "out", dtype, shape)


def _resident_launch(n, threads, registers, stream, share, shared=0):
    """``launch_1d(n, stream, threads=threads, share=share)`` for a kernel of ``registers`` per
    thread and ``shared`` bytes of shared memory per block, its persistent grid capped at the
    blocks that stay resident together.

    ``launch_1d`` sizes the grid for RESIDENT_THREADS_PER_SM threads per multiprocessor; above 32
    registers a thread only part of them fit, and the blocks beyond would run in a second, partial
    wave (every block of a grid-stride loop gets the same work). Hence the extra share.
    """
    warps = threads // _WARP
    warp_registers = -(-registers // 8) * 8 * _WARP
    by_shared = _SHARED_PER_SM // (shared + _SHARED_RESERVED) if shared else RESIDENT_BLOCKS_PER_SM
    resident = max(1, min(RESIDENT_BLOCKS_PER_SM, _WARPS_PER_SM // warps, by_shared,
                          _REGISTERS_PER_SM // (warp_registers * warps)))
    per_sm = max(1, min(RESIDENT_BLOCKS_PER_SM, RESIDENT_THREADS_PER_SM // threads))
    fit = min(1.0, resident / per_sm + 1e-9)  # + 1e-9: launch_1d truncates its product
    return launch_1d(n, stream, threads=threads, share=share * fit)


# ---------------------------------------------------------------------------------------------
# fp8 rowwise.
# ---------------------------------------------------------------------------------------------

def quantize_fp8_rowwise(x, *, out=None, stream=None):
    """fp8-rowwise-quantize the rows of ``x``: e4m3fn elements, one power-of-two fp32 scale per row.

    With amax = max |x| over a row (exact arithmetic), the layout SM90 ``torch._scaled_grouped_mm``
    takes for its A operand (scales (M,) float32, 1-D, contiguous; D % 16 == 0):
      scale   = 2^e, e = clamp(ceil(log2(amax / 448)), -126, 127)   (MXFP8's "rceil", per row;
                amax = 0 gives 2^-126: scale and 1 / scale are normal fp32)
      element = round-to-nearest-even(x / scale) as e4m3fn, saturated to +-448.
    A row holding NaN or +-Inf gets scale NaN and elements 0x7F: it dequantizes (and multiplies in
    the GEMM) to NaN. Bit-identical to a float64 evaluation of these formulas.

    Args:
        x: (M, D) bf16 or fp32 device array, C-contiguous, D % 16 == 0, its address a multiple
            of 16 bytes (the kernel loads 16 bytes at a time). Read.
        out: a (data, scales) pair to write, (M, D) uint8 and (M,) float32, C-contiguous, or None
            to allocate. Written.
        stream: the stream to launch on (None: CuPy's current stream); not synchronized.
    Returns:
        (data, scales): (M, D) uint8 e4m3fn bits and (M,) float32 scales.
    Raises:
        TypeError: ``x`` is not a device array or not bf16/fp32; ``out`` not a pair, or of other
            dtypes.
        ValueError: ``x`` not 2-D, D % 16 != 0, not C-contiguous or its address not a multiple of
            16 bytes; ``out`` of other shapes.
    """
    x = check_rows(x, "x", ROWWISE_MULTIPLE, _DTYPES)
    FP8_ROWWISE.check_input(x)
    m, d = x.shape
    data, scales = _out_pair(out, (m, d), (m,))
    return launch_quantize_fp8_rowwise(x, data, scales, stream_ptr(stream))


def launch_quantize_fp8_rowwise(x, data, scales, stream, share=1.0):
    """Enqueue the rowwise quantize kernel (arguments checked by the caller): ``x`` (M, D) bf16/
    fp32 into ``data`` (M, D) uint8 and ``scales`` (M,) float32, on the raw stream handle
    ``stream``, with a grid of ``share`` of the device. Returns (data, scales)."""
    m, d = x.shape
    if m == 0:
        return data, scales
    if host_backend():
        return _host_quantize_fp8_rowwise(x, out=(data, scales))
    _rowwise_quantize_launch(d, x.dtype, share)(stream, m, x, data, scales)
    return data, scales


@prepared
def _rowwise_quantize_launch(d, dtype, share):
    """The prepared rowwise quantize launch (``kernels.SizedLaunch``) of ``dtype`` rows of width
    ``d``, per row."""
    if dtype == bfloat16:  # units of 8 elements -> one uint64 of e4m3
        kernel, data = quantize_fp8_rowwise_bf16_kernel, Words(0, (1, d // 8), _U64)
    else:  # units of 4 elements -> one uint32
        kernel, data = quantize_fp8_rowwise_f32_kernel, Words(0, (1, d // 4), _U32)
    # one warp per row, ROWS_PER_BLOCK rows per CUDA block, each kept in the block's shared
    # memory between the passes as far as STASH_BLOCK_BYTES go (the rest of a row is re-read)
    units = data.shape[1]
    rows = 1 if simulated() else ROWS_PER_BLOCK  # the simulator's blocks are one warp
    stash_units = min(units, fp8_rowwise.STASH_BLOCK_BYTES // (rows * fp8_rowwise.STASH_UNIT_BYTES))
    threads = _WARP * rows
    shared = rows * stash_units * fp8_rowwise.STASH_UNIT_BYTES
    config = _resident_launch(UNBOUNDED, threads, fp8_rowwise.QUANTIZE_REGISTERS, 0, share,
                              shared)
    return SizedLaunch(kernel, config[:3] + (shared,), (_WARP, 1),  # a warp per row
                       Words(0, (1, d * dtype.itemsize // 8), _U64, PAIR_BYTES),  # pair loads
                       data, Words(0, (1,), _U32), stash_units)


def dequantize_fp8_rowwise(data, scales, dtype=bfloat16, *, out=None, stream=None):
    """Decode fp8 rowwise rows: x = e4m3 * scale.

    The product is rounded once to fp32 (exact for power-of-two scales); bf16 output is its
    round-to-nearest-even. A NaN scale or NaN element gives NaN (canonical quiet NaN: bf16 0x7FC0,
    fp32 0x7FC00000). Any fp32 scales are accepted (e.g. from another quantizer).

    Args:
        data: (M, D) uint8 e4m3fn bits, C-contiguous, D % 16 == 0. Read.
        scales: (M,) float32, C-contiguous. Read.
        dtype: bf16 (``mxcomm.bfloat16``, default) or fp32.
        out: (M, D) ``dtype`` C-contiguous device array, or None to allocate. Written.
        stream: the stream to launch on (None: CuPy's current stream); not synchronized.
    Returns:
        ``out``: (M, D) ``dtype``.
    Raises:
        TypeError: ``data``/``scales`` not device arrays or of other dtypes; ``dtype`` not
            bf16/fp32; ``out`` of another dtype.
        ValueError: ``data`` not 2-D, D % 16 != 0, or not C-contiguous; ``scales`` or ``out`` of
            another shape or not C-contiguous.
    """
    data = check_rows(data, "data", ROWWISE_MULTIPLE, (_U8,))
    m, d = data.shape
    scales = _check_array(scales, "scales", float32, (m,))
    out = _out_array(out, (m, d), _out_dtype(dtype))
    return launch_dequantize_fp8_rowwise(data, scales, out, stream_ptr(stream))


def launch_dequantize_fp8_rowwise(data, scales, out, stream, share=1.0):
    """Enqueue the rowwise dequantize kernel (arguments checked by the caller): ``data`` (M, D)
    uint8 and ``scales`` (M,) float32 into ``out`` (M, D) bf16/fp32. Returns ``out``."""
    if out.size == 0:
        return out
    if host_backend():
        return _host_dequantize_fp8_rowwise(data, scales, out.dtype, out=out)
    m, d = data.shape
    _rowwise_dequantize_launch(d, out.dtype, share)(stream, m, data, scales, out)
    return out


@prepared
def _rowwise_dequantize_launch(d, dtype, share):
    """The prepared rowwise dequantize launch (``kernels.SizedLaunch``) of rows of width ``d``
    into ``dtype``, per row."""
    words = d // 8
    kernel = dequantize_fp8_rowwise_bf16_kernel if dtype == bfloat16 else \
        dequantize_fp8_rowwise_f32_kernel
    config = _resident_launch(UNBOUNDED, THREADS_PER_BLOCK, fp8_rowwise.DEQUANTIZE_REGISTERS, 0,
                              share)
    return SizedLaunch(kernel, config, (words, fp8_rowwise.WORDS_PER_THREAD),
                       Words(0, (words,), _U64), Words(0, (1,), _U32),
                       Words(0, (words * dtype.itemsize,), _U64), words)


# ---------------------------------------------------------------------------------------------
# fp8 block128.
# ---------------------------------------------------------------------------------------------

def quantize_fp8_block128(x, scale_mode="plain", *, out=None, stream=None):
    """Quantize the rows of ``x`` in blocks of 128: e4m3fn elements, one fp32 scale per block.

    DeepSeek-V3's fine-grained activation quantization (DeepEP's fp8 dispatch format). With
    amax = max |x| over a block:
      "plain" (DeepSeek-V3, DeepEP's default; DeepGEMM's ``per_token_cast_to_fp8``):
          a = max(amax, 448 * 2^-126); scale = fl32(a / 448);
          element = RNE_e4m3(fl32(x * fl32(1 / scale)))
          (fl32: one IEEE fp32 operation, round to nearest even). Bit-identical to DeepGEMM's cast
          for amax >= 1e-4, where DeepGEMM and DeepEP clamp amax to 1e-4 instead.
      "pow2" (DeepGEMM's UE8M0 scales, DeepEP's round_scale):
          scale = 2^clamp(ceil(log2(amax / 448)), -126, 127); element = RNE_e4m3(x / scale)
    Elements saturate to +-448. A block holding NaN or +-Inf gets scale NaN and elements 0x7F.

    Args:
        x: (M, D) bf16 or fp32 device array, C-contiguous, D % 128 == 0. Read.
        scale_mode: "plain" or "pow2".
        out: a (data, scales) pair to write, (M, D) uint8 and (M, D // 128) float32, C-contiguous,
            or None to allocate. Written.
        stream: the stream to launch on (None: CuPy's current stream); not synchronized.
    Returns:
        (data, scales): (M, D) uint8 e4m3fn bits and (M, D // 128) float32 scales.
    Raises:
        TypeError: ``x`` is not a device array or not bf16/fp32; ``out`` not a pair, or of other
            dtypes.
        ValueError: ``x`` not 2-D, D % 128 != 0 or not C-contiguous; unknown ``scale_mode``;
            ``out`` of other shapes.
    """
    x = check_rows(x, "x", FP8_BLOCK, _DTYPES)
    if scale_mode not in BLOCK_SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {BLOCK_SCALE_MODES}, got {scale_mode!r}")
    m, d = x.shape
    data, scales = _out_pair(out, (m, d), (m, d // FP8_BLOCK))
    return launch_quantize_fp8_block128(x, data, scales, scale_mode, stream_ptr(stream))


def launch_quantize_fp8_block128(x, data, scales, scale_mode, stream, share=1.0):
    """Enqueue the block128 quantize kernel (arguments checked by the caller): ``x`` (M, D) bf16/
    fp32 into ``data`` (M, D) uint8 and ``scales`` (M, D // 128) float32. Returns (data, scales)."""
    if x.size == 0:
        return data, scales
    if host_backend():
        return _host_quantize_fp8_block128(x, scale_mode, out=(data, scales))
    _block_quantize_launch(x.dtype, scale_mode == "pow2", share)(stream, x.size // FP8_BLOCK, x,
                                                                 data, scales)
    return data, scales


@prepared
def _block_quantize_launch(dtype, pow2, share):
    """The prepared block128 quantize launch (``kernels.SizedLaunch``) of ``dtype`` rows, per
    128-element block."""
    if dtype == bfloat16:
        kernel, registers = quantize_fp8_block128_bf16_kernel, fp8_block.QUANTIZE_BF16_REGISTERS
    else:
        kernel, registers = quantize_fp8_block128_f32_kernel, fp8_block.QUANTIZE_F32_REGISTERS
    data = Words(0, (FP8_BLOCK // 8,), _U64)  # units of 8 elements
    config = _resident_launch(UNBOUNDED, THREADS_PER_BLOCK, registers, 0, share)
    return SizedLaunch(kernel, config, (data.size, UNITS_PER_THREAD),
                       Words(0, (FP8_BLOCK * dtype.itemsize // 8,), _U64), data,
                       Words(0, (1,), _U32), pow2)


def dequantize_fp8_block128(data, scales, dtype=bfloat16, *, out=None, stream=None):
    """Decode fp8 block128 rows: x = e4m3 * scale of its 128-element block.

    The product is rounded once to fp32; bf16 output is its round-to-nearest-even. A NaN scale or
    NaN element gives NaN (canonical quiet NaN: bf16 0x7FC0, fp32 0x7FC00000).

    Args:
        data: (M, D) uint8 e4m3fn bits, C-contiguous, D % 128 == 0. Read.
        scales: (M, D // 128) float32, C-contiguous. Read.
        dtype: bf16 (``mxcomm.bfloat16``, default) or fp32.
        out: (M, D) ``dtype`` C-contiguous device array, or None to allocate. Written.
        stream: the stream to launch on (None: CuPy's current stream); not synchronized.
    Returns:
        ``out``: (M, D) ``dtype``.
    Raises:
        TypeError: ``data``/``scales`` not device arrays or of other dtypes; ``dtype`` not
            bf16/fp32; ``out`` of another dtype.
        ValueError: ``data`` not 2-D, D % 128 != 0, or not C-contiguous; ``scales`` or ``out`` of
            another shape or not C-contiguous.
    """
    data = check_rows(data, "data", FP8_BLOCK, (_U8,))
    m, d = data.shape
    scales = _check_array(scales, "scales", float32, (m, d // FP8_BLOCK))
    out = _out_array(out, (m, d), _out_dtype(dtype))
    return launch_dequantize_fp8_block128(data, scales, out, stream_ptr(stream))


def launch_dequantize_fp8_block128(data, scales, out, stream, share=1.0):
    """Enqueue the block128 dequantize kernel (arguments checked by the caller): ``data`` (M, D)
    uint8 and ``scales`` (M, D // 128) float32 into ``out`` (M, D) bf16/fp32. Returns ``out``."""
    if out.size == 0:
        return out
    if host_backend():
        return _host_dequantize_fp8_block128(data, scales, out.dtype, out=out)
    _block_dequantize_launch(out.dtype, share)(stream, out.size // FP8_BLOCK, data, scales, out)
    return out


@prepared
def _block_dequantize_launch(dtype, share):
    """The prepared block128 dequantize launch (``kernels.SizedLaunch``) into ``dtype``, per
    128-element block."""
    data = Words(0, (FP8_BLOCK // 8,), _U64)
    kernel = dequantize_fp8_block128_bf16_kernel if dtype == bfloat16 else \
        dequantize_fp8_block128_f32_kernel
    config = _resident_launch(UNBOUNDED, THREADS_PER_BLOCK, fp8_block.DEQUANTIZE_REGISTERS, 0,
                              share)
    return SizedLaunch(kernel, config, (data.size, WORDS_PER_THREAD), data, Words(0, (1,), _U32),
                       Words(0, (FP8_BLOCK * dtype.itemsize // 8,), _U64))


# ---------------------------------------------------------------------------------------------
# MXFP8 -> fp8 rowwise, in the permute.
# ---------------------------------------------------------------------------------------------

def mx_to_rowwise_permute(mx, permuted_indices, *, out=None, stream=None):
    """Gather MXFP8 rows by ``permuted_indices`` and write them as fp8 rowwise rows, in one pass.

    Row p is source row i = permuted_indices[p] with its blocks rescaled to one scale per row:
    scale = 2^(r - 127) with r = max(max of the row's e8m0 block scales, 1), and each element of
    block b (scale s_b) becomes RNE_e4m3(e4m3 * 2^(s_b - r)) (exact product, one rounding; blocks
    at the row's scale are copied bit for bit). For MXFP8 quantized with "rceil" the row scale is
    exactly what :func:`quantize_fp8_rowwise` gives for the original row. Padding rows (i < 0, or
    i >= N) get zeros and scale 1.0 (finite, so the GEMM's epilogue gives 0 for them, also for
    consumers that invert scales); a row with a NaN block (scale 0xFF) gets scale NaN and elements
    0x7F; NaN elements stay NaN.

        permuted row   0    1    2    3      (P = 4)
        indices        5    0   -1   -1
        data           q(mx[5]) q(mx[0]) 0  0
        scales         s5   s0   1.0  1.0

    Args:
        mx: MXFP8Array (N, D), the received rows; its data's address a multiple of 16 bytes (the
            kernel moves 16 bytes at a time). Read.
        permuted_indices: (P,) int32 device array, C-contiguous: source row or -1 (as returned
            by ``mxcomm.permute``). Read.
        out: a (data, scales) pair to write, (P, D) uint8 and (P,) float32, C-contiguous, data's
            address a multiple of 16 bytes, or None to allocate. Written.
        stream: the stream to launch on (None: CuPy's current stream); not synchronized.
    Returns:
        (data, scales): (P, D) uint8 e4m3fn bits and (P,) float32 power-of-two row scales, ready
        for ``torch._scaled_grouped_mm`` with the permute's ``group_offsets``.
    Raises:
        TypeError: ``mx`` not an MXFP8Array; ``permuted_indices`` not an int32 device array;
            ``out`` not a pair, or of other dtypes.
        ValueError: ``permuted_indices`` not 1-D or not C-contiguous; ``out`` of other shapes;
            ``mx.data`` or the out data at an address not a multiple of 16 bytes.
    """
    if not isinstance(mx, MXFP8Array):
        raise TypeError(f"mx: expected an MXFP8Array, got {type(mx).__name__}")
    indices = as_device_array(permuted_indices, "permuted_indices")
    if indices.ndim != 1:
        raise ValueError(f"permuted_indices: expected a 1-D array, "
                         f"got shape {tuple(indices.shape)}")
    indices = _check_array(indices, "permuted_indices", numpy.dtype(numpy.int32), indices.shape)
    p = indices.shape[0]
    d = mx.shape[1]
    data, scales = _out_pair(out, (p, d), (p,))
    for a, name in ((mx.data, "mx.data"), (data, "out[0] (data)")):
        if a.size and address(a) % PAIR_BYTES:
            raise ValueError(f"{name}: expected an address that is a multiple of {PAIR_BYTES} "
                             f"bytes (the gather moves 16 bytes at a time), got {address(a):#x}")
    return launch_mx_to_rowwise_permute(mx, indices, data, scales, stream_ptr(stream))


def launch_mx_to_rowwise_permute(mx, indices, data, scales, stream, share=1.0):
    """Enqueue the MXFP8 -> rowwise gather (arguments checked by the caller): rows
    ``indices`` (P,) int32 of ``mx`` (N, D) into ``data`` (P, D) uint8 and ``scales`` (P,)
    float32. Returns (data, scales)."""
    p = indices.shape[0]
    if p == 0:
        return data, scales
    if host_backend():
        return _host_mx_to_rowwise_permute(mx, indices, out=(data, scales))
    out_words = words(data, _U64, "out data", rows=True, align=PAIR_BYTES)  # stored in pairs
    threads = _WARP * ROWS_PER_BLOCK  # one warp per row
    mx_to_rowwise_gather_kernel[_resident_launch(-(-p // ROWS_PER_BLOCK) * threads, threads,
                                                 GATHER_REGISTERS, stream, share)](
        indices, words(mx.data, _U64, "mx.data", rows=True, align=PAIR_BYTES), mx.scales, out_words,
        words(scales, _U32, "scales"))
    return data, scales


# ---------------------------------------------------------------------------------------------
# fp8 rowwise -> fp8 per (group, column), transposed: the token-axis operands of the fp8 wgrad.
# ---------------------------------------------------------------------------------------------

def group_colwise_positions(rows, groups):
    """T, the token positions of :func:`fp8_rowwise_to_group_colwise`'s output for ``rows`` rows
    in ``groups`` groups: 16 * ceil(rows / 16) + 16 * groups (each group padded to a multiple of
    16 positions, at least 16)."""
    return -(-rows // GROUP_ALIGN) * GROUP_ALIGN + GROUP_ALIGN * groups


def fp8_rowwise_to_group_colwise(data, scales, group_ends, *, stream=None):
    """Rescale fp8 rowwise rows to one scale per (group, column) and transpose them, in two reads.

    The operands of a grouped weight gradient dw[g] = x[g]^T @ grad[g] in fp8 are scaled along
    the token axis per group and laid out token-contiguous: ``torch._scaled_grouped_mm``'s 2d-2d
    case (A = ``data_t`` (D, T) row-major, B = another ``data_t``'s transpose, scales flattened,
    ``offs=aligned_ends``). With v = e4m3 * row scale (exact) and amax = max |v| over a group's
    rows in a column:

        scales_t[g, d] = 2^clamp(ceil(log2(amax / 448)), -126, 127)   (amax = 0: 2^-126)
        data_t[d, t]   = RNE_e4m3(v[p, d] / scales_t[g, d])            (one rounding)

    the fp8 rowwise rule along the token axis (``kernels.fp8_colwise``). Group g's rows take the
    token positions from ``aligned_ends[g - 1]`` on, followed by zero padding up to a multiple of
    16 positions, at least 16 (so the GEMM sees no empty and no misaligned group: its 2d-2d kernel
    asserts on the device that each group is a multiple of 16). A row with a NaN/Inf scale or a
    NaN element makes its group's column NaN (scale NaN, elements 0x7F). Bit-identical to a
    float64 evaluation of these formulas.

    Args:
        data: (P, D) uint8 e4m3fn bits, C-contiguous, D % 16 == 0: fp8 rowwise rows sorted by
            group (a permute's output). Read.
        scales: (P,) float32 row scales: powers of two (as the fp8 rowwise quantizers and
            ``mx_to_rowwise_permute`` write them), 0 or NaN. Read.
        group_ends: (G,) int32 device array, G >= 1: the cumulative group ends (``permute``'s
            ``group_offsets``), non-decreasing, the last <= P; rows from the last on are
            ignored. Read on the device (no host sync).
        stream: the stream to launch on (None: CuPy's current stream); not synchronized.
    Returns:
        (data_t, scales_t, aligned_ends): (D, T) uint8 e4m3fn bits, (G, D) float32 and (G,)
        int32, T = :func:`group_colwise_positions` (P, G).
    Raises:
        TypeError: arrays of other dtypes, or not device arrays.
        ValueError: ``data`` not 2-D, D % 16 != 0 or not C-contiguous; ``scales`` of another
            shape; ``group_ends`` not 1-D or empty; an output of 2^33 bytes or more (8 GiB: the
            encode kernel indexes words in int32).
    Group ends that are not sorted or exceed P are not detected (that needs a host sync): rows
    then land in the wrong groups or are ignored, but nothing is written out of bounds.
    """
    data = check_rows(data, "data", ROWWISE_MULTIPLE, (_U8,))
    p, d = data.shape
    scales = _check_array(scales, "scales", float32, (p,))
    ends = as_device_array(group_ends, "group_ends")
    if ends.ndim != 1 or ends.shape[0] == 0:
        raise ValueError(f"group_ends: expected a 1-D array of G >= 1 group ends, got shape "
                         f"{tuple(ends.shape)}")
    ends = _check_array(ends, "group_ends", numpy.dtype(numpy.int32), ends.shape)
    if group_colwise_positions(p, ends.shape[0]) * d // 4 > fp8_colwise.ENCODE_MAX_WORDS:
        raise ValueError(f"data: {p} x {d} rows in {ends.shape[0]} groups give an output of "
                         f"{group_colwise_positions(p, ends.shape[0])} x {d} bytes, above the "
                         f"{4 * fp8_colwise.ENCODE_MAX_WORDS} the encode kernel indexes (int32 "
                         f"words); split the rows")
    return launch_fp8_rowwise_to_group_colwise(data, scales, ends, stream_ptr(stream))


def launch_fp8_rowwise_to_group_colwise(data, scales, group_ends, stream):
    """Enqueue the three kernels of :func:`fp8_rowwise_to_group_colwise` (arguments checked by
    the caller) on the raw stream handle ``stream``; returns (data_t, scales_t, aligned_ends)."""
    if host_backend():
        return _host_fp8_rowwise_to_group_colwise(data, scales, group_ends)
    xp = array_module()
    p, d = data.shape
    g = group_ends.shape[0]
    t = group_colwise_positions(p, g)
    data_t = xp.empty((d, t), dtype=_U8)
    scales_t = xp.empty((g, d), dtype=float32)
    aligned = xp.empty(g, dtype=numpy.int32)
    keys = scales_t.view(_U32)
    if simulated():
        keys[...] = 0
    elif keys.size:
        import cupy
        cupy.cuda.runtime.memsetAsync(keys.data.ptr, 0, keys.nbytes, stream)
    row_scales = scales.view(_U32)
    # The simulator runs CUDA threads as Python threads whose device-function calls contend for a
    # lock (and its atomics for another): a launch of 32 of them took minutes where one took a
    # fraction of a second. There, one thread per block takes whole columns (no atomics).
    sim = simulated()
    chunk = max(p, 1) if sim else fp8_colwise.CHUNK_ROWS
    group_colwise_amax_kernel[launch_1d(-(-p // chunk) * (d // fp8_colwise.AMAX_COLUMNS), stream,
                                        threads=1 if sim else None)](
        words(data, _U64, "data", rows=True), row_scales, group_ends, keys, chunk)
    group_colwise_scales_kernel[launch_1d(g * d, stream)](keys.reshape(g * d), group_ends, aligned)
    items = fp8_colwise.encode_items(t, d)
    group_colwise_encode_kernel[launch_1d(items * THREADS_PER_BLOCK, stream)](
        words(data, _U32, "data", rows=True), row_scales, group_ends, keys,
        words(data_t, _U32, "data_t", rows=True))
    return data_t, scales_t, aligned


# ---------------------------------------------------------------------------------------------
# bf16 matrices -> fp8 rowwise along their columns, transposed: the B operand of a dgrad.
# ---------------------------------------------------------------------------------------------

def quantize_fp8_rowwise_transposed(x, *, stream=None):
    """fp8-rowwise-quantize the columns of each matrix of ``x`` and write them as rows.

    For x (B, R, C) and every (b, c), the column x[b, :, c] is quantized as
    :func:`quantize_fp8_rowwise` quantizes a row (scale 2^clamp(ceil(log2(amax / 448)), -126,
    127), elements round-to-nearest-even e4m3fn saturated to +-448; a column holding NaN or Inf:
    scale NaN, elements 0x7F), and becomes row c of matrix b of the result: bit-identical to
    ``quantize_fp8_rowwise`` of ``x.transpose(0, 2, 1)`` made contiguous, without that copy
    (``kernels.fp8_transpose``). It is the B operand of a grouped dgrad in fp8 (``torch.
    _scaled_grouped_mm``: B (G, N, K) column-major, scales (G, K)) from weights kept as (G, N, K)
    with K contiguous, as MoE layers keep them.

    Args:
        x: (B, R, C) bf16 device array, C-contiguous, R % 16 == 0 and C % 16 == 0. Read.
        stream: the stream to launch on (None: CuPy's current stream); not synchronized.
    Returns:
        (data, scales): (B, C, R) uint8 e4m3fn bits and (B, C) float32 scales.
    Raises:
        TypeError: ``x`` is not a device array or not bf16.
        ValueError: ``x`` not 3-D, R or C not a multiple of 16, or not C-contiguous; 2^33 or
            more elements (16 GiB: the encode kernel indexes words in int32).
    """
    x = as_device_array(x, "x")
    if x.ndim != 3:
        raise ValueError(f"x: expected a 3-D (B, R, C) array, got shape {tuple(x.shape)}")
    b, r, c = x.shape
    if x.dtype != bfloat16:
        raise TypeError(f"x: expected dtype bfloat16, got {x.dtype}")
    if r % ROWWISE_MULTIPLE or c % ROWWISE_MULTIPLE:
        raise ValueError(f"x: expected R and C multiples of {ROWWISE_MULTIPLE}, got shape "
                         f"{tuple(x.shape)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"x: expected a C-contiguous array, got strides {x.strides}")
    if x.size // 4 > fp8_transpose.ENCODE_MAX_WORDS:
        raise ValueError(f"x: {x.size} elements (shape {tuple(x.shape)}), above the "
                         f"{4 * fp8_transpose.ENCODE_MAX_WORDS} the encode kernel indexes "
                         f"(int32 words); quantize fewer matrices per call")
    return launch_quantize_fp8_rowwise_transposed(x, stream_ptr(stream))


def launch_quantize_fp8_rowwise_transposed(x, stream):
    """Enqueue the two kernels of :func:`quantize_fp8_rowwise_transposed` (``x`` checked by the
    caller) on the raw stream handle ``stream``; returns (data, scales)."""
    if host_backend():
        return _host_quantize_fp8_rowwise_transposed(x)
    xp = array_module()
    b, r, c = x.shape
    data = xp.empty((b, c, r), dtype=_U8)
    scales = xp.empty((b, c), dtype=float32)
    if data.size == 0:
        scales[...] = 2.0 ** -126  # an empty column's amax is 0
        return data, scales
    keys = xp.empty(b * c, dtype=_U32)
    if simulated():
        keys[...] = 0
    else:
        import cupy
        cupy.cuda.runtime.memsetAsync(keys.data.ptr, 0, keys.nbytes, stream)
    x_words = x.reshape(b * r, c).view(_U64)
    # the simulator: one thread per column (no atomics: they serialize its Python threads)
    sim = simulated()
    chunk = r if sim else fp8_transpose.CHUNK_ROWS
    transpose_amax_kernel[launch_1d(b * -(-r // chunk) * (c // 4), stream,
                                    threads=1 if sim else None)](x_words, r, keys, chunk)
    tiles = b * -(-r // fp8_transpose.TILE_ROWS) * -(-(c // 4) // fp8_transpose.TILE_WORDS)
    transpose_encode_kernel[launch_1d(tiles * THREADS_PER_BLOCK, stream)](
        x_words, r, keys, data.reshape(b * c, r).view(_U32), scales.reshape(b * c).view(_U32))
    return data, scales


# ---------------------------------------------------------------------------------------------
# NumPy host implementations, bit-identical to the kernels (the same operations: integer scale
# exponents, fp32 products rounded by NumPy's float32 arithmetic, ml_dtypes' round-to-nearest-even
# conversions to e4m3fn and bf16).
# ---------------------------------------------------------------------------------------------

_E4M3 = numpy.dtype(ml_dtypes.float8_e4m3fn)
_F32_INF_BITS = 0x7F800000
_F32_NAN_BITS = 0x7FC00000
_BF16_NAN_BITS = 0x7FC0
_E4M3_NAN_BITS = 0x7F
_PLAIN_AMAX_MIN = numpy.float32(448.0 * 2.0 ** -126)


def _host_abs_f32_bits(x):
    """uint32 fp32 bits of |x| for bf16 / fp32 ``x`` (bf16 widened exactly)."""
    if x.dtype == bfloat16:
        return (x.view(_U16).astype(_U32) & numpy.uint32(0x7FFF)) << numpy.uint32(16)
    return x.view(_U32) & numpy.uint32(0x7FFFFFFF)


def _host_e4m3(y):
    """e4m3fn bits (uint8) of the float32 ``y``: round to nearest even, saturated to +-448."""
    return numpy.clip(y, -448.0, 448.0).astype(_E4M3).view(_U8)


def _host_quantize_blocks(x, block, pow2):
    """(data (M, D) uint8, scales (M, D // block) float32) of ``x`` (M, D) bf16/fp32 in blocks of
    ``block`` consecutive elements of a row, with pow2 or plain scales."""
    m, d = x.shape
    nb = d // block if block else 0
    xb = x.reshape(m, nb, block)
    amax = _host_abs_f32_bits(xb).max(axis=-1, initial=0)
    nonfinite = amax >= _F32_INF_BITS
    with numpy.errstate(invalid="ignore", over="ignore"):  # non-finite blocks, overwritten below
        if pow2:  # the e8m0 "rceil" exponent: exp - 8, plus 1 above a mantissa of 1.75
            e = (amax >> numpy.uint32(23)).astype(numpy.int64) - 8 + (
                (amax & numpy.uint32(0x7FFFFF)) > numpy.uint32(0x600000))
            s = numpy.clip(e, 1, 254).astype(_U32)
            scale_bits = s << numpy.uint32(23)
            mult = ((numpy.uint32(254) - s) << numpy.uint32(23)).view(float32)
        else:
            a = numpy.maximum(numpy.where(nonfinite, 0, amax).astype(_U32).view(float32),
                              _PLAIN_AMAX_MIN)
            scale = a / numpy.float32(448.0)
            mult = numpy.float32(1.0) / scale
            scale_bits = scale.view(_U32)
        data = _host_e4m3(xb.astype(float32) * mult[..., None])
    data[nonfinite] = _E4M3_NAN_BITS
    scale_bits = numpy.where(nonfinite, numpy.uint32(_F32_NAN_BITS), scale_bits).astype(_U32)
    return data.reshape(m, d), scale_bits.view(float32)


def _host_write(out, data, scales):
    """Copy (data, scales) into the pair ``out`` (if given); return what holds the result."""
    if out is None:
        return data, scales
    out[0][...] = data
    out[1][...] = scales
    return out[0], out[1]


def _host_quantize_fp8_rowwise(x, *, out=None):
    """:func:`quantize_fp8_rowwise` on NumPy arrays: ``x`` (M, D) bf16/fp32 -> (data (M, D) uint8,
    scales (M,) float32), written into the pair ``out`` when given."""
    x = check_rows(x, "x", ROWWISE_MULTIPLE, _DTYPES, _host_array)
    m, d = x.shape
    if d == 0:
        data, scales = numpy.zeros((m, 0), _U8), numpy.full(m, 2.0 ** -126, float32)
    else:
        data, scales = _host_quantize_blocks(x, d, True)
    return _host_write(out, data, scales.reshape(m))


def _host_quantize_fp8_rowwise_transposed(x):
    """:func:`quantize_fp8_rowwise_transposed` on NumPy arrays: ``x`` (B, R, C) bf16 -> (data
    (B, C, R) uint8, scales (B, C) float32)."""
    x = numpy.asarray(x)
    b, r, c = x.shape
    data, scales = _host_quantize_fp8_rowwise(
        numpy.ascontiguousarray(x.transpose(0, 2, 1)).reshape(b * c, r))
    return data.reshape(b, c, r), scales.reshape(b, c)


def _host_quantize_fp8_block128(x, scale_mode="plain", *, out=None):
    """:func:`quantize_fp8_block128` on NumPy arrays: ``x`` (M, D) bf16/fp32 -> (data (M, D)
    uint8, scales (M, D // 128) float32), written into the pair ``out`` when given."""
    if scale_mode not in BLOCK_SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {BLOCK_SCALE_MODES}, got {scale_mode!r}")
    x = check_rows(x, "x", FP8_BLOCK, _DTYPES, _host_array)
    return _host_write(out, *_host_quantize_blocks(x, FP8_BLOCK, scale_mode == "pow2"))


def _host_dequantize_scaled(data, scales, block, dtype, out):
    """``data`` (M, D) e4m3 bits times ``scales`` (M, D // block) in fp32 (one rounding), as
    ``dtype`` (bf16: round to nearest even), canonical NaN."""
    m, d = data.shape
    dtype = _out_dtype(dtype)
    nb = d // block if d else 0
    v = numpy.ascontiguousarray(data).view(_E4M3).astype(float32).reshape(m, nb, block)
    with numpy.errstate(invalid="ignore", over="ignore"):  # NaN scales, 0 * Inf; overflow to Inf
        v = (v * numpy.asarray(scales, dtype=float32).reshape(m, nb, 1)).reshape(m, d)
        result = v.astype(dtype)
    nan = numpy.isnan(v)
    if dtype == float32:
        result.view(_U32)[nan] = _F32_NAN_BITS
    else:
        result.view(_U16)[nan] = _BF16_NAN_BITS
    if out is None:
        return result
    out[...] = result
    return out


def _host_dequantize_fp8_rowwise(data, scales, dtype=bfloat16, *, out=None):
    """:func:`dequantize_fp8_rowwise` on NumPy arrays: (M, D) ``dtype``."""
    data = check_rows(data, "data", ROWWISE_MULTIPLE, (_U8,), _host_array)
    scales = _check_array(scales, "scales", float32, data.shape[:1], _host_array)
    return _host_dequantize_scaled(data, scales, data.shape[1], dtype, out)


def _host_dequantize_fp8_block128(data, scales, dtype=bfloat16, *, out=None):
    """:func:`dequantize_fp8_block128` on NumPy arrays: (M, D) ``dtype``."""
    data = check_rows(data, "data", FP8_BLOCK, (_U8,), _host_array)
    m, d = data.shape
    scales = _check_array(scales, "scales", float32, (m, d // FP8_BLOCK), _host_array)
    return _host_dequantize_scaled(data, scales, FP8_BLOCK, dtype, out)


def _host_fp8_rowwise_to_group_colwise(data, scales, group_ends):
    """:func:`fp8_rowwise_to_group_colwise` on NumPy arrays: (P, D) uint8 and (P,) float32 rows,
    (G,) int group ends -> (data_t (D, T) uint8, scales_t (G, D) float32, aligned_ends (G,)
    int32). v = e4m3 * scale is exact in float64; the column scales come from its amax."""
    data, scales = numpy.asarray(data), numpy.asarray(scales, dtype=float32)
    ends = numpy.asarray(group_ends).astype(numpy.int64)
    p, d = data.shape
    g = ends.shape[0]
    data_t = numpy.zeros((d, group_colwise_positions(p, g)), _U8)
    scales_t = numpy.empty((g, d), float32)
    aligned = numpy.empty(g, numpy.int32)
    with numpy.errstate(invalid="ignore", over="ignore"):
        v = data.view(_E4M3).astype(numpy.float64) * scales.astype(numpy.float64)[:, None]
    start = position = 0
    for k in range(g):
        end = min(max(int(ends[k]), start), p)
        rows = v[start:end]
        finite = numpy.isfinite(rows).all(axis=0)
        amax = numpy.abs(numpy.where(numpy.isfinite(rows), rows, 0)).max(axis=0, initial=0.0)
        with numpy.errstate(divide="ignore"):
            e = numpy.clip(numpy.ceil(numpy.log2(amax / 448.0)), -126, 127)
        scale = numpy.exp2(e)
        with numpy.errstate(invalid="ignore"):
            q = _host_e4m3(rows / scale)
        q[:, ~finite] = _E4M3_NAN_BITS
        scales_t[k] = scale
        scales_t[k].view(_U32)[~finite] = _F32_NAN_BITS
        data_t[:, position:position + end - start] = q.T
        position += max(GROUP_ALIGN, -(-(end - start) // GROUP_ALIGN) * GROUP_ALIGN)
        aligned[k] = position
        start = end
    return data_t, scales_t, aligned


def _host_mx_to_rowwise_permute(mx, permuted_indices, *, out=None):
    """:func:`mx_to_rowwise_permute` on NumPy arrays: ``mx`` with NumPy ``.data`` (N, D) uint8 and
    ``.scales`` (N, D // 32) uint8, ``permuted_indices`` (P,) int -> (data (P, D) uint8, scales
    (P,) float32), written into the pair ``out`` when given."""
    src_data, src_scales = numpy.asarray(mx.data), numpy.asarray(mx.scales)
    n, d = src_data.shape
    idx = numpy.asarray(permuted_indices).astype(numpy.int64)
    p = idx.shape[0]
    valid = (idx >= 0) & (idx < n)
    rows = numpy.where(valid, idx, 0)
    if n == 0:
        src_data, src_scales = numpy.zeros((1, d), _U8), numpy.zeros((1, d // 32), _U8)
    d8 = src_data[rows]                                    # (P, D) e4m3 bits
    s = src_scales[rows].astype(numpy.int64)               # (P, D / 32) biased exponents
    smax = s.max(axis=1, initial=0)
    r = numpy.maximum(smax, 1)
    k = numpy.maximum(s - r[:, None], -32)                 # <= 0; below -19 everything is 0
    mult = ((127 + k).astype(_U32) << numpy.uint32(23)).view(float32)
    with numpy.errstate(invalid="ignore"):
        v = d8.view(_E4M3).astype(float32).reshape(p, d // 32, 32) * mult[..., None]
        conv = v.astype(_E4M3).view(_U8).reshape(p, d)
    data = numpy.where((d8 & 0x7F) == _E4M3_NAN_BITS, d8, conv)
    scale_bits = (r.astype(_U32) << numpy.uint32(23))
    nan_row = smax == 0xFF
    data[nan_row] = _E4M3_NAN_BITS
    scale_bits[nan_row] = _F32_NAN_BITS
    data[~valid] = 0
    scales = scale_bits.view(float32).copy()
    scales[~valid] = PADDING_SCALE
    return _host_write(out, data, scales)


# ---------------------------------------------------------------------------------------------
# The formats, registered with mxcomm.formats.
# ---------------------------------------------------------------------------------------------

def _rowwise_quantize(x, out, stream, share, scale_mode):
    launch_quantize_fp8_rowwise(x, out.data, out.scales, stream, share)


def _rowwise_dequantize(q, out, stream, share):
    launch_dequantize_fp8_rowwise(q.data, q.scales, out, stream, share)


def _block128_quantize(mode):
    def quantize(x, out, stream, share, scale_mode):
        launch_quantize_fp8_block128(x, out.data, out.scales, mode, stream, share)
    return quantize


def _block128_dequantize(q, out, stream, share):
    launch_dequantize_fp8_block128(q.data, q.scales, out, stream, share)


def _rowwise_sized_quantize(dtype, width, scale_mode, share):
    if host_backend():
        return None
    return _rowwise_quantize_launch(width, dtype, share), 1  # per row


def _block128_sized_quantize(mode):
    def sized(dtype, width, scale_mode, share):
        if host_backend():
            return None
        return _block_quantize_launch(dtype, mode == "pow2", share), width // FP8_BLOCK
    return sized


#: ``"fp8_rowwise"``, ``"fp8_block128"`` and ``"fp8_block128_pow2"`` (``mxcomm.formats``).
FP8_ROWWISE = register(Format(
    "fp8_rowwise", "e4m3fn", _U8, float32, PER_ROW, ROWWISE_MULTIPLE, PADDING_SCALE, (),
    "SM90 torch._scaled_grouped_mm's A operand (fp32 row scales, K % 16)",
    _rowwise_quantize, _rowwise_dequantize, input_align=PAIR_BYTES,
    _sized_quantize=_rowwise_sized_quantize))
FP8_BLOCK128 = register(Format(
    "fp8_block128", "e4m3fn", _U8, float32, FP8_BLOCK, FP8_BLOCK, PADDING_SCALE, (),
    "DeepSeek-V3 / DeepEP dispatch: scale = amax / 448",
    _block128_quantize("plain"), _block128_dequantize, input_align=8,
    _sized_quantize=_block128_sized_quantize("plain")))
FP8_BLOCK128_POW2 = register(Format(
    "fp8_block128_pow2", "e4m3fn", _U8, float32, FP8_BLOCK, FP8_BLOCK, PADDING_SCALE, (),
    "DeepGEMM UE8M0 / DeepEP round_scale: scale = 2^ceil(log2(amax / 448))",
    _block128_quantize("pow2"), _block128_dequantize, input_align=8,
    _sized_quantize=_block128_sized_quantize("pow2")))


def _mx_to_rowwise(x, indices, stream, alloc):
    """The permute's MXFP8 -> fp8 rowwise gather (``mxcomm.formats.conversion``)."""
    out = FP8_ROWWISE.empty(indices.shape[0], x.shape[1], alloc)
    launch_mx_to_rowwise_permute(x, indices, out.data, out.scales, stream)
    return out


register_conversion("mxfp8", "fp8_rowwise", _mx_to_rowwise)
