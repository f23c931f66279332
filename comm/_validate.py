"""Argument checks of the communicators, local and cross-rank.

Every collective first checks its arguments locally (types, lengths, signs, bounds), then, unless
validation is off, all ranks exchange one fixed-size ``int64`` *ballot* in a single allgather:

======================  =========================================================================
words                   content
======================  =========================================================================
``[0]``                 verdict: 0 valid, 1 ``ValueError``, 2 ``TypeError`` (local checks)
``[1]``                 the operation (1 ``alltoallv``, 2 ``alltoall_counts``), to catch ranks
                        calling different collectives
``[2 : 2+W]``           units this rank sends to each rank (``send_counts``; -1 if unreadable)
``[2+W : 2+2W]``        units this rank expects from each rank (``recv_counts``)
``[2+2W : ]``           ``TEXT_BYTES`` of UTF-8: the local error message if the verdict is not 0,
                        else a description of the rows (dtypes and row shapes)
======================  =========================================================================

Every rank then composes the same message from the same table, so a problem on any rank raises the
same exception with the same text on every rank, and no rank goes on to move data while another
has given up. Units are rows for ``alltoallv`` and entries for ``alltoall_counts``.
"""

import operator
import struct

import numpy

#: Operation codes carried in a ballot.
OP_ALLTOALLV = 1
OP_ALLTOALL_COUNTS = 2
OP_NAMES = {OP_ALLTOALLV: "alltoallv", OP_ALLTOALL_COUNTS: "alltoall_counts"}

#: Verdict codes carried in a ballot, and the exception each one raises.
VALID, BAD_VALUE, BAD_TYPE = 0, 1, 2
_ERRORS = {BAD_VALUE: ValueError, BAD_TYPE: TypeError}

#: Bytes of message text in a ballot (longer messages are cut, ending in "...").
TEXT_BYTES = 256
_TEXT_WORDS = TEXT_BYTES // 8
_HEADER = 2
_INT64_MAX = 2**63 - 1


def ballot_size(size):
    """Number of int64 words of one rank's ballot in a world of ``size`` ranks."""
    return _HEADER + 2 * size + _TEXT_WORDS


def encode_text(text):
    """``text`` as ``TEXT_BYTES // 8`` int64 words (UTF-8, zero padded, cut with "...")."""
    return numpy.frombuffer(_text_bytes(text), dtype=numpy.int64)


def _text_bytes(text):
    """``text`` as exactly ``TEXT_BYTES`` bytes: UTF-8, zero padded, cut with "..."."""
    raw = text.encode("utf-8", "replace")
    if len(raw) > TEXT_BYTES:
        raw = raw[:TEXT_BYTES - 3] + b"..."
    return raw.ljust(TEXT_BYTES, b"\0")


def decode_text(words):
    """Inverse of :func:`encode_text`."""
    return numpy.ascontiguousarray(words).tobytes().rstrip(b"\0").decode("utf-8", "replace")


def as_counts(values, name, rank, size):
    """``values`` as a list of ``size`` non-negative Python ints (each fits in int64).

    Args:
        values: a sequence (list, tuple, 1-D NumPy array) of ``size`` integers.
        name: the argument's name, for messages.
        rank: this process's rank, for messages.
        size: the number of ranks.
    Raises:
        TypeError: ``values`` is not a sequence of integers.
        ValueError: wrong length or a negative entry.
    """
    # Fast paths (every call takes one): plain ints in a list/tuple, or a 1-D integer array.
    # Anything else, or anything wrong, goes through NumPy below, which words the messages.
    kind = type(values)
    if kind is list or kind is tuple:
        if size and len(values) == size and all(type(v) is int for v in values) and \
                min(values) >= 0 and max(values) <= _INT64_MAX:
            return list(values)
    elif kind is numpy.ndarray and values.ndim == 1 and len(values) == size and \
            values.dtype.kind in "iu":
        out = values.tolist()
        if not size or (min(out) >= 0 and max(out) <= _INT64_MAX):
            return out
    return _as_counts_numpy(values, name, rank, size).tolist()


