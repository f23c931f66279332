"""The ``pull`` transport of the staged exchange: receivers read the senders' memory (one node).

Every rank produces its peers' rows into its own staging memory, which every peer has mapped
(CUDA IPC on GPUs, ``_ipc``; an MPI shared window on the host, ``_shm``), and signals each peer
once its rows are there. Receivers wait for each sender's signal on a side stream, then copy the
rows with copy engines into the result, or hand them to the consumer where they are::

    caller stream:  begin  produce(r+1) signal  produce(r+2) signal ...  produce(r)  .. join
    side stream:           wait(r-1) pull(r-1)  wait(r-2) pull(r-2) ...  done(all)

``begin`` opens a new generation and waits until every peer has signalled "done" for the previous
one (its reads of this rank's staging are over); ``join`` orders the caller's stream after the side
stream, so the next exchange's ``begin`` follows this one's signals. Nothing here meets the other
ranks' hosts: the ordering is on the devices, through the flags of the peer memory (see
docs/design.md, "Signals on the device"). Step ``s`` pairs sender ``r`` with receiver ``r + s``:
every rank produces first the rows its step-1 receiver pulls first. A small exchange
(``_staged.batched``) produces every peer's rows in one launch (two around the own rows), signals
every peer in one, and waits for every sender in one: as many launches at 4 ranks as at 2.
"""

import weakref

from mxcomm._driver import row_range

from ._staged import (MAX_BATCH, batched, call_tag, kind_base, kind_word, landed, pieces,
                      regions, row_bytes_of, send_order)


class PullTransport:
    """Receivers pull their rows from the senders' staging (module docstring).

    Args:
        comm: the communicator.
        memory: the peer memory (``_ipc.CudaPeerMemory`` or ``_shm.HostPeerMemory``).

    What an exchange of a plan does (which rows go where, the staging slots, the kinds, the
    pieces, the copies) is worked out once per (plan, row layout, kind, consumption) into a
    :class:`_Schedule`, kept while the plan lives and the staging buffers stay where they are; a
    call then only produces, signals, waits and copies (docs/design.md, "The staged exchange").
    """

    name = "pull"

    def __init__(self, comm, memory):
        self._comm = comm
        self.memory = memory
        self.kinds = {}  # 16-bit kind hash -> kind text, for mismatch messages
        self._bases = {}  # kind text -> 16-bit hash
        self._schedules = weakref.WeakKeyDictionary()  # plan -> {key: _Schedule}
        self._epoch = memory.epoch

    def _kind(self, text):
        base = self._bases.get(text)
        if base is None:
            base = self._bases[text] = kind_base(text)
            self.kinds.setdefault(base, text)
        return base

    def run(self, rows, plan, outs, in_place, stream, landing=None, beside=None, tag=None):
        """The exchange of ``plan`` (``StagedExchange.exchange``'s arguments, ``outs`` a tuple
        or None); ``beside``: None, or ``beside(stream)``, work enqueued on ``stream`` after the
        own rows and before the join, so it runs while the copy engines pull (the ``hier``
        transport's exchange between nodes); ``tag``: the call's tag (``_staged.call_tag``),
        None for ``plan``'s.

        Every ready word carries the kind's hash and the call's tag: a receiver whose peer is
        at another call (a rank failed one alone and went on, or uses a stale layout) finds
        it in its wait, on every rank, before it reads a row (the host: RuntimeError at once;
        a GPU: the wait reports it, the watchdog aborts, the next call or ``wait`` raises).
        """
        memory = self.memory
        if tag is None:
            tag = call_tag(plan)
        arrays = rows.arrays
        row_bytes = row_bytes_of(arrays)
        base = self._kind(rows.kind + ", read in place" if in_place else rows.kind)
        memory.reserve(plan.staging_bytes(row_bytes), stream)
        schedule = self._schedule(plan, arrays, row_bytes, base, in_place, landing)
        if outs is None and not in_place:
            outs = self._comm._new_arrays(arrays, plan.rows_received)
        memory.begin(stream)
        produce = rows.produce
        signal = memory.signal_ready
        for begin, end, slots, signals in schedule.sends:
            if end > begin:
                produce(begin, end, slots, stream)
            if signals:
                signal(_tagged(signals, tag), stream)
        # The side stream's waits and pulls are enqueued before the own rows' launches (which
        # a landing splits into one per run): the copy engines can start as soon as a peer's
        # rows are ready, not once the host has enqueued this rank's own rows too.
        await_ready = memory.await_ready
        if in_place:
            consume = rows.consume
            for awaits, views in schedule.receives:
                side = await_ready(_tagged(awaits, tag))
                for begin, end, held in views:
                    if end > begin:
                        consume(begin, end, held, side)
        else:
            copy_all = memory.copy_all
            for awaits, copies in schedule.receives:
                copy_all(copies, outs, await_ready(_tagged(awaits, tag)))
        own = schedule.own
        if own is not None:  # own rows, last: straight to the result, or kept by the consumer
            begin, end, at, slots, lands = own
            if in_place:
                rows.keep(begin, end, at, slots, stream)
            else:
                for first, last, out_row in lands:
                    produce(first, last, tuple(row_range(o, out_row, out_row + last - first)
                                               for o in outs), stream)
        if beside is not None:
            beside(stream)
        # where a device wait failed, the end poisons what the copies or the consumer wrote
        memory.end(stream, getattr(rows, "results", ()) if in_place else outs)
        return outs

    def _schedule(self, plan, arrays, row_bytes, base, in_place, landing=None):
        """The :class:`_Schedule` of ``plan`` for these rows, from the cache or made now."""
        if self.memory.epoch != self._epoch:  # the staging moved: forget every view of it
            self._schedules.clear()
            self._epoch = self.memory.epoch
        by_key = self._schedules.get(plan)
        if by_key is None:
            by_key = self._schedules[plan] = {}
        key = (arrays, base, in_place, landing)
        schedule = by_key.get(key)
        if schedule is None:
            schedule = by_key[key] = _Schedule(plan, self.memory, arrays, row_bytes, base,
                                               in_place, landing)
        return schedule

    def close(self):
        self._schedules.clear()
        self.memory.close()


