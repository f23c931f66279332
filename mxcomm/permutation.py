"""EP steps 2 and 4: permute received rows into expert-major, ``align``-padded groups, and back.

Glossary: W ranks, E_local experts per rank, E = W * E_local, M_recv received rows, P permuted rows.
Received rows are ordered by source rank, then local expert; ``num_tokens_per_expert_group`` (E,) is
rank-major: entry r * E_local + e = rows rank r sent to my local expert e. Example, W = 2,
E_local = 2, counts [2, 1, 0, 3] (rank 0: e0 2, e1 1; rank 1: e0 0, e1 3), align = 4:

    received row   0    1    2    3    4    5
    (rank, expert) 0,e0 0,e0 0,e1 1,e1 1,e1 1,e1

    permuted row   0  1  2  3  |  4  5  6  7  |  8  ..  15
    expert         e0 e0 -  -  |  e1 e1 e1 e1 |  -       (P = round_up(6 + 2 * 4, 4) = 16)
    indices        0  1  -1 -1 |  2  3  4  5  |  -1 ..  -1
    group_offsets  [4, 8]

A group with no rows takes no padding. No host sync: P is a static bound, and the index is built on
the device where the counts are. ``stream``: the stream to launch on (None: CuPy's current), not
synchronized; on a CPU the work is done when the call returns.
"""

import numpy

from .kernels import (UNBOUNDED, SizedLaunch, Words, array_module,  # first: sets up the simulator
                      launch_1d, prepared)                    # before numba loads
from .kernels.permute import (gather_rows_kernel, permute_indices_kernel, permute_layout_kernel,
                              scatter_rows_kernel)
from . import _host
from ._array import as_device_array, check_rows, on_stream, stream_ptr
from ._driver import row_range
from ._platform import host_backend
from ._row_moves import move_rows, padding_scale
from .layout import Layout
from .formats import QuantizedArray, conversion, get_format

_INT32 = numpy.dtype(numpy.int32)


