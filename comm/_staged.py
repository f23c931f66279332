"""What the transports of the staged exchange (``Communicator.exchange``; ``_pull``, ``_hier``,
``_grouped``) share: the :class:`Plan`, a staging region's byte layout, the send order, pieces, the
kind and the call tag. docs/design.md, "The staged exchange".

A *rows* object (``mxcomm._driver.LaunchRows``, ``mxcomm.route``'s) has:

- ``arrays``: ``((row shape, dtype), ...)``, the arrays moved together (MXFP8: data, scales);
- ``kind``: text naming the exchange (operation, format, D), compared across ranks;
- ``produce(begin, end, slots, stream)``: write rows ``[begin, end)`` of the send order into
  ``slots`` (one array per entry of ``arrays``);
- ``consume(begin, end, rows, stream)`` (in place only): read received rows ``[begin, end)`` where
  they are; keep no reference to ``rows`` past the call;
- ``results`` (in place, optional): the consumer's outputs, filled with 0xFF on GPUs where a device
  wait of the exchange failed;
- ``keep(begin, end, at, slots, stream)`` (in place only): for a rank's own rows, leave what
  ``produce`` then ``consume`` at received row ``at`` would, in one pass where it can.

All enqueue on the raw stream handle ``stream``. Slots and rows are C-contiguous ``(rows,) + row
shape``: ``mxcomm._driver.Words`` (pull) or CuPy arrays (grouped) on a GPU, NumPy on the host."""

import bisect
import math
import zlib

from . import _validate

#: Staging regions start at multiples of this many bytes (each array of the layout, too).
ALIGN = 256
#: The pull transport moves a peer's rows in pieces of about this many bytes, up to MAX_PIECES,
#: each signalled on its own (the first is pulled while the next is filled). In-place consumers
#: take rows whole. Sizes measured on H200s: bench/NOTES.md.
PIECE_BYTES = 256 << 20
MAX_PIECES = 4
#: Rows of an exchange up to this many bytes in all are produced, signalled and awaited in one
#: launch (at most MAX_BATCH peers); larger ones keep a launch per peer, so pulls overlap the
#: producer. Sender and receiver choose apart: both write and await the same flag words.
BATCH_BYTES = 128 << 20
MAX_BATCH = 8


class Plan:
    """Every rank's counts of one exchange, agreed (by a layout or a vote): ``sent[j][i]`` rows
    rank j sends rank i; ``rank`` this one.

    Attributes:
        send_counts, recv_counts, send_offsets, recv_offsets (W ints each), rows_sent,
        rows_received.
        largest_peer_rows: the most rows any rank sends to its peers (own rows not counted), so
            every rank chooses alike by it.
        generation: the number of the communicator's layout this plan is a direction of, or None
            (a vote's plan).
        calls: this rank's calls given a layout's plan, counted on entry (failed ones too); a
            vote's host-collective number. With ``generation``, the call tag (:func:`call_tag`)."""

    __slots__ = ("rank", "size", "sent", "send_counts", "recv_counts", "send_offsets",
                 "recv_offsets", "rows_sent", "rows_received", "largest_peer_rows", "_staging_rows",
                 "generation", "calls", "__weakref__")

    def __init__(self, rank, sent):
        self.rank = rank
        self.size = len(sent)
        self.sent = sent
        self.send_counts = list(sent[rank])
        self.recv_counts = [row[rank] for row in sent]
        self.send_offsets = _validate.exclusive_cumsum(self.send_counts)
        self.recv_offsets = _validate.exclusive_cumsum(self.recv_counts)
        self.rows_sent = sum(self.send_counts)
        self.rows_received = sum(self.recv_counts)
        self._staging_rows = max([sum(row) for row in sent], default=0)
        self.largest_peer_rows = max([sum(row) - row[j] for j, row in enumerate(sent)],
                                     default=0)
        self.generation = None
        self.calls = 0

    def transposed(self):
        """The plan of the reverse exchange (combine direction of a dispatch plan)."""
        return Plan(self.rank, [list(col) for col in zip(*self.sent)])

    def staging_bytes(self, row_bytes):
        """Bytes of the largest rank's staging region for rows of ``row_bytes`` (equal on every
        rank)."""
        return max(ALIGN, regions(row_bytes, self._staging_rows)[1])


