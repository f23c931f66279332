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

from ._staged import (MAX_BATCH, batched, kind_base, kind_word, landed, layout_tag, pieces,
                      regions, row_bytes_of, send_order)

_NONE = {}  # no schedule of a plan yet


class PullTransport:
    """Receivers pull their rows from the senders' staging; ``memory``: ``_ipc.CudaPeerMemory`` or
    ``_shm.HostPeerMemory``. Each (plan, row layout, kind, consumption) is worked out once into a
    :class:`_Schedule`, kept while the plan lives and the staging stays where it is."""

    name = "pull"

    def __init__(self, comm, memory):
        self._comm = comm
        self.memory = memory
        self.kinds = {}  # 16-bit kind hash -> kind text, for mismatch messages
        self._schedules = weakref.WeakKeyDictionary()  # plan -> {run's key: _Schedule}
        self._epoch = memory.epoch

    def run(self, rows, plan, outs, in_place, stream, landing=None, beside=None, tag=None):
        """The exchange of ``plan`` (``Communicator.exchange``'s arguments, ``outs`` a tuple or
        None). ``beside(stream)``: work enqueued after the own rows, before the join, overlapping
        the pulls (hier's exchange between nodes); ``tag``: the call tag, None for ``plan``'s.

        Every ready word carries the kind's hash and the call tag, so a peer at another call is
        found before a row is read (host: RuntimeError at once; GPU: the watchdog aborts, the next
        call raises)."""
        memory = self.memory
        key = (rows.arrays, rows.kind, in_place, landing)
        schedule = self._schedules.get(plan, _NONE).get(key) \
            if memory.epoch == self._epoch else None
        if schedule is None:  # the first call of these rows with this staging
            schedule = self._schedule(plan, key, stream)
        if tag is None:  # call_tag(plan)
            tag = schedule.layout_tag | (plan.calls & 0xFF)
        if outs is None and not in_place:
            outs = self._comm._new_arrays(rows.arrays, plan.rows_received)
        memory.begin(stream)
        produce = rows.produce
        for begin, end, slots, signals in schedule.sends:
            if end > begin:
                produce(begin, end, slots, stream)
            if signals:
                memory.signal_ready(signals, tag, stream)
        # pulls are enqueued before the own rows' launches, so copies need not wait for the host
        if in_place:
            consume = rows.consume
            for awaits, views in schedule.receives:
                side = memory.await_ready(awaits, tag)
                for begin, end, held in views:
                    if end > begin:
                        consume(begin, end, held, side)
        else:
            for awaits, copies in schedule.receives:
                memory.copy_all(copies, outs, memory.await_ready(awaits, tag))
        own = schedule.own
        if own is not None:  # own rows, last: straight to the result, or kept by the consumer
            begin, end, at, slots, lands = own
            if in_place:
                rows.keep(begin, end, at, slots, stream)
            else:
                for first, last, out_row in lands:
                    slots = ()
                    for o in outs:
                        slots += (row_range(o, out_row, out_row + last - first),)
                    produce(first, last, slots, stream)
        if beside is not None:
            beside(stream)
        # where a device wait failed, the end poisons what the copies or the consumer wrote
        memory.end(stream, getattr(rows, "results", ()) if in_place else outs)
        return outs

    def _schedule(self, plan, key, stream):
        """The :class:`_Schedule` of ``plan`` for ``key`` (row arrays, kind, in place, landing),
        cached until the staging moves; a new one after the staging is grown for it (collective
        where it grows)."""
        arrays, kind, in_place, landing = key
        row_bytes = row_bytes_of(arrays)
        memory = self.memory
        memory.reserve(plan.staging_bytes(row_bytes), stream)
        if memory.epoch != self._epoch:  # the staging moved: forget every view of it
            self._schedules.clear()
            self._epoch = memory.epoch
        by_key = self._schedules.setdefault(plan, {})
        schedule = by_key.get(key)
        if schedule is None:
            text = kind + ", read in place" if in_place else kind
            base = kind_base(text)
            self.kinds.setdefault(base, text)
            schedule = by_key[key] = _Schedule(plan, memory, arrays, row_bytes, base, in_place,
                                               landing)
        return schedule

    def close(self):
        self._schedules.clear()
        self.memory.close()

    def abandon(self):
        """After an abort: forget the schedules; the memory keeps what peers may still map."""
        self._schedules.clear()
        self.memory.abandon()


class _Schedule:
    """One plan's exchange for one row layout, worked out.

    Attributes:
        sends: ``(begin, end, slots, signals)`` per producer launch, in send order: rows ``[begin,
            end)`` into ``slots`` (this rank's staging), then ``(peer, piece, kind)`` words
            signalled; one per peer and piece, or (``_staged.batched``) one or two ranges, every
            peer signalled after the last.
        own: ``(begin, end, at, slots, lands)`` of the own rows (produced last, received at row
            ``at``; ``slots`` in place only; ``lands``: ``[(first, last, result row), ...]``), or
            None.
        receives: ``(awaits, work)`` in pull order: copies ``[(peer, staging offset, array index,
            result byte offset, bytes), ...]``, or in place ``[(begin, end, views of the sender's
            staging), ...]``; one per sender and piece, or one for all when batched.
        layout_tag: ``_staged.layout_tag`` of the plan."""

    __slots__ = ("sends", "own", "receives", "layout_tag")

    def __init__(self, plan, memory, arrays, row_bytes, base, in_place, landing):
        rank, size = plan.rank, plan.size
        bases, _ = regions(row_bytes, plan.rows_sent)

        def slots(first, count):
            return tuple(memory.local(b + first * rb, (count,) + shape, dtype)
                         for b, rb, (shape, dtype) in zip(bases, row_bytes, arrays))

        self.sends, self.own, self.receives = [], None, []
        self.layout_tag = layout_tag(plan)
        kind = kind_word(base)  # each call's tag is OR-ed in by the memory's signals and waits
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
