"""Rows moved by an index on the device: the gather, scatter and padding launches of the permutation
and of the exchanges that land rows in its order.

Rows of any shape move as rows of the widest word (8/4/2/1 bytes) dividing the row and every
address; one or two (source, destination) pairs per launch (data, and a quantized format's scales),
one CUDA block per row (``kernels.permute``). The host backend runs ``mxcomm._host``'s twins
instead.
"""

import numpy

from .kernels import UNBOUNDED, SizedLaunch, Words, address, launch_1d, prepared, simulated
from .kernels._launch import THREADS_PER_BLOCK
from .kernels.permute import gather_rows_kernel, scatter_rows_kernel, zero_rows_kernel
from . import _host
from ._array import stream_ptr
from ._platform import host_backend

_WORDS = tuple(numpy.dtype(t) for t in (numpy.uint64, numpy.uint32, numpy.uint16, numpy.uint8))
#: Words of a row each thread of a row-moving block aims to copy (measured: bench/NOTES.md).
WORDS_PER_ROW_THREAD = 32


def _word(row_bytes, arrays):
    """The widest word of 8/4/2/1 bytes dividing ``row_bytes`` and every address of ``arrays``."""
    for word in _WORDS:
        if row_bytes % word.itemsize == 0 and all(address(a) % word.itemsize == 0
                                                 for a in arrays if a.size):
            return word
    raise AssertionError("unreachable: a uint8 word divides every row")


def _flat_rows(a):
    """The rows of ``a`` (any shape) as a 2-D array."""
    return a if a.ndim == 2 else a.reshape(a.shape[0], int(numpy.prod(a.shape[1:])))


def _row_words(arrays):
    """``(words per row, word)`` of 2-D ``arrays`` whose rows have the same bytes."""
    row_bytes = arrays[-1].shape[1] * arrays[-1].dtype.itemsize
    word = _word(row_bytes, arrays)
    return row_bytes // word.itemsize, word


def _row_threads(words):
    """Threads per block moving a row of ``words`` words: about WORDS_PER_ROW_THREAD each, a power
    of two in [32, THREADS_PER_BLOCK]. Short rows (MXFP8 data: 896 words at D = 7168) get smaller
    blocks, so more rows and their index loads are in flight per multiprocessor."""
    threads = 32
    while threads < THREADS_PER_BLOCK and threads * WORDS_PER_ROW_THREAD < words:
        threads *= 2
    return threads


def padding_scale(fmt):
    """``(value, scale dtype)`` a gather writes in the scales of ``fmt``'s padding rows; None for
    plain rows."""
    return None if fmt is None or not fmt.quantized else \
        (fmt.padding_scale, numpy.dtype(fmt.scale_dtype))


def _fill_word(fill, word):
    """The int whose ``word`` bytes repeat the padding scale ``fill`` (None: 0): what the kernels
    write into every word of a padding row's scales."""
    if fill is None:
        return 0
    value = numpy.array(fill[0], fill[1]).tobytes()
    if word.itemsize % len(value) == 0:
        return int.from_bytes(value * (word.itemsize // len(value)), "little")
    if value == bytes(len(value)):
        return 0
    raise AssertionError(f"unreachable: {word} words narrower than a {fill[1]} scale")


def move_rows(kernel, indices, srcs, dsts, stream, share=1.0, fill=None):
    """Move one or two (src, dst) row-array pairs by ``indices`` with the gather or scatter
    ``kernel`` (the host backend: its ``_host`` twin). Arrays: CuPy/NumPy or 2-D ``Words``;
    ``share`` of the grid; ``fill``: a gather's padding scale for the second pair (None: zeros)."""
    gather = kernel is gather_rows_kernel
    if host_backend():
        if gather:
            _host.gather_rows(indices, srcs, dsts, None if fill is None else fill[0])
        else:
            _host.scatter_rows(indices, srcs, dsts)
        return
    p = indices.shape[0]
    shapes, arrays = [], [indices]
    for src, dst in zip(srcs, dsts):
        src, dst = _flat_rows(src), _flat_rows(dst)
        shapes.append(_row_words((src, dst)))
        arrays += (src, dst)
    other = dsts[0].shape[0] if not gather else srcs[0].shape[0]
    if len(shapes) == 1:  # a missing second pair is an empty one, never an alias of the first
        shapes.append(None)  # (the simulator copies every argument in and out)
        arrays += (0, 0) if not simulated() else \
            tuple(numpy.empty((0, 0), _WORDS[0]) for _ in range(2))
    if p == 0 or not any(shape and shape[0] for shape in shapes):
        return
    fill_word = _fill_word(fill, shapes[1][1]) if gather and shapes[1] else 0
    _move_launch(kernel, tuple(shapes), share, fill_word)(stream_ptr(stream), (p, other, 0),
                                                           *arrays)


@prepared
def _move_launch(kernel, shapes, share=1.0, fill_word=0):
    """The prepared launch of the gather or scatter ``kernel`` for two ``(words per row, word)``
    pairs (the second None: an empty pair) and a gather's ``fill_word``. Counts: P (a block per
    row), the rows on the other side, 0 (the empty pair's rows)."""
    args = [Words(0, (1,), numpy.dtype(numpy.int32))]
    gather = kernel is not scatter_rows_kernel
    for shape in shapes:
        if shape is None:
            empty = (Words(0, (1, 0), _WORDS[0]), 2)
            args += (empty, empty)
            continue
        words, word = shape
        other, indexed = (Words(0, (1, words), word), 1), (Words(0, (1, words), word), 0)
        args += (other, indexed) if gather else (indexed, other)
    if gather:
        args.append(fill_word)
    threads = _row_threads(max(shape[0] for shape in shapes if shape))
    return SizedLaunch(kernel, launch_1d(UNBOUNDED, threads=threads, share=share), (threads, 1),
                       *args)


def pad_rows(dsts, fmt, indices, stream):
    """Zeros and ``fmt``'s padding scale in the padding rows (``indices[p] < 0``) of the permuted
    ``dsts`` (data and scales, or one plain array), other rows untouched: one launch, no host
    sync."""
    p = indices.shape[0]
    if p == 0:
        return
    fill = padding_scale(fmt)
    if host_backend():
        _host.zero_rows(indices, dsts, None if fill is None else fill[0])
        return
    shapes, arrays = [], [indices]
    for dst in dsts:
        dst = _flat_rows(dst)
        shapes.append(_row_words((dst,)))
        arrays.append(dst)
    if len(shapes) == 1:
        shapes.append(None)
        arrays.append(0 if not simulated() else numpy.empty((0, 0), _WORDS[0]))
    fill_word = _fill_word(fill, shapes[1][1]) if shapes[1] else 0
    _zero_launch(tuple(shapes), fill_word)(stream_ptr(stream), (p, 0), *arrays)


@prepared
def _zero_launch(shapes, fill_word):
    """The sized launch of ``zero_rows_kernel`` for two ``(words per row, word)`` arrays (the second
    None: empty) and the second's ``fill_word``; count: P."""
    args = [Words(0, (1,), numpy.dtype(numpy.int32))]
    for shape in shapes:
        if shape is None:
            args.append((Words(0, (1, 0), _WORDS[0]), 1))
            continue
        words, word = shape
        args.append(Words(0, (1, words), word))
    args.append(fill_word)
    threads = _row_threads(max(shape[0] for shape in shapes if shape))
    return SizedLaunch(zero_rows_kernel, launch_1d(UNBOUNDED, threads=threads), (threads, 1),
                       *args)
