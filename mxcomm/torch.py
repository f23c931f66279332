"""The EP token path as differentiable torch functions (torch autograd on top of the array API).

Glossary: M rows sent by this rank, N = M_recv rows received, P permuted rows, D hidden, H GEMM
output, E experts, E_local experts per rank, W ranks.

Tensors cross to arrays zero-copy: a CUDA tensor is seen as a CuPy array over its memory (built
from ``data_ptr``: CuPy's DLPack import costs 17-27 us of host time per tensor), a CPU tensor as a
NumPy array; bf16 as ml_dtypes' bf16, fp8 as uint8 bits. The exchanges' results are allocated by
torch (the engine's ``alloc``), so they come back as those tensors, with no DLPack export and no
second memory pool. Work is enqueued on torch's current CUDA stream; CPU tensors run with the host
backend and the MPI communicator, so CI exercises autograd too. Given a layout, a plain tensor whose
exchange is one ``alltoallv`` (a plain precision, or a small quantized exchange) or a staged one
whose result stays quantized skips all that: checked in O(1) against the engine's direct call
(``mxcomm.route``), it is passed by its address, and results are allocated by torch
(docs/design.md, "Direct calls").

Quantized values travel as a :class:`QuantizedTensor` (any format of ``mxcomm.formats``; its
``"mxfp8"`` case is :class:`MXFP8Tensor`), a bf16-typed wrapper holding e4m3 data and the format's
scales. It has to be bf16-typed: autograd casts a gradient to the dtype of the output it flows
into, so an fp8-typed output would receive fp8 gradients. Any torch op on it (``torch._grouped_mm``
included) runs on its dequantized bf16 values, with a straight-through gradient::

    forward:   x --a2a_dispatch--> MXFP8Tensor --permute--> MXFP8Tensor --GEMM--> bf16
                 --unpermute--> bf16 --a2a_combine--> out
    backward:  grad(out) --a2a_combine bwd--> MXFP8Tensor --unpermute bwd--> MXFP8Tensor
                 --GEMM bwd--> bf16 --permute bwd--> bf16 --a2a_dispatch bwd--> grad(x) bf16

torch is imported only here and in this module's private helpers (``_torch_arrays``: tensors as
arrays and back; ``_torch_gemm``: the fp8 grouped GEMM).
"""

import numpy
import torch
from torch.utils._pytree import tree_map

from . import a2a as _a2a
from . import layout as _layout
from . import permutation as _permutation
from . import route as _route
from ._array import bfloat16
from ._driver import Words
from ._platform import gpu_arrays
from .kernels import array_module
from ._torch_arrays import (_ARRAY_DTYPES, _TORCH_DTYPES, _array, _current_stream, _stream,
                            _tensor, _view)
from ._torch_gemm import WeightCache, fp8_gemm_available, grouped_mm
from .formats import QuantizedArray, get_format

__all__ = ["QuantizedTensor", "MXFP8Tensor", "grouped_mm", "fp8_gemm_available",
           "exchange_layout", "a2a_dispatch", "permute", "unpermute", "a2a_combine",
           "all_to_all_single", "all_to_all_single_fn", "communicator_for", "ExpertParallel",
           "EPHandle", "WeightCache"]

# array dtype of a quantized format's data / scales -> the torch dtype its tensor has
# (fp8 travels as uint8 bits: data is e4m3fn, uint8 scales are e8m0)
_DATA_DTYPE = torch.float8_e4m3fn
_SCALE_DTYPES = {numpy.dtype(numpy.uint8): torch.float8_e8m0fnu,
                 numpy.dtype(numpy.float32): torch.float32}
#: The scale rounding of every exchange made through this module (the array API's default).
_SCALE_MODE = "rceil"
# (kind, array dtype) of a direct call's result (``mxcomm.route``) -> its torch dtype
_DIRECT_DTYPES = {("rows", dtype): torch_dtype for dtype, torch_dtype in _TORCH_DTYPES.items()}
_DIRECT_DTYPES.update({("data", numpy.dtype(numpy.uint8)): _DATA_DTYPE})
_DIRECT_DTYPES.update({("scales", dtype): torch_dtype for dtype, torch_dtype
                       in _SCALE_DTYPES.items()})


class _Alloc:
    """The engine's allocator in a torch call (``alloc(shape, dtype)``): results are torch
    tensors from torch's caching allocator on ``device`` (on torch's current stream, where the
    call runs), seen as arrays, so they come back as those tensors (:meth:`tensor`) without a
    DLPack round trip, and the memory stays in torch's pool."""

    __slots__ = ("_device", "_made")

    def __init__(self, device):
        self._device = device
        self._made = []

    def __call__(self, shape, dtype):
        torch_dtype = _TORCH_DTYPES.get(dtype)
        if torch_dtype is None:
            return array_module().empty(shape, dtype)
        t = torch.empty(shape, dtype=torch_dtype, device=self._device)
        a = _view(t, dtype) if t.numel() else _array(t, "result")
        self._made.append((a, t))
        return a

    def tensor(self, a, dtype=None):
        """The tensor of an array this allocator made (``dtype``: a bit view of it), else
        :func:`_tensor`'s."""
        for made, t in self._made:
            if made is a:
                return t if dtype is None else t.view(dtype)
        return _tensor(a, dtype)


