"""All-to-all steps of the EP token path on arrays: dispatch, combine, their backwards, the drop-in.

Glossary: M rows sent by this rank, N rows received, D hidden (row width), W ranks (``comm.size``).
Split sizes are host ints counting rows: ``input_splits[r]`` rows this rank sends to rank r in the
dispatch direction, ``output_splits[r]`` rows it receives from rank r (``exchange_layout``).

Directions and default precisions (torchtitan's conventions, docs/design.md "EP semantics")::

    function                 sends            receives         default    returns
    a2a_dispatch             input_splits     output_splits    "mxfp8"    QuantizedArray | array
    a2a_dispatch_backward    output_splits    input_splits     "bf16"     grad's dtype
    a2a_combine              output_splits    input_splits     "bf16"     y's dtype
    a2a_combine_backward     input_splits     output_splits    "mxfp8"    QuantizedArray | array
    all_to_all_single        input_splits     output_splits    "mxfp8"    x's dtype

Every function takes explicit splits and a communicator (checked across ranks by a vote, one
small host allgather) or a :class:`~mxcomm.layout.Layout` (checked locally; no host collective).
The engine reads the Format object, never its name; ``mxcomm.route`` decides how an exchange
travels. docs/design.md, "The layout object", "One route".
"""

import operator

import numpy

from ._array import bfloat16, check_rows, float32
from .kernels import array_module
from .formats import QuantizedArray, format_names, get_format
from .layout import Layout
from .mxfp8 import SCALE_MODES
from .permutation import GatheredRows, _check_int, _permute, _unpermute, expert_order
from .route import CALLS, arrays, choose, gathered_plain, landed, run, staged_quantized
from .route import kind as route_kind

#: Every precision a direction accepts: the formats of ``mxcomm.formats``.
PRECISIONS = format_names()
_INPUT_DTYPES = (bfloat16, float32)
# ---------------------------------------------------------------------------------- arguments
def _check_precision(precision, name="precision", rank=None):
    """The :class:`~mxcomm.formats.Format` named ``precision``; else ValueError naming ``name``."""
    return get_format(precision, name if rank is None else f"{name} on rank {rank}")


def _check_rows(x, name, rank):
    """``x`` checked as (M, D) bf16/fp32 C-contiguous rows; a QuantizedArray or GatheredRows
    (made here from checked arrays) as is."""
    if isinstance(x, (QuantizedArray, GatheredRows)):
        return x
    return check_rows(x, f"{name} on rank {rank}", 1, _INPUT_DTYPES)


def _check_splits(splits, name, comm):
    """``splits`` as a list of ``comm.size`` non-negative host ints."""
    try:
        values = [operator.index(v) for v in splits]
    except TypeError:
        raise TypeError(f"{name} on rank {comm.rank}: expected a sequence of {comm.size} ints "
                        f"(rows per rank), got {splits!r}") from None
    if len(values) != comm.size:
        raise ValueError(f"{name} on rank {comm.rank}: expected {comm.size} entries (one per "
                         f"rank), got {len(values)}")
    if any(v < 0 for v in values):
        raise ValueError(f"{name} on rank {comm.rank}: expected non-negative row counts, got "
                         f"{values}")
    return values


def _resolve(input_splits, output_splits, comm, layout, function):
    """``(layout or None, comm)`` of a call: a Layout from ``layout=`` or ``input_splits``."""
    if isinstance(input_splits, Layout):
        if layout is not None:
            raise TypeError(f"{function}: a layout given twice (as input_splits and layout=)")
        layout, input_splits = input_splits, None
    if layout is not None:
        if not isinstance(layout, Layout):
            raise TypeError(f"{function}: layout: expected a Layout (exchange_layout), got "
                            f"{type(layout).__name__}")
        if input_splits is not None or output_splits is not None:
            raise TypeError(f"{function}: give either a layout or input_splits and "
                            f"output_splits, not both")
        if comm is not None and comm is not layout.comm:
            raise ValueError(f"{function}: comm is not the communicator of the layout")
        return layout, layout.comm
    if comm is None:
        raise TypeError(f"{function}: expected a layout, or input_splits, output_splits and comm")
    return None, comm