def _tagged(words, tag):
    """``(peer, piece, kind)`` words of a schedule with the call's ``tag`` OR-ed into each
    kind (a schedule serves every call of its plan; the tag is the call's)."""
    return tuple([(peer, piece, kind | tag) for peer, piece, kind in words])


class _Schedule:
    """One plan's exchange for one row layout, worked out (:class:`PullTransport`).

    Attributes:
        sends: ``(begin, end, slots, signals)`` per launch of the producer, in send order: rows
            ``[begin, end)`` of the send order go into ``slots`` (views of this rank's
            staging), then each ``(peer, piece, kind)`` of ``signals`` is signalled (one launch
            for one or all). A piece of one peer's rows per entry; where the peers' rows are few
            (``_staged.batched``), every peer's rows in one or two ranges (those of the peers
            after this rank, then before), every peer signalled after the last.
        own: ``(begin, end, at, slots, lands)`` of this rank's own rows (produced last),
            received at row ``at``; ``slots`` (in place) the staging they are kept through;
            ``lands``: ``[(first, last, result row), ...]``, the rows of the send order
            produced straight into the result at that row (several where a ``landing`` splits
            them). None without own rows.
        receives: ``(awaits, work)`` in pull order (step 1 first): wait for each ``(peer,
            piece, kind)`` of ``awaits`` (one launch for one or all), then ``work``: with
            copies, ``[(peer, offset in its staging, array index, byte offset in the result,
            bytes), ...]`` (one copy per array, or per array and landed segment); in place,
            ``[(begin, end, views), ...]``, views of a sender's staging (mapped here) holding
            received rows ``[begin, end)``. One entry per sender and piece; where the received
            rows are few (``_staged.batched``), one entry awaiting every sender.
    """

    __slots__ = ("sends", "own", "receives")

    def __init__(self, plan, memory, arrays, row_bytes, base, in_place, landing):
        rank, size = plan.rank, plan.size
        bases, _ = regions(row_bytes, plan.rows_sent)

        def slots(first, count):
            return tuple(memory.local(b + first * rb, (count,) + shape, dtype)
                         for b, rb, (shape, dtype) in zip(bases, row_bytes, arrays))

        self.sends, self.own, self.receives = [], None, []
        kind = kind_word(base)  # each call ORs its tag in (``_tagged``)
        peers = size - 1
        begin, count = plan.send_offsets[rank], plan.send_counts[rank]
        if count:
            at = plan.recv_offsets[rank]
            lands = [(begin + r - at, begin + r - at + n, out_row)
                     for r, out_row, n in landed(landing, at, at + count)]
            self.own = (begin, begin + count, at, slots(begin, count) if in_place else None,
                        lands)
        if 0 < peers <= MAX_BATCH and batched(plan.rows_sent - count, row_bytes):
            # the peers after this rank, then those before: each one range of the send order
            signals = tuple((peer, 0, kind) for peer in send_order(rank, size) if peer != rank)
            ranges = [(lo, hi) for lo, hi in ((begin + count, plan.rows_sent), (0, begin))
                      if hi > lo] or [(0, 0)]
            for lo, hi in ranges:
                self.sends.append((lo, hi, slots(lo, hi - lo), ()))
            self.sends[-1] = self.sends[-1][:3] + (signals,)
        else:
            for peer in send_order(rank, size):
                if peer == rank:
                    continue
                begin, count = plan.send_offsets[peer], plan.send_counts[peer]
                for piece, (lo, hi) in enumerate([(0, count)] if in_place
                                                 else pieces(count, row_bytes)):
                    self.sends.append((begin + lo, begin + hi, slots(begin + lo, hi - lo),
                                       ((peer, piece, kind),)))
        batch = 0 < peers <= MAX_BATCH and \
            batched(plan.rows_received - plan.recv_counts[rank], row_bytes)
        for step in range(1, size):
            peer = (rank - step) % size
            first = sum(plan.sent[peer][:rank])  # my rows' first row in the peer's staging
            peer_bases, _ = regions(row_bytes, sum(plan.sent[peer]))
            count, at = plan.recv_counts[peer], plan.recv_offsets[peer]
            if in_place:
                views = tuple(memory.peer_view(peer, b + first * rb, (count,) + shape, dtype)
                              for b, rb, (shape, dtype) in zip(peer_bases, row_bytes, arrays)) \
                    if count else ()
                self.receives.append((((peer, 0, kind),), [(at, at + count, views)]))
                continue
            # received row r is row r + first - at of the peer's staging
            starts = [(index, b + (first - at) * rb, rb)
                      for index, (b, rb) in enumerate(zip(peer_bases, row_bytes)) if rb]
            for piece, (lo, hi) in enumerate(pieces(count, row_bytes)):
                runs = landed(landing, at + lo, at + hi)
                copies = [(peer, b + r * rb, index, out_row * rb, n * rb)
                          for index, b, rb in starts for r, out_row, n in runs]
                self.receives.append((((peer, piece, kind),), copies))
        if batch and self.receives:  # one wait for every sender, then all the work
            self.receives = [(tuple(a for awaits, _ in self.receives for a in awaits),
                              [w for _, work in self.receives for w in work])]
