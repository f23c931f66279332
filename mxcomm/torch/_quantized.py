"""QuantizedTensor: quantized rows that autograd and torch ops see as bf16 (mxcomm.torch).

Glossary: M rows, D hidden.
"""

import numpy
import torch
from torch.utils._pytree import tree_map

from .._array import bfloat16
from .._torch_arrays import _array, _record, _stream, _view
from ..formats import get_format

# array dtype of a quantized format's scales -> torch dtype (uint8 bits are e8m0; data e4m3fn)
_DATA_DTYPE = torch.float8_e4m3fn
_SCALE_DTYPES = {numpy.dtype(numpy.uint8): torch.float8_e8m0fnu,
                 numpy.dtype(numpy.float32): torch.float32}


def _dequantized(t):
    """The bf16 values of the QuantizedTensor ``t`` as a plain tensor allocated by torch (no
    autograd)."""
    if type(t.qdata) is not torch.Tensor or torch.compiler.is_compiling():
        # traced (fake or functional inner tensors): the op mxcomm::dequantize (torch._ops)
        return torch.ops.mxcomm.dequantize(t.qdata, t.scales, t.format_name)
    _record(t)  # read on this stream: t may have been made on another
    out = torch.empty(t.shape, dtype=torch.bfloat16, device=t.qdata.device)
    if out.numel():
        rows = t.format.wrap(_array(t.qdata, "qdata"), _array(t.scales, "scales"))
        rows.dequantize(bfloat16, out=_view(out, bfloat16), stream=_stream(t.qdata))
    return out


# ------------------------------------------------------------------------- QuantizedTensor
class QuantizedTensor(torch.Tensor):
    """An (M, D) tensor of a quantized format (``mxcomm.formats``) that autograd and torch ops see
    as bf16: its gradients are bf16, :meth:`dequantize` is straight-through, any other torch op but
    ``detach`` runs on its dequantized values. The ``"mxfp8"`` format gives an
    :class:`MXFP8Tensor`.

    Args (kept as the attributes ``qdata``, ``scales``, ``format``):
        qdata: (M, D) float8_e4m3fn (or uint8 bits) tensor.
        scales: the format's scales, ``format.scales_shape(M, D)``: float8_e8m0fnu (M, D // 32)
            for mxfp8 (uint8 bits accepted), float32 (M,) for fp8_rowwise, (M, D // 128) for the
            block128 formats; same device.
        format: a quantized Format or its name.
        requires_grad: as for any tensor.
    Raises:
        TypeError: dtypes other than the format's; ``format`` not a quantized format.
        ValueError: an unknown format; shapes other than the format's.
    """

    @staticmethod
    def __new__(cls, qdata, scales, format, *, requires_grad=False):  # noqa: A002
        fmt = get_format(format, "format")
        if not fmt.quantized:
            raise TypeError(f"format: expected a quantized format, got {fmt.name!r}")
        if cls is QuantizedTensor and fmt.name == "mxfp8":
            cls = MXFP8Tensor
        scale_dtype = _SCALE_DTYPES[numpy.dtype(fmt.scale_dtype)]
        if qdata.dtype == torch.uint8:
            qdata = qdata.view(_DATA_DTYPE)
        if scales.dtype == torch.uint8 and scale_dtype.itemsize == 1:
            scales = scales.view(scale_dtype)
        if qdata.dtype != _DATA_DTYPE or scales.dtype != scale_dtype:
            raise TypeError(f"{cls.__name__}: expected {_DATA_DTYPE} data and {scale_dtype} "
                            f"scales ({fmt.name}), got {qdata.dtype} and {scales.dtype}")
        if qdata.dim() != 2 or qdata.shape[1] % fmt.d_multiple or \
                tuple(scales.shape) != fmt.scales_shape(*qdata.shape):
            scales_text = "(M,)" if len(fmt.scales_shape(1, fmt.d_multiple)) == 1 else \
                f"(M, D // {fmt.scale_block})"
            raise ValueError(f"{cls.__name__}: expected data (M, D) with D % {fmt.d_multiple} "
                             f"== 0 and scales {scales_text} ({fmt.name}), got "
                             f"{tuple(qdata.shape)} and {tuple(scales.shape)}")
        return _quantized_tensor(qdata, scales, fmt, cls, requires_grad)

    def __init__(self, *args, **kwargs):
        pass  # everything happens in __new__

    def __repr__(self):
        return (f"{type(self).__name__}(format={self.format.name!r}, shape={tuple(self.shape)}, "
                f"device={self.device})")

    def dequantize(self):
        """The values as a bf16 tensor; differentiable (the gradient passes through unchanged)."""
        return _Dequantize.apply(self)

    def __tensor_flatten__(self):
        return ["qdata", "scales"], self.format.name

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return QuantizedTensor(inner["qdata"], inner["scales"], meta)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            (t,) = args
            return QuantizedTensor(t.qdata, t.scales, t.format)
        if func is torch.ops.aten.record_stream.default:
            # an explicit record_stream: the memory to keep is the data's and the scales' (the
            # fallback below would record a dequantized copy). Autograd's engine does not come
            # here: it records a gradient's own storage, which this wrapper has not
            t, stream = args
            t.qdata.record_stream(stream)
            t.scales.record_stream(stream)
            return None
        if func in _GEMM_OPS:  # the grouped GEMM's ops read the rows as they are (_gemm_op)
            names = [a.name for a in func._schema.arguments]
            bound = dict(zip(names, args), **(kwargs or {}))  # by name: any given positionally
            t = bound[names[_GEMM_OPS[func]]]
            _record(t)  # read on this stream: t may have been made on another
            bound.update({names[_GEMM_OPS[func]]: t.qdata, "x_scales": t.scales,
                          "x_format": t.format_name})
            return func(**bound)
        args, kwargs = tree_map(lambda a: _dequantized(a) if isinstance(a, QuantizedTensor)
                                else a, (args, kwargs or {}))
        return func(*args, **kwargs)


