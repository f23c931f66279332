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

The MXFP8 exchange is one :meth:`~mxcomm.comm.Communicator.alltoallv_staged`: each peer's rows
are quantized straight into the memory they travel from. On one node (``comm.transport ==
"pull"``) the receivers read the senders' memory (CUDA IPC), so quantizing the rows of later peers
overlaps the transfers. Where the result is dequantized (the combine directions and the drop-in)
the dequantize kernel reads each sender's rows in place over NVLink, on a side stream, with a
quarter of the GPU, as soon as that sender has quantized them; the caller's stream goes on
quantizing with the rest::

    caller stream:  q(r+1) q(r+2) q(r+3) q(r) dq(r)
    side stream:           dq(r-1 over NVLink) .... dq(r-2) .......... dq(r-3) ..........

Where it stays quantized (MXFP8Array results), copy engines pull the rows into the result, peer
after peer, with no SMs taken from the quantize kernels. Elsewhere (``"grouped"``) the rows are
quantized into a staging array, move in one NCCL group (or MPI call), and are then dequantized.
bf16 exchanges are one ``comm.alltoallv`` either way.
"""

import contextlib
import operator

import numpy

from ._array import as_device_array, bfloat16, float32, stream_ptr
from .kernels import array_module, simulated
from .kernels._fp8 import MX_BLOCK
from .mxfp8 import (SCALE_MODES, MXFP8Array, dequantize_mxfp8, launch_dequantize,
                    launch_quantize)

#: Precisions implemented, and those planned (named in the error message).
PRECISIONS = ("bf16", "mxfp8")
PLANNED_PRECISIONS = ("fp8_rowwise", "fp8_block128")
_INPUT_DTYPES = (bfloat16, float32)
#: Grid share of a dequantize reading a peer's rows over NVLink beside the caller's quantize
#: kernels: on an H200 about 2 MB of loads in flight, more than NVLink's bandwidth-delay product;
#: the rest of the SMs stay with the quantize kernels (bench/NOTES.md).
_BESIDE_SHARE = 0.25


class _Streams:
    """The caller's stream: its raw handle, and where CuPy allocates and runs array operations.

    On a GPU ``ExternalStream`` wraps the caller's handle, so torch's or CuPy's current stream
    both work; under the simulator the handle is 0 and work runs in program order. Only this
    class asks which it is.

    Args:
        stream: the caller's stream: None (CuPy's current), a CuPy/torch stream, or an int handle.
    """

    def __init__(self, stream):
        self.caller_ptr = stream_ptr(stream)
        self._caller = None
        if not simulated():
            import cupy
            self._caller = cupy.cuda.ExternalStream(self.caller_ptr)

    def on_caller(self):
        """Context in which CuPy allocates and runs array operations on the caller's stream."""
        return self._caller if self._caller is not None else contextlib.nullcontext()

    def to_host(self, array):
        """``array`` as a NumPy array (a device-to-host copy on a GPU; already there otherwise)."""
        if self._caller is None:
            return numpy.asarray(array)
        return array.get(stream=self._caller)


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


def _vote(x, send_counts, recv_counts, comm, validate, stream, context):
    """Check a bf16 exchange across ranks once, before any data moves.

    A zero-byte stand-in for ``x``'s rows, (M, 0, D) bf16, goes through ``comm.alltoallv``: the
    communicator checks the split lists and the peers' counts, and compares the rows across ranks
    (a peer exchanging MXFP8 describes other rows, so ranks disagreeing on the precision are
    caught too), raising the same error on every rank; nothing moves. The exchange itself then
    skips the check (``validate=False``).

    Args:
        validate: False to skip the check.
        stream: raw handle of the caller's stream.
        context: the call and its splits, prefixed to the communicator's message.
    """
    if not validate:
        return
    stand_in = array_module().empty((x.shape[0], 0, x.shape[1]), dtype=bfloat16)
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


# ---------------------------------------------------------------------------------- the engine
def _context(what):
    """The call and its splits, prefixed to the cross-rank check's messages."""
    function, _, send_name, recv_name = what
    return f"{function}({send_name} sent, {recv_name} received)"


