"""The exchanges (steps 1 and 5) as differentiable torch functions, their custom ops
``mxcomm::exchange`` and ``mxcomm::dequantize`` (what ``torch.compile`` traces; eager calls run
their body, :func:`exchange`, directly) and the communicator of a torch group
(:func:`communicator_for`). An op takes a group as a string key (``"pg:<group_name>"``: a
ProcessGroup; ``"comm:<id>"``: a communicator registered outside the trace), a layout as a (1,)
int64 CPU handle naming it in :data:`_registry`. docs/design.md, "torch.compile and custom ops".
"""

import itertools
import warnings
import weakref

import numpy
import torch

from .. import a2a as _a2a
from .. import route as _route
from .. import layout as _layout
from .._driver import Words
from .._platform import backend
from .._torch_arrays import (_ARRAY_DTYPES, _INT_OF_SIZE, _TORCH_DTYPES, _Alloc, _current_stream,
                             _stream)
from ._quantized import (_DATA_DTYPE, _SCALE_DTYPES, QuantizedTensor, _dequantized,
                         _quantized_tensor)
from ._tensors import _index_tensors, _rows, _wrap

NAMESPACE = "mxcomm"
#: The group key prefixes (module docstring).
_PG, _COMM = "pg:", "comm:"
#: The scale rounding of every exchange made through this package (the array API's default).
_SCALE_MODE = "rceil"
# (kind, array dtype) of an array ``mxcomm.route.arrays`` lists -> its torch dtype
_DIRECT_DTYPES = {("rows", dtype): torch_dtype for dtype, torch_dtype in _TORCH_DTYPES.items()}
_DIRECT_DTYPES.update({("scales", dtype): torch_dtype for dtype, torch_dtype
                       in _SCALE_DTYPES.items()})
_DIRECT_DTYPES["data", numpy.dtype(numpy.uint8)] = _DATA_DTYPE


class LayoutHandle:
    """What :func:`mxcomm.torch.exchange_layout` returns while ``torch.compile`` traces; pass it
    where a layout goes. Attributes: ``handle``, (1,) int64 CPU tensor naming the layout in the
    registry; ``num_local_experts``; ``rows``, M, set by the dispatch made with it, else -1.
    """

    def __init__(self, handle, num_local_experts):
        self.handle = handle
        self.num_local_experts = num_local_experts
        self.rows = -1


class _Registry:
    """The ops' state that is not a tensor: communicators by group key and by process group,
    layouts by handle, the warnings given."""

    def __init__(self):
        self._comms = weakref.WeakValueDictionary()
        self._by_group = weakref.WeakKeyDictionary()
        self._layouts = {}
        self._ids = itertools.count(1)
        self.warned = set()

    def add_layout(self, layout):
        """A new handle for ``layout``: (1,) int64 CPU tensor; the entry lives as long as it."""
        key = next(self._ids)
        handle = torch.tensor([key], dtype=torch.int64)
        self._layouts[key] = layout
        weakref.finalize(handle, self._layouts.pop, key, None)
        return handle

    def layout(self, handle):
        """The layout a handle names; RuntimeError if it is unknown (freed, or not a handle)."""
        key = int(handle.reshape(-1)[0]) if handle.numel() == 1 else None
        layout = self._layouts.get(key)
        if layout is None:
            raise RuntimeError(f"layout: {handle!r} names no live mxcomm layout (a handle comes "
                               f"from mxcomm.torch.exchange_layout inside the same compiled "
                               f"region)")
        return layout

    def register(self, comm):
        """The key of the mxcomm communicator ``comm``, registered."""
        key = f"{_COMM}{id(comm)}"
        self._comms[key] = comm
        return key

    def of_group(self, pg):
        """The open communicator of the ``ProcessGroup`` ``pg``, built on first use (collective)
        and kept as long as the group; an aborted one stays (its calls raise), a closed one is
        rebuilt."""
        comm = self._by_group.get(pg)
        if comm is None or comm.closed:
            from ..comm import init
            comm = self._by_group[pg] = init(group=pg)
        return comm

    def communicator(self, key):
        """The communicator a group key names (module docstring)."""
        if key.startswith(_PG):
            from torch.distributed.distributed_c10d import _resolve_process_group
            return communicator_for(_resolve_process_group(key[len(_PG):]))
        comm = self._comms.get(key)
        if comm is None:
            raise RuntimeError(f"group: {key!r} names no registered mxcomm communicator; a "
                               f"communicator used inside torch.compile must have been used "
                               f"once outside it (or passed to "
                               f"mxcomm.torch.communicator_for) first")
        return comm