# ---------------------------------------------------------------------------------- the engine
def _exchange(x, input_splits, output_splits, comm, precision, layout, *, function, name,
              direction, dequantize, scale_mode, stream, validate, alloc, permute_align=None):
    """The engine of every public function (``_COMMON_ARGS``): check, vote (explicit splits),
    choose the path (``mxcomm.route.choose``), take it. ``alloc(shape, dtype)``: the results'
    allocator (None: the array module's; ``mxcomm.torch`` hands in torch's)."""
    layout, comm = _resolve(input_splits, output_splits, comm, layout, function)
    if layout is not None:  # this call's number, counted as the peers count theirs, failed or
        # not: a later call of this rank does not pair with theirs unnoticed (comm's call tag)
        (layout.dispatch_plan if direction == "dispatch" else layout.combine_plan).calls += 1
    rank = comm.rank
    error = plan = send_counts = recv_counts = None
    try:
        fmt = _check_precision(precision, rank=rank)
        x = _check_rows(x, name, rank)
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode on rank {rank}: expected one of {SCALE_MODES}, got "
                             f"{scale_mode!r}")
        width = x.shape[1]
        fmt.check_input(x.source if isinstance(x, GatheredRows) else x, f"{name} on rank {rank}")
        if permute_align is not None:
            if layout is None:
                raise TypeError(f"permute_align on rank {rank}: needs a layout (the permute "
                                f"order is the layout's)")
            permute_align = _check_int(permute_align, f"permute_align on rank {rank}", 1)
        if layout is not None:
            plan = layout.dispatch_plan if direction == "dispatch" else layout.combine_plan
            send_counts, recv_counts = plan.send_counts, plan.recv_counts
            rows, what = plan.rows_sent, f"sends {plan.rows_sent} in the {direction} direction"
            if permute_align is not None and direction == "combine":
                rows = layout.permuted_rows(permute_align)
                what = f"permutes to {rows} rows for permute_align = {permute_align}"
            if x.shape[0] != rows:
                raise ValueError(f"{name} on rank {rank}: has {x.shape[0]} rows, but the layout "
                                 f"{what}")
        else:
            sends, recvs = ((input_splits, "input_splits"), (output_splits, "output_splits"))
            if direction == "combine":
                sends, recvs = recvs, sends
            send_counts = _check_splits(sends[0], sends[1], comm)
            recv_counts = _check_splits(recvs[0], recvs[1], comm)
            if sum(send_counts) != x.shape[0]:
                raise ValueError(f"{sends[1]} on rank {rank}: adds up to {sum(send_counts)} "
                                 f"rows, but {name} has {x.shape[0]} rows")
    except (TypeError, ValueError) as exc:
        if layout is not None:
            raise type(exc)(f"{function}: {exc}") from None
        error = exc
    if layout is None:
        # the vote: the same error on every rank if any call is bad; else every rank's counts
        description = "" if error is not None else \
            f"precision {fmt.name!r}, D = {width}, {_dtype_name(x)} rows"
        plan = comm.check(send_counts, recv_counts, description, error=error, validate=validate,
                          what=function)
    caller = comm.stream_ptr(stream)
    if permute_align is not None and direction == "combine":  # x permuted: received order
        indices, _, inverse = expert_order(layout, permute_align, caller)
        with comm.on_stream(caller):
            x = _unpermute(x, indices, layout, caller, alloc) if isinstance(x, QuantizedArray) \
                else GatheredRows(x, inverse)
    if isinstance(x, QuantizedArray) and x.format is not fmt:  # another format: via bf16
        with comm.on_stream(caller):  # the bf16 rows from the caller's stream (or alloc)
            x = x.dequantize(bfloat16, stream=caller,
                             out=None if alloc is None else alloc(x.shape, bfloat16))
    agreed = plan is not None  # every rank's counts: ranks choose the small path alike
    if plan is None:  # validate=False on explicit splits: the peers' counts are not known
        if fmt.quantized and comm.transport != "grouped":
            raise ValueError(f"validate=False on rank {rank}: the {comm.transport} transport "
                             f"needs every rank's counts; pass a layout (no vote) or validate")
        plan = _local_plan(comm, send_counts, recv_counts)
    align = permute_align if direction == "dispatch" else None
    path, r = choose(function, fmt, scale_mode, comm, plan, x, agreed=agreed, align=align)
    if isinstance(x, GatheredRows) and path != "gathered" and \
            not (fmt.quantized and fmt.quantizes_gathered(x.dtype)):
        with comm.on_stream(caller):  # gathered where the format cannot read them in place
            x = x.materialize(caller, alloc)
    kind = route_kind(function, fmt, width)
    if path == "gathered":
        return gathered_plain(x, plan, comm, caller, kind, alloc)
    if path == "widened":  # fp32 rows in "bf16": rounded to it, moved, widened back
        with comm.on_stream(caller):
            out = _run_route(r, "alltoallv", _f32_to_bf16(x), comm, plan, caller, alloc, layout,
                             align)
            return _bf16_to_f32(out) if dequantize else out
    if path == "landed":
        return landed(x, fmt, plan, comm, caller, scale_mode, kind, alloc, layout, align)
    if path == "engine":
        return staged_quantized(x, fmt, plan, comm, caller, dequantize, scale_mode, kind, alloc)
    return _run_route(r, path, x, comm, plan, caller, alloc, layout, align)