#: The grouped GEMM's custom ops (``mxcomm.torch._gemm_op``, filled in there) -> the position of
#: their rows argument, which a QuantizedTensor gives as its data and scales.
_GEMM_OPS = {}


def _quantized_tensor(qdata, scales, fmt, cls=None, requires_grad=False):
    """A QuantizedTensor of ``fmt``, unchecked (for results this package made; the constructor
    after its checks). ``cls`` None: MXFP8Tensor for mxfp8, else QuantizedTensor."""
    if cls is None:
        cls = MXFP8Tensor if fmt.name == "mxfp8" else QuantizedTensor
    self = torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.bfloat16,
                                               device=qdata.device, requires_grad=requires_grad)
    self.qdata, self.scales, self.format = qdata, scales, fmt
    self.format_name = fmt.name  # a string: what traced code reads (dynamo wraps no Format)
    return self


class MXFP8Tensor(QuantizedTensor):
    """The ``"mxfp8"`` :class:`QuantizedTensor` (``qdata``, ``scales`` also named as below).

    Args:
        data_e4m3: (M, D) float8_e4m3fn (or uint8 bits) tensor, D % 32 == 0.
        scales_e8m0: (M, D // 32) float8_e8m0fnu (or uint8 bits) tensor, same device.
        format: ``"mxfp8"`` only (for ``QuantizedTensor``'s constructor).
    Raises:
        As :class:`QuantizedTensor`; ValueError for another format.
    """

    @staticmethod
    def __new__(cls, data_e4m3, scales_e8m0, format="mxfp8", *, requires_grad=False):  # noqa: A002
        if get_format(format, "format").name != "mxfp8":
            raise ValueError(f"format: MXFP8Tensor holds 'mxfp8' rows, got {format!r}")
        return QuantizedTensor.__new__(cls, data_e4m3, scales_e8m0, "mxfp8",
                                       requires_grad=requires_grad)

    @property
    def data_e4m3(self):
        """(M, D) float8_e4m3fn: the elements (``qdata``)."""
        return self.qdata

    @property
    def scales_e8m0(self):
        """(M, D // 32) float8_e8m0fnu: the scales (``scales``)."""
        return self.scales


class _Dequantize(torch.autograd.Function):
    """Forward: mx (M, D) QuantizedTensor -> (M, D) bf16. Backward: straight-through."""

    @staticmethod
    def forward(ctx, mx):
        return _dequantized(mx)

    @staticmethod
    def backward(ctx, grad):
        return grad


