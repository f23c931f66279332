"""All-to-all steps of the EP token path on arrays: dispatch, combine, their backwards, the drop-in.

Glossary: M rows sent by this rank, N rows received, D hidden (row width), W ranks (``comm.size``).
Split sizes are host ints counting rows: ``input_splits[r]`` rows this rank sends to rank r in the
dispatch direction, ``output_splits[r]`` rows it receives from rank r (``exchange_layout``).

Directions and default precisions (torchtitan's conventions, DESIGN.md "EP semantics")::

    function                 sends            receives         default    returns
    a2a_dispatch             input_splits     output_splits    "mxfp8"    MXFP8Array | bf16
    a2a_dispatch_backward    output_splits    input_splits     "bf16"     grad's dtype
    a2a_combine              output_splits    input_splits     "bf16"     y's dtype
    a2a_combine_backward     input_splits     output_splits    "mxfp8"    MXFP8Array | bf16
    all_to_all_single        input_splits     output_splits    "mxfp8"    x's dtype

Host time. With ``chunks=1`` (the default) an MXFP8 exchange is one quantize launch, the cross-rank
check of the splits (``_vote``, host MPI, which runs while the device quantizes), one grouped
exchange of data and scales, and one dequantize launch: no side stream, no events.

Overlap (``chunks > 1``). The exchange is pipelined in ``chunks`` pieces: every peer's row segment
is cut into ``chunks`` near-equal pieces; piece k of every segment is quantized on the caller's
stream, a side stream waits for it and exchanges piece k (data and scales in one grouped call, at
offsets into the full buffers), and the caller's stream waits for that exchange and dequantizes the
received rows of piece k (when the result is dequantized). All quantizations are enqueued first, so
quantizing piece k+1 overlaps sending piece k, and dequantizing piece k overlaps sending piece k+1::

    caller stream:  q0 q1 q2 q3 ........ dq0 ...... dq1 ...... dq2 ...... dq3
    side stream:        a2a0 ...... a2a1 ...... a2a2 ...... a2a3 ......

Under the simulator there are no streams: the same code runs in program order (handles are 0).
Counts are checked across ranks once per call (one small vote, ``_vote``); the pieces skip it.
Every rank must pass the same ``chunks``.
"""

import contextlib
import operator

import numpy

from ._array import as_device_array, bfloat16, float32, stream_ptr
from .kernels import array_module, simulated
from .kernels._fp8 import MX_BLOCK
from .mxfp8 import MXFP8Array, dequantize_mxfp8, quantize_mxfp8

#: Pieces the MXFP8 exchange is pipelined in. 1: on 2 and 4 H200s (NVLink) the pipelined
#: exchange measured no faster than one grouped exchange (bench/results/a2a_w*.md).
DEFAULT_CHUNKS = 1
#: Precisions implemented, and those planned (named in the error message).
PRECISIONS = ("bf16", "mxfp8")
PLANNED_PRECISIONS = ("fp8_rowwise", "fp8_block128")
_INPUT_DTYPES = (bfloat16, float32)


class _Streams:
    """The caller's stream, a side stream for the exchange, and events ordering work between them.

    On a GPU these are CuPy streams and events (``ExternalStream`` wraps the caller's handle, so
    torch's or CuPy's current stream both work); under the simulator every handle is 0 and every
    method a no-op, since work there runs in program order. Only this class asks which it is. A
    side stream is cheap to create (no device synchronization), so one is made per call.

    Args:
        stream: the caller's stream: None (CuPy's current), a CuPy/torch stream, or an int handle.
    """

    def __init__(self, stream):
        self.caller_ptr = stream_ptr(stream)
        self._caller = self._side_stream = None
        if not simulated():
            import cupy
            self._cupy = cupy
            self._caller = cupy.cuda.ExternalStream(self.caller_ptr)

    @property
    def _side(self):
        """The side stream, made on first use (only a pipelined exchange needs one)."""
        if self._side_stream is None and self._caller is not None:
            self._side_stream = self._cupy.cuda.Stream(non_blocking=True)
        return self._side_stream

    @property
    def side_ptr(self):
        """Raw handle of the side stream (the caller's under the simulator)."""
        side = self._side
        return self.caller_ptr if side is None else side.ptr

    def on_caller(self):
        """Context in which CuPy allocates and runs array operations on the caller's stream."""
        return self._caller if self._caller is not None else contextlib.nullcontext()

    def caller_event(self):
        """An event marking the work enqueued so far on the caller's stream (None: simulator)."""
        return self._record(self._caller)

    def side_event(self):
        """An event marking the work enqueued so far on the side stream (None: simulator)."""
        return self._record(self._side)

    def side_waits(self, event):
        """Make later side-stream work wait for ``event``."""
        if event is not None:
            self._side.wait_event(event)

    def caller_waits(self, event):
        """Make later caller-stream work wait for ``event``."""
        if event is not None:
            self._caller.wait_event(event)

    def to_host(self, array):
        """``array`` as a NumPy array (a device-to-host copy on a GPU; already there otherwise)."""
        if self._caller is None:
            return numpy.asarray(array)
        return array.get(stream=self._caller)

    def _record(self, stream):
        if stream is None:
            return None
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        return event


