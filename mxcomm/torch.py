"""The EP token path as differentiable torch functions (torch autograd on top of the array API).

Glossary: M rows sent by this rank, N = M_recv rows received, P permuted rows, D hidden, H GEMM
output, E experts, E_local experts per rank, W ranks.

Tensors cross to arrays zero-copy through DLPack: bf16 as an int16 view (NumPy has no bf16 DLPack;
the same view works with CuPy), fp8 as uint8 views. Work is enqueued on torch's current CUDA stream;
CPU tensors run in Numba's CUDA simulator with the MPI communicator, so CI exercises autograd too.

MXFP8 values travel as :class:`MXFP8Tensor`, a bf16-typed wrapper holding e4m3 data and e8m0
scales. It has to be bf16-typed: autograd casts a gradient to the dtype of the output it flows
into, so an fp8-typed output would receive fp8 gradients. Any torch op on it (``torch._grouped_mm``
included) runs on its dequantized bf16 values, with a straight-through gradient::

    forward:   x --a2a_dispatch--> MXFP8Tensor --permute--> MXFP8Tensor --GEMM--> bf16
                 --unpermute--> bf16 --a2a_combine--> out
    backward:  grad(out) --a2a_combine bwd--> MXFP8Tensor --unpermute bwd--> MXFP8Tensor
                 --GEMM bwd--> bf16 --permute bwd--> bf16 --a2a_dispatch bwd--> grad(x) bf16

torch is imported only here.
"""

import numpy
import torch
from torch.utils._pytree import tree_map

from . import a2a as _a2a
from . import layout as _layout
from . import permutation as _permutation
from ._array import as_device_array, bfloat16
from .mxfp8 import MXFP8Array, dequantize_mxfp8

__all__ = ["MXFP8Tensor", "exchange_layout", "a2a_dispatch", "permute", "unpermute",
           "a2a_combine", "all_to_all_single"]

# torch dtype -> (same-size integer torch dtype for DLPack, NumPy dtype of the array view)
_BIT_VIEWS = {
    torch.bfloat16: (torch.int16, bfloat16),
    torch.float8_e4m3fn: (torch.uint8, numpy.dtype(numpy.uint8)),
    torch.float8_e8m0fnu: (torch.uint8, numpy.dtype(numpy.uint8)),
}


# ------------------------------------------------------------------------------ conversions
def _stream(t):
    """torch's current stream on ``t``'s device (raw handle), or None for CPU tensors."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _array(t, name):
    """The plain tensor ``t`` as an array (zero-copy; a contiguous copy first if needed)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    view = _BIT_VIEWS.get(t.dtype)
    if view is None:
        return as_device_array(t, name)
    int_dtype, array_dtype = view
    return as_device_array(t.view(int_dtype), name).view(array_dtype)


def _tensor(a, dtype=None):
    """The array ``a`` as a torch tensor (zero-copy); ``dtype`` reinterprets bits (fp8 views)."""
    if a.dtype == bfloat16:
        return torch.from_dlpack(a.view(numpy.int16)).view(torch.bfloat16)
    t = torch.from_dlpack(a)
    return t if dtype is None else t.view(dtype)


def _rows(t, name):
    """A tensor as what the array API takes: MXFP8Array for an MXFP8Tensor, else an array."""
    if isinstance(t, MXFP8Tensor):
        return MXFP8Array(_array(t.data_e4m3, f"{name}.data_e4m3"),
                          _array(t.scales_e8m0, f"{name}.scales_e8m0"))
    return _array(t, name)


def _wrap(result):
    """An array API result as a tensor: MXFP8Tensor for an MXFP8Array, else a plain tensor."""
    if isinstance(result, MXFP8Array):
        return MXFP8Tensor(_tensor(result.data, torch.float8_e4m3fn),
                           _tensor(result.scales, torch.float8_e8m0fnu))
    return _tensor(result)


def _dequantized(t):
    """The bf16 values of the MXFP8Tensor ``t`` as a plain tensor (no autograd)."""
    mx = _rows(t, "MXFP8Tensor")
    return _tensor(dequantize_mxfp8(mx, bfloat16, stream=_stream(t.data_e4m3)))