def regions(layout, rows):
    """Byte offsets of each array of ``layout`` (``(row_bytes, ...)``) in a staging region of
    ``rows`` rows, and the region's size: ``([offset per array], total bytes)``."""
    offsets, total = [], 0
    for row_bytes in layout:
        offsets.append(total)
        total += -(-rows * row_bytes // ALIGN) * ALIGN
    return offsets, total


def send_order(rank, size):
    """Peers in the order their rows are produced: ``rank+1, rank+2, ..., rank`` (self last)."""
    return [(rank + s) % size for s in range(1, size)] + [rank]


def pieces(rows, layout):
    """Row ranges ``[(lo, hi), ...]`` a peer's ``rows`` are produced and pulled in: about
    ``PIECE_BYTES`` each, 1 to ``MAX_PIECES`` (maybe empty)."""
    k = min(MAX_PIECES, max(1, -(-rows * sum(layout) // PIECE_BYTES)))
    return [(rows * i // k, rows * (i + 1) // k) for i in range(k)]


def batched(rows, layout):
    """Whether a rank's ``rows`` rows of ``layout`` for (or from) all its peers fit one launch."""
    return rows * sum(layout) <= min(BATCH_BYTES, PIECE_BYTES)


def landed(landing, lo, hi):
    """Where received rows ``[lo, hi)`` land in the result: ``[(received row, result row, rows),
    ...]`` in received order. ``landing``: None (each row at its own index) or such runs sorted by
    received row, covering every received row once (``permute_align``)."""
    if landing is None:
        return [(lo, lo, hi - lo)] if hi > lo else []
    out = []
    # the last run starting at or before lo: O(log runs) per ask
    i = max(0, bisect.bisect_right(landing, (lo, math.inf)) - 1)
    for start, at, count in landing[i:]:
        if start >= hi:
            break
        a, b = max(lo, start), min(hi, start + count)
        if b > a:
            out.append((a, at + a - start, b - a))
    return out


def row_bytes_of(arrays):
    """Bytes of one row of each array of ``arrays`` (``((row shape, dtype), ...)``)."""
    return tuple(dtype.itemsize * math.prod(shape) for shape, dtype in arrays)


def kind_base(text):
    """The 16-bit hash of an exchange's kind text; never 0xFFFF, so no ready word is one of the peer
    memories' markers (``0xFFFFxxxx``)."""
    return min(zlib.crc32(text.encode()) & 0xFFFF, 0xFFFE)


def kind_word(base):
    """The 32-bit kind a sender signals: the kind's hash high, :func:`call_tag` OR-ed in per call."""
    return base << 16


def call_tag(plan):
    """The 16-bit tag of this rank's current call of ``plan``: :func:`layout_tag` in the high byte,
    ``plan.calls`` mod 256 in the low one. The pull transport ORs it into its ready words; NCCL
    sends it in a header (``_header``)."""
    return layout_tag(plan) | (plan.calls & 0xFF)


def layout_tag(plan):
    """The high byte of :func:`call_tag`, fixed per plan: ``plan.generation`` mod 256 (0 for a
    vote's plan)."""
    return ((plan.generation or 0) & 0xFF) << 8


def describe_tag(tag):
    """A :func:`call_tag` in words: "call 3 of layout 2" (each mod 256)."""
    layout, calls = tag >> 8 & 0xFF, tag & 0xFF
    if layout:
        return f"call {calls} of layout {layout} (mod 256)"
    return f"the exchange of host collective {calls} (mod 256; explicit splits)"


def describe_mismatch(peer, expected, got, kinds):
    """The message for a ready word of the right generation but the wrong kind (32-bit words:
    kind hash, call tag); ``kinds``: hashes to the kind texts seen here."""
    if expected >> 16 != got >> 16:
        theirs = kinds.get(got >> 16)
        theirs = f"'{theirs}'" if theirs else "an exchange of another kind"
        return (f"rank {peer} called {theirs} where this rank called "
                f"'{kinds.get(expected >> 16, '?')}' (ranks disagree on the operation, precision "
                f"or D): the exchange is mis-paired")
    return (f"rank {peer} is at {describe_tag(got & 0xFFFF)} where this rank is at "
            f"{describe_tag(expected & 0xFFFF)}: the exchange is mis-paired (a rank failed or "
            f"skipped a call alone and went on, or uses another layout)")
