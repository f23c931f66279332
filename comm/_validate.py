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


def ballot_size(size):
    """Number of int64 words of one rank's ballot in a world of ``size`` ranks."""
    return _HEADER + 2 * size + _TEXT_WORDS


def encode_text(text):
    """``text`` as ``TEXT_BYTES // 8`` int64 words (UTF-8, zero padded, cut with "...")."""
    raw = text.encode("utf-8", "replace")
    if len(raw) > TEXT_BYTES:
        raw = raw[:TEXT_BYTES - 3] + b"..."
    return numpy.frombuffer(raw.ljust(TEXT_BYTES, b"\0"), dtype=numpy.int64)


def decode_text(words):
    """Inverse of :func:`encode_text`."""
    return numpy.ascontiguousarray(words).tobytes().rstrip(b"\0").decode("utf-8", "replace")


def as_counts(values, name, rank, size):
    """``values`` as a length-``size`` int64 NumPy array of non-negative host ints.

    Args:
        values: a sequence (list, tuple, 1-D NumPy array) of ``size`` integers.
        name: the argument's name, for messages.
        rank: this process's rank, for messages.
        size: the number of ranks.
    Raises:
        TypeError: ``values`` is not a sequence of integers.
        ValueError: wrong length or a negative entry.
    """
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
    offsets = numpy.zeros_like(counts)
    numpy.cumsum(counts[:-1], out=offsets[1:])
    return offsets


def check_region(counts, offsets, rows, what, rank, explicit):
    """Check that blocks ``[offsets[r], offsets[r] + counts[r])`` fit in ``rows`` rows.

    Args:
        counts, offsets: (W,) int64, non-negative.
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
        total = int(counts.sum())
        if total != rows:
            raise ValueError(f"{what}_counts on rank {rank} add up to {total} rows, but {noun} "
                             f"has {rows} rows")
        return
    ends = offsets + counts
    if len(ends) and int(ends.max()) > rows:
        r = int(numpy.argmax(ends))
        raise ValueError(f"{what}_offsets[{r}] + {what}_counts[{r}] = {int(offsets[r])} + "
                         f"{int(counts[r])} on rank {rank} runs past the {rows} rows of {noun}")
    if what == "recv":
        used = numpy.flatnonzero(counts)
        order = used[numpy.argsort(offsets[used], kind="stable")]
        clash = numpy.flatnonzero(ends[order[:-1]] > offsets[order[1:]])
        if len(clash):
            a, b = int(order[clash[0]]), int(order[clash[0] + 1])
            raise ValueError(f"recv_offsets on rank {rank}: the blocks from ranks {a} and {b} "
                             f"overlap in out")


class Ballot:
    """One rank's ballot and the gathered table, in buffers reused from call to call.

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

    def fill(self, op, error, send_counts, recv_counts, description):
        """Write this rank's ballot.

        Args:
            op: an ``OP_*`` code.
            error: the local exception (``ValueError``/``TypeError``), or None.
            send_counts, recv_counts: (W,) int64 units, or None when unreadable.
            description: text naming the rows (dtypes, row shapes); compared across ranks.
        """
        w = self.size
        mine = self.mine
        mine[1] = op
        if error is not None:
            mine[0] = BAD_TYPE if isinstance(error, TypeError) else BAD_VALUE
            mine[_HEADER:_HEADER + 2 * w] = -1
            mine[_HEADER + 2 * w:] = encode_text(str(error))
            return
        mine[0] = VALID
        mine[_HEADER:_HEADER + w] = send_counts
        mine[_HEADER + w:_HEADER + 2 * w] = recv_counts
        words = self._text_cache.get(description)
        if words is None:
            if len(self._text_cache) > 64:
                self._text_cache.clear()
            words = self._text_cache[description] = encode_text(description)
        mine[_HEADER + 2 * w:] = words

    def verdict(self, unit="rows"):
        """The exception every rank raises for the gathered table, or None if all is well.

        Args:
            unit: what the counts count, for messages (``"rows"`` or ``"entries"``).
        Returns:
            A ``ValueError``/``TypeError`` whose message is identical on every rank, or None.
        """
        table = self.table
        w = self.size
        status = table[:, 0]
        ops = table[:, 1]
        op_name = OP_NAMES.get(int(ops[self.rank]), "collective")
        if status.any():
            bad = numpy.flatnonzero(status)
            first = int(bad[0])
            text = decode_text(table[first, _HEADER + 2 * w:])
            if len(bad) > 1:
                text += f" (also invalid on rank{'s' if len(bad) > 2 else ''} " \
                        f"{', '.join(str(int(r)) for r in bad[1:])})"
            name = OP_NAMES.get(int(ops[first]), op_name)
            return _ERRORS[int(status[first])](f"{name}: {text}")
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