def _check_int(value, name, minimum):
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, (int, numpy.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def _rows(x, name):
    """``([data] or [data, scales], Format or None)`` of ``x``, validated."""
    if isinstance(x, QuantizedArray):
        return [x.data, x.scales], x.format
    return [check_rows(x, name, two_d=False)], None


class GatheredRows:
    """Rows ``source[index[i]]`` not yet written: the gradient permute's backward owes dispatch's
    backward (docs/design.md, "The permute's backward folded into a quantized dispatch
    gradient"). ``source`` (M, D) C-contiguous; ``index`` (N,) int32 in [0, M); ``shape`` (N, D).
    """

    __slots__ = ("source", "index", "shape", "dtype")

    def __init__(self, source, index):
        self.source, self.index = source, index
        self.shape = (index.shape[0],) + tuple(source.shape[1:])
        self.dtype = source.dtype

    @property
    def size(self):
        return int(numpy.prod(self.shape))

    def materialize(self, stream, alloc=None):
        """The rows as a new (N, D) array from ``alloc`` (None: ``empty``), on raw ``stream``."""
        out = (alloc or array_module().empty)(self.shape, self.dtype)
        if self.shape[0]:
            move_rows(gather_rows_kernel, self.index, (self.source,), (out,), stream)
        return out

    def write(self, begin, end, out, stream, share=1.0):
        """Rows ``[begin, end)`` into ``out`` (an array or ``Words``) on raw ``stream`` with
        ``share`` of the grid: a producer of the staged exchange."""
        if end > begin:
            move_rows(gather_rows_kernel, row_range(self.index, begin, end), (self.source,),
                       (out,), stream, share)


def _check_indices(permuted_indices, rows, name, stream):
    idx = as_device_array(permuted_indices, "permuted_indices")
    if idx.dtype != numpy.int32:
        raise TypeError(f"permuted_indices: expected dtype int32, got {idx.dtype}")
    if idx.ndim != 1:
        raise ValueError(f"permuted_indices: expected a 1-D array, got shape {tuple(idx.shape)}")
    if not idx.flags.c_contiguous:  # the kernels take contiguous indices: copied where they run
        with on_stream(stream):
            idx = idx.copy()
    if rows is not None and idx.shape[0] != rows:
        raise ValueError(f"permuted_indices: expected length {rows} (the rows of {name}), "
                         f"got {idx.shape[0]}")
    return idx


def _wrap(arrays, fmt):
    return fmt.wrap(*arrays) if fmt is not None else arrays[0]


def expert_order(layout, align, stream):
    """``(permuted_indices (P,), group_offsets (E_local,), inverse (N,))`` int32 device arrays of
    ``layout``'s permute for ``align`` (``inverse``: received row -> permuted row), built on the
    device (no host sync) once per layout and ``align``."""
    align = _check_int(align, "align", 1)
    with on_stream(stream):  # the index's arrays from the stream it is built on
        return _layout_index(layout, align, stream)


def permuted_landing(layout, align):
    """Where received rows land in :func:`permute`'s order for ``align``: ``((received row,
    permuted row, rows), ...)`` per (source rank, local expert) with rows, in received order
    (``Communicator.exchange``'s ``landing``); on the host from the layout's counts, cached."""
    align = _check_int(align, "align", 1)
    key = ("landing", align)
    cached = layout._cache.get(key)
    if cached is not None:
        return cached
    e_local, world = layout.num_local_experts, layout.comm.size
    first = layout.comm.rank * e_local
    mine = layout.counts[:, first:first + e_local].tolist()  # [source rank][local expert]
    start, end = [[0] * e_local for _ in range(world)], 0
    for e in range(e_local):  # expert-major, then source rank; groups padded to align
        for j in range(world):
            start[j][e] = end
            end += mine[j][e]
        end = -(-end // align) * align
    runs, row = [], 0
    for j in range(world):  # received order: source rank, then local expert
        for e in range(e_local):
            if mine[j][e]:
                runs.append((row, start[j][e], mine[j][e]))
            row += mine[j][e]
    cached = layout._cache[key] = tuple(runs)
    return cached


def permute(x, num_tokens_per_expert_group, num_local_experts=None, align=32, *, out_format=None,
            stream=None):
    """Received rows -> expert-major order, each expert's group zero-padded to a multiple of
    ``align`` (the module docstring's table); a group's rows keep their received order.

    Args:
        x: (M_recv, ...) C-contiguous device array of any dtype, or a QuantizedArray (any format;
            data and scales permuted together in one launch). Read.
        num_tokens_per_expert_group: (E,) int32 device array, rank-major counts summing to M_recv
            (not checked: that needs a host sync; extra counts give -1 indices). Read. Or the
            :class:`~mxcomm.layout.Layout`: M_recv checked against it, the index built once per
            layout and ``align`` and reused (no launch).
        num_local_experts: E_local, a positive int dividing E (not needed with a layout).
        align: rows, a positive int (32 for MX grouped GEMMs, a multiple of 16 for SM90 fp8).
        out_format: None (or ``x``'s format) to move rows as they are; or a format to convert the
            QuantizedArray ``x`` to in the same pass (``"fp8_rowwise"`` or ``"bf16"`` from
            ``"mxfp8"``; ``mxcomm.formats.conversion``).
        stream: as the module docstring says.
    Returns:
        ``(permuted, permuted_indices, group_offsets)``: permuted (P, ...) of ``x``'s dtype or
        format (or ``out_format``; padding rows have data 0 and the format's ``padding_scale``, so
        dequantize to 0), P = round_up(M_recv + E_local * align, align); permuted_indices (P,)
        int32, the received row of each permuted row or -1; group_offsets (E_local,) int32,
        cumulative padded group ends.
    Raises:
        TypeError: counts not int32; ``x`` not an array; non-int ``num_local_experts``/``align``.
        ValueError: no conversion to ``out_format``; counts not 1-D or their length not a multiple
            of ``num_local_experts``; ``num_local_experts`` or ``align`` < 1; ``x`` not
            C-contiguous; on the host backend, a negative count; with a layout, rows or
            ``num_local_experts`` other than its.
    """
    return _permute(x, num_tokens_per_expert_group, num_local_experts, align, out_format, stream,
                    None)


def _permute(x, num_tokens_per_expert_group, num_local_experts, align, out_format, stream,
             alloc):
    """:func:`permute`, its results (but a conversion's) from ``alloc(shape, dtype)`` (None:
    ``empty``; ``mxcomm.torch`` hands in torch's allocator)."""
    srcs, fmt = _rows(x, "x")
    convert = _conversion(fmt, out_format, srcs)
    m_recv = srcs[0].shape[0]
    layout = num_tokens_per_expert_group
    if isinstance(layout, Layout):  # rows checked against it; the index cached per align
        if num_local_experts not in (None, layout.num_local_experts):
            raise ValueError(f"permute: num_local_experts = {num_local_experts}, but the layout "
                             f"has {layout.num_local_experts}")
        align = _check_int(align, "align", 1)
        if m_recv != layout.num_received:
            raise ValueError(f"permute: x on rank {layout.comm.rank} has {m_recv} rows, but the "
                             f"layout receives {layout.num_received}")
        with on_stream(stream if alloc is None else None):  # alloc: torch's, on its stream
            indices, group_offsets, _ = _layout_index(layout, align, stream, alloc)
            return _gather(x, srcs, fmt, convert, indices, stream, alloc), indices, group_offsets
    if num_local_experts is None:
        raise TypeError("permute: num_local_experts is required without a layout")
    counts = as_device_array(num_tokens_per_expert_group, "num_tokens_per_expert_group")
    if counts.dtype != numpy.int32:
        raise TypeError(f"num_tokens_per_expert_group: expected dtype int32, got {counts.dtype}")
    if counts.ndim != 1:
        raise ValueError(f"num_tokens_per_expert_group: expected a 1-D (E,) array, "
                         f"got shape {tuple(counts.shape)}")
    e_local = _check_int(num_local_experts, "num_local_experts", 1)
    align = _check_int(align, "align", 1)
    if counts.shape[0] == 0 or counts.shape[0] % e_local:
        raise ValueError(f"num_tokens_per_expert_group: expected a length that is a positive "
                         f"multiple of num_local_experts = {e_local}, got {counts.shape[0]}")
    if not counts.flags.c_contiguous:  # the kernels take contiguous counts
        with on_stream(stream):
            counts = counts.copy()
    p = -(-(m_recv + e_local * align) // align) * align
    with on_stream(stream if alloc is None else None):  # alloc: torch's, on its stream
        indices, group_offsets, _ = _layout(counts, e_local, align, m_recv, p, stream, alloc)
        return _gather(x, srcs, fmt, convert, indices, stream, alloc), indices, group_offsets


def _conversion(fmt, out_format, srcs):
    """The gather converting rows of ``fmt`` (None: plain) into ``out_format``, or None where they
    move as they are; ValueError where none exists."""
    if out_format is None:
        return None
    target = get_format(out_format, "out_format")
    if target is fmt or (fmt is None and not target.quantized and
                         (target.element_dtype is None or target.element_dtype == srcs[0].dtype)):
        return None
    return conversion(fmt, target)


def _gather(x, srcs, fmt, convert, indices, stream, alloc):
    """Rows ``indices`` of ``x`` (padding: zeros, the padding scale), by ``convert`` if given."""
    if convert is not None:
        return convert(x, indices, stream_ptr(stream), alloc)
    alloc = alloc or array_module().empty
    p = indices.shape[0]
    dsts = [alloc((p,) + tuple(s.shape[1:]), s.dtype) for s in srcs]
    move_rows(gather_rows_kernel, indices, srcs, dsts, stream, fill=padding_scale(fmt))
    return _wrap(dsts, fmt)


def _layout_index(layout, align, stream, alloc=None):
    """``(indices, group_offsets, inverse)`` of ``layout``'s permute for ``align`` (:func:`_layout`),
    cached on the layout."""
    key = ("permute", align)
    cached = layout._cache.get(key)
    if cached is None:
        cached = layout._cache[key] = _layout(
            layout.num_tokens_per_expert_group, layout.num_local_experts, align,
            layout.num_received, layout.permuted_rows(align), stream, alloc)
    return cached


def _layout(counts, e_local, align, m_recv, p, stream, alloc=None):
    """``(indices (P,) int32, group_offsets (E_local,) int32, inverse (M_recv,) int32)`` of
    :func:`permute` (``inverse``: the permuted row of each received row, written where the counts
    place it), into arrays from ``alloc`` (None: ``empty``)."""
    if host_backend():
        return _host.permute_layout(counts, e_local, align, m_recv, p)
    alloc = alloc or array_module().empty
    e = counts.shape[0]
    starts = alloc((2 * e,), _INT32)  # each segment's first received, then permuted row
    group_offsets = alloc((e_local,), _INT32)
    indices = alloc((p,), _INT32)
    inverse = alloc((m_recv,), _INT32)
    layout_launch, index_launch = _index_launches(align)
    ptr = stream_ptr(stream)
    src_start, dst_start = row_range(starts, 0, e), row_range(starts, e, 2 * e)
    layout_launch(ptr, (1, e, e_local), counts, src_start, dst_start, group_offsets)
    index_launch(ptr, (p, e, e_local, m_recv), counts, src_start, dst_start, group_offsets,
                 indices, inverse)
    return indices, group_offsets, inverse


@prepared
def _index_launches(align):
    """The sized launches of ``permute_layout_kernel`` (one thread; count ``(1, E, E_local)``) and
    ``permute_indices_kernel`` (a thread per permuted row; ``(P, E, E_local, M_recv)``)."""
    def words(count):
        return Words(0, (1,), _INT32), count
    layout = SizedLaunch(permute_layout_kernel, launch_1d(1, threads=32), (0, 1), words(1),
                         (None, 2), align, words(1), words(1), words(2))
    index = SizedLaunch(permute_indices_kernel, launch_1d(UNBOUNDED), (1, 1), words(1),
                        words(1), words(1), words(2), (None, 3), words(0), words(3))
    return layout, index


def unpermute(y, permuted_indices, num_rows, *, stream=None):
    """Permuted rows back to received order, padding dropped: out[permuted_indices[p]] = y[p].

    Args:
        y: (P, H...) C-contiguous device array (any dtype) or a QuantizedArray (any format). Read.
        permuted_indices: (P,) int32 device array from :func:`permute`. Read.
        num_rows: M_recv, an int >= 0 (rows no index names are zero; indices >= num_rows are
            dropped), or the layout (its ``num_received``; no fill needed).
        stream: as the module docstring says.
    Returns:
        (num_rows, H...) array of ``y``'s dtype, or a QuantizedArray (any format).
    Raises:
        TypeError: indices not int32; non-int ``num_rows``; ``y`` not an array.
        ValueError: indices not 1-D or not of length P; ``num_rows`` < 0; ``y`` not C-contiguous.
    """
    return _unpermute(y, permuted_indices, num_rows, stream, None)


def _unpermute(y, permuted_indices, num_rows, stream, alloc):
    """:func:`unpermute` into arrays from ``alloc(shape, dtype)`` (None: ``empty``)."""
    srcs, fmt = _rows(y, "y")
    idx = _check_indices(permuted_indices, srcs[0].shape[0], "y", stream)
    # with the layout its permute names every received row once: no fill
    covered = isinstance(num_rows, Layout)
    if covered:
        num_rows = num_rows.num_received
    num_rows = _check_int(num_rows, "num_rows", 0)
    alloc = alloc or array_module().empty
    with on_stream(stream):
        dsts = [alloc((num_rows,) + tuple(s.shape[1:]), s.dtype) for s in srcs]
        if not covered and num_rows:
            for d in dsts:
                d.fill(0)
    if num_rows:
        move_rows(scatter_rows_kernel, idx, srcs, dsts, stream)
    return _wrap(dsts, fmt)


def permute_backward(grad, permuted_indices, num_rows, *, stream=None):
    """Backward of :func:`permute`: :func:`unpermute` of ``grad`` (P, D...) (padding rows'
    gradient ignored); arguments and errors as there."""
    return unpermute(grad, permuted_indices, num_rows, stream=stream)


def unpermute_backward(grad, permuted_indices, *, stream=None):
    """Backward of :func:`unpermute`: out[p] = grad[permuted_indices[p]], zero rows where it is -1.

    Args:
        grad: (M_recv, H...) C-contiguous device array or a QuantizedArray (any format; padding
            rows get data 0 and the format's padding scale). Read.
        permuted_indices: (P,) int32, from :func:`permute`. Read.
        stream: as the module docstring says.
    Returns:
        (P, H...) array of ``grad``'s dtype, or a QuantizedArray (any format).
    Raises:
        TypeError: indices not int32; ``grad`` not an array.
        ValueError: indices not 1-D; ``grad`` not C-contiguous.
    """
    return _unpermute_backward(grad, permuted_indices, stream, None)


def _unpermute_backward(grad, permuted_indices, stream, alloc, out_format=None):
    """:func:`unpermute_backward` from ``alloc``, converted to ``out_format`` as in permute."""
    srcs, fmt = _rows(grad, "grad")
    idx = _check_indices(permuted_indices, None, "grad", stream)
    with on_stream(stream if alloc is None else None):  # alloc: torch's, on its stream
        return _gather(grad, srcs, fmt, _conversion(fmt, out_format, srcs), idx, stream, alloc)
