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

Every function takes either explicit splits and a communicator (checked across ranks by a vote,
one small host allgather) or a :class:`~mxcomm.layout.Layout` (checked locally only; no host
collective, no host barrier: the GPUs order themselves, docs/design.md "The layout object").

The MXFP8 exchange is one :meth:`~mxcomm.comm.Communicator.exchange`: each peer's rows are
quantized straight into the memory they travel from. On one node (``comm.transport ==
"pull"``) the receivers read the senders' memory (CUDA IPC), so quantizing the rows of later peers
overlaps the transfers. Where the result is dequantized (the combine directions and the drop-in)
the dequantize kernel reads each sender's rows in place over NVLink, on a side stream, with a
quarter of the GPU, as soon as that sender has quantized them; the caller's stream goes on
quantizing with the rest::

    caller stream:  q(r+1) q(r+2) q(r+3) q+dq(r)
    side stream:           dq(r-1 over NVLink) .... dq(r-2) .......... dq(r-3) ..........

(``q+dq(r)``: the rank's own rows through the format's one-pass round trip where it has one,
MXFP8 of bf16; else quantized into the staging and dequantized from there.)

Every precision argument takes any format of ``mxcomm.formats`` (``PRECISIONS``): the engine reads
the Format object (row arrays, quantize and dequantize launchers) and never branches on its name;
below, "MXFP8" stands for any quantized format. Where it stays quantized (QuantizedArray results),
copy engines pull the rows into the result, peer
after peer, with no SMs taken from the quantize kernels. Elsewhere (``"grouped"``) the rows are
quantized into a staging array, move in one NCCL group (or MPI call), and are then dequantized.
Small quantized exchanges (no rank sending more than ``comm.small_exchange_bytes`` of rows to
its peers; 64 MiB on the GPUs of one node by default) skip all that: the bf16/fp32 rows move in
one ``comm.alltoallv`` as they are and are quantized (or round-tripped) on arrival, the same bits
(every format is row-local; docs/design.md, "Small exchanges travel unquantized"). Every exchange
of rows as they come that is one ``alltoallv`` (plain, or small) or a staged one whose result
stays quantized runs through one :class:`_Direct` call, decided once per signature
(docs/design.md, "Direct calls").
bf16 exchanges are one ``comm.alltoallv`` either way, but for the combine direction of
``permute_align`` on the pull transport: there each peer's rows are gathered out of permute's
order into the staging it pulls from (no pass into received order first).
"""

import functools
import operator

import numpy

from ._array import bfloat16, check_rows, float32
from ._driver import Words, copy_bytes, flat, row_range
from .kernels import array_module
from .formats import PER_ROW, QuantizedArray, format_names, get_format
from .layout import Layout
from .mxfp8 import SCALE_MODES
from .permutation import (GatheredRows, _permute, _unpermute, expert_order, pad_rows,
                          permuted_landing)

#: Every precision a direction accepts: the formats of ``mxcomm.formats``.
PRECISIONS = format_names()
_INPUT_DTYPES = (bfloat16, float32)
#: Grid share of a dequantize reading a peer's rows over NVLink beside the caller's quantize
#: kernels: on an H200 about 2 MB of loads in flight, more than NVLink's bandwidth-delay product;
#: the rest of the SMs stay with the quantize kernels (bench/NOTES.md). Measured best at 2 ranks
#: (H200, H100: 1/4 against 1/8 and 1/2); at 4 ranks, where 3/4 of a rank's rows arrive over
#: NVLink, 1/2 (H100: 2.97 against 3.18 ms at 131072 x 7168), taken from 3 ranks on (unmeasured).
_BESIDE_SHARE = 0.25
_BESIDE_SHARE_MANY = 0.5


def _beside_share(size):
    """The grid share of the dequantize beside the quantize, at ``size`` ranks."""
    return _BESIDE_SHARE if size <= 2 else _BESIDE_SHARE_MANY


#: Grid share of a quantize producing rows that copy engines pull: a little room is left for the
#: one-thread wait kernel the side stream parks beside it (a full persistent grid would make it,
#: or a quantize block, wait for a whole wave).
_PULLED_SHARE = 0.98


# ---------------------------------------------------------------------------------- arguments
def _check_precision(precision, name="precision", rank=None):
    """The :class:`~mxcomm.formats.Format` named ``precision``; else ValueError naming
    ``name`` (and the rank) and listing every format."""
    return get_format(precision, name if rank is None else f"{name} on rank {rank}")


def _check_rows(x, name, rank):
    """``x`` as a 2-D array of rows (bf16 or fp32, C-contiguous), or a QuantizedArray or
    GatheredRows (made by this package from checked arrays) as is."""
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
    """The layout of a call, from ``layout=`` or a Layout passed as ``input_splits``, or None
    for explicit splits (then ``comm`` is required)."""
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
class _QuantizedRows:
    """The quantized exchange's producer and consumer (``mxcomm.comm._staged`` protocol), for any
    quantized format: quantize each peer's rows straight into the memory they travel from (or
    copy their bits if ``x`` is already of the format); dequantize each sender's rows where they
    are (in-place exchanges); this rank's own rows through the format's one-pass round trip
    where it has one (in-place exchanges: ``keep``)."""

    __slots__ = ("arrays", "kind", "_x", "_format", "_out", "_scale_mode", "_caller", "_share",
                 "_quantize")

    def __init__(self, x, fmt, kind, scale_mode, out, caller, share):
        self.arrays = fmt.row_arrays(x.shape[1])
        self.kind = kind
        self._x = x
        self._format = fmt
        self._out = out
        self._scale_mode = scale_mode
        self._caller = caller
        self._share = share
        # plain rows: the format's quantize prepared for their signature and this grid share
        self._quantize = None if isinstance(x, (QuantizedArray, GatheredRows)) else \
            _quantizer(fmt, x.dtype, x.shape[1], scale_mode, share)

    def _rows(self, data, scales):
        """The travelling (data, scales) slots as a QuantizedArray (per-row scales 1-D)."""
        fmt = self._format
        if fmt.scale_block == PER_ROW:
            scales = flat(scales)
        return fmt.view(data, scales)

    def produce(self, begin, end, slots, stream):
        data, scales = slots
        x = self._x
        if isinstance(x, QuantizedArray):  # already of the format: copy its bits
            copy_bytes(data, row_range(x.data, begin, end), stream)
            copy_bytes(scales, row_range(x.scales, begin, end), stream)
        elif isinstance(x, GatheredRows):  # read where they are (the permuted gradient)
            self._format.launch_quantize_gather(x.source, row_range(x.index, begin, end),
                                                self._rows(data, scales), stream, self._share,
                                                self._scale_mode)
        else:
            if self._format.scale_block == PER_ROW:
                scales = flat(scales)
            self._quantize(row_range(x, begin, end), data, scales, end - begin, stream)

    def consume(self, begin, end, rows, stream):
        # beside the producer on the side stream: the share of the SMs it leaves
        self._format.launch_dequantize(self._rows(*rows), row_range(self._out, begin, end),
                                       stream, 1.0 if stream == self._caller else 1.0 - self._share)

    def keep(self, begin, end, at, slots, stream):
        # bf16 rows (read where they are, or through the permuted gradient's index) take the
        # format's round trip where it has one: one pass, nothing written to the slots.
        x, fmt = self._x, self._format
        source, rows = (x.source, row_range(x.index, begin, end)) \
            if isinstance(x, GatheredRows) else (x, None)
        if isinstance(source, QuantizedArray) or not fmt.round_trips(source.dtype):
            self.produce(begin, end, slots, stream)
            self.consume(at, at + end - begin, slots, stream)
            return
        fmt.launch_round_trip(source if rows is not None else row_range(x, begin, end), rows,
                              row_range(self._out, at, at + end - begin), stream, self._share,
                              self._scale_mode)


class _GatheredPlainRows:
    """The plain exchange of rows still to be gathered (``mxcomm.comm._staged`` protocol; the
    combine direction with ``permute_align`` on the pull transport): each peer's rows gathered
    through the inverse permute index straight into the staging the peer pulls from, the own
    rows straight into the result."""

    __slots__ = ("arrays", "kind", "_x")

    def __init__(self, x, kind):
        self.arrays = (((x.shape[1],), numpy.dtype(x.dtype)),)
        self.kind = kind
        self._x = x

    def produce(self, begin, end, slots, stream):
        self._x.write(begin, end, slots[0], stream, _PULLED_SHARE)


class _Direct:
    """An exchange of rows as they come that one call runs (docs/design.md, "Direct calls"): one
    ``alltoallv`` of the rows as they are (a plain format, or a quantized exchange small enough
    to travel unquantized), or, for a quantized exchange whose result stays quantized, one
    ``alltoallv`` of the quantized rows (a medium exchange) or a staged exchange (larger), for
    one signature: function, format, scale mode, input dtype and row width. Made once per
    signature (:func:`_direct`), with its launches prepared for the signature
    (``Format.quantizer`` / ``Format.round_tripper``); row counts come with each call's plan.

    Attributes:
        fmt: the Format; dispatch: True in the dispatch direction (the layout's dispatch plan);
        dequantize: whether a quantized format's result is decoded back (round trip);
        dtype: the rows' dtype (the wire's); width: D; row_bytes: bytes of one row as it travels;
        kind: the exchange in words (the staged exchange's kind: peers compare it).

    Calling it, ``direct(comm, plan, x, stream, empty)``: ``x`` the (``plan.rows_sent``, D) rows
    (checked by the caller: C-contiguous, the signature's dtype and width, aligned) as a buffer
    the communicator and the launches take (a ``Words`` or CuPy array on a GPU, a NumPy array on
    the host); ``empty(shape, dtype, kind)`` -> ``(result, buffer)``: a new array as returned to
    the caller and as handed to the communicator and the launches (the same array for the array
    API, a torch tensor and its address for ``mxcomm.torch``), ``kind`` saying which result it
    is: ``"rows"`` (rows of ``dtype``), ``"data"`` or ``"scales"`` (a quantized result's arrays,
    of the format's dtypes). Returns the result, or ``(data, scales)`` results of a quantized
    format kept quantized. Enqueued on ``stream``; no host synchronization. Only for the
    exchanges :meth:`runs` names.
    """

    __slots__ = ("fmt", "dispatch", "dequantize", "dtype", "width", "row_bytes", "kind",
                 "_scale_mode", "_quantize", "_round_trip", "_scales_shape")

    def __init__(self, fmt, function, dispatch, dequantize, dtype, width, scale_mode):
        self.fmt, self.dispatch, self.dequantize = fmt, dispatch, dequantize
        self.dtype, self.width = dtype, width
        self.row_bytes = width * dtype.itemsize
        self.kind = _kind(function, fmt, width)
        self._scale_mode = scale_mode
        self._quantize = self._round_trip = self._scales_shape = None
        if fmt.quantized:  # the launches prepared for this signature
            self._quantize = _quantizer(fmt, dtype, width, scale_mode, 1.0)
            if dequantize and dtype == bfloat16:
                self._round_trip = fmt.round_tripper(width, scale_mode)
            self._scales_shape = fmt.scales_shape(1, width)[1:]  # a row's: (D // block,) or ()

    def runs(self, comm, plan, staged=True):
        """Whether this call runs the exchange of ``plan``: one ``alltoallv`` (a plain format,
        a quantized exchange small enough to travel unquantized, or a medium one whose result
        stays quantized), or with ``staged`` a staged quantized exchange whose result stays
        quantized. The same answer on every rank."""
        if self._quantize is None or comm.small_exchange(plan.largest_peer_rows, self.row_bytes):
            return True
        if self.dequantize:
            return False
        return staged or comm.medium_exchange(plan.largest_peer_rows, self.row_bytes)

    def __call__(self, comm, plan, x, stream, empty):
        # Every array allocated here stays referenced until the launches that use it are
        # enqueued: an allocator may hand a freed array's memory to the next request at once
        # (freed in stream order, it is safe for work enqueued later on `stream`).
        n, width, dtype, fmt = plan.rows_received, self.width, self.dtype, self.fmt
        if self._quantize is not None and not self.dequantize and \
                not comm.small_exchange(plan.largest_peer_rows, self.row_bytes):
            data, scales, buffers = self._quantized(n, empty)
            if comm.medium_exchange(plan.largest_peer_rows, self.row_bytes):
                # medium: every row quantized here, then one alltoallv of data and scales
                m = plan.rows_sent
                sent, sent_scales, quantized = self._quantized(m, empty)
                self._quantize(x, *quantized, m, stream)
                comm.alltoallv_plan(quantized, buffers, plan, stream)
            else:  # staged
                _exchange_kept(x, fmt, plan, comm, stream, self._scale_mode, self.kind, *buffers)
            return data, scales
        arrived, received = empty((n, width), dtype, "rows")
        comm.alltoallv_plan((x,), (received,), plan, stream)
        if self._quantize is None:
            return arrived
        if self.dequantize:
            result, out = empty((n, width), dtype, "rows")
            if self._round_trip is not None:
                self._round_trip(received, out, n, stream)
            elif n:
                data, scales, buffers = self._quantized(n, empty)
                self._quantize(received, *buffers, n, stream)
                fmt.launch_dequantize(fmt.view(*buffers), out, stream)
            return result
        data, scales, buffers = self._quantized(n, empty)
        self._quantize(received, *buffers, n, stream)
        return data, scales

    def _quantized(self, n, empty):
        """A quantized result of ``n`` rows from ``empty``: ``(data, scales, (data buffer,
        scales buffer))``; the caller keeps all four until its launches are enqueued."""
        fmt = self.fmt
        data, data_buffer = empty((n, self.width), fmt.element_dtype, "data")
        scales, scales_buffer = empty((n,) + self._scales_shape, fmt.scale_dtype, "scales")
        return data, scales, (data_buffer, scales_buffer)


@functools.lru_cache(maxsize=256)
def _direct(function, precision, scale_mode, dtype, width):
    """The :class:`_Direct` of a signature, or None where its exchange is never direct: an
    unknown precision or scale mode, rows of another dtype than bf16/fp32, a width the format
    cannot take, or a plain format that converts the rows on the wire (fp32 in ``"bf16"``).
    Nothing here raises: the engine's path raises the errors."""
    try:
        fmt = get_format(precision)
    except (TypeError, ValueError):
        return None
    if dtype not in _INPUT_DTYPES or scale_mode not in SCALE_MODES or width % fmt.d_multiple:
        return None
    if not fmt.quantized and numpy.dtype(fmt.element_dtype or dtype) != dtype:
        return None
    _, direction, dequantize = _CALLS[function]
    return _Direct(fmt, function, direction == "dispatch", dequantize, dtype, width, scale_mode)


@functools.lru_cache(maxsize=256)
def _quantizer(fmt, dtype, width, scale_mode, share):
    """``fmt.quantizer(dtype, width, scale_mode, share)``, made once per signature and share
    (the staged exchange's producer asks on every call)."""
    return fmt.quantizer(dtype, width, scale_mode, share)


def _kind(function, fmt, width):
    """An exchange in words: the kind the staged exchange's peers compare (and name in errors)."""
    return f"{function} {fmt.name} rows of D = {width}"


def _exchange(x, input_splits, output_splits, comm, precision, layout, *, function, name,
              direction, dequantize, scale_mode, stream, validate, alloc, permute_align=None):
    """Move rows of ``x`` to the peers in ``precision``; the engine of every public function.

    Args:
        x: (M, D) bf16/fp32 array or QuantizedArray. Read.
        input_splits, output_splits, comm, layout: as the public functions take them.
        precision: a format name (``mxcomm.formats``) or Format.
        function, name: the public function and ``x``'s name, for messages.
        direction: ``"dispatch"`` (send input_splits) or ``"combine"`` (send output_splits).
        dequantize: False to return the wire format (a QuantizedArray, or an array of the
            format's dtype); True to return an array of ``x``'s dtype (bf16 for a QuantizedArray).
        validate: explicit splits only: check across ranks first (None: the communicator's).
        alloc: ``alloc(shape, dtype)`` -> a new array for the results, or None for the array
            module's ``empty`` (``mxcomm.torch`` hands in torch's allocator).
        permute_align: None, or (layout only) the expert side in ``permute``'s order for this
            align (docs/design.md, "The expert side of an exchange in permute's order"): the
            dispatch direction returns ``permute``'s triple, the combine direction reads ``x``
            as the permuted rows (P, D).
    Returns:
        (N, D) QuantizedArray or array; with ``permute_align`` in the dispatch direction,
        ``(permuted (P, D), permuted_indices (P,), group_offsets (E_local,))``.
    """
    layout, comm = _resolve(input_splits, output_splits, comm, layout, function)
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
            permute_align = _check_align(permute_align, rank)
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
        if layout is not None:  # counted, as the peers count this call: a later one of this
            # rank does not pair with it unnoticed (``HostCommunicator.alltoallv_plan``)
            (layout.dispatch_plan if direction == "dispatch" else layout.combine_plan).calls += 1
            raise type(exc)(f"{function}: {exc}") from None
        error = exc
    if layout is None:
        # The vote: every rank raises the same error if any rank's call is bad; else every
        # rank learns every rank's counts (the pull transport reads them).
        description = "" if error is not None else \
            f"precision {fmt.name!r}, D = {width}, {_dtype_name(x)} rows"
        plan = comm.check(send_counts, recv_counts, description, error=error, validate=validate,
                          what=function)
    caller = comm._stream_ptr(stream)
    if permute_align is not None and direction == "combine":  # x permuted: received order
        indices, _, inverse = expert_order(layout, permute_align, caller)
        with comm._on_stream(caller):
            x = _unpermute(x, indices, layout, caller, alloc) if isinstance(x, QuantizedArray) \
                else GatheredRows(x, inverse)
    if isinstance(x, QuantizedArray) and x.format is not fmt:  # another format: via bf16
        x = x.dequantize(bfloat16, stream=caller)
    # plain rows still to be gathered: gathered into the staging, where the pull transport
    # moves them and the wire is their dtype
    staged_gather = (isinstance(x, GatheredRows) and not fmt.quantized and
                     comm.transport == "pull" and numpy.dtype(fmt.element_dtype or x.dtype) ==
                     x.dtype)
    if isinstance(x, GatheredRows) and not staged_gather and \
            not (fmt.quantized and fmt.quantizes_gathered(x.dtype)):
        with comm._on_stream(caller):  # gathered where the format cannot read them in place
            x = x.materialize(caller, alloc)
    agreed = plan is not None  # every rank's counts: ranks choose the small path alike
    if plan is None:  # validate=False on explicit splits: the peers' counts are not known
        if fmt.quantized and comm.transport == "pull":
            raise ValueError(f"validate=False on rank {rank}: the pull transport needs every "
                             f"rank's counts; pass a layout (no vote) or validate")
        plan = _local_plan(comm, send_counts, recv_counts)
    kind = _kind(function, fmt, width)
    if staged_gather:
        return _exchange_gathered_plain(x, plan, comm, caller, kind, alloc)
    align = permute_align if direction == "dispatch" else None
    if not isinstance(x, QuantizedArray):
        # one alltoallv of the rows as they are (a plain format, or a small quantized exchange,
        # which the ranks choose alike only from every rank's counts), or a staged quantized
        # exchange kept quantized (not with permute_align: that one lands in permuted order)
        direct = _direct(function, fmt, scale_mode, x.dtype, width)
        if direct is not None and (agreed or not fmt.quantized) and \
                direct.runs(comm, plan, staged=align is None):
            return _run_direct(direct, x, comm, plan, caller, alloc, layout, align)
    if not fmt.quantized:  # fp32 rows in "bf16": rounded to it, moved, widened back
        with comm._on_stream(caller):
            out = _run_direct(_direct(function, fmt, scale_mode, bfloat16, width),
                              _f32_to_bf16(x), comm, plan, caller, alloc, layout, align)
            return _bf16_to_f32(out) if dequantize else out
    if permute_align is not None and direction == "dispatch":
        return _exchange_permuted(x, fmt, plan, comm, caller, scale_mode, kind, alloc, layout,
                                  permute_align)
    return _exchange_quantized(x, fmt, plan, comm, caller, dequantize, scale_mode, kind, alloc)


def _check_align(align, rank):
    """``align`` as a positive int; else TypeError/ValueError naming the rank."""
    try:
        value = operator.index(align)
    except TypeError:
        raise TypeError(f"permute_align on rank {rank}: expected an int (rows), got "
                        f"{align!r}") from None
    if value < 1:
        raise ValueError(f"permute_align on rank {rank}: expected a positive int, got {value}")
    return value


def _local_plan(comm, send_counts, recv_counts):
    """A plan of this rank's counts only (``validate=False``: the peers' are not known): enough
    for a plain exchange and the grouped transport, not for the pull transport."""
    from .comm._staged import Plan
    sent = [[0] * comm.size for _ in range(comm.size)]
    sent[comm.rank] = list(send_counts)
    for peer, n in enumerate(recv_counts):
        sent[peer][comm.rank] = n
    return Plan(comm.rank, sent)


def _dtype_name(x):
    return x.format.name.upper() if isinstance(x, QuantizedArray) else x.dtype.name


def _exchange_gathered_plain(x, plan, comm, caller, kind, alloc):
    """The plain exchange of the pending gather ``x`` (``GatheredRows``) on the pull transport
    (docs/design.md, "The expert side of an exchange in permute's order"): each peer's rows
    gathered into the staging it pulls from, copy engines pulling them in pieces, the own rows
    gathered straight into the result; no pass into received order first."""
    with comm._on_stream(caller):
        out = (alloc or array_module().empty)((plan.rows_received, x.shape[1]), x.dtype)
        comm.exchange(_GatheredPlainRows(x, kind), plan, out=(out,), stream=caller)
    return out


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


def _run_direct(direct, x, comm, plan, caller, alloc, layout=None, align=None):
    """The :class:`_Direct` exchange of the array ``x`` (rows of a pending gather gathered
    first) on the caller's stream, results from ``alloc`` (or the array module's ``empty``);
    quantized results as a QuantizedArray; with ``align`` (the dispatch direction's
    ``permute_align``), then the permute's gather: ``permute``'s triple."""
    make = alloc or array_module().empty

    def empty(shape, dtype, kind):
        a = make(shape, dtype)
        return a, a

    with comm._on_stream(caller):
        if isinstance(x, GatheredRows):
            x = x.materialize(caller, alloc)
        out = direct(comm, plan, x, caller, empty)
        if type(out) is tuple:
            out = direct.fmt.view(*out)
        if align is None:
            return out
        # NCCL leaves no place to scatter into: the permute's gather after
        return _permute(out, layout, None, align, None, caller, alloc)


def _exchange_quantized(x, fmt, plan, comm, caller, dequantize, scale_mode, kind, alloc):
    """The quantized exchange (module docstring), for the quantized format ``fmt``: quantize into
    the travelling memory peer by peer; dequantize each sender's rows where they are, or collect
    them still quantized."""
    xp = array_module()
    width = x.shape[1]
    pull = comm.transport == "pull"
    with comm._on_stream(caller):
        if dequantize:
            out = (alloc or xp.empty)((plan.rows_received, width), _dtype_of(x))
            share = 1.0 - _beside_share(comm.size) if pull else 1.0
            comm.exchange(_QuantizedRows(x, fmt, kind, scale_mode, out, caller, share), plan,
                          in_place=True, stream=caller)
            return out
        received = fmt.empty(plan.rows_received, width, alloc)
        _exchange_kept(x, fmt, plan, comm, caller, scale_mode, kind, received.data,
                       received.scales)
        return received


def _exchange_kept(x, fmt, plan, comm, stream, scale_mode, kind, data, scales):
    """The staged quantized exchange of ``x`` (plain rows, rows of ``fmt`` or a pending
    gather) whose result stays quantized: the received rows land in ``data`` and ``scales``
    (``plan.rows_received`` rows, the format's shapes; CuPy or NumPy arrays, or ``Words``), the
    copy engines pulling them where the transport is ``"pull"``. Enqueued on ``stream``."""
    if fmt.scale_block == PER_ROW:  # per-row scales travel as (rows, 1)
        n = plan.rows_received
        scales = Words(scales.ptr, (n, 1), scales.dtype) if type(scales) is Words else \
            scales.reshape(n, 1)
    share = _PULLED_SHARE if comm.transport == "pull" else 1.0
    comm.exchange(_QuantizedRows(x, fmt, kind, scale_mode, None, stream, share), plan,
                  out=(data, scales), stream=stream)


def _exchange_permuted(x, fmt, plan, comm, caller, scale_mode, kind, alloc, layout, align):
    """The quantized exchange in the dispatch direction whose received rows land in permuted
    order (docs/design.md, "The expert side of an exchange in permute's order"): each
    (sender, local expert) run of rows copied straight into its permuted rows (the exchange's
    ``landing``: on the pull transport by the copy engines, from the sender's staging; the own
    rows quantized straight into place); the padding rows get zeros and the padding scale
    first. Returns ``permute``'s triple."""
    indices, offsets, _ = expert_order(layout, align, caller)
    p = indices.shape[0]
    with comm._on_stream(caller):
        permuted = fmt.empty(p, x.shape[1], alloc)
        scales = permuted.scales  # per-row scales travel as (rows, 1)
        dsts = (permuted.data, scales.reshape(p, 1) if fmt.scale_block == PER_ROW else scales)
        pad_rows(dsts, fmt, indices, caller)
        share = _PULLED_SHARE if comm.transport == "pull" else 1.0
        comm.exchange(_QuantizedRows(x, fmt, kind, scale_mode, None, caller, share), plan,
                      out=dsts, landing=permuted_landing(layout, align), stream=caller)
    return permuted, indices, offsets


def _dtype_of(x):
    """The dtype a dequantized result of ``x`` takes: ``x``'s, or bf16 for a QuantizedArray."""
    return bfloat16 if isinstance(x, QuantizedArray) else x.dtype


# ------------------------------------------------------------------------------------- public
#: Each public function: the name of the rows it takes, the direction it sends, and whether it
#: returns them dequantized (module docstring's table).
_CALLS = {
    "a2a_dispatch": ("x", "dispatch", False),
    "a2a_dispatch_backward": ("grad", "combine", True),
    "a2a_combine": ("y", "combine", True),
    "a2a_combine_backward": ("grad", "dispatch", False),
    "all_to_all_single": ("x", "dispatch", True),
}


def _call(function, x, input_splits, output_splits, comm, precision, layout=None, *,
          scale_mode="rceil", stream=None, validate=None, alloc=None, permute_align=None):
    """The public ``function`` (a key of ``_CALLS``), with the engine's ``alloc`` (the torch
    adapters pass torch's allocator)."""
    name, direction, dequantize = _CALLS[function]
    return _exchange(x, input_splits, output_splits, comm, precision, layout, function=function,
                     name=name, direction=direction, dequantize=dequantize,
                     scale_mode=scale_mode, stream=stream, validate=validate, alloc=alloc,
                     permute_align=permute_align)


_COMMON_ARGS = """
        comm: a communicator (``mxcomm.comm.init()``); with a layout, None or the layout's.
            A quantized exchange in which no rank sends more than its ``small_exchange_bytes``
            of rows to its peers moves them unquantized, in one ``alltoallv``, and quantizes
            them on arrival: the same results, bf16 bytes on the wire.
        scale_mode: ``"rceil"`` or ``"floor"`` (MXFP8 scale rounding, docs/design.md); the
            other formats fix their own scaling and ignore it.
        stream: CUDA stream to enqueue on (None: CuPy's current; ignored on the host). The rows
            must be ready on it: work that wrote them on another stream (a copy from the host
            on the null stream, say, which a non-blocking stream does not wait for) must be
            ordered before the call, by an event or a synchronize.
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
            :func:`~mxcomm.permute`'s order for ``align=A`` instead of received order, bit for
            bit as a separate permute / unpermute would leave it, without that pass (on the
            pull transport the copy engines pull each (sender, local expert) run of rows
            straight into its permuted rows, and the bf16 combine gathers each peer's rows into
            the staging it pulls from; docs/design.md, "The expert side of an exchange in
            permute's order"; measured in bench/NOTES.md). The dispatch direction then returns
            ``(permuted (P, D),
            permuted_indices (P,) int32, group_offsets (E_local,) int32)`` as ``permute``
            does; the combine direction takes the permuted (P, D) rows.
    Raises:
        ValueError: a bad precision, shape or split list (with explicit splits: the same message
            on every rank, naming the rank; ranks disagreeing on the precision, D or the counts
            too).
        TypeError: a dtype other than bf16/fp32; a layout and splits both given;
            ``permute_align`` without a layout.
        TimeoutError: a peer did not arrive within ``comm.timeout`` s; the communicator is
            aborted.
        RuntimeError: the communicator is aborted or closed; a peer called a different
            exchange (found on the device, raised by a later call)."""


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
                          validate=None,
                          permute_align=None):
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
                         validate=None,
                         permute_align=None):
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
        and scales
        together), else (N, H) bf16 array.
    """)


def all_to_all_single(x, output_splits, input_splits, comm, precision="mxfp8", *,
                      scale_mode="rceil", stream=None, validate=None):
    """The drop-in for torch's ``all_to_all_single_autograd``: quantize, exchange, dequantize.

    Argument order as torch's (output splits first). In MXFP8 data and scales travel together,
    overlapped with the quantize and dequantize kernels (module docstring). Its backward is the
    same call with the splits swapped. Collective; with explicit splits it checks the call
    across ranks (``validate``), as torch's does not.

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