def _as_counts_numpy(values, name, rank, size):
    """:func:`as_counts` for any input, as a (W,) int64 array; raises the argument errors."""
    try:
        arr = numpy.asarray(values)
    except Exception:  # ragged or exotic input: report it, do not crash the vote
        raise TypeError(f"{name} on rank {rank} is not a sequence of integers") from None
    if arr.ndim != 1:
        if not hasattr(values, "__len__") and not hasattr(values, "shape"):
            raise TypeError(f"{name} on rank {rank} is not a sequence of integers "
                            f"(got {type(values).__name__})")
        raise ValueError(f"{name} on rank {rank} has shape {arr.shape}, expected ({size},) "
                         f"(one entry per rank)")
    if len(arr) != size:
        raise ValueError(f"{name} on rank {rank} has {len(arr)} entries, expected {size} "
                         f"(one per rank)")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} on rank {rank} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(numpy.int64, copy=False)
    if size and arr.min() < 0:
        r = int(numpy.argmin(arr))
        raise ValueError(f"{name} on rank {rank} is negative for rank {r}: {int(arr[r])}")
    return arr


def exclusive_cumsum(counts):
    """Offsets of consecutive blocks of ``counts`` units: ``[0, c0, c0+c1, ...]`` (length W)."""
    offsets = []
    total = 0
    for c in counts:
        offsets.append(total)
        total += c
    return offsets


def check_region(counts, offsets, rows, what, rank, explicit):
    """Check that blocks ``[offsets[r], offsets[r] + counts[r])`` fit in ``rows`` rows.

    Args:
        counts, offsets: W non-negative Python ints each.
        rows: rows of the array the blocks index.
        what: ``"send"`` or ``"recv"``, for messages.
        rank: this rank, for messages.
        explicit: offsets given by the caller (bounds and overlap checked); else the blocks are
            consecutive from row 0 and must cover exactly ``rows`` rows.
    Raises:
        ValueError: a block runs past the end, blocks overlap (receive side), or the counts do not
            add up to the rows.
    """
    noun = "out" if what == "recv" else "send"
    if not explicit:
        total = sum(counts)
        if total != rows:
            raise ValueError(f"{what}_counts on rank {rank} add up to {total} rows, but {noun} "
                             f"has {rows} rows")
        return
    ends = list(map(operator.add, offsets, counts))
    if ends and max(ends) > rows:
        r = ends.index(max(ends))
        raise ValueError(f"{what}_offsets[{r}] + {what}_counts[{r}] = {offsets[r]} + "
                         f"{counts[r]} on rank {rank} runs past the {rows} rows of {noun}")
    if what == "recv":
        order = sorted((r for r, c in enumerate(counts) if c), key=offsets.__getitem__)
        for a, b in zip(order, order[1:]):
            if ends[a] > offsets[b]:
                raise ValueError(f"recv_offsets on rank {rank}: the blocks from ranks {a} and "
                                 f"{b} overlap in out")


