"""The agreement round (``Communicator.agree``): every rank checks its arguments locally, then all
exchange one fixed-size ``int64`` *ballot* in one side-channel allgather:

==============  ===============================================================================
words           content
==============  ===============================================================================
``[0]``         verdict: 0 valid, 1 ``ValueError``, 2 ``TypeError`` (local checks)
``[1]``         the operation (an ``OP_CODES`` code), to catch ranks calling different collectives
``[2 : 2+n]``   the caller's n words (an ``alltoallv``: the W counts sent, then the W expected)
``[2+n : ]``    ``TEXT_BYTES`` of UTF-8: the local error if the verdict is not 0, else the rows'
                description (dtypes and row shapes), compared across ranks
==============  ===============================================================================

Every rank composes the same message from the same table, so a problem anywhere raises the same
exception on every rank. Cross-rank conditions on the words the caller checks on the table."""

import struct

import numpy

from . import _validate
from ._staged import Plan

#: Operation codes carried in a ballot.
OP_NAMES = {1: "alltoallv", 2: "alltoall_counts", 3: "exchange_layout"}
OP_CODES = {name: code for code, name in OP_NAMES.items()}

#: Verdict codes carried in a ballot, and the exception each one raises.
VALID, BAD_VALUE, BAD_TYPE = 0, 1, 2
_ERRORS = {BAD_VALUE: ValueError, BAD_TYPE: TypeError}

#: Bytes of message text in a ballot (longer messages are cut, ending in "...").
TEXT_BYTES = 256
_HEADER = 2


def _text_bytes(text):
    """``text`` as exactly ``TEXT_BYTES`` bytes: UTF-8, zero padded, cut with "..."."""
    raw = text.encode("utf-8", "replace")
    if len(raw) > TEXT_BYTES:
        raw = raw[:TEXT_BYTES - 3] + b"..."
    return raw.ljust(TEXT_BYTES, b"\0")


def _decode_text(words):
    return numpy.ascontiguousarray(words).tobytes().rstrip(b"\0").decode("utf-8", "replace")


class Ballot:
    """One rank's ballot of ``n`` words and the gathered table, in buffers reused from call to call;
    the valid path packs and reads them with one ``struct`` call each."""

    def __init__(self, rank, size, n):
        self.rank = rank
        self.size = size
        self.n = n
        width = _HEADER + n + TEXT_BYTES // 8
        self.mine = numpy.zeros(width, dtype=numpy.int64)
        self.table = numpy.zeros((size, width), dtype=numpy.int64)
        self._text_cache = {}
        record = f"{_HEADER + n}q{TEXT_BYTES}s"
        self._pack = struct.Struct("=" + record).pack_into
        self._unpack = struct.Struct("=" + record * size).unpack_from
        self._stride = _HEADER + n + 1  # items per rank in the unpacked table

    def fill(self, op, error, words, text):
        """Write this rank's ballot: ``op`` code, local ``error`` or None, ``n`` ints (ignored with
        an error), and ``text`` naming the rows."""
        mine = self.mine
        if error is not None:
            mine[0] = BAD_TYPE if isinstance(error, TypeError) else BAD_VALUE
            mine[1] = op
            mine[_HEADER:_HEADER + self.n] = -1
            mine[_HEADER + self.n:] = numpy.frombuffer(_text_bytes(str(error)), numpy.int64)
            return
        raw = self._text_cache.get(text)
        if raw is None:
            if len(self._text_cache) > 64:
                self._text_cache.clear()
            raw = self._text_cache[text] = _text_bytes(text)
        self._pack(mine, 0, VALID, op, *words, raw)

    def all_valid(self):
        """True when the table shows no local error, one operation and one text (the fast test)."""
        stride = self._stride
        flat = self._unpack(self.table)
        if any(flat[0::stride]):
            return False
        ops = flat[1::stride]
        texts = flat[_HEADER + self.n::stride]
        return ops.count(ops[0]) == self.size and texts.count(texts[0]) == self.size

    def verdict(self, name):
        """The exception every rank raises for the table (message prefixed by ``name``), or None."""
        table, n = self.table, self.n
        status = table[:, 0]
        ops = table[:, 1]
        if status.any():
            bad = numpy.flatnonzero(status)
            first = int(bad[0])
            text = _decode_text(table[first, _HEADER + n:])
            if len(bad) > 1:
                text += f" (also invalid on rank{'s' if len(bad) > 2 else ''} " \
                        f"{', '.join(str(int(r)) for r in bad[1:])})"
            return _ERRORS[int(status[first])](f"{name}: {text}")
        if (ops != ops[0]).any():
            other = int(numpy.flatnonzero(ops != ops[0])[0])
            return ValueError(f"collective mismatch: rank 0 called {OP_NAMES.get(int(ops[0]))} "
                              f"but rank {other} called {OP_NAMES.get(int(ops[other]))}")
        texts = table[:, _HEADER + n:]
        differ = numpy.flatnonzero((texts != texts[0]).any(axis=1))
        if len(differ):
            r = int(differ[0])
            return ValueError(f"{name}: rows differ across ranks: rank 0 has "
                              f"{_decode_text(texts[0])}, rank {r} has {_decode_text(texts[r])}")
        return None

    def words(self):
        """(W, n) int64: every rank's words from the last gathered table (a view)."""
        return self.table[:, _HEADER:_HEADER + self.n]