def _rows(t, name):
    """A tensor as what the array API takes: a QuantizedArray (MXFP8Array for mxfp8) for a
    QuantizedTensor, GatheredRows for a :class:`_PendingGather`, else an array."""
    if isinstance(t, QuantizedTensor):
        return t.format.wrap(_array(t.qdata, f"{name}.qdata"), _array(t.scales, f"{name}.scales"))
    if isinstance(t, _PendingGather):
        return _permutation.GatheredRows(_array(t.source, f"{name}.source"),
                                         _array(t.inverse, f"{name}.inverse"))
    return _array(t, name)


def _wrap(result, alloc=None):
    """An array API result as a tensor: a QuantizedTensor (MXFP8Tensor for mxfp8) for a
    QuantizedArray, else a plain tensor; the tensors ``alloc`` (an :class:`_Alloc`) made for
    it, where it made them."""
    tensor = _tensor if alloc is None else alloc.tensor
    if isinstance(result, QuantizedArray):
        return QuantizedTensor(tensor(result.data, _DATA_DTYPE),
                               tensor(result.scales, _SCALE_DTYPES[result.scales.dtype]),
                               result.format)
    return tensor(result)


def _exchange(function, rows, input_splits, output_splits, comm, precision, layout=None,
              permute_align=None):
    """The array API's ``function`` (``mxcomm.a2a``) on the tensor ``rows`` (plain or a
    QuantizedTensor), on torch's current stream, results allocated by torch: a tensor (with
    ``permute_align`` in the dispatch direction, ``permute``'s triple of tensors). A plain
    tensor whose exchange the engine's direct call runs goes straight to it."""
    if layout is not None and permute_align is None and type(rows) is torch.Tensor and \
            input_splits is None and output_splits is None and comm in (None, layout.comm):
        out = _exchange_direct(function, rows, layout, precision)
        if out is not None:
            return out
    alloc = _Alloc(rows.device)
    result = _a2a._call(function, _rows(rows, _a2a._CALLS[function][0]), input_splits,
                        output_splits, comm, precision, layout, stream=_stream(rows), alloc=alloc,
                        permute_align=permute_align)
    if type(result) is tuple:
        permuted, indices, offsets = result
        return (_wrap(permuted, alloc),) + _index_tensors(layout, permute_align, indices, offsets)
    return _wrap(result, alloc)


def _exchange_direct(function, t, layout, precision):
    """The exchange of the plain tensor ``t`` given ``layout`` on its route (``mxcomm.route``;
    docs/design.md, "One route"), or None where the engine must take it (another signature,
    rows that do not fit the layout or the format, a staged exchange whose result is
    dequantized): O(1) checks, ``t`` passed by its address, results allocated by torch in their
    final dtypes (a quantized result's data as float8_e4m3fn, its scales as the format's)."""
    dtype = _ARRAY_DTYPES.get(t.dtype)
    shape = t.shape
    if dtype is None or len(shape) != 2:
        return None
    r = _route.route(function, precision, _SCALE_MODE, dtype, shape[1])
    if r is None:
        return None
    comm = layout.comm
    plan = layout.dispatch_plan if r.dispatch else layout.combine_plan
    cuda = t.is_cuda
    if shape[0] != plan.rows_sent or cuda != gpu_arrays() or not t.is_contiguous():
        return None
    path = r.path(comm, plan)
    if path is None:
        return None
    device = t.device
    if cuda:
        ptr = t.data_ptr()
        if ptr % r.fmt.input_align:
            return None
        x = Words(ptr, (plan.rows_sent, r.width), dtype)
        stream = comm.stream_ptr(_current_stream(device))
    else:
        x = _view(t, dtype)
        stream = comm.stream_ptr(None)

    specs = _route.arrays(r, path, plan)
    tensors = [torch.empty(shape, dtype=_DIRECT_DTYPES[kind, dtype], device=device)
               for shape, dtype, kind in specs]
    buffers = [Words(t.data_ptr(), shape, dtype) if cuda else _view(t, dtype)
               for t, (shape, dtype, _) in zip(tensors, specs)]
    _route.run(r, path, comm, plan, x, stream, buffers)
    return _quantized_tensor(tensors[0], tensors[1], r.fmt) if r.kept else tensors[0]


def _index_tensors(layout, align, indices, offsets, alloc=None):
    """The permute index and group offsets (arrays) of ``layout`` for ``align`` as tensors: the
    tensors ``alloc`` (an :class:`_Alloc`) made them in, else exported through DLPack once;
    kept beside the layout (the arrays are too), so a later call imports and exports nothing,
    and :func:`_index_array` finds the index's array from its tensor."""
    key = ("torch permute index", align)
    cached = layout._cache.get(key) if layout is not None else None
    if cached is None or cached[0] is not indices:
        tensor = _tensor if alloc is None else alloc.tensor
        cached = (indices, tensor(indices), tensor(offsets))
        if layout is not None:
            layout._cache[key] = cached
            layout._cache["torch index array", id(cached[1])] = (cached[1], indices)
    return cached[1], cached[2]