_registry = _Registry()


def group_key(group):
    """The string key an op takes for ``group`` (a communicator registered when called outside a
    trace). Raises as :func:`communicator_for`."""
    comm, pg = _resolve_group(group)
    if comm is None:
        return _PG + pg.group_name
    if torch.compiler.is_compiling():
        return f"{_COMM}{id(comm)}"
    return _registry.register(comm)


def communicator_for(group):
    """The mxcomm communicator for ``group`` (built on first use, collectively; cached).

    Args:
        group: a torch.distributed ``ProcessGroup``, a 1-D ``DeviceMesh``, an mxcomm
            communicator (returned as is), or None for torch.distributed's default group.
    Returns:
        A communicator over the group's ranks (NCCL on GPUs, the torch host backend on a CPU),
        registered for the custom ops: one used inside ``torch.compile`` must have passed
        through here (or ``exchange_layout``) outside it first.
    Raises:
        TypeError: ``group`` of another type (the message names what is accepted), or None
            while torch.distributed is not initialized.
        ValueError: a DeviceMesh of more than one dimension, or this process not in the group.
        RuntimeError: called for a group while ``torch.compile`` traces.
        TimeoutError: the first call, collective, did not complete on every rank in time.
    """
    comm, pg = _resolve_group(group)
    if comm is None and torch.compiler.is_compiling():
        raise RuntimeError("communicator_for: a group's communicator cannot be built or looked "
                           "up inside torch.compile; call it outside the compiled region, or "
                           "pass the ProcessGroup itself (mxcomm's ops find its communicator "
                           "when they run)")
    comm = comm if comm is not None else _registry.of_group(pg)
    if not torch.compiler.is_compiling():
        _registry.register(comm)  # so a compiled region's ops find it
    return comm


def _resolve_group(group):
    """``(communicator or None, ProcessGroup or None)`` of ``group``; TypeError otherwise."""
    from ..comm import Communicator
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