def _local_plan(comm, send_counts, recv_counts):
    """A plan of this rank's counts only (``validate=False``): enough for a plain exchange and
    the grouped transport, not the pull transport."""
    from .comm import Plan
    sent = [[0] * comm.size for _ in range(comm.size)]
    sent[comm.rank] = list(send_counts)
    for peer, n in enumerate(recv_counts):
        sent[peer][comm.rank] = n
    return Plan(comm.rank, sent)


def _dtype_name(x):
    return x.format.name.upper() if isinstance(x, QuantizedArray) else x.dtype.name


def _f32_to_bf16(x):
    """fp32 -> bf16, round to nearest even, NaN kept quiet, on the bits (CuPy has no bf16 math)."""
    xp = array_module()
    bits = x.view(numpy.uint32)
    rounded = (bits + numpy.uint32(0x7FFF) + ((bits >> 16) & numpy.uint32(1))) >> 16
    nan = (bits & numpy.uint32(0x7FFFFFFF)) > numpy.uint32(0x7F800000)
    rounded = xp.where(nan, (bits >> 16) | numpy.uint32(0x0040), rounded)
    return rounded.astype(numpy.uint16).view(bfloat16)


def _bf16_to_f32(x):
    """bf16 -> fp32 (exact), on the bits."""
    return (x.view(numpy.uint16).astype(numpy.uint32) << 16).view(numpy.float32)


def _run_route(r, path, x, comm, plan, caller, alloc, layout=None, align=None):
    """``mxcomm.route.run`` of ``path`` on the caller's stream, buffers from ``alloc``; a kept
    result as a QuantizedArray; with ``align``, then permuted: ``permute``'s triple."""
    make = alloc or array_module().empty
    with comm.on_stream(caller):
        if isinstance(x, GatheredRows):
            x = x.materialize(caller, alloc)
        buffers = [make(shape, dtype) for shape, dtype, _ in arrays(r, path, plan)]
        run(r, path, comm, plan, x, caller, buffers)
        out = r.fmt.view(*buffers[:2]) if r.kept else buffers[0]
        if align is None:
            return out
        # NCCL leaves no place to scatter into: the permute's gather after
        return _permute(out, layout, None, align, None, caller, alloc)


# ------------------------------------------------------------------------------------- public