def _index_array(t, layout):
    """The permute index tensor ``t`` as an array: the one kept beside ``layout`` (a layout or
    None) where ``t`` is the layout's index tensor (:func:`_index_tensors`), else a view of
    ``t``."""
    if layout is not None:
        kept = layout._cache.get(("torch index array", id(t)))
        if kept is not None and kept[0] is t:
            return kept[1]
    return _array(t, "permuted_indices")


def _dequantized(t):
    """The bf16 values of the QuantizedTensor ``t`` as a plain tensor (no autograd), allocated by
    torch (no DLPack import per call)."""
    out = torch.empty(t.shape, dtype=torch.bfloat16, device=t.qdata.device)
    if out.numel():
        _rows(t, type(t).__name__).dequantize(bfloat16, out=_view(out, bfloat16),
                                              stream=_stream(t.qdata))
    return out


# ------------------------------------------------------------------------- QuantizedTensor
def _scales_shape_text(fmt):
    """The scale shape of a format in words: "(M,)" or "(M, D // 32)"."""
    return "(M,)" if len(fmt.scales_shape(1, fmt.d_multiple)) == 1 else \
        f"(M, D // {fmt.scale_block})"


class QuantizedTensor(torch.Tensor):
    """An (M, D) tensor of a quantized format (``mxcomm.formats``) that autograd and torch ops see
    as bf16.

    Holds ``qdata`` (M, D) ``torch.float8_e4m3fn``, ``scales`` of the format's scale shape
    (``format.scales_shape(M, D)``: ``torch.float8_e8m0fnu`` (M, D // 32) for mxfp8,
    ``torch.float32`` (M,) for fp8_rowwise, (M, D // 128) for the block128 formats) and
    ``format`` (a :class:`~mxcomm.formats.Format`). Its dtype is bf16, so gradients flowing into it
    are bf16 of the same shape. :meth:`dequantize` is differentiable (straight-through); any other
    torch op dequantizes it and runs on bf16 (``detach`` keeps it quantized), so
    ``torch._grouped_mm`` or a slice "just works" on it. Constructing one with the ``"mxfp8"``
    format gives an :class:`MXFP8Tensor`.

    Args:
        qdata: (M, D) float8_e4m3fn (or uint8 bits) tensor.
        scales: the format's scales (uint8 bits accepted for e8m0), same device.
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
            raise ValueError(f"{cls.__name__}: expected data (M, D) with D % {fmt.d_multiple} "
                             f"== 0 and scales {_scales_shape_text(fmt)} ({fmt.name}), got "
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
        args, kwargs = tree_map(lambda a: _dequantized(a) if isinstance(a, QuantizedTensor)
                                else a, (args, kwargs or {}))
        return func(*args, **kwargs)


def _quantized_tensor(qdata, scales, fmt, cls=None, requires_grad=False):
    """A QuantizedTensor of ``qdata`` (float8_e4m3fn) and ``scales`` (the format's torch dtype)
    of the quantized Format ``fmt``, unchecked: the constructor's end after its checks, and the
    whole of it for results this package made with the format's dtypes and shapes. ``cls``:
    the class (None: MXFP8Tensor for mxfp8, else QuantizedTensor)."""
    if cls is None:
        cls = MXFP8Tensor if fmt.name == "mxfp8" else QuantizedTensor
    self = torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.bfloat16,
                                               device=qdata.device, requires_grad=requires_grad)
    self.qdata, self.scales, self.format = qdata, scales, fmt
    return self


class MXFP8Tensor(QuantizedTensor):
    """The ``"mxfp8"`` :class:`QuantizedTensor`: ``data_e4m3`` (M, D) ``torch.float8_e4m3fn`` and
    ``scales_e8m0`` (M, D // 32) ``torch.float8_e8m0fnu`` (one scale per 32 elements of a row),
    also reachable as ``qdata`` and ``scales``.

    Args:
        data_e4m3: (M, D) float8_e4m3fn (or uint8 bits) tensor, D % 32 == 0.
        scales_e8m0: (M, D // 32) float8_e8m0fnu (or uint8 bits) tensor, same device.
        format: ``"mxfp8"`` only (the argument exists for ``QuantizedTensor``'s constructor).
        requires_grad: as for any tensor.
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


# ------------------------------------------------------------------------ autograd functions
class _PendingGather(torch.Tensor):
    """The gradient permute's backward hands dispatch's backward with a layout: (N, D), row i
    = ``source[inverse[i]]`` of the permuted gradient (P, D), not written yet (docs/design.md,
    "The permute's backward folded into a quantized dispatch gradient").

    Dispatch's backward reads it as ``permutation.GatheredRows``: a quantized dispatch gradient
    whose format quantizes gathered rows (MXFP8) reads the permuted rows in place, so the bf16
    rows in received order are never written and read back. Any other torch op on it (the sum
    with another gradient of the received rows, a hook) first materializes it (the gather
    ``GatheredRows.materialize``: the rows permute's backward scatters otherwise, the same bits).
    """

    @staticmethod
    def __new__(cls, source, inverse):
        shape = (inverse.shape[0],) + tuple(source.shape[1:])
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=source.dtype,
                                                   device=source.device)
        self.source, self.inverse = source, inverse
        return self

    def __init__(self, *args, **kwargs):
        pass  # everything happens in __new__

    def __repr__(self):
        return f"_PendingGather(shape={tuple(self.shape)}, device={self.device})"

    def materialize(self):
        """The rows as a plain tensor, gathered from ``source`` on torch's current stream."""
        alloc = _Alloc(self.source.device)
        return _wrap(_rows(self, "grad").materialize(_stream(self.source), alloc), alloc)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(lambda a: a.materialize() if isinstance(a, _PendingGather) else a,
                                (args, kwargs or {}))
        return func(*args, **kwargs)


def _folds_into_dispatch(x, layout):
    """True where permute's backward may hand its gradient to the dispatch that made ``x`` as a
    :class:`_PendingGather`: ``x`` is the output of :func:`a2a_dispatch` on the same layout,
    whose gradient precision quantizes gathered rows."""
    node = x.grad_fn
    backward = getattr(_A2ADispatch, "_backward_cls", None)
    if layout is None or backward is None or not isinstance(node, backward):
        return False
    *_, grad_precision, dispatch_layout, permute_align = node.args
    fmt = get_format(grad_precision)
    return dispatch_layout is layout and permute_align is None and fmt.quantized and \
        fmt.quantizes_gathered(bfloat16)


class _Dequantize(torch.autograd.Function):
    """QuantizedTensor -> bf16.

    Forward:  mx (M, D) QuantizedTensor (any format) -> (M, D) bf16.
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

    Forward:  x (M, D) bf16 -> (N, D) QuantizedTensor of ``precision`` (MXFP8Tensor for
              ``"mxfp8"``) or a plain tensor (``"bf16"``, ``"native"``); sends
              ``input_splits``, receives ``output_splits``. With ``permute_align``: ``permute``'s
              triple, permuted (P, D) rows (indices and offsets not differentiable).
    Backward: grad (N, D), or (P, D) permuted -> (M, D) bf16, combine direction, in
              ``grad_precision``.

    The arguments but ``x`` travel as one tuple, ``call`` = (input_splits, output_splits, comm,
    precision, grad_precision, layout, permute_align): autograd's ``apply`` spends host time
    on every argument.
    """

    @staticmethod
    def forward(ctx, x, call):
        input_splits, output_splits, comm, precision, grad_precision, layout, permute_align = call
        ctx.args = (input_splits, output_splits, comm, grad_precision, layout, permute_align)
        out = _exchange("a2a_dispatch", x, input_splits, output_splits, comm, precision, layout,
                        permute_align)
        if type(out) is tuple:
            ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, grad, *index_grads):
        input_splits, output_splits, comm, grad_precision, layout, permute_align = ctx.args
        dx = _exchange("a2a_dispatch_backward", grad, input_splits, output_splits, comm,
                       grad_precision, layout, permute_align)
        return dx, None  # None for the call's tuple


class _Permute(torch.autograd.Function):
    """Step 2, received order -> expert-major groups padded to ``align`` rows.

    Forward:  x (N, D) bf16 or QuantizedTensor -> permuted (P, D) of the same kind (data and
              scales move together; ``out_format``: converted), permuted_indices (P,) int32,
              group_offsets (E_local,) int32.
    Backward: grad (P, D) -> (N, D), a scatter back to received order (padding rows dropped);
              with ``fold`` (:func:`_folds_into_dispatch`), a :class:`_PendingGather` that the
              dispatch's MXFP8 gradient reads in place instead.
    """

    @staticmethod
    def forward(ctx, x, num_tokens_per_expert_group, num_local_experts, align, out_format, fold):
        counts = num_tokens_per_expert_group
        layout = counts if isinstance(counts, _layout.Layout) else None
        if layout is None:
            counts = _array(counts, "num_tokens_per_expert_group")
        alloc = _Alloc(x.device)
        permuted, indices, offsets = _permutation._permute(_rows(x, "x"), counts,
                                                           num_local_experts, align, out_format,
                                                           _stream(x), alloc)
        indices, offsets = _index_tensors(layout, align, indices, offsets, alloc)
        ctx.save_for_backward(indices)
        # with the layout, its permute's indices name every received row once: the backward's
        # scatter needs no zero fill first (one pass over the gradient less)
        ctx.layout = layout
        ctx.num_rows = layout if layout is not None else x.shape[0]
        ctx.inverse = _inverse_index(layout, align, indices) if fold else None
        ctx.mark_non_differentiable(indices, offsets)
        return _wrap(permuted, alloc), indices, offsets

    @staticmethod
    def backward(ctx, grad, grad_indices, grad_offsets):
        (indices,) = ctx.saved_tensors
        if ctx.inverse is not None and type(grad) is torch.Tensor and grad.is_contiguous() \
                and grad.dtype == torch.bfloat16:
            dx = _PendingGather(grad, ctx.inverse)
        else:
            alloc = _Alloc(grad.device)
            dx = _wrap(_permutation._unpermute(_rows(grad, "grad"),
                                               _index_array(indices, ctx.layout),
                                               ctx.num_rows, _stream(grad), alloc), alloc)
        # None for: num_tokens_per_expert_group, num_local_experts, align, out_format, fold
        return dx, None, None, None, None, None


def _inverse_index(layout, align, indices):
    """(N,) int32 tensor: the permuted row of each received row, the inverse of the layout's
    permute index ``indices`` (P,) (padding rows, -1, land in a dropped slot N); kept beside the
    layout per ``align``, like the index, and built on the device (no host sync)."""
    key = ("torch permute inverse", align)
    cached = layout._cache.get(key)
    if cached is not None and cached[0] is indices:
        return cached[1]
    n = layout.num_received
    inverse = torch.empty(n + 1, dtype=torch.int32, device=indices.device)
    slots = torch.where(indices >= 0, indices, n).long()
    inverse.scatter_(0, slots, torch.arange(indices.shape[0], dtype=torch.int32,
                                            device=indices.device))
    inverse = inverse[:n]
    layout._cache[key] = (indices, inverse)
    return inverse


class _Unpermute(torch.autograd.Function):
    """Step 4, expert-major rows -> received order.

    Forward:  y (P, H) bf16 -> (N, H) bf16; padding rows dropped.
    Backward: grad (N, H) bf16 or QuantizedTensor -> (P, H) of the same kind, a gather (scales
              kept; padding rows zero with the format's padding scale).
    """

    @staticmethod
    def forward(ctx, y, permuted_indices, num_rows, grad_format):
        ctx.save_for_backward(permuted_indices)
        ctx.grad_format = grad_format
        ctx.layout = num_rows if isinstance(num_rows, _layout.Layout) else None
        alloc = _Alloc(y.device)
        return _wrap(_permutation._unpermute(_rows(y, "y"),
                                             _index_array(permuted_indices, ctx.layout),
                                             num_rows, _stream(y), alloc), alloc)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        alloc = _Alloc(grad.device)
        dy = _permutation._unpermute_backward(_rows(grad, "grad"),
                                              _index_array(indices, ctx.layout),
                                              _stream(grad), alloc, ctx.grad_format)
        # None for: permuted_indices, num_rows, grad_format
        return _wrap(dy, alloc), None, None, None


class _A2ACombine(torch.autograd.Function):
    """Step 5, the combine all-to-all.

    Forward:  y (N, H) bf16, or (P, H) permuted with ``permute_align`` -> (M, H) bf16 in
              ``precision``; sends ``output_splits``, receives ``input_splits``.
    Backward: grad (M, H) bf16 -> (N, H), or (P, H) permuted, QuantizedTensor of
              ``grad_precision`` (quantized formats) or a plain tensor, dispatch direction.

    The arguments but ``y`` travel as one tuple, as :class:`_A2ADispatch`'s.
    """

    @staticmethod
    def forward(ctx, y, call):
        input_splits, output_splits, comm, precision, grad_precision, layout, permute_align = call
        ctx.args = (input_splits, output_splits, comm, grad_precision, layout, permute_align)
        return _exchange("a2a_combine", y, input_splits, output_splits, comm, precision, layout,
                         permute_align)

    @staticmethod
    def backward(ctx, grad):
        input_splits, output_splits, comm, grad_precision, layout, permute_align = ctx.args
        dy = _exchange("a2a_combine_backward", grad, input_splits, output_splits, comm,
                       grad_precision, layout, permute_align)
        if type(dy) is tuple:  # the permuted gradient (the index is the forward's)
            dy = dy[0]
        return dy, None  # None for the call's tuple


class _AllToAllSingle(torch.autograd.Function):
    """The drop-in for ``all_to_all_single_autograd``.

    Forward:  x (M, D) -> (sum(output_splits), D) of x's dtype: quantize, exchange, dequantize.
    Backward: grad -> (M, D): the same with the splits swapped.
    """

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, comm, precision):
        ctx.args = (output_splits, input_splits, comm, precision)
        return _exchange("all_to_all_single", x, input_splits, output_splits, comm, precision)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits, comm, precision = ctx.args
        # the same exchange with the splits swapped (the rows are named x in messages)
        dx = _exchange("all_to_all_single", grad, output_splits, input_splits, comm, precision)
        # None for: output_splits, input_splits, comm, precision
        return dx, None, None, None, None


# ---------------------------------------------------------------------------------- public
class Layout(_layout.Layout):
    """:class:`mxcomm.layout.Layout` on tensors: ``group_tensor`` is its (E,) int32
    ``num_tokens_per_expert_group`` as a tensor (the array is a view of it); unpacks as
    ``(group tensor, input_splits, output_splits)``."""

    @classmethod
    def of(cls, layout):
        """The layout on tensors of the array API's ``layout`` (its group array exported as a
        tensor through DLPack)."""
        self = cls(layout.comm, layout.num_tokens_per_expert_group, layout.counts,
                   layout.num_local_experts)
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
    device = num_tokens_per_expert.device
    made = []

    def upload(host):  # the group counts, copied by torch on its current stream, as an array
        t = torch.from_numpy(host)
        if device.type != "cpu":
            t = t.to(device, non_blocking=True)  # pageable: staged before this returns
        made.append(t)
        return _array(t, "num_tokens_per_expert_group")

    layout = _layout._exchange(_array(num_tokens_per_expert, "num_tokens_per_expert"), comm,
                               _stream(num_tokens_per_expert), Layout, upload)
    layout.group_tensor = made[0]
    return layout


def a2a_dispatch(x, input_splits=None, output_splits=None, comm=None, precision="mxfp8",
                 grad_precision="bf16", *, layout=None, permute_align=None):
    """Step 1, differentiable: (M, D) bf16 -> (N, D) MXFP8Tensor (``"mxfp8"``) or bf16.

    See :func:`mxcomm.a2a_dispatch`; ``grad_precision`` is the backward's wire format. Give the
    layout (``a2a_dispatch(x, layout)``) for calls without any host collective.

    ``permute_align=A`` (with the layout): steps 1 and 2 in one, bit for bit ``permute(
    a2a_dispatch(x, layout, ...), layout, align=A)``, forward and backward: returns
    ``(permuted (P, D), permuted_indices (P,) int32, group_offsets (E_local,) int32)``, the
    received rows scattered straight into their permuted rows where the precision is quantized
    (no copy into received order, no separate permute pass), and the backward takes the permuted
    gradient (an MXFP8 ``grad_precision`` quantizes it in place; docs/design.md, "The expert
    side of an exchange in permute's order"). No ``out_format``: for a conversion in the
    permute, call :func:`permute` separately.
    """
    _a2a._check_precision(precision)
    _a2a._check_precision(grad_precision, "grad_precision")
    if isinstance(input_splits, _layout.Layout):
        layout, input_splits = input_splits, None
    return _A2ADispatch.apply(x, (input_splits, output_splits, comm, precision, grad_precision,
                                 layout, permute_align))


def permute(x, num_tokens_per_expert_group, num_local_experts=None, align=32, *,
            out_format=None):
    """Step 2, differentiable: received rows -> expert-major, ``align``-padded groups.

    Args:
        x: (N, D) bf16 tensor or QuantizedTensor.
        num_tokens_per_expert_group: (E,) int32 tensor (``exchange_layout``), or the layout
            itself (then ``num_local_experts`` is the layout's, and N is checked against it).
        num_local_experts: E_local (not needed with a layout).
        align: rows each group is padded to a multiple of.
        out_format: None, or a format to convert quantized rows to in the same pass
            (:func:`mxcomm.permute`): ``"bf16"`` from an MXFP8Tensor gives a plain bf16 tensor,
            dequantized in the gather (for a bf16 grouped GEMM: one pass instead of a permute
            and a dequantize); ``"fp8_rowwise"`` a QuantizedTensor for the fp8 grouped GEMM.
            The gradient of ``x`` is bf16 either way.
    Returns:
        ``(permuted (P, D) like x, permuted_indices (P,) int32, group_offsets (E_local,) int32)``;
        ``group_offsets`` is the ``offs`` of ``torch._grouped_mm``. With a layout, when ``x``
        is :func:`a2a_dispatch`'s output on it with an MXFP8 ``grad_precision``, the backward
        hands the dispatch its permuted gradient to quantize in place (no bf16 rows written in
        received order; the same bits, docs/design.md).
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
    if out_format is not None:
        get_format(out_format, "out_format")
    layout = num_tokens_per_expert_group if isinstance(num_tokens_per_expert_group,
                                                      _layout.Layout) else None
    return _Permute.apply(x, num_tokens_per_expert_group, num_local_experts, align, out_format,
                          _folds_into_dispatch(x, layout))


def unpermute(y, permuted_indices, num_rows, *, grad_format=None):
    """Step 4, differentiable: (P, H) -> (num_rows, H) in received order.

    ``num_rows`` is N, or the layout whose permute made ``permuted_indices`` (its
    ``num_received``; its indices name every received row once, so the result needs no
    zero fill: one pass less). ``grad_format``: None, or a format the backward converts a
    quantized gradient to in its gather, as :func:`permute`'s ``out_format`` does: ``"bf16"``
    gives the bf16 grouped GEMM's backward plain bf16 rows, with no separate dequantize pass.

    Raises:
        ValueError: ``grad_format`` is not a format.
    """
    if grad_format is not None:
        get_format(grad_format, "grad_format")
    return _Unpermute.apply(y, permuted_indices, num_rows, grad_format)


def a2a_combine(y, input_splits=None, output_splits=None, comm=None, precision="bf16",
                grad_precision="mxfp8", *, layout=None, permute_align=None):
    """Step 5, differentiable: (N, H) -> (M, H); splits (or the layout) as given to
    :func:`a2a_dispatch`.

    The gradient of ``y`` is a QuantizedTensor of ``grad_precision`` when that is a quantized
    format (an MXFP8Tensor for ``"mxfp8"``).

    ``permute_align=A`` (with the layout): steps 4 and 5 in one, bit for bit ``a2a_combine(
    unpermute(y, permuted_indices, layout), layout, ...)`` with ``permuted_indices`` the
    layout's for ``align=A``: ``y`` is the permuted (P, H) rows (padding rows ignored), and the
    gradient of ``y`` comes back permuted (padding rows zero with the format's padding scale),
    scattered straight from where it arrives when ``grad_precision`` is quantized (no separate
    unpermute backward pass; docs/design.md). No ``grad_format``: for a conversion, call
    :func:`unpermute` separately.
    """
    _a2a._check_precision(precision)
    _a2a._check_precision(grad_precision, "grad_precision")
    if isinstance(input_splits, _layout.Layout):
        layout, input_splits = input_splits, None
    return _A2ACombine.apply(y, (input_splits, output_splits, comm, precision, grad_precision,
                                layout, permute_align))


# ------------------------------------------------------------------------------------ drop-in
#: The precision that keeps the input's dtype (sent as is, exactly).
_NATIVE = "native"


class _Communicators:
    """The mxcomm communicator of each torch.distributed process group the drop-in is given.

    Built on first use over the group's ranks (``mxcomm.comm.init(group=...)``: collective, so
    every rank of the group makes that first call together, as any collective), then reused;
    after a timeout it stays aborted (its calls raise ``RuntimeError``: start a fresh job). Keys
    are weak: a communicator lives as long as its group. A DeviceMesh maps to its group, so a
    mesh and its group share one communicator.
    """

    def __init__(self):
        import weakref
        self._by_group = weakref.WeakKeyDictionary()

    def get(self, pg):
        """The open communicator of ``pg`` (a ``ProcessGroup``), built if needed."""
        comm = self._by_group.get(pg)
        # Closed (by the caller, on every rank): a new one. Aborted stays: its calls raise.
        if comm is None or comm.closed:
            from .comm import init
            comm = self._by_group[pg] = init(group=pg)
        return comm


_communicators = _Communicators()


def communicator_for(group):
    """The mxcomm communicator the drop-in uses for ``group`` (built on first use, cached).

    Args:
        group: a torch.distributed ``ProcessGroup``, a 1-D ``DeviceMesh`` (its group), an mxcomm
            communicator (returned as is), or None for torch.distributed's default group.
    Returns:
        A communicator over the group's ranks (``mxcomm.comm.init(group=...)``; on a CPU the
        torch host backend, on GPUs NCCL).
    Raises:
        TypeError: ``group`` of another type (the message names what is accepted), or None
            while torch.distributed is not initialized.
        ValueError: a DeviceMesh of more than one dimension, or this process not in the group.
        TimeoutError: the first call, collective, did not complete on every rank in time.
    """
    comm, pg = _resolve_group(group)
    return comm if comm is not None else _communicators.get(pg)


def _resolve_group(group):
    """``(communicator or None, ProcessGroup or None)`` of a drop-in's ``group``; TypeError
    naming what is accepted."""
    from .comm import Communicator
    if isinstance(group, Communicator):
        return group, group.group
    import torch.distributed as dist
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise TypeError("group: None needs an initialized torch.distributed (its default "
                            "group); pass a ProcessGroup, a 1-D DeviceMesh or an mxcomm "
                            "communicator")
        return None, dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return None, group
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group: expected a 1-D DeviceMesh, got one of shape "
                             f"{tuple(group.shape)} (take one dimension: mesh['ep'])")
        return None, group.get_group()
    raise TypeError(f"group: expected a torch.distributed ProcessGroup, a 1-D DeviceMesh or an "
                    f"mxcomm communicator (mxcomm.comm.init), got {type(group).__name__}")


def _splits(splits, name):
    """``splits`` as a list of host ints (torch's lists, tuples or 1-D tensors)."""
    try:
        return [int(s) for s in splits]
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a sequence of ints (rows per rank), got "
                        f"{splits!r}") from None


