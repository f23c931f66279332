"""How an exchange of rows travels: its route, decided once per signature, and its paths.

A :class:`Route` is made once per signature (:func:`route`); :meth:`Route.path` names the path
for a plan (the same on every rank) and :func:`run` takes it into the arrays :func:`arrays` lists.
The paths, when each is taken and what each buys: docs/design.md, "One route".
"""

import dataclasses
import functools

import numpy

from ._array import bfloat16, float32
from ._driver import LaunchRows, Words, copy_bytes, flat, row_range
from .formats import PER_ROW, QuantizedArray, get_format
from .kernels import array_module
from .mxfp8 import SCALE_MODES
from ._row_moves import pad_rows
from .permutation import GatheredRows, expert_order, permuted_landing

_INPUT_DTYPES = (bfloat16, float32)
#: Grid share of a quantize whose rows copy engines pull: room for the one-thread wait kernel
#: beside it (a full grid would make it, or a quantize block, wait for a whole wave).
PULLED_SHARE = 0.98
#: Grid share of a dequantize reading peers' rows over NVLink beside the caller's quantize: enough
#: loads in flight for NVLink's bandwidth-delay product; 1/2 from 3 ranks on (bench/NOTES.md).
BESIDE_SHARE = 0.25
BESIDE_SHARE_MANY = 0.5


def beside_share(size):
    """The grid share of the dequantize beside the quantize, at ``size`` ranks."""
    return BESIDE_SHARE if size <= 2 else BESIDE_SHARE_MANY