# ---------------------------------------------------------------------------------- arguments
def _check_precision(precision, name="precision"):
    """Return ``precision`` if implemented; else ValueError naming the allowed values."""
    if isinstance(precision, str) and precision in PRECISIONS:
        return precision
    allowed = ", ".join(map(repr, PRECISIONS))
    if precision in PLANNED_PRECISIONS:
        raise ValueError(f"{name}: {precision!r} is planned but not implemented yet; expected one "
                         f"of {allowed}")
    raise ValueError(f"{name}: expected one of {allowed}, got {precision!r}")


def _check_rows(x, name):
    """``x`` as a 2-D array of rows (bf16 or fp32, C-contiguous), or an MXFP8Array as is."""
    if isinstance(x, MXFP8Array):
        return x
    x = as_device_array(x, name)
    if x.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D (rows, D) array, got shape {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name}: expected dtype bfloat16 or float32, got {x.dtype}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (rows of a row-major array); "
                         f"got strides {tuple(x.strides)}")
    return x


def _check_chunks(chunks):
    if isinstance(chunks, bool) or not isinstance(chunks, (int, numpy.integer)) or chunks < 1:
        raise ValueError(f"chunks: expected a positive int, got {chunks!r}")
    return int(chunks)


def _vote(x, precision, send_counts, recv_counts, comm, validate, stream, context):
    """Check the whole exchange across ranks once, before any data moves.

    A zero-byte stand-in for ``x``'s rows, (M, 0, D) of the wire dtype (uint8 for ``"mxfp8"``,
    bf16 for ``"bf16"``), goes through ``comm.alltoallv``: the communicator checks the split lists
    (length, sign, sum against M) and the peers' counts, and compares the wire dtype and D across
    ranks (so ranks disagreeing on the precision are caught too), raising the same error on
    every rank (a rank with bad splits does not leave its peers waiting); nothing moves. The pieces of the
    exchange then skip the check (``validate=False``).

    Args:
        stream: raw handle of the caller's stream.
        context: the call and its splits, prefixed to the communicator's message.
    """
    if validate is None:
        validate = comm.validate
    if not validate:
        return
    xp = array_module()
    wire = numpy.uint8 if precision == "mxfp8" else bfloat16  # ranks must agree on the wire format
    stand_in = xp.empty((x.shape[0], 0, x.shape[1]), dtype=wire)
    try:
        comm.alltoallv(stand_in, send_counts, recv_counts, stream=stream, validate=True)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{context}: {exc}") from None


def _check_splits(splits, name, comm):
    """``splits`` as a list of ``comm.size`` non-negative host ints."""
    try:
        values = [operator.index(v) for v in splits]
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of {comm.size} ints (rows per rank), got "
                        f"{splits!r}") from None
    if len(values) != comm.size:
        raise ValueError(f"{name}: expected {comm.size} entries (one per rank), got {len(values)}")
    if any(v < 0 for v in values):
        raise ValueError(f"{name}: expected non-negative row counts, got {values}")
    return values


