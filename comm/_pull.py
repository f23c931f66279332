"""The ``pull`` transport (one node; docs/design.md, "The staged exchange" and "Signals on the
device"): each rank produces its peers' rows into its own staging, which the peers have mapped
(``_ipc``, ``_shm``), and signals each; receivers wait on a side stream, then copy the rows (copy
engines) or consume them where they are::

    caller stream:  begin  produce(r+1) signal  produce(r+2) signal ...  produce(r)  .. join
    side stream:           wait(r-1) pull(r-1)  wait(r-2) pull(r-2) ...  done(all)

``begin`` waits for every peer's "done" of the previous generation; ``join`` orders the caller's
stream after the side stream. No host meets another's: the ordering is on the devices."""

import weakref

from mxcomm._driver import row_range

from ._staged import (MAX_BATCH, batched, call_tag, kind_base, kind_word, landed, pieces,
                      regions, row_bytes_of, send_order)


class PullTransport:
    """Receivers pull their rows from the senders' staging; ``memory``: ``_ipc.CudaPeerMemory`` or
    ``_shm.HostPeerMemory``. Each (plan, row layout, kind, consumption) is worked out once into a
    :class:`_Schedule`, kept while the plan lives and the staging stays where it is."""

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
        """The exchange of ``plan`` (``StagedExchange.exchange``'s arguments, ``outs`` a tuple or
        None). ``beside(stream)``: work enqueued after the own rows, before the join, overlapping
        the pulls (hier's exchange between nodes); ``tag``: the call tag, None for ``plan``'s.

        Every ready word carries the kind's hash and the call tag, so a peer at another call is
        found before a row is read (host: RuntimeError at once; GPU: the watchdog aborts, the next
        call raises)."""
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
        # pulls are enqueued before the own rows' launches, so copies need not wait for the host
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
        """The :class:`_Schedule` of ``plan`` for these rows, cached until the staging moves."""
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
    """The schedule's ``(peer, piece, kind)`` words with the call's ``tag`` OR-ed into each kind."""
    return tuple([(peer, piece, kind | tag) for peer, piece, kind in words])


class _Schedule:
    """One plan's exchange for one row layout, worked out.

    Attributes:
        sends: ``(begin, end, slots, signals)`` per producer launch, in send order: rows ``[begin,
            end)`` into ``slots`` (this rank's staging), then ``signals`` (``(peer, piece, kind)``
            words) signalled. One piece of one peer per entry, or, when batched
            (``_staged.batched``), one or two ranges with every peer signalled after the last.
        own: ``(begin, end, at, slots, lands)`` of the own rows (produced last, received at row
            ``at``; ``slots`` in place only; ``lands``: ``[(first, last, result row), ...]``
            produced straight into the result), or None.
        receives: ``(awaits, work)`` in pull order: wait for ``awaits``, then ``work``: copies
            ``[(peer, staging offset, array index, result byte offset, bytes), ...]``, or in place
            ``[(begin, end, views of the sender's staging), ...]``. One entry per sender and piece,
            or one awaiting every sender when batched."""

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
