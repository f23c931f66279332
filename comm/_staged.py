"""The staged exchange: rows a producer writes where they travel from and a consumer reads.

:meth:`Communicator.exchange` moves the rows described by a *rows* object (any object with the
protocol below; the engine's are in ``mxcomm.a2a``) according to a :class:`Plan` (every rank's
counts). The rows object implements:

- ``arrays``: ``((row shape, dtype), ...)``, the arrays moved together (MXFP8: data and scales);
- ``kind``: a short text naming the exchange (operation, format, D), compared across ranks;
- ``produce(begin, end, slots, stream)``: write rows ``[begin, end)`` of the send order (the rows
  for one peer or a piece of them; the grouped transport: every peer's at once) into ``slots``,
  one array per entry of ``arrays``, enqueued on the stream handle ``stream``;
- ``consume(begin, end, rows, stream)`` (in-place exchanges only): read a sender's rows, rows
  ``[begin, end)`` of the receive order, where they are, enqueued on ``stream``; keep no
  reference to ``rows`` past the call.
- ``results`` (in-place exchanges, optional): the arrays the consumer writes, which the pull
  transport fills with 0xFF bytes on GPUs where a device wait of the exchange failed;
- ``keep(begin, end, at, slots, stream)`` (in-place exchanges only; a transport may call it for
  the rows a rank sends itself instead of ``produce`` and ``consume``): leave what ``produce``
  into ``slots`` then ``consume`` of them as received rows ``[at, at + end - begin)`` would
  leave, in one pass where the consumer can (the quantized exchange's round trip), enqueued on
  ``stream``.

Slots and rows are C-contiguous arrays of ``(rows,) + row shape``: on a GPU the pull transport
names them by address (``mxcomm._driver.Words``: what a kernel launch or ``copy_bytes`` takes,
without the host time of a CuPy view), the grouped one hands CuPy arrays; on the host they are
NumPy arrays.

Two transports implement the movement (``_pull``: receivers read the senders' memory on one node;
``_grouped``: one ``alltoallv``). This module holds what they share: the plan, the byte layout of a
staging region, the send order, the pieces of large regions and the 32-bit kind of an exchange.
"""

import bisect
import math
import zlib

from . import _validate

#: Staging regions start at multiples of this many bytes (each array of the layout, too).
ALIGN = 256
#: The pull transport's copy engines move a peer's rows in pieces of about this many bytes, up to
#: MAX_PIECES, each signalled on its own: the first piece is pulled while the sender still fills
#: the next. Measured on H200s, MXFP8 rows, 131072 per rank (bench/NOTES.md): 128 MB pieces made a
#: 2-rank dispatch 6-9 % faster and left 4 ranks even, but cost host time through the torch
#: adapters; 256 MB keeps 4-rank regions of up to 7168-wide rows whole and splits 2-rank ones in
#: two. In-place consumers take each peer's rows whole (pieces measured slower there).
PIECE_BYTES = 256 << 20
MAX_PIECES = 4
#: A rank whose peers' rows of an exchange take at most this many bytes in all produces them in
#: one launch and signals every peer in one more, and a receiver of at most this many bytes waits
#: for every sender in one launch (at most MAX_BATCH peers): small exchanges are host-bound, and a
#: launch per peer cost 4 ranks 12 launches per MXFP8 dispatch (bench/NOTES.md). Larger ones keep
#: a launch per peer, so the first peer's pull starts while the next peer's rows are produced.
#: Sender and receiver choose apart: both write and await the same flag words.
BATCH_BYTES = 128 << 20
MAX_BATCH = 8


class Plan:
    """Every rank's counts of one exchange, agreed across ranks (by a layout or a vote).

    Args:
        rank: this rank.
        sent: W lists of W non-negative ints, ``sent[j][i]`` rows rank j sends to rank i.

    Attributes:
        sent, send_counts, recv_counts, send_offsets, recv_offsets (W ints each),
        rows_sent, rows_received.
        largest_peer_rows: the most rows any rank sends to its peers (rows it keeps not
            counted); the same on every rank, so ranks choose alike by it.
        generation: which layout of its communicator the plan is a direction of (1, 2, ...:
            ``exchange_layout`` numbers them alike on every rank), or None (a vote's plan).
        calls: a layout's plan: the engine's calls given it on this rank, counted as each
            call enters (``mxcomm.a2a``, the torch adapters' direct path), those that then
            failed included; a vote's plan: the number of its vote among the communicator's
            host collectives. With ``generation``, what every rank's exchange carries with its
            rows (:func:`call_tag`), so that a call paired with another call of a peer (a rank
            failed one alone and went on, or uses a stale layout) is found on every rank.
    """

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
        """Bytes of the largest rank's staging region for rows of ``row_bytes`` (every rank
        computes the same)."""
        return max(ALIGN, regions(row_bytes, self._staging_rows)[1])