class Agreement:
    """The communicators' agreement calls (a mixin of ``Communicator``): the layouts' numbers, the
    agreement round and the vote of explicit-splits calls. Reads the communicator's ``rank``,
    ``size``, ``validate``, ``_side``, ``_ballots``, ``_layouts``, ``_descriptions`` and
    ``check_usable``."""

    def next_layout_number(self):
        """Number the next layout agreed here (1, 2, ...); equal across ranks
        (``Plan.generation``)."""
        self._layouts += 1
        return self._layouts

    def agree(self, op, error, words, *, text="", what=None, counted=True):
        """One agreement round (one host allgather): every rank shows its local verdict, ``words``
        and ``text``, so bad arguments anywhere raise the same exception on every rank before data
        moves.

        Args:
            op: ``"alltoallv"``, ``"alltoall_counts"`` or ``"exchange_layout"``; ranks calling
                different ones raise ValueError.
            error: this rank's local ``TypeError``/``ValueError``, or None.
            words: n ints (n equal on every rank); not read with an error.
            text: names this rank's rows (dtypes, row shapes); must match on every rank.
            what: the call, prefixed to messages (default ``op``).
            counted: False leaves the round out of ``host_collectives``.
        Returns:
            (W, n) int64 NumPy array, row r from rank r: a view valid until the next round of n
            words.
        Raises:
            TypeError, ValueError: the first invalid rank's error (naming the invalid ranks),
                another collective or another ``text`` on some rank: the same message on every rank.
            TimeoutError: a rank did not join within ``timeout`` s; the communicator is aborted.
            RuntimeError: the communicator is aborted or closed."""
        self.check_usable()
        what = what or op
        ballot = self._ballots.get(len(words))
        if ballot is None:
            ballot = self._ballots[len(words)] = Ballot(self.rank, self.size, len(words))
        ballot.fill(OP_CODES[op], error, words, text)
        self._side.allgather_into(ballot.mine, ballot.table, f"{what} (agreement)", counted)
        if not ballot.all_valid():
            raise ballot.verdict(what)
        return ballot.words()

    def check(self, send_counts, recv_counts, description, *, error=None, validate=None,
              what="alltoallv"):
        """The vote of an explicit-splits call: one agreement round (:meth:`agree`) unless
        validation is off; every rank raises the same exception if a local ``error``, counts not
        matching the peers', or a differing ``description`` is found anywhere.

        Args:
            send_counts, recv_counts: W ints each (rows), or None with ``error``.
            description: this rank's rows in the user's terms (precision, dtype, D); compared.
            error: this rank's local ``TypeError``/``ValueError``, or None.
            validate: False skips the vote (``error`` raised locally, no plan); None: the default.
            what: the call, prefixed to messages.
        Returns:
            The :class:`~mxcomm.comm.Plan` of every rank's counts (None without a vote).
        Raises:
            ValueError, TypeError: invalid here or on another rank (same message everywhere).
            TimeoutError: a rank did not join within ``timeout`` s; the communicator is aborted."""
        self.check_usable()
        if not (self.validate if validate is None else validate):
            if error is not None:
                raise error
            return None
        plan = Plan(self.rank, _validate.vote_counts(self, "alltoallv", error, send_counts,
                                                     recv_counts, description, what))
        plan.calls = self._side.collectives  # the vote's number: what the transports carry
        return plan

    def _plan(self, send, send_counts, recv_counts, out, send_offsets, recv_offsets, validate):
        """``_validate.check_alltoallv`` of an ``alltoallv`` call (locally, then the vote)."""
        return _validate.check_alltoallv(
            self, send, send_counts, recv_counts, out, send_offsets, recv_offsets,
            self.validate if validate is None else validate, self._descriptions)