def _call(function, x, input_splits, output_splits, comm, precision, layout=None, *,
          scale_mode="rceil", stream=None, validate=None, alloc=None, permute_align=None):
    """The public ``function`` (a key of ``mxcomm.route.CALLS``), with the engine's ``alloc``."""
    name, direction, dequantize = CALLS[function]
    return _exchange(x, input_splits, output_splits, comm, precision, layout, function=function,
                     name=name, direction=direction, dequantize=dequantize,
                     scale_mode=scale_mode, stream=stream, validate=validate, alloc=alloc,
                     permute_align=permute_align)


_COMMON_ARGS = """
        comm: a communicator (``mxcomm.comm.init()``); with a layout, None or the layout's.
        scale_mode: ``"rceil"`` or ``"floor"`` (MXFP8 scale rounding, docs/design.md); the
            other formats fix their own scaling and ignore it.
        stream: CUDA stream to enqueue on (None: CuPy's current; ignored on the host); the
            rows must be ready on it.
        layout: a :class:`~mxcomm.layout.Layout` instead of the splits (it may also be passed
            as the second positional argument). Then the call checks its arguments locally
            only, in O(1), and makes no host collective and no host barrier: a peer that fails
            or skips the call makes this rank's exchange time out (``TimeoutError`` naming it,
            raised by a later call or ``comm.wait`` on a GPU, at once on the host).
        validate: explicit splits only: check the call across ranks first (one small host
            allgather; the same error on every rank). None: the communicator's default. The
            low-precision exchanges need it (or a layout) where ``comm.transport == "pull"``.
        permute_align: None, or (with a layout) an int A: the expert side of the exchange (the
            rows received in the dispatch direction, sent in the combine direction) is in
            :func:`~mxcomm.permute`'s order for ``align=A``, bit for bit as a separate
            permute / unpermute would leave it, without that pass (docs/design.md, "The expert
            side of an exchange in permute's order"). The dispatch direction then returns
            ``permute``'s triple; the combine direction takes the permuted (P, D) rows.
    Raises:
        ValueError: a bad precision, shape or split list (with explicit splits: the same message
            on every rank, naming the rank; ranks disagreeing on the precision, D or the counts
            too).
        TypeError: a dtype other than bf16/fp32; a layout and splits both given;
            ``permute_align`` without a layout.
        TimeoutError: a peer did not arrive within ``comm.timeout`` s; the communicator is
            aborted.
        RuntimeError: the communicator is aborted or closed; a peer called a different
            exchange, or (with a layout) is at another call of it: it failed one alone and
            went on, or uses another layout (found on the device, raised by a later call)."""


def _doc(text):
    return text.replace("{common}", _COMMON_ARGS)


def a2a_dispatch(x, input_splits=None, output_splits=None, comm=None, precision="mxfp8", *,
                 scale_mode="rceil", stream=None, layout=None, validate=None,
                 permute_align=None):
    return _call("a2a_dispatch", x, input_splits, output_splits, comm, precision, layout,
                 scale_mode=scale_mode, stream=stream, validate=validate,
                 permute_align=permute_align)


a2a_dispatch.__doc__ = _doc("""Step 1: send routed token rows to the ranks holding their experts.

    Collective. Received rows are ordered by source rank, then (as each sender sorted them) by
    local expert. No host synchronization.

    Args:
        x: (M, D) bf16/fp32, C-contiguous, rows sorted by global expert; D % 32 == 0 for MXFP8.
            Read.
        input_splits: W host ints, rows sent to each rank (sum = M); or a Layout.
        output_splits: W host ints, rows received from each rank.
        precision: a format name (``PRECISIONS``): a quantized one (``"mxfp8"``,
            ``"fp8_rowwise"``, ``"fp8_block128"``, ``"fp8_block128_pow2"``: data and scales
            travel) or ``"bf16"`` / ``"native"`` (the input's dtype as is).{common}
    Returns:
        (N, D) QuantizedArray of the format (an MXFP8Array for ``"mxfp8"``; still
        quantized), else (N, D) bf16 (``"native"``: ``x``'s dtype) array;
        N = sum(output_splits).
    """)