# ---------------------------------------------------------------------------- MXFP8Tensor
class MXFP8Tensor(torch.Tensor):
    """An (M, D) MXFP8 tensor that autograd and torch ops see as bf16.

    Holds ``data_e4m3`` (M, D) ``torch.float8_e4m3fn`` and ``scales_e8m0`` (M, D // 32)
    ``torch.float8_e8m0fnu`` (one scale per 32 elements of a row). Its dtype is bf16, so gradients
    flowing into it are bf16 of the same shape. :meth:`dequantize` is differentiable
    (straight-through); any other torch op dequantizes it and runs on bf16 (``detach`` keeps it
    quantized), so ``torch._grouped_mm`` or a slice "just works" on it.

    Args:
        data_e4m3: (M, D) float8_e4m3fn (or uint8 bits) tensor.
        scales_e8m0: (M, D // 32) float8_e8m0fnu (or uint8 bits) tensor, same device.
        requires_grad: as for any tensor.
    """

    @staticmethod
    def __new__(cls, data_e4m3, scales_e8m0, *, requires_grad=False):
        if data_e4m3.dtype == torch.uint8:
            data_e4m3 = data_e4m3.view(torch.float8_e4m3fn)
        if scales_e8m0.dtype == torch.uint8:
            scales_e8m0 = scales_e8m0.view(torch.float8_e8m0fnu)
        if data_e4m3.dtype != torch.float8_e4m3fn or scales_e8m0.dtype != torch.float8_e8m0fnu:
            raise TypeError(f"MXFP8Tensor: expected float8_e4m3fn data and float8_e8m0fnu "
                            f"scales, got {data_e4m3.dtype} and {scales_e8m0.dtype}")
        if data_e4m3.dim() != 2 or data_e4m3.shape[1] % _a2a.MX_BLOCK or tuple(
                scales_e8m0.shape) != (data_e4m3.shape[0], data_e4m3.shape[1] // _a2a.MX_BLOCK):
            raise ValueError(f"MXFP8Tensor: expected data (M, D) with D % 32 == 0 and scales "
                             f"(M, D // 32), got {tuple(data_e4m3.shape)} and "
                             f"{tuple(scales_e8m0.shape)}")
        self = torch.Tensor._make_wrapper_subclass(cls, data_e4m3.shape, dtype=torch.bfloat16,
                                                   device=data_e4m3.device,
                                                   requires_grad=requires_grad)
        self.data_e4m3 = data_e4m3
        self.scales_e8m0 = scales_e8m0
        return self

    def __init__(self, data_e4m3, scales_e8m0, *, requires_grad=False):
        pass  # everything happens in __new__

    def __repr__(self):
        return f"MXFP8Tensor(shape={tuple(self.shape)}, device={self.device})"

    def dequantize(self):
        """The values as a bf16 tensor; differentiable (the gradient passes through unchanged)."""
        return _Dequantize.apply(self)

    def __tensor_flatten__(self):
        return ["data_e4m3", "scales_e8m0"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return MXFP8Tensor(inner["data_e4m3"], inner["scales_e8m0"])

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            (t,) = args
            return MXFP8Tensor(t.data_e4m3, t.scales_e8m0)
        args, kwargs = tree_map(lambda a: _dequantized(a) if isinstance(a, MXFP8Tensor) else a,
                                (args, kwargs or {}))
        return func(*args, **kwargs)


# ------------------------------------------------------------------------ autograd functions
class _Dequantize(torch.autograd.Function):
    """MXFP8Tensor -> bf16.

    Forward:  mx (M, D) MXFP8Tensor -> (M, D) bf16.
    Backward: grad (M, D) bf16 -> the same, unchanged (straight-through).
    """

    @staticmethod
    def forward(ctx, mx):
        return _dequantized(mx)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _A2ADispatch(torch.autograd.Function):
    """Step 1, the dispatch all-to-all.

    Forward:  x (M, D) bf16 -> (N, D) MXFP8Tensor (``precision="mxfp8"``) or bf16; sends
              ``input_splits``, receives ``output_splits``.
    Backward: grad (N, D) -> (M, D) bf16, combine direction, in ``grad_precision``.
    """

    @staticmethod
    def forward(ctx, x, input_splits, output_splits, comm, precision, grad_precision, layout):
        ctx.args = (input_splits, output_splits, comm, grad_precision, layout)
        return _wrap(_a2a.a2a_dispatch(_rows(x, "x"), input_splits, output_splits, comm,
                                       precision, stream=_stream(x), layout=layout))

    @staticmethod
    def backward(ctx, grad):
        input_splits, output_splits, comm, grad_precision, layout = ctx.args
        dx = _a2a.a2a_dispatch_backward(_rows(grad, "grad"), input_splits, output_splits, comm,
                                        grad_precision, stream=_stream(grad), layout=layout)
        # None for: input_splits, output_splits, comm, precision, grad_precision, layout
        return _wrap(dx), None, None, None, None, None, None


class _Permute(torch.autograd.Function):
    """Step 2, received order -> expert-major groups padded to ``align`` rows.

    Forward:  x (N, D) bf16 or MXFP8Tensor -> permuted (P, D) of the same kind (data and scales
              move together), permuted_indices (P,) int32, group_offsets (E_local,) int32.
    Backward: grad (P, D) -> (N, D), a scatter back to received order (padding rows dropped).
    """

    @staticmethod
    def forward(ctx, x, num_tokens_per_expert_group, num_local_experts, align):
        counts = num_tokens_per_expert_group
        if not isinstance(counts, _layout.Layout):
            counts = _array(counts, "num_tokens_per_expert_group")
        permuted, indices, offsets = _permutation.permute(_rows(x, "x"), counts,
                                                          num_local_experts, align,
                                                          stream=_stream(x))
        indices, offsets = _tensor(indices), _tensor(offsets)
        ctx.save_for_backward(indices)
        ctx.num_rows = x.shape[0]
        ctx.mark_non_differentiable(indices, offsets)
        return _wrap(permuted), indices, offsets

    @staticmethod
    def backward(ctx, grad, grad_indices, grad_offsets):
        (indices,) = ctx.saved_tensors
        dx = _permutation.permute_backward(_rows(grad, "grad"), _array(indices, "permuted_indices"),
                                       ctx.num_rows, stream=_stream(grad))
        # None for: num_tokens_per_expert_group, num_local_experts, align
        return _wrap(dx), None, None, None


class _Unpermute(torch.autograd.Function):
    """Step 4, expert-major rows -> received order.

    Forward:  y (P, H) bf16 -> (N, H) bf16; padding rows dropped.
    Backward: grad (N, H) bf16 or MXFP8Tensor -> (P, H) of the same kind, a gather (scales kept;
              padding rows zero).
    """

    @staticmethod
    def forward(ctx, y, permuted_indices, num_rows):
        ctx.save_for_backward(permuted_indices)
        return _wrap(_permutation.unpermute(_rows(y, "y"), _array(permuted_indices, "permuted_indices"),
                                        num_rows, stream=_stream(y)))

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        dy = _permutation.unpermute_backward(_rows(grad, "grad"), _array(indices, "permuted_indices"),
                                         stream=_stream(grad))
        # None for: permuted_indices, num_rows
        return _wrap(dy), None, None


class _A2ACombine(torch.autograd.Function):
    """Step 5, the combine all-to-all.

    Forward:  y (N, H) bf16 -> (M, H) bf16 in ``precision``; sends ``output_splits``, receives
              ``input_splits``.
    Backward: grad (M, H) bf16 -> (N, H) MXFP8Tensor (``grad_precision="mxfp8"``) or bf16,
              dispatch direction.
    """

    @staticmethod
    def forward(ctx, y, input_splits, output_splits, comm, precision, grad_precision, layout):
        ctx.args = (input_splits, output_splits, comm, grad_precision, layout)
        return _wrap(_a2a.a2a_combine(_rows(y, "y"), input_splits, output_splits, comm, precision,
                                      stream=_stream(y), layout=layout))

    @staticmethod
    def backward(ctx, grad):
        input_splits, output_splits, comm, grad_precision, layout = ctx.args
        dy = _a2a.a2a_combine_backward(_rows(grad, "grad"), input_splits, output_splits, comm,
                                       grad_precision, stream=_stream(grad), layout=layout)
        # None for: input_splits, output_splits, comm, precision, grad_precision, layout
        return _wrap(dy), None, None, None, None, None, None


class _AllToAllSingle(torch.autograd.Function):
    """The drop-in for ``all_to_all_single_autograd``.

    Forward:  x (M, D) -> (sum(output_splits), D) of x's dtype: quantize, exchange, dequantize.
    Backward: grad -> (M, D): the same with the splits swapped.
    """

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, comm, precision):
        ctx.args = (output_splits, input_splits, comm, precision)
        return _wrap(_a2a.all_to_all_single(_rows(x, "x"), output_splits, input_splits, comm,
                                            precision, stream=_stream(x)))

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits, comm, precision = ctx.args
        dx = _a2a.all_to_all_single(_rows(grad, "grad"), input_splits, output_splits, comm,
                                    precision, stream=_stream(grad))
        # None for: output_splits, input_splits, comm, precision
        return _wrap(dx), None, None, None, None


# ---------------------------------------------------------------------------------- public
class Layout(_layout.Layout):
    """:class:`mxcomm.layout.Layout` on tensors: ``num_tokens_per_expert_group`` is an (E,)
    int32 tensor (unpacks as ``(group tensor, input_splits, output_splits)``)."""

    def __new__(cls, layout):
        self = _layout.Layout.__new__(cls, layout.comm, layout.num_tokens_per_expert_group,
                                      layout.counts, layout.num_local_experts)
        self.group_tensor = _tensor(layout.num_tokens_per_expert_group)
        return self

    def __iter__(self):
        return iter((self.group_tensor, self.input_splits, self.output_splits))

    def __getitem__(self, i):
        return (self.group_tensor, self.input_splits, self.output_splits)[i]


def exchange_layout(num_tokens_per_expert, comm):
    """Step 0 on tensors; see :func:`mxcomm.exchange_layout` (the one host synchronization).

    Args:
        num_tokens_per_expert: (E,) integer tensor (int64 from ``bincount`` is fine).
    Returns:
        A layout: pass it to :func:`a2a_dispatch`, :func:`permute`, :func:`unpermute` and
        :func:`a2a_combine` (no host collective per call); it unpacks as
        ``(num_tokens_per_expert_group (E,) int32 tensor, input_splits, output_splits)``.
    """
    return Layout(_layout.exchange_layout(
        _array(num_tokens_per_expert, "num_tokens_per_expert"), comm,
        stream=_stream(num_tokens_per_expert)))


def a2a_dispatch(x, input_splits=None, output_splits=None, comm=None, precision="mxfp8",
                 grad_precision="bf16", *, layout=None):
    """Step 1, differentiable: (M, D) bf16 -> (N, D) MXFP8Tensor (``"mxfp8"``) or bf16.

    See :func:`mxcomm.a2a_dispatch`; ``grad_precision`` is the backward's wire format. Give the
    layout (``a2a_dispatch(x, layout)``) for calls without any host collective.
    """
    _a2a._check_precision(precision)
    _a2a._check_precision(grad_precision, "grad_precision")
    if isinstance(input_splits, _layout.Layout):
        layout, input_splits = input_splits, None
    return _A2ADispatch.apply(x, input_splits, output_splits, comm, precision, grad_precision,
                              layout)


def permute(x, num_tokens_per_expert_group, num_local_experts=None, align=32):
    """Step 2, differentiable: received rows -> expert-major, ``align``-padded groups.

    Args:
        x: (N, D) bf16 tensor or MXFP8Tensor.
        num_tokens_per_expert_group: (E,) int32 tensor (``exchange_layout``), or the layout
            itself (then ``num_local_experts`` is the layout's, and N is checked against it).
        num_local_experts: E_local (not needed with a layout).
        align: rows each group is padded to a multiple of.
    Returns:
        ``(permuted (P, D) like x, permuted_indices (P,) int32, group_offsets (E_local,) int32)``;
        ``group_offsets`` is the ``offs`` of ``torch._grouped_mm``.
    Raises:
        ValueError: with a layout, ``x`` has another number of rows than it receives.
    """
    if isinstance(num_tokens_per_expert_group, _layout.Layout):
        layout = num_tokens_per_expert_group
        if x.shape[0] != layout.num_received:  # here too: before autograd records anything
            raise ValueError(f"permute: x on rank {layout.comm.rank} has {x.shape[0]} rows, but "
                             f"the layout receives {layout.num_received}")
    elif num_local_experts is None:
        raise TypeError("permute: num_local_experts is required without a layout")
    return _Permute.apply(x, num_tokens_per_expert_group, num_local_experts, align)


def unpermute(y, permuted_indices, num_rows):
    """Step 4, differentiable: (P, H) -> (num_rows, H) in received order.

    ``num_rows`` is N, or the layout (its ``num_received``)."""
    if isinstance(num_rows, _layout.Layout):
        num_rows = num_rows.num_received
    return _Unpermute.apply(y, permuted_indices, num_rows)


def a2a_combine(y, input_splits=None, output_splits=None, comm=None, precision="bf16",
                grad_precision="mxfp8", *, layout=None):
    """Step 5, differentiable: (N, H) -> (M, H); splits (or the layout) as given to
    :func:`a2a_dispatch`.

    The gradient of ``y`` is an MXFP8Tensor when ``grad_precision="mxfp8"``.
    """
    _a2a._check_precision(precision)
    _a2a._check_precision(grad_precision, "grad_precision")
    if isinstance(input_splits, _layout.Layout):
        layout, input_splits = input_splits, None
    return _A2ACombine.apply(y, input_splits, output_splits, comm, precision, grad_precision,
                             layout)


def all_to_all_single(x, output_splits, input_splits, comm, precision="mxfp8"):
    """Differentiable drop-in for ``all_to_all_single_autograd(x, output_splits, input_splits,
    group)``: the result has x's dtype; MXFP8 on the wire both ways."""
    _a2a._check_precision(precision)
    return _AllToAllSingle.apply(x, output_splits, input_splits, comm, precision)