# ------------------------------------------------------------------------------------ the ops
@torch.library.custom_op(f"{NAMESPACE}::exchange", mutates_args=())
def _exchange_op(rows: torch.Tensor, layout: torch.Tensor | None, function: str,
                 input_splits: list[int] | None, output_splits: list[int] | None, group: str,
                 precision: str, permute_align: int, out_rows: int, num_local_experts: int,
                 keep_quantized: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One exchange ``function``: ``(rows, scales, permuted_indices, group_offsets)``; with
    ``keep_quantized``, a quantized result's float8_e4m3fn data and scales, else bf16 and (0,)
    scales; index and offsets (0,) int32 unless a permuted dispatch."""
    found = _registry.layout(layout) if layout is not None else None
    comm = None if found is not None else _registry.communicator(group)
    out = exchange(function, rows, input_splits, output_splits, comm, precision, found,
                   permute_align or None)
    if type(out) is tuple:
        # the layout keeps its index tensors for the next call: an op's outputs are its own
        out, indices, offsets = out[0], out[1].clone(), out[2].clone()
    else:
        indices, offsets = (torch.empty(0, dtype=torch.int32, device=rows.device)
                            for _ in range(2))
    scales = rows.new_empty(0)
    if isinstance(out, QuantizedTensor):
        out, scales = (out.qdata, out.scales) if keep_quantized else (_dequantized(out), scales)
    return out, scales, indices, offsets


@_exchange_op.register_fake
def _(rows, layout, function, input_splits, output_splits, group, precision, permute_align,
      out_rows, num_local_experts, keep_quantized):
    _, direction, dequantize = _route.CALLS[function]
    fmt = _a2a._check_precision(precision)
    expert_side = direction == "dispatch"
    if out_rows >= 0:
        n = out_rows
    elif input_splits is not None and output_splits is not None:
        n = sum(output_splits) if expert_side else sum(input_splits)
    else:
        n = torch.library.get_ctx().new_dynamic_size()
    scales = rows.new_empty(0)
    if fmt.quantized and keep_quantized and not dequantize:
        dtype = _DATA_DTYPE
        scales = rows.new_empty(fmt.scales_shape(n, rows.shape[1]),
                                dtype=_SCALE_DTYPES[numpy.dtype(fmt.scale_dtype)])
    elif fmt.quantized:
        dtype = rows.dtype if dequantize else torch.bfloat16
        # warned here, not in the traced Python: dynamo does not trace warnings
        if not dequantize and ("dequantized", precision) not in _registry.warned:
            _registry.warned.add(("dequantized", precision))
            warnings.warn(f"mxcomm: under torch.compile the {precision!r} rows of {function} "
                          f"come back dequantized to bf16 (one pass more than eager, the same "
                          f"values): a QuantizedTensor does not cross a custom op")
    else:
        dtype = rows.dtype if fmt.element_dtype is None else \
            _TORCH_DTYPES.get(numpy.dtype(fmt.element_dtype), rows.dtype)
    out = rows.new_empty((n, rows.shape[1]), dtype=dtype)
    permuted = expert_side and permute_align > 0
    indices = rows.new_empty((n if permuted else 0,), dtype=torch.int32)
    offsets = rows.new_empty((num_local_experts if permuted else 0,), dtype=torch.int32)
    return out, scales, indices, offsets


@torch.library.custom_op(f"{NAMESPACE}::dequantize", mutates_args=())
def _dequantize_op(data: torch.Tensor, scales: torch.Tensor, format: str) -> torch.Tensor:  # noqa: A002
    """(M, D) bf16 values of quantized rows (data float8_e4m3fn, the format's scales)."""
    from ..formats import get_format
    return _dequantized(_quantized_tensor(data, scales, get_format(format)))


@_dequantize_op.register_fake
def _(data, scales, format):  # noqa: A002
    return data.new_empty(data.shape, dtype=torch.bfloat16)


# ---------------------------------------------------------------------- what the steps call
def exchange(function, rows, input_splits, output_splits, comm, precision, layout=None,
             permute_align=None, out_rows=-1):
    """The exchange ``function`` on the tensor ``rows``, for the autograd Functions and the op:
    eager, the direct route or the array API; traced, the op ``mxcomm::exchange`` (only the
    dispatch's rows stay quantized). Returns a tensor, a QuantizedTensor, or permute's triple.
    ``comm``: a communicator, a ProcessGroup, or None with a layout; ``out_rows``: -1 unknown.
    """
    if not torch.compiler.is_compiling():
        if layout is not None and permute_align is None and type(rows) is torch.Tensor and \
                input_splits is None and output_splits is None and comm in (None, layout.comm):
            out = _exchange_direct(function, rows, layout, precision)
            if out is not None:
                return out
        if comm is not None and not hasattr(comm, "alltoallv"):  # a ProcessGroup
            comm = communicator_for(comm)
        return _exchange(function, rows, input_splits, output_splits, comm, precision, layout,
                         permute_align)
    if isinstance(layout, _layout.Layout):
        raise RuntimeError(f"{function}: a layout made outside torch.compile cannot be used "
                           f"inside it; call mxcomm.torch.exchange_layout inside the compiled "
                           f"region")
    # a QuantizedTensor input goes in as is: its dispatch hands the op its dequantized values
    fmt = _a2a._check_precision(precision)
    keep = fmt.quantized and function == "a2a_dispatch"
    out, scales, indices, offsets = torch.ops.mxcomm.exchange(
        rows, None if layout is None else layout.handle, function,
        None if input_splits is None else list(input_splits),
        None if output_splits is None else list(output_splits),
        "" if layout is not None else group_key(comm), precision, permute_align or 0,
        out_rows, 0 if layout is None else layout.num_local_experts, keep)
    if keep:
        out = QuantizedTensor(out, scales, fmt.name)
    if permute_align and _route.CALLS[function][1] == "dispatch":
        return out, indices, offsets
    return out


def _exchange(function, rows, input_splits, output_splits, comm, precision, layout,
              permute_align):
    """The array API's ``function`` on the tensor ``rows``, on torch's current stream, results
    allocated by torch: a tensor, or ``permute``'s triple of tensors."""
    alloc = _Alloc(rows.device)
    result = _a2a._call(function, _rows(rows, _route.CALLS[function][0]), input_splits,
                        output_splits, comm, precision, layout, stream=_stream(rows), alloc=alloc,
                        permute_align=permute_align)
    if type(result) is tuple:
        permuted, indices, offsets = result
        return (_wrap(permuted, alloc),) + _index_tensors(layout, permute_align, indices, offsets,
                                                          alloc)
    return _wrap(result, alloc)


def _exchange_direct(function, t, layout, precision):
    """The exchange of the plain tensor ``t`` given ``layout`` on its route, ``t`` passed by its
    address after O(1) checks; None where the array API must take it (docs/design.md, "One
    route")."""
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
    if shape[0] != plan.rows_sent or cuda != (backend() == "cuda") or not t.is_contiguous():
        return None
    # the path and the arrays it needs are fixed by the route and the layout: worked out once
    taken = layout._cache.get(r)
    if taken is None:
        path = r.path(comm, plan)
        taken = layout._cache[r] = (path, path and _route.arrays(r, path, plan))
    path, specs = taken
    if path is None:
        return None
    device = t.device
    if cuda:
        ptr = t.data_ptr()
        if ptr % r.fmt.input_align:
            return None
        x = Words(ptr, (plan.rows_sent, r.width), dtype)
        stream = _current_stream(device)  # a raw handle: what comm.stream_ptr makes of it
    else:  # as _view does
        x = t.view(_INT_OF_SIZE[t.element_size()]).numpy().view(dtype)
        stream = 0  # the host backends' stream
    plan.calls += 1  # this call's number, as the engine counts it (comm's call tag)
    tensors, buffers = [], []
    for shape, dtype, kind in specs:
        made = torch.empty(shape, dtype=_DIRECT_DTYPES[kind, dtype], device=device)
        tensors.append(made)
        buffers.append(Words(made.data_ptr(), shape, dtype) if cuda else
                       made.view(_INT_OF_SIZE[dtype.itemsize]).numpy().view(dtype))
    _route.run(r, path, comm, plan, x, stream, buffers)
    return _quantized_tensor(tensors[0], tensors[1], r.fmt) if r.kept else tensors[0]


# ----------------------------------------------------------- steps 1 and 5, differentiable
class _A2A(torch.autograd.Function):
    """Steps 1 and 5, the dispatch and combine all-to-alls (``function``); each one's backward
    is the other direction's exchange, in ``grad_precision``.

    Forward:  dispatch: x (M, D) bf16 -> (N, D) QuantizedTensor of ``precision`` or a plain
              tensor; with ``permute_align``, ``permute``'s triple (P, D) (the index and offsets
              not differentiable). Combine: y (N, H) bf16, or (P, H) permuted -> (M, H) bf16.
    Backward: dispatch: grad (N, D), or (P, D) permuted -> (M, D) bf16. Combine: grad (M, H)
              bf16 -> (N, H), or (P, H) permuted, a QuantizedTensor of a quantized
              ``grad_precision``, else plain.

    All arguments but the rows travel as one tuple ``call`` (autograd's ``apply`` spends host
    time per argument): (function, input_splits, output_splits, comm, precision,
    grad_precision, layout, permute_align).
    """

    @staticmethod
    def forward(ctx, rows, call):
        function, input_splits, output_splits, comm, precision, _, layout, permute_align = call
        ctx.call, ctx.rows = call, rows.shape[0]
        out_rows = -1
        if type(layout) is LayoutHandle:  # compiled: the combine's result rows, the dispatch's
            if function == "a2a_dispatch":
                layout.rows = rows.shape[0]
            else:
                out_rows = layout.rows
        out = exchange(function, rows, input_splits, output_splits, comm, precision, layout,
                       permute_align, out_rows)
        if type(out) is tuple:
            ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, grad, *index_grads):
        function, input_splits, output_splits, comm, _, grad_precision, layout, permute_align = \
            ctx.call
        out = exchange(function + "_backward", grad, input_splits, output_splits, comm,
                       grad_precision, layout, permute_align, ctx.rows)
        if type(out) is tuple:  # the combine's permuted gradient (the index is the forward's)
            out = out[0]
        return out, None  # None for the call's tuple


def a2a_dispatch(x, input_splits=None, output_splits=None, comm=None, precision="mxfp8",
                 grad_precision="bf16", *, layout=None, permute_align=None):
    """Step 1, differentiable: (M, D) bf16 -> (N, D) MXFP8Tensor (``"mxfp8"``) or bf16.

    Arguments, shapes and errors as :func:`mxcomm.a2a_dispatch`; ``grad_precision`` is the
    backward's wire format. With a layout, no host collective. ``permute_align=A`` (with the
    layout): bit for bit ``permute(a2a_dispatch(x, layout, ...), layout, align=A)``, forward and
    backward, in one pass: returns ``(permuted (P, D), permuted_indices (P,) int32,
    group_offsets (E_local,) int32)``; for an ``out_format``, call :func:`permute` separately.
    Under ``torch.compile``: the op ``mxcomm::exchange``, given the :class:`LayoutHandle` of
    :func:`exchange_layout` there (or splits and a ``comm`` that may be a ProcessGroup).
    """
    if precision not in _a2a.PRECISIONS or grad_precision not in _a2a.PRECISIONS:
        _a2a._check_precision(precision)  # a Format, or an unknown name: ValueError
        _a2a._check_precision(grad_precision, "grad_precision")
    if isinstance(input_splits, (_layout.Layout, LayoutHandle)):
        layout, input_splits = input_splits, None
    return _A2A.apply(x, ("a2a_dispatch", input_splits, output_splits, comm, precision,
                          grad_precision, layout, permute_align))


def a2a_combine(y, input_splits=None, output_splits=None, comm=None, precision="bf16",
                grad_precision="mxfp8", *, layout=None, permute_align=None):
    """Step 5, differentiable: (N, H) -> (M, H); splits (or the layout) as given to
    :func:`a2a_dispatch`. The gradient of ``y`` is a QuantizedTensor of a quantized
    ``grad_precision``. ``permute_align=A`` (with the layout): bit for bit
    ``a2a_combine(unpermute(y, permuted_indices, layout), layout, ...)`` in one pass: ``y`` is
    the permuted (P, H) rows (padding ignored), its gradient permuted (padding rows zero, the
    format's padding scale); for a ``grad_format``, call :func:`unpermute` separately. Under
    ``torch.compile``: as :func:`a2a_dispatch`, the quantized gradient dequantized to bf16
    (warned once).
    """
    if precision not in _a2a.PRECISIONS or grad_precision not in _a2a.PRECISIONS:
        _a2a._check_precision(precision)  # a Format, or an unknown name: ValueError
        _a2a._check_precision(grad_precision, "grad_precision")
    if isinstance(input_splits, (_layout.Layout, LayoutHandle)):
        layout, input_splits = input_splits, None
    return _A2A.apply(y, ("a2a_combine", input_splits, output_splits, comm, precision,
                          grad_precision, layout, permute_align))