def _offsets(counts):
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def _piece(counts, offsets, k, chunks):
    """Piece ``k`` of ``chunks`` of every segment: (starts, sizes), W ints each (rows).

    Segment r (``counts[r]`` rows from ``offsets[r]``) is cut at ``counts[r] * j // chunks``: a
    sender and its receiver compute the same cuts from the same count.
    """
    starts = [o + c * k // chunks for c, o in zip(counts, offsets)]
    sizes = [c * (k + 1) // chunks - c * k // chunks for c in counts]
    return starts, sizes


def _row_ranges(starts, sizes):
    """Merged ``(begin, end)`` row ranges covering the non-empty segments (adjacent ones joined)."""
    ranges = []
    for begin, size in sorted(zip(starts, sizes)):
        if size == 0:
            continue
        if ranges and ranges[-1][1] == begin:
            ranges[-1] = (ranges[-1][0], begin + size)
        else:
            ranges.append((begin, begin + size))
    return ranges


# ---------------------------------------------------------------------------------- the engine
def _context(what):
    """The call and its splits, prefixed to the cross-rank check's messages."""
    function, _, send_name, recv_name = what
    return f"{function}({send_name} sent, {recv_name} received)"


def _exchange(x, send_counts, recv_counts, comm, precision, *, what, dequantize, scale_mode,
              stream, chunks, validate):
    """Move rows of ``x`` to the peers in ``precision``; the engine of every public function.

    Args:
        x: (M, D) bf16/fp32 array or MXFP8Array. Read.
        send_counts, recv_counts: W host ints (rows).
        precision: ``"bf16"`` or ``"mxfp8"`` (the wire format).
        what: ``(function, x's name, name of send_counts, name of recv_counts)``, for messages.
        dequantize: False to return the wire format (MXFP8Array or bf16 array); True to return an
            array of ``x``'s dtype (bf16 for an MXFP8Array).
        chunks: pieces of the pipelined MXFP8 exchange.
    Returns:
        (N, D) MXFP8Array or array, N = sum(recv_counts).
    """
    function, name, send_name, recv_name = what
    try:
        precision = _check_precision(precision)
        chunks = _check_chunks(chunks)
        x = _check_rows(x, name)
        if precision == "mxfp8" and x.shape[1] % MX_BLOCK:
            raise ValueError(f"{name}: D = {x.shape[1]} is not a multiple of the MX block size "
                             f"{MX_BLOCK}")
    except (TypeError, ValueError) as exc:
        # The peers are about to check the exchange together: join them with the error, so they
        # raise it too instead of waiting for this rank until the timeout.
        if validate is False or (validate is None and not comm.validate):
            raise
        try:
            comm.reject(type(exc)(f"rank {comm.rank}: {exc}"))
        except (TypeError, ValueError) as voted:
            raise type(voted)(f"{_context(what)}: {voted}") from None
    rows, width = x.shape
    streams = _Streams(stream)

    def vote():
        _vote(x, precision, send_counts, recv_counts, comm, validate, streams.caller_ptr,
              _context(what))
        counts = (_check_splits(send_counts, send_name, comm),
                  _check_splits(recv_counts, recv_name, comm))
        if sum(counts[0]) != rows:
            raise ValueError(f"{send_name}: adds up to {sum(counts[0])} rows, but {name} has "
                             f"{rows} rows")
        return counts

    dequantize = _dtype_of(x) if dequantize else None
    if precision == "bf16":
        return _exchange_bf16(x, *vote(), comm, streams, dequantize)
    return _exchange_mxfp8(x, vote, comm, streams, dequantize, scale_mode, chunks)


def _exchange_bf16(x, send_counts, recv_counts, comm, streams, dequantize):
    """One all-to-all of bf16 rows on the caller's stream (nothing to overlap)."""
    xp = array_module()
    with streams.on_caller():
        if isinstance(x, MXFP8Array):
            x = dequantize_mxfp8(x, bfloat16, stream=streams.caller_ptr)
        elif x.dtype != bfloat16:
            x = _f32_to_bf16(x)
        out = xp.empty((sum(recv_counts), x.shape[1]), dtype=bfloat16)
        comm.alltoallv(x, send_counts, recv_counts, out, stream=streams.caller_ptr,
                       validate=False)
        if dequantize is not None and dequantize != bfloat16:
            out = _bf16_to_f32(out)
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


def _exchange_mxfp8(x, vote, comm, streams, dequantize, scale_mode, chunks):
    """The MXFP8 exchange (module docstring, "Overlap").

    The quantization is launched before ``vote`` runs, so the host's cross-rank check overlaps
    the device's quantization; no data moves before the vote has passed on every rank.

    Args:
        vote: callable checking the exchange across ranks; returns (send_counts, recv_counts).
    """
    xp = array_module()
    quantized = isinstance(x, MXFP8Array)
    rows, width = x.shape
    caller = streams.caller_ptr
    with streams.on_caller():
        if quantized or chunks > 1:
            sent = x if quantized else MXFP8Array(
                xp.empty((rows, width), dtype=numpy.uint8),
                xp.empty((rows, width // MX_BLOCK), dtype=numpy.uint8))
        else:
            sent = quantize_mxfp8(x, scale_mode, stream=caller)
        if chunks == 1 or quantized:
            send_counts, recv_counts = vote()
            pieces = None
        else:
            pieces, send_counts, recv_counts = _pieces(x, sent, vote, scale_mode, chunks, streams)
        recv_rows = sum(recv_counts)
        received = MXFP8Array(xp.empty((recv_rows, width), dtype=numpy.uint8),
                              xp.empty((recv_rows, width // MX_BLOCK), dtype=numpy.uint8))
        out = None if dequantize is None else xp.empty((recv_rows, width), dtype=dequantize)
        if pieces is None:  # one grouped exchange on the caller's stream, then decode it all
            comm.alltoallv((sent.data, sent.scales), send_counts, recv_counts,
                           (received.data, received.scales), stream=caller, validate=False)
            if out is not None:
                dequantize_mxfp8(received, dequantize, out=out, stream=caller)
            return received if out is None else out
        exchanged = []  # one side-stream event per piece
        recv_offsets = _offsets(recv_counts)
        for k, (sizes, starts, quantized_k) in enumerate(pieces):
            streams.side_waits(quantized_k)
            recv_starts, recv_sizes = _piece(recv_counts, recv_offsets, k, chunks)
            comm.alltoallv((sent.data, sent.scales), sizes, recv_sizes,
                           (received.data, received.scales), send_offsets=starts,
                           recv_offsets=recv_starts, stream=streams.side_ptr, validate=False)
            exchanged.append(streams.side_event())
        for k in range(chunks):
            streams.caller_waits(exchanged[k])
            if out is None:
                continue
            recv_starts, recv_sizes = _piece(recv_counts, recv_offsets, k, chunks)
            for begin, end in _row_ranges(recv_starts, recv_sizes):
                dequantize_mxfp8(MXFP8Array(received.data[begin:end],
                                            received.scales[begin:end]),
                                 dequantize, out=out[begin:end], stream=caller)
    # The caller's stream now follows every exchange: later work on it (reusing `sent`'s memory,
    # reading `received`) is ordered after the side stream's reads and writes.
    return received if out is None else out


def _pieces(x, sent, vote, scale_mode, chunks, streams):
    """Vote, then quantize ``x`` into ``sent`` piece by piece, each followed by an event.

    Returns:
        ([(send sizes, send starts, event after the piece's quantization)] per piece,
        send_counts, recv_counts), the splits as voted.
    """
    send_counts, recv_counts = vote()
    offsets = _offsets(send_counts)
    pieces = []
    for k in range(chunks):
        starts, sizes = _piece(send_counts, offsets, k, chunks)
        for begin, end in _row_ranges(starts, sizes):
            quantize_mxfp8(x[begin:end], scale_mode, stream=streams.caller_ptr,
                           out=MXFP8Array(sent.data[begin:end], sent.scales[begin:end]))
        pieces.append((sizes, starts, streams.caller_event()))
    return pieces, send_counts, recv_counts


def _dtype_of(x):
    """The dtype a dequantized result of ``x`` takes: ``x``'s, or bf16 for an MXFP8Array."""
    return bfloat16 if isinstance(x, MXFP8Array) else x.dtype


# ------------------------------------------------------------------------------------- public
def a2a_dispatch(x, input_splits, output_splits, comm, precision="mxfp8", *, scale_mode="rceil",
                 chunks=DEFAULT_CHUNKS, stream=None, validate=None):
    """Step 1: send routed token rows to the ranks holding their experts.

    Collective. Received rows are ordered by source rank, then (as each sender sorted them) by
    local expert. No host synchronization.

    Args:
        x: (M, D) bf16/fp32, C-contiguous, rows sorted by global expert; D % 32 == 0 for MXFP8.
            Read.
        input_splits: W host ints, rows sent to each rank (sum = M).
        output_splits: W host ints, rows received from each rank.
        comm: a communicator (``mxcomm.comm.init()``).
        precision: ``"mxfp8"`` (quantized rows travel: data and scales) or ``"bf16"``.
        scale_mode: ``"rceil"`` or ``"floor"`` (MXFP8 scale rounding, DESIGN.md).
        chunks: pieces the quantize and the exchange are pipelined in (same on every rank).
        stream: CUDA stream to enqueue on (None: CuPy's current; ignored on the simulator).
        validate: check counts across ranks first; None for the communicator's default.
    Returns:
        (N, D) MXFP8Array (still quantized) for ``"mxfp8"``, else (N, D) bf16 array;
        N = sum(output_splits).
    Raises:
        ValueError: a bad precision, shape or split list (same message on every rank for splits).
        TypeError: a dtype other than bf16/fp32.
        TimeoutError: the exchange did not finish within ``comm.timeout`` s.
    """
    return _exchange(x, input_splits, output_splits, comm, precision,
                     what=("a2a_dispatch", "x", "input_splits", "output_splits"), dequantize=False,
                     scale_mode=scale_mode, stream=stream, chunks=chunks, validate=validate)


def a2a_dispatch_backward(grad, input_splits, output_splits, comm, precision="bf16", *,
                          scale_mode="rceil", chunks=DEFAULT_CHUNKS, stream=None, validate=None):
    """Backward of :func:`a2a_dispatch`: return the received rows' gradient to their senders.

    Combine direction: sends ``output_splits``, receives ``input_splits``.

    Args:
        grad: (N, D) bf16/fp32 array (or MXFP8Array), N = sum(output_splits). Read.
        input_splits, output_splits: as given to :func:`a2a_dispatch`.
        precision: wire format, ``"bf16"`` (default) or ``"mxfp8"``.
        Others as :func:`a2a_dispatch`.
    Returns:
        (M, D) array of ``grad``'s dtype (bf16 for an MXFP8Array).
    """
    return _exchange(grad, output_splits, input_splits, comm, precision,
                     what=("a2a_dispatch_backward", "grad", "output_splits", "input_splits"),
                     dequantize=True, scale_mode=scale_mode, stream=stream, chunks=chunks,
                     validate=validate)


def a2a_combine(y, input_splits, output_splits, comm, precision="bf16", *, scale_mode="rceil",
                chunks=DEFAULT_CHUNKS, stream=None, validate=None):
    """Step 5: return expert outputs to the ranks their tokens came from.

    Sends ``output_splits`` rows back, receives ``input_splits`` (splits as given to dispatch).

    Args:
        y: (N, H) bf16/fp32 array (or MXFP8Array), rows in received order (``unpermute``). Read.
        input_splits, output_splits: as given to :func:`a2a_dispatch`.
        precision: wire format, ``"bf16"`` (default) or ``"mxfp8"``.
        Others as :func:`a2a_dispatch`.
    Returns:
        (M, H) array of ``y``'s dtype (bf16 for an MXFP8Array), rows in the caller's original order.
    """
    return _exchange(y, output_splits, input_splits, comm, precision,
                     what=("a2a_combine", "y", "output_splits", "input_splits"),
                     dequantize=True, scale_mode=scale_mode, stream=stream, chunks=chunks,
                     validate=validate)


def a2a_combine_backward(grad, input_splits, output_splits, comm, precision="mxfp8", *,
                         scale_mode="rceil", chunks=DEFAULT_CHUNKS, stream=None, validate=None):
    """Backward of :func:`a2a_combine`: send the outputs' gradient to the experts' ranks.

    Dispatch direction: sends ``input_splits``, receives ``output_splits``.

    Args:
        grad: (M, H) bf16/fp32 array. Read.
        input_splits, output_splits: as given to :func:`a2a_dispatch`.
        precision: wire format, ``"mxfp8"`` (default) or ``"bf16"``.
        Others as :func:`a2a_dispatch`.
    Returns:
        (N, H) MXFP8Array for ``"mxfp8"`` (so ``unpermute_backward`` permutes data and scales
        together), else (N, H) bf16 array.
    """
    return _exchange(grad, input_splits, output_splits, comm, precision,
                     what=("a2a_combine_backward", "grad", "input_splits", "output_splits"),
                     dequantize=False, scale_mode=scale_mode, stream=stream, chunks=chunks,
                     validate=validate)


def all_to_all_single(x, output_splits, input_splits, comm, precision="mxfp8", *,
                      scale_mode="rceil", chunks=DEFAULT_CHUNKS, stream=None, validate=None):
    """The drop-in for torch's ``all_to_all_single_autograd``: quantize, exchange, dequantize.

    Argument order as torch's (output splits first). In MXFP8 data and scales travel together,
    in one grouped exchange (or ``chunks`` pipelined pieces; module docstring). Its backward is
    the same call with the splits swapped.

    Args:
        x: (M, D) bf16/fp32, C-contiguous; D % 32 == 0 for MXFP8. Read.
        output_splits: W host ints, rows received from each rank.
        input_splits: W host ints, rows sent to each rank (sum = M).
        precision: wire format, ``"mxfp8"`` (default) or ``"bf16"``.
        Others as :func:`a2a_dispatch`.
    Returns:
        (sum(output_splits), D) array of ``x``'s dtype.
    """
    return _exchange(x, input_splits, output_splits, comm, precision,
                     what=("all_to_all_single", "x", "input_splits", "output_splits"),
                     dequantize=True, scale_mode=scale_mode, stream=stream, chunks=chunks,
                     validate=validate)