def _align(n):
    return -(-n // ALIGN) * ALIGN


def regions(layout, rows):
    """Byte offsets of each array of ``layout`` in a staging region of ``rows`` rows, and its size.

    Args:
        layout: ``(row_bytes, ...)``, one per array moved together.
        rows: rows the region holds.
    Returns:
        ``([offset per array], total bytes)``.
    """
    offsets, total = [], 0
    for row_bytes in layout:
        offsets.append(total)
        total += _align(rows * row_bytes)
    return offsets, total


def send_order(rank, size):
    """Peers in the order their rows are produced: ``rank+1, rank+2, ..., rank`` (self last)."""
    return [(rank + s) % size for s in range(1, size)] + [rank]


def pieces(rows, layout):
    """Row ranges ``[(lo, hi), ...]`` a peer's ``rows`` are produced and pulled in: about
    ``PIECE_BYTES`` each, at most ``MAX_PIECES``, at least one (maybe empty). Sender and
    receiver compute the same from the plan."""
    k = min(MAX_PIECES, max(1, -(-rows * sum(layout) // PIECE_BYTES)))
    return [(rows * i // k, rows * (i + 1) // k) for i in range(k)]


def batched(rows, layout):
    """Whether ``rows`` rows of ``layout`` (``(row_bytes, ...)``), a rank's rows for all its
    peers or from all of them, are few enough to go in one launch (``BATCH_BYTES``; also within
    one piece, so every peer's rows are one)."""
    return rows * sum(layout) <= min(BATCH_BYTES, PIECE_BYTES)


def landed(landing, lo, hi):
    """Where received rows ``[lo, hi)`` land in the result: ``[(received row, result row,
    rows), ...]`` in received order. ``landing``: None (each received row at its own index) or
    ``((received row, result row, rows), ...)``, runs of at least one row sorted by received row,
    covering every received row once (an exchange whose rows land in another order:
    ``permute_align``)."""
    if landing is None:
        return [(lo, lo, hi - lo)] if hi > lo else []
    out = []
    # the first run that may hold row lo: the last one starting at or before it (sorted runs);
    # a schedule asks once per piece, so a layout of many runs costs O(log runs) per ask
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
    """The 16-bit hash of an exchange's kind text (operation, format, D); never 0xFFFF, so no
    ready word is one of the peer memories' markers (``0xFFFFxxxx``)."""
    return min(zlib.crc32(text.encode()) & 0xFFFF, 0xFFFE)


def kind_word(base):
    """The high half of the 32-bit kind a sender signals with its rows: the kind's hash (the
    low half is the call's :func:`call_tag`, OR-ed in per call)."""
    return base << 16


def call_tag(plan):
    """The 16-bit number of this rank's current call of ``plan`` that the transports carry with
    its rows: the layout's number (``plan.generation``, mod 256; 0 for a vote's plan) in the
    high byte, ``plan.calls`` (mod 256) in the low one. The pull transport ORs it into its
    ready words; the NCCL backend sends it (with the layout's whole numbers) in a header. A
    rank paired with another call of a peer (one failed a call alone and went on, or uses a
    stale layout) reads another tag, on every rank."""
    return ((plan.generation or 0) & 0xFF) << 8 | (plan.calls & 0xFF)


def describe_tag(tag):
    """A :func:`call_tag` in words: "call 3 of layout 2" (each mod 256)."""
    layout, calls = tag >> 8 & 0xFF, tag & 0xFF
    if layout:
        return f"call {calls} of layout {layout} (mod 256)"
    return f"the exchange of host collective {calls} (mod 256; explicit splits)"


def describe_mismatch(peer, expected, got, kinds):
    """The message for a ready word of the right generation but the wrong kind.

    Args:
        peer: the sender.
        expected, got: the 32-bit words (kind hash, call tag) expected here and signalled by
            the peer.
        kinds: ``{16-bit hash: kind text}`` of the exchanges this rank has made.
    """
    if expected >> 16 != got >> 16:
        theirs = kinds.get(got >> 16)
        theirs = f"'{theirs}'" if theirs else "an exchange of another kind"
        return (f"rank {peer} called {theirs} where this rank called "
                f"'{kinds.get(expected >> 16, '?')}' (ranks disagree on the operation, precision "
                f"or D): the exchange is mis-paired")
    return (f"rank {peer} is at {describe_tag(got & 0xFFFF)} where this rank is at "
            f"{describe_tag(expected & 0xFFFF)}: the exchange is mis-paired (a rank failed or "
            f"skipped a call alone and went on, or uses another layout)")


class StagedExchange:
    """The staged exchange's entry on a :class:`~mxcomm.comm.Communicator` (a base of it):
    :meth:`exchange` over the transport ``_transport.choose`` picked."""

    @property
    def nodes(self):
        """The node of each rank (a tuple of W ints, numbered by their first rank), as ``init``
        agreed on it: peer memory is used only among the ranks of one node."""
        return self._side.nodes.of_rank

    @property
    def transport(self):
        """``"pull"``, ``"hier"`` or ``"grouped"``: how :meth:`exchange` moves rows."""
        return self._transport.name

    def exchange(self, rows, plan, *, out=None, in_place=False, landing=None, stream=None):
        """Move rows a producer writes where they travel from, to a consumer (``_staged``).

        Collective, on the devices only: no host collective and no host barrier (the staging
        grows collectively in the rare call that needs more). The plan must be the same on
        every rank (a layout's, or one from :meth:`check`); a peer calling another exchange,
        another kind of rows or another plan is detected where the transport can (the pull
        transport compares a kind word) and ends in an error, else in a timeout.

        Args:
            rows: the producer/consumer (``_staged`` docstring): ``arrays``, ``kind``,
                ``produce``, and ``consume`` for ``in_place``.
            plan: a :class:`~mxcomm.comm.Plan`, every rank's counts.
            out: arrays of ``plan.rows_received`` rows, one per entry of ``rows.arrays``, or
                None to allocate them. Written. Must be None with ``in_place``.
            in_place: the consumer reads each sender's rows where they are (pull: over NVLink on
                a side stream beside the producer) instead of them being copied into ``out``.
            landing: None (received row r is row r of ``out``), or ``((received row, row of
                out, rows), ...)``, runs of at least one row sorted by received row, covering
                every received row once:
                where each run of received rows lands in ``out`` (``out`` may have more rows,
                which stay as they are). Not with ``in_place``. The pull transport copies each
                run straight into place; the grouped one receives, then copies the runs.
            stream: the caller's stream (NCCL: as in :meth:`alltoallv`; MPI: ignored).
        Returns:
            The tuple of ``out`` arrays (complete on ``stream``), or None with ``in_place``.
        Raises:
            TimeoutError: a peer did not arrive within ``timeout`` s (on the GPU: found by this
                or a later call, or :meth:`wait`); the communicator is aborted.
            RuntimeError: a peer called a different exchange (as above); the communicator is
                aborted or closed.
        """
        self.check_usable()
        if landing is not None and (in_place or out is None):
            raise ValueError("landing: needs out arrays and in_place=False")
        stream_ptr = self.stream_ptr(stream)
        with self.on_stream(stream_ptr):  # allocations ordered on the caller's stream
            outs = self._transport.run(rows, plan, None if out is None else tuple(out), in_place,
                                       stream_ptr, landing)
        # No watchdog event here: the pull transport's device waits give up on their own after
        # ``timeout`` (the watchdog reads their status), and the grouped one's alltoallv
        # records its own.
        return None if in_place else outs

    def _new_arrays(self, arrays, rows):
        """One new array of ``rows`` rows per ``(row shape, dtype)`` of ``arrays``."""
        return tuple(self._empty((rows,) + shape, dtype) for shape, dtype in arrays)