def a2a_dispatch_backward(grad, input_splits=None, output_splits=None, comm=None,
                          precision="bf16", *, scale_mode="rceil", stream=None, layout=None,
                          validate=None, permute_align=None):
    return _call("a2a_dispatch_backward", grad, input_splits, output_splits, comm, precision,
                 layout, scale_mode=scale_mode, stream=stream, validate=validate,
                 permute_align=permute_align)


a2a_dispatch_backward.__doc__ = _doc("""Backward of :func:`a2a_dispatch`: return the received
    rows' gradient to their senders.

    Combine direction: sends ``output_splits``, receives ``input_splits``.

    Args:
        grad: (N, D) bf16/fp32 array (or QuantizedArray), N = sum(output_splits). Read.
        input_splits, output_splits: as given to :func:`a2a_dispatch` (or a Layout).
        precision: wire format, ``"bf16"`` (default) or any of ``PRECISIONS``.{common}
    Returns:
        (M, D) array of ``grad``'s dtype (bf16 for a QuantizedArray).
    """)


def a2a_combine(y, input_splits=None, output_splits=None, comm=None, precision="bf16", *,
                scale_mode="rceil", stream=None, layout=None, validate=None,
                permute_align=None):
    return _call("a2a_combine", y, input_splits, output_splits, comm, precision, layout,
                 scale_mode=scale_mode, stream=stream, validate=validate,
                 permute_align=permute_align)


a2a_combine.__doc__ = _doc("""Step 5: return expert outputs to the ranks their tokens came from.

    Sends ``output_splits`` rows back, receives ``input_splits`` (splits as given to dispatch).

    Args:
        y: (N, H) bf16/fp32 array (or QuantizedArray), rows in received order (``unpermute``). Read.
        input_splits, output_splits: as given to :func:`a2a_dispatch` (or a Layout).
        precision: wire format, ``"bf16"`` (default) or any of ``PRECISIONS``.{common}
    Returns:
        (M, H) array of ``y``'s dtype (bf16 for a QuantizedArray), rows in the caller's original
        order.
    """)


def a2a_combine_backward(grad, input_splits=None, output_splits=None, comm=None,
                         precision="mxfp8", *, scale_mode="rceil", stream=None, layout=None,
                         validate=None, permute_align=None):
    return _call("a2a_combine_backward", grad, input_splits, output_splits, comm, precision,
                 layout, scale_mode=scale_mode, stream=stream, validate=validate,
                 permute_align=permute_align)


a2a_combine_backward.__doc__ = _doc("""Backward of :func:`a2a_combine`: send the outputs'
    gradient to the experts' ranks.

    Dispatch direction: sends ``input_splits``, receives ``output_splits``.

    Args:
        grad: (M, H) bf16/fp32 array. Read.
        input_splits, output_splits: as given to :func:`a2a_dispatch` (or a Layout).
        precision: wire format, ``"mxfp8"`` (default) or any of ``PRECISIONS``.{common}
    Returns:
        (N, H) QuantizedArray for a quantized format (so ``unpermute_backward`` permutes data
        and scales together), else (N, H) bf16 array.
    """)


def all_to_all_single(x, output_splits, input_splits, comm, precision="mxfp8", *,
                      scale_mode="rceil", stream=None, validate=None):
    """The drop-in for torch's ``all_to_all_single_autograd``: quantize, exchange, dequantize.

    Argument order as torch's (output splits first); its backward is the same call with the
    splits swapped. Collective; it checks the call across ranks (``validate``), as torch's does
    not.

    Args:
        x: (M, D) bf16/fp32, C-contiguous; D % 32 == 0 for MXFP8. Read.
        output_splits: W host ints, rows received from each rank.
        input_splits: W host ints, rows sent to each rank (sum = M).
        comm: a communicator.
        precision: wire format, ``"mxfp8"`` (default) or any of ``PRECISIONS``.
        scale_mode, stream, validate: as :func:`a2a_dispatch`.
    Returns:
        (sum(output_splits), D) array of ``x``'s dtype.
    Raises:
        As :func:`a2a_dispatch`.
    """
    return _call("all_to_all_single", x, input_splits, output_splits, comm, precision,
                 scale_mode=scale_mode, stream=stream, validate=validate)