class Ballot:
    """One rank's ballot and the gathered table, in buffers reused from call to call.

    The valid path packs and reads the buffers with one ``struct`` call each (no per-call NumPy
    on arrays of a few words); the messages of an invalid call are composed with NumPy.

    Args:
        rank, size: this process's rank and the number of ranks.
    """

    def __init__(self, rank, size):
        self.rank = rank
        self.size = size
        n = ballot_size(size)
        self.mine = numpy.zeros(n, dtype=numpy.int64)
        self.table = numpy.zeros((size, n), dtype=numpy.int64)
        self._text_cache = {}
        record = f"{_HEADER + 2 * size}q{TEXT_BYTES}s"
        self._pack = struct.Struct("=" + record).pack_into
        self._unpack = struct.Struct("=" + record * size).unpack_from
        self._stride = _HEADER + 2 * size + 1  # items per rank in the unpacked table

    def fill(self, op, error, send_counts, recv_counts, description):
        """Write this rank's ballot.

        Args:
            op: an ``OP_*`` code.
            error: the local exception (``ValueError``/``TypeError``), or None.
            send_counts, recv_counts: W ints each (units), or None when unreadable.
            description: text naming the rows (dtypes, row shapes); compared across ranks.
        """
        w = self.size
        mine = self.mine
        if error is not None:
            mine[0] = BAD_TYPE if isinstance(error, TypeError) else BAD_VALUE
            mine[1] = op
            mine[_HEADER:_HEADER + 2 * w] = -1
            mine[_HEADER + 2 * w:] = encode_text(str(error))
            return
        text = self._text_cache.get(description)
        if text is None:
            if len(self._text_cache) > 64:
                self._text_cache.clear()
            text = self._text_cache[description] = _text_bytes(description)
        self._pack(mine, 0, VALID, op, *send_counts, *recv_counts, text)

    def sent_counts(self):
        """``sent[j][i]``: units rank j sends to rank i, from the last gathered table."""
        w = self.size
        return self.table[:, _HEADER:_HEADER + w].tolist()

    def all_valid(self):
        """True when the gathered table shows a valid call everywhere: no local error, one
        operation, one description of the rows, and every rank expecting what its peers send.

        The plain-Python test of the common case; :meth:`verdict` says what is wrong.
        """
        w = self.size
        stride = self._stride
        flat = self._unpack(self.table)
        if any(flat[0::stride]):
            return False
        ops = flat[1::stride]
        if ops.count(ops[0]) != w:
            return False
        texts = flat[_HEADER + 2 * w::stride]
        if texts.count(texts[0]) != w:
            return False
        sent = [flat[j * stride + _HEADER:j * stride + _HEADER + w] for j in range(w)]
        received = zip(*sent)  # received[i]: what each rank j sends to rank i
        return all(flat[i * stride + _HEADER + w:i * stride + _HEADER + 2 * w] == column
                   for i, column in enumerate(received))

    def verdict(self, unit="rows", name=None):
        """The exception every rank raises for the gathered table, or None if all is well.

        Args:
            unit: what the counts count, for messages (``"rows"`` or ``"entries"``).
            name: the call, prefixed to the message (default: the operation's name).
        Returns:
            A ``ValueError``/``TypeError`` whose message is identical on every rank, or None.
        """
        table = self.table
        w = self.size
        status = table[:, 0]
        ops = table[:, 1]
        op_name = name or OP_NAMES.get(int(ops[self.rank]), "collective")
        if status.any():
            bad = numpy.flatnonzero(status)
            first = int(bad[0])
            text = decode_text(table[first, _HEADER + 2 * w:])
            if len(bad) > 1:
                text += f" (also invalid on rank{'s' if len(bad) > 2 else ''} " \
                        f"{', '.join(str(int(r)) for r in bad[1:])})"
            called = name or OP_NAMES.get(int(ops[first]), op_name)
            return _ERRORS[int(status[first])](f"{called}: {text}")
        if (ops != ops[0]).any():
            other = int(numpy.flatnonzero(ops != ops[0])[0])
            return ValueError(f"collective mismatch: rank 0 called {OP_NAMES.get(int(ops[0]))} "
                                f"but rank {other} called {OP_NAMES.get(int(ops[other]))}")
        texts = table[:, _HEADER + 2 * w:]
        differ = numpy.flatnonzero((texts != texts[0]).any(axis=1))
        if len(differ):
            r = int(differ[0])
            return ValueError(f"{op_name}: rows differ across ranks: rank 0 has "
                             f"{decode_text(texts[0])}, rank {r} has {decode_text(texts[r])}")
        sent = table[:, _HEADER:_HEADER + w]          # sent[j, i]: units rank j sends to rank i
        expected = table[:, _HEADER + w:_HEADER + 2 * w]  # expected[i, j]: i expects from j
        if numpy.array_equal(expected, sent.T):
            return None
        pairs = numpy.argwhere(expected != sent.T)
        i, j = (int(v) for v in pairs[0])
        text = (f"{op_name}: rank {i} expects {int(expected[i, j])} {unit} from rank {j}, but "
                f"rank {j} sends {int(sent[j, i])}")
        if len(pairs) > 1:
            text += f" ({len(pairs)} mismatched (receiver, sender) pairs in all)"
        return ValueError(text)