def _exchange(x, send_counts, recv_counts, comm, precision, *, what, dequantize, scale_mode,
              stream, validate):
    """Move rows of ``x`` to the peers in ``precision``; the engine of every public function.

    Args:
        x: (M, D) bf16/fp32 array or MXFP8Array. Read.
        send_counts, recv_counts: W host ints (rows).
        precision: ``"bf16"`` or ``"mxfp8"`` (the wire format).
        what: ``(function, x's name, name of send_counts, name of recv_counts)``, for messages.
        dequantize: False to return the wire format (MXFP8Array or bf16 array); True to return an
            array of ``x``'s dtype (bf16 for an MXFP8Array).
        validate: bf16 only: check counts across ranks first (None: the communicator's
            default). MXFP8 exchanges always check (``alltoallv_staged``).
    Returns:
        (N, D) MXFP8Array or array, N = sum(recv_counts).
    """
    function, name, send_name, recv_name = what
    if validate is None:
        validate = comm.validate
    try:
        precision = _check_precision(precision)
        x = _check_rows(x, name)
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode: expected one of {SCALE_MODES}, got {scale_mode!r}")
        if precision == "mxfp8" and x.shape[1] % MX_BLOCK:
            raise ValueError(f"{name}: D = {x.shape[1]} is not a multiple of the MX block size "
                             f"{MX_BLOCK}")
        send_counts = _check_splits(send_counts, send_name, comm)
        recv_counts = _check_splits(recv_counts, recv_name, comm)
        if sum(send_counts) != x.shape[0]:
            raise ValueError(f"{send_name}: adds up to {sum(send_counts)} rows, but {name} has "
                             f"{x.shape[0]} rows")
    except (TypeError, ValueError) as exc:
        # The peers are about to check the exchange together: join them with the error, so they
        # raise it too instead of waiting for this rank until the timeout.
        if not validate and precision == "bf16":
            raise
        try:
            comm.reject(type(exc)(f"rank {comm.rank}: {exc}"))
        except (TypeError, ValueError) as voted:
            raise type(voted)(f"{_context(what)}: {voted}") from None
    streams = _Streams(stream)
    dequantize = _dtype_of(x) if dequantize else None
    if precision == "bf16":
        _vote(x, send_counts, recv_counts, comm, validate, streams.caller_ptr, _context(what))
        return _exchange_bf16(x, send_counts, recv_counts, comm, streams, dequantize)
    return _exchange_mxfp8(x, send_counts, recv_counts, comm, streams, dequantize, scale_mode,
                           _context(what))


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


def _exchange_mxfp8(x, send_counts, recv_counts, comm, streams, dequantize, scale_mode, context):
    """The MXFP8 exchange (module docstring): quantize into the travelling memory peer by peer;
    dequantize each sender's rows where they are, or collect them still quantized."""
    xp = array_module()
    width = x.shape[1]
    caller = streams.caller_ptr
    recv_rows = sum(recv_counts)
    arrays = (((width,), numpy.uint8), ((width // MX_BLOCK,), numpy.uint8))
    # Reading peers' rows in place runs beside the quantize kernels: leave it its share.
    fill_share = 1.0 - _BESIDE_SHARE if dequantize is not None and comm.transport == "pull" \
        else 1.0

    def fill(peer, begin, end, slots):
        if begin == end:
            return
        data, scales = slots
        if isinstance(x, MXFP8Array):  # already quantized: copy its bits
            data[...] = x.data[begin:end]
            scales[...] = x.scales[begin:end]
        else:
            launch_quantize(x[begin:end], MXFP8Array(data, scales), scale_mode, caller,
                            fill_share)

    def arrived(peer, begin, end, rows, on):
        launch_dequantize(MXFP8Array(*rows), out[begin:end], on,
                          1.0 if on == caller else _BESIDE_SHARE)

    try:
        with streams.on_caller():
            if dequantize is not None:
                out = xp.empty((recv_rows, width), dtype=dequantize)
                comm.alltoallv_staged(arrays, send_counts, recv_counts, fill, arrived=arrived,
                                      direct=True, stream=caller)
                return out
            received = MXFP8Array(xp.empty((recv_rows, width), dtype=numpy.uint8),
                                  xp.empty((recv_rows, width // MX_BLOCK), dtype=numpy.uint8))
            comm.alltoallv_staged(arrays, send_counts, recv_counts, fill,
                                  out=(received.data, received.scales), stream=caller)
            return received
    except (TypeError, ValueError) as exc:  # the cross-rank check: name the call
        raise type(exc)(f"{context}: {exc}") from None


def _dtype_of(x):
    """The dtype a dequantized result of ``x`` takes: ``x``'s, or bf16 for an MXFP8Array."""
    return bfloat16 if isinstance(x, MXFP8Array) else x.dtype


# ------------------------------------------------------------------------------------- public
def a2a_dispatch(x, input_splits, output_splits, comm, precision="mxfp8", *, scale_mode="rceil",
                 stream=None, validate=None):
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
        stream: CUDA stream to enqueue on (None: CuPy's current; ignored on the simulator).
        validate: for ``"bf16"``, check counts across ranks first (None: the communicator's
            default); MXFP8 exchanges always check them (the transport needs every rank's).
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
                     scale_mode=scale_mode, stream=stream, validate=validate)


def a2a_dispatch_backward(grad, input_splits, output_splits, comm, precision="bf16", *,
                          scale_mode="rceil", stream=None, validate=None):
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
                     dequantize=True, scale_mode=scale_mode, stream=stream, validate=validate)


def a2a_combine(y, input_splits, output_splits, comm, precision="bf16", *, scale_mode="rceil",
                stream=None, validate=None):
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
                     dequantize=True, scale_mode=scale_mode, stream=stream, validate=validate)


def a2a_combine_backward(grad, input_splits, output_splits, comm, precision="mxfp8", *,
                         scale_mode="rceil", stream=None, validate=None):
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
                     dequantize=False, scale_mode=scale_mode, stream=stream, validate=validate)


def all_to_all_single(x, output_splits, input_splits, comm, precision="mxfp8", *,
                      scale_mode="rceil", stream=None, validate=None):
    """The drop-in for torch's ``all_to_all_single_autograd``: quantize, exchange, dequantize.

    Argument order as torch's (output splits first). In MXFP8 data and scales travel together,
    overlapped with the quantize and dequantize kernels (module docstring). Its backward is the
    same call with the splits swapped.

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
                     dequantize=True, scale_mode=scale_mode, stream=stream, validate=validate)