#: Each public function: the name of the rows it takes, the direction it sends, and whether it
#: returns them dequantized (``mxcomm.a2a``'s table).
CALLS = {
    "a2a_dispatch": ("x", "dispatch", False),
    "a2a_dispatch_backward": ("grad", "combine", True),
    "a2a_combine": ("y", "combine", True),
    "a2a_combine_backward": ("grad", "dispatch", False),
    "all_to_all_single": ("x", "dispatch", True),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Route:
    """The route of one signature: ``dispatch`` (the direction), ``dequantize`` (a quantized
    result decoded), ``width`` D, ``row_bytes`` of a plain row, ``kind`` (:func:`kind`),
    ``quantize`` and ``round_trip`` (the format's prepared launches, or None), ``scales_shape`` of
    a quantized row (``(D // block,)`` or ``()``), ``kept`` (a quantized result stays so),
    ``arrays`` (a quantized row as the staged exchange moves it)."""

    fmt: object
    function: str
    dispatch: bool
    dequantize: bool
    dtype: numpy.dtype
    width: int
    scale_mode: str
    row_bytes: int
    kind: str
    quantize: object
    round_trip: object
    scales_shape: tuple
    kept: bool
    arrays: tuple

    def path(self, comm, plan, staged=True):
        """``"alltoallv"``, ``"medium"``, ``"staged"`` (only with ``staged``) or None, for
        ``plan``. The same answer on every rank; no collective."""
        if self.quantize is None:
            return "alltoallv"
        nbytes = plan.largest_peer_rows * self.row_bytes
        if nbytes <= comm.small_exchange_bytes:
            return "alltoallv"
        if self.dequantize:
            return None
        if nbytes <= comm.medium_exchange_bytes:
            return "medium"
        return "staged" if staged else None


def small(comm, rows, row_bytes):
    """Whether a quantized exchange whose largest sender sends ``rows`` plain rows of
    ``row_bytes`` each (``Plan.largest_peer_rows``) is small, so travels unquantized."""
    return rows * row_bytes <= comm.small_exchange_bytes


@functools.lru_cache(maxsize=256)
def kind(function, fmt, width):
    """An exchange in words: the kind the staged exchange's peers compare (and name in errors)."""
    return f"{function} {fmt.name} rows of D = {width}"


@functools.lru_cache(maxsize=256)
def route(function, precision, scale_mode, dtype, width):
    """The :class:`Route` of a signature (LRU-cached), or None where no route takes it (a bad
    argument, or a plain format converting the rows: fp32 in ``"bf16"``). Never raises: the
    engine's checks raise the errors."""
    try:
        fmt = get_format(precision)
    except (TypeError, ValueError):
        return None
    if dtype not in _INPUT_DTYPES or scale_mode not in SCALE_MODES or width % fmt.d_multiple:
        return None
    if not fmt.quantized and numpy.dtype(fmt.element_dtype or dtype) != dtype:
        return None
    _, direction, dequantize = CALLS[function]
    quantize = round_trip = scales_shape = arrays = None
    if fmt.quantized:
        arrays = fmt.row_arrays(width)
        quantize = quantizer(fmt, dtype, width, scale_mode, 1.0)
        if dequantize and dtype == bfloat16:
            round_trip = fmt.round_tripper(width, scale_mode)
        scales_shape = fmt.scales_shape(1, width)[1:]
    return Route(fmt, function, direction == "dispatch", dequantize, dtype, width, scale_mode,
                 width * dtype.itemsize, kind(function, fmt, width), quantize, round_trip,
                 scales_shape, fmt.quantized and not dequantize, arrays)


def choose(function, fmt, scale_mode, comm, plan, x, *, agreed, align):
    """``(path, route or None)`` of the array API's exchange of ``x`` (plain rows, a
    QuantizedArray of ``fmt`` or GatheredRows): the one place a path is chosen, alike on every
    rank. ``agreed``: the plan holds every rank's counts; ``align``: the dispatch direction's
    ``permute_align``. Paths: ``"gathered"`` (:func:`gathered_plain`), a route's (:func:`run`),
    ``"widened"`` (fp32 rows in ``"bf16"``), ``"landed"`` (:func:`landed`), ``"engine"``
    (:func:`staged_quantized`).
    """
    if isinstance(x, GatheredRows) and not fmt.quantized and comm.transport == "pull" and \
            numpy.dtype(fmt.element_dtype or x.dtype) == x.dtype:
        return "gathered", None
    width = x.shape[1]
    if not isinstance(x, QuantizedArray) and (agreed or not fmt.quantized):
        r = route(function, fmt, scale_mode, x.dtype, width)
        path = r.path(comm, plan, staged=align is None) if r is not None else None
        if path is not None:
            return path, r
    if not fmt.quantized:
        return "widened", route(function, fmt, scale_mode, bfloat16, width)
    return ("landed" if align is not None else "engine"), None


@functools.lru_cache(maxsize=256)
def quantizer(fmt, dtype, width, scale_mode, share):
    """``fmt.quantizer(dtype, width, scale_mode, share)``, made once per signature and share."""
    return fmt.quantizer(dtype, width, scale_mode, share)


def arrays(r, path, plan):
    """``((shape, dtype, kind), ...)`` the caller allocates for :func:`run` of ``path``
    (``kind``: ``"rows"``, ``"data"``, ``"scales"``): the result first (data and scales where
    ``r.kept``), then temporaries, all held until :func:`run` returns."""
    n, w = plan.rows_received, r.width
    if r.quantize is None:
        return (((n, w), r.dtype, "rows"),)
    data, scales = r.fmt.element_dtype, r.fmt.scale_dtype
    result = (((n, w), data, "data"), ((n,) + r.scales_shape, scales, "scales"))
    if path == "medium":
        k = plan.rows_sent
        return result + (((k, w), data, "data"), ((k,) + r.scales_shape, scales, "scales"))
    if path == "staged":
        return result
    if r.kept:
        return result + (((n, w), r.dtype, "rows"),)
    return (((n, w), r.dtype, "rows"),) * 2 + (result if r.round_trip is None else ())


def run(r, path, comm, plan, x, stream, buffers):
    """Take ``path`` for the (``plan.rows_sent``, D) rows ``x`` into ``buffers`` (:func:`arrays`'
    list: ``Words`` on a GPU, NumPy arrays on the host), enqueued on the raw ``stream``; no host
    sync. The result is the first of ``buffers`` (two where ``r.kept``)."""
    if path != "staged":
        _PATHS[path](r, comm, plan, x, stream, buffers)
        return
    # plain rows kept quantized: the format's launch, prepared for the signature, produces them
    data, scales = buffers
    per_row = not r.scales_shape
    if per_row:
        scales = _travelling_scales(scales, plan.rows_received)
    share = PULLED_SHARE if comm.transport == "pull" else 1.0
    rows = LaunchRows(x, quantizer(r.fmt, r.dtype, r.width, r.scale_mode, share), r.arrays,
                      r.kind, per_row)
    comm.exchange(rows, plan, out=(data, scales), stream=stream)


def _producer(x, fmt, kind, scale_mode, share):
    """The rows object producing ``x`` in ``fmt`` for a copying staged exchange: a
    :class:`LaunchRows` for plain rows, else a :class:`QuantizedRows`."""
    if isinstance(x, (QuantizedArray, GatheredRows)):
        return QuantizedRows(x, fmt, kind, scale_mode, None, None, share)
    return LaunchRows(x, quantizer(fmt, x.dtype, x.shape[1], scale_mode, share),
                      fmt.row_arrays(x.shape[1]), kind, fmt.scale_block == PER_ROW)


def _travelling_scales(scales, n):
    """Per-row scales (n,) as they travel in the staged exchange: (n, 1)."""
    return Words(scales.ptr, (n, 1), scales.dtype) if type(scales) is Words else \
        scales.reshape(n, 1)


def _alltoallv(r, comm, plan, x, stream, buffers):
    n = plan.rows_received
    if r.quantize is None:
        comm.alltoallv_plan((x,), (buffers[0],), plan, stream)
    elif r.kept:
        data, scales, received = buffers
        comm.alltoallv_plan((x,), (received,), plan, stream)
        r.quantize(received, data, scales, n, stream)
    else:
        out, received = buffers[:2]
        comm.alltoallv_plan((x,), (received,), plan, stream)
        if r.round_trip is not None:
            r.round_trip(received, out, n, stream)
        elif n:
            r.quantize(received, *buffers[2:], n, stream)
            r.fmt.launch_dequantize(r.fmt.view(*buffers[2:]), out, stream)


def _medium(r, comm, plan, x, stream, buffers):
    data, scales, sent, sent_scales = buffers
    r.quantize(x, sent, sent_scales, plan.rows_sent, stream)
    comm.alltoallv_plan((sent, sent_scales), (data, scales), plan, stream)


_PATHS = {"alltoallv": _alltoallv, "medium": _medium}


def staged_kept(x, fmt, plan, comm, stream, scale_mode, kind, data, scales):
    """The staged quantized exchange of ``x`` (plain rows, a QuantizedArray of ``fmt`` or
    GatheredRows) into ``data`` and ``scales`` (kept quantized), enqueued on ``stream``."""
    if fmt.scale_block == PER_ROW:
        scales = _travelling_scales(scales, plan.rows_received)
    share = PULLED_SHARE if comm.transport == "pull" else 1.0
    comm.exchange(_producer(x, fmt, kind, scale_mode, share), plan, out=(data, scales),
                  stream=stream)


class QuantizedRows(LaunchRows):
    """The quantized exchange's rows protocol (``Communicator.exchange``) for any rows: quantize
    (or copy) each peer's rows into the memory they travel from; in place, dequantize each
    sender's rows where they are, and this rank's own through the format's round trip where it
    has one."""

    __slots__ = ("_format", "_out", "_scale_mode", "_caller", "_share")

    def __init__(self, x, fmt, kind, scale_mode, out, caller, share):
        # plain rows: the format's quantize prepared for their signature and this grid share
        quantize = None if isinstance(x, (QuantizedArray, GatheredRows)) else \
            quantizer(fmt, x.dtype, x.shape[1], scale_mode, share)
        super().__init__(x, quantize, fmt.row_arrays(x.shape[1]), kind,
                         fmt.scale_block == PER_ROW)
        self._format = fmt
        self._out = out
        self._scale_mode = scale_mode
        self._caller = caller
        self._share = share

    @property
    def results(self):
        """The arrays the consumer writes, which a transport poisons where the exchange failed."""
        return () if self._out is None else (self._out,)

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
            super().produce(begin, end, slots, stream)

    def consume(self, begin, end, rows, stream):
        # beside the producer on the side stream: the share of the SMs it leaves
        self._format.launch_dequantize(self._rows(*rows), row_range(self._out, begin, end),
                                       stream, 1.0 if stream == self._caller else 1.0 - self._share)

    def keep(self, begin, end, at, slots, stream):
        # the format's one-pass round trip where it has one: nothing written to the slots
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


class GatheredPlainRows:
    """The rows protocol of a pending gather's plain exchange (a ``permute_align`` combine on
    the pull transport): rows gathered straight into the staging peers pull from."""

    __slots__ = ("arrays", "kind", "_x")

    def __init__(self, x, kind):
        self.arrays = (((x.shape[1],), numpy.dtype(x.dtype)),)
        self.kind = kind
        self._x = x

    def produce(self, begin, end, slots, stream):
        self._x.write(begin, end, slots[0], stream, PULLED_SHARE)


def gathered_plain(x, plan, comm, caller, kind, alloc):
    """The plain exchange of the pending gather ``x`` on the pull transport, no pass into
    received order first (docs/design.md, "The expert side of an exchange in permute's order")."""
    with comm.on_stream(caller):
        out = (alloc or array_module().empty)((plan.rows_received, x.shape[1]), x.dtype)
        comm.exchange(GatheredPlainRows(x, kind), plan, out=(out,), stream=caller)
    return out


def staged_quantized(x, fmt, plan, comm, caller, dequantize, scale_mode, kind, alloc):
    """The staged exchange in the quantized ``fmt``: decoded in place (``dequantize``) or kept."""
    xp = array_module()
    width = x.shape[1]
    pull = comm.transport == "pull"
    with comm.on_stream(caller):
        if dequantize:
            dtype = bfloat16 if isinstance(x, QuantizedArray) else x.dtype  # decoded
            out = (alloc or xp.empty)((plan.rows_received, width), dtype)
            share = 1.0 - beside_share(comm.size) if pull else 1.0
            comm.exchange(QuantizedRows(x, fmt, kind, scale_mode, out, caller, share), plan,
                          in_place=True, stream=caller)
            return out
        received = fmt.empty(plan.rows_received, width, alloc)
        staged_kept(x, fmt, plan, comm, caller, scale_mode, kind, received.data,
                    received.scales)
        return received


def landed(x, fmt, plan, comm, caller, scale_mode, kind, alloc, layout, align):
    """The quantized dispatch whose received rows land in permuted order, padding rows zeroed
    first (docs/design.md, "The expert side of an exchange in permute's order"). Returns
    ``permute``'s triple."""
    indices, offsets, _ = expert_order(layout, align, caller)
    p = indices.shape[0]
    with comm.on_stream(caller):
        permuted = fmt.empty(p, x.shape[1], alloc)
        scales = permuted.scales
        dsts = (permuted.data,
                _travelling_scales(scales, p) if fmt.scale_block == PER_ROW else scales)
        pad_rows(dsts, fmt, indices, caller)
        share = PULLED_SHARE if comm.transport == "pull" else 1.0
        comm.exchange(_producer(x, fmt, kind, scale_mode, share), plan, out=dsts,
                      landing=permuted_landing(layout, align), stream=caller)
    return permuted, indices, offsets