def _exact_over(comm, input, output_split_sizes, input_split_sizes):
    """torch's semantics on an mxcomm communicator without a torch group (built from MPI): the
    rows' bytes moved exactly, even splits for None; no autograd (integer tensors)."""
    world = comm.size
    rows = input.shape[0]
    if output_split_sizes is None or input_split_sizes is None:
        if rows % world:
            raise ValueError(f"input on rank {comm.rank}: {rows} rows do not split evenly over "
                             f"{world} ranks (None splits)")
        output_split_sizes = input_split_sizes = [rows // world] * world
    x = input.detach().contiguous()
    out = comm.alltoallv(_array(x, "input"), _splits(input_split_sizes, "input_split_sizes"),
                         _splits(output_split_sizes, "output_split_sizes"),
                         stream=_stream(x))
    return _tensor(out)


def all_to_all_single(input, output_split_sizes=None, input_split_sizes=None, group=None,
                      tag="", *, precision="mxfp8"):
    """Drop-in for torch's ``all_to_all_single_autograd(input, output_split_sizes,
    input_split_sizes, group, tag)`` (``torch.distributed._functional_collectives``), with the
    rows in ``precision`` on the wire. Differentiable: the backward is the same exchange with
    the splits swapped, in the same precision.

    Same signature and result as torch's: rows (first-axis slices) of ``input``,
    ``input_split_sizes[r]`` of them to rank r; the result holds ``output_split_sizes[r]`` rows
    from each rank r, in rank order, in ``input``'s dtype and trailing shape. Collective over
    ``group``; with explicit splits the call is checked across ranks first (the vote: one small
    host allgather), so bad splits on any rank raise the same error on every rank.

    Passed through to torch's own collective, unchanged (same result, an
    ``AsyncCollectiveTensor`` as torch returns): integer and bool tensors (e.g. token counts),
    ``None`` splits (even splits), and ``"native"`` where mxcomm's exchange does not take the
    dtype (other than bf16/fp32). With an mxcomm communicator built from MPI (no torch group)
    those move exactly through it instead (no autograd: integer rows).

    Host syncs and collectives: the first call on a group builds its communicator (collective);
    an explicit-splits call votes (one host allgather over the side channel); the exchange itself
    is the communicator's (NCCL on the device, or blocking on the host).

    Args:
        input: (M, ...) tensor, floating point (bf16 or fp32 for a low precision; with D, the
            elements of a row, a multiple of the format's block, 32 for MXFP8) or integer. Read.
        output_split_sizes: W ints, rows received from each rank; or None (with
            ``input_split_sizes`` None) for even splits.
        input_split_sizes: W ints, rows sent to each rank (sum = M); or None.
        group: a torch.distributed ``ProcessGroup``, a 1-D ``DeviceMesh`` (mapped to a cached
            communicator over its ranks, :func:`communicator_for`), an mxcomm communicator, or
            None for torch.distributed's default group.
        tag: passed to torch's collective where it runs; otherwise unused.
        precision: wire format: ``"mxfp8"`` (default), ``"bf16"`` (fp32 rows rounded to bf16),
            ``"native"`` (the input's dtype, exact), or any format of ``mxcomm.formats``.
    Returns:
        (sum(output_split_sizes), ...) tensor of ``input``'s dtype on its device.
    Raises:
        TypeError: ``group`` of another type (the message names ProcessGroup, DeviceMesh and
            mxcomm communicator); a dtype the precision does not take.
        ValueError: an unknown precision; splits of the wrong length, negative or not adding up
            to the rows (same message on every rank); D not a multiple of the format's block.
        TimeoutError: a peer did not arrive within the communicator's timeout.
    """
    comm, pg = _resolve_group(group)
    exact = not (input.is_floating_point() or input.is_complex()) or \
        output_split_sizes is None or input_split_sizes is None or \
        (precision == _NATIVE and (_NATIVE not in _a2a.PRECISIONS or
                                   input.dtype not in (torch.bfloat16, torch.float32)))
    if exact:
        if pg is None:
            return _exact_over(comm, input, output_split_sizes, input_split_sizes)
        from torch.distributed._functional_collectives import all_to_all_single_autograd
        return all_to_all_single_autograd(input, output_split_sizes, input_split_sizes, pg, tag)
    _a2a._check_precision(precision)
    if comm is None:
        comm = _communicators.get(pg)
    output_split_sizes = _splits(output_split_sizes, "output_split_sizes")
    input_split_sizes = _splits(input_split_sizes, "input_split_sizes")
    rows = input if input.dim() == 2 else input.reshape(input.shape[0], -1)
    out = _AllToAllSingle.apply(rows, output_split_sizes, input_split_sizes, comm, precision)
    return out if input.dim() == 2 else out.reshape((out.shape[0],) + tuple(input.shape[1:]))


def all_to_all_single_fn(precision="mxfp8", group=None):
    """A function with the signature of torch's ``all_to_all_single_autograd`` that runs
    :func:`all_to_all_single` in ``precision``: what a caller that takes torch's function (or
    a module that imports it, patched) is given.

    ``fn(input, output_split_sizes=None, input_split_sizes=None, group=None, tag="")``; a call's
    ``group`` wins, else the bound ``group`` (None: torch.distributed's default group).

    Args:
        precision: the wire format of every call (as :func:`all_to_all_single`).
        group: the group used when a call passes none: a ``ProcessGroup``, a 1-D
            ``DeviceMesh``, an mxcomm communicator, or None.
    Raises:
        ValueError: an unknown precision (now, not at the first call).
    Example (torchtitan 0.2.x, in the training script before the model is parallelized)::

        import torchtitan.distributed.expert_parallel as ep
        ep.all_to_all_single_autograd = mxcomm.torch.all_to_all_single_fn("mxfp8")
    """
    if precision != _NATIVE or _NATIVE in _a2a.PRECISIONS:
        _a2a._check_precision(precision)
    bound = group

    def all_to_all_single_autograd(input, output_split_sizes=None, input_split_sizes=None,
                                   group=None, tag=""):
        return all_to_all_single(input, output_split_sizes, input_split_sizes,
                                 bound if group is None else group, tag, precision=precision)

    all_to_all_single_autograd.__doc__ = (f"torch's all_to_all_single_autograd through "
                                          f"mxcomm, {precision!r} on the wire "
                                          f"(mxcomm.torch.all_to_all_single_fn)")
    all_to_all_single_autograd.precision = precision
    return all_to_all_single_autograd


from ._torch_ep import EPHandle, ExpertParallel  # noqa: E402 (it builds on the above)
