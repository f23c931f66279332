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
every rank produces first the rows its step-1 receiver pulls first.
"""

from ._staged import kind_base, kind_word, pieces, regions, row_bytes_of, send_order


class PullTransport:
    """Receivers pull their rows from the senders' staging (module docstring).

    Args:
        comm: the communicator.
        memory: the peer memory (``_ipc.CudaPeerMemory`` or ``_shm.HostPeerMemory``).
    """

    name = "pull"

    def __init__(self, comm, memory):
        self._comm = comm
        self.memory = memory
        self.kinds = {}  # 16-bit kind hash -> kind text, for mismatch messages

    def _kind(self, text):
        base = kind_base(text)
        self.kinds.setdefault(base, text)
        return base

    def run(self, rows, plan, outs, in_place, stream):
        comm, memory = self._comm, self.memory
        rank, size = comm.rank, comm.size
        row_bytes = row_bytes_of(rows.arrays)
        base = self._kind(rows.kind + (", read in place" if in_place else ""))
        memory.reserve(plan.staging_bytes(row_bytes), stream)
        if outs is None and not in_place:
            outs = comm._new_arrays(rows.arrays, plan.rows_received)
        memory.begin(stream)
        bases, _ = regions(row_bytes, plan.rows_sent)
        own = None
        for peer in send_order(rank, size):
            begin = plan.send_offsets[peer]
            count = plan.send_counts[peer]
            if peer == rank:
                if count and not in_place:  # own rows go straight to the result
                    at = plan.recv_offsets[rank]
                    rows.produce(begin, begin + count,
                                 tuple(o[at:at + count] for o in outs), stream)
                elif count:
                    own = self._slots(rows.arrays, bases, row_bytes, begin, count)
                    rows.produce(begin, begin + count, own, stream)
                continue
            kind = kind_word(base, count)
            parts = [(0, count)] if in_place else pieces(count, row_bytes)
            for piece, (lo, hi) in enumerate(parts):
                if hi > lo:
                    rows.produce(begin + lo, begin + hi,
                                 self._slots(rows.arrays, bases, row_bytes, begin + lo, hi - lo),
                                 stream)
                memory.signal_ready(peer, piece, kind, stream)
        if in_place:
            self._consume_in_place(rows, plan, base, row_bytes, own, stream)
        else:
            self._pull(rows, plan, base, row_bytes, outs)
        memory.end(stream)
        return outs

    def _slots(self, arrays, bases, row_bytes, first, count):
        """This rank's staging slots for ``count`` rows from row ``first`` of the send order."""
        local = self.memory.local
        return tuple(local(b + first * rb, (count,) + shape, dtype)
                     for b, rb, (shape, dtype) in zip(bases, row_bytes, arrays))

    def _senders(self, plan, row_bytes):
        """``(peer, first row of mine in the peer's staging, the peer's array bases)`` in pull
        order (step 1 first)."""
        rank, size = plan.rank, plan.size
        for step in range(1, size):
            peer = (rank - step) % size
            peer_sent = plan.sent[peer]
            yield peer, sum(peer_sent[:rank]), regions(row_bytes, sum(peer_sent))[0]

    def _pull(self, rows, plan, base, row_bytes, outs):
        """Copy every sender's rows into ``outs`` on the side stream, piece by piece as each is
        signalled."""
        memory = self.memory
        for peer, first, peer_bases in self._senders(plan, row_bytes):
            count = plan.recv_counts[peer]
            at = plan.recv_offsets[peer]
            kind = kind_word(base, count)
            for piece, (lo, hi) in enumerate(pieces(count, row_bytes)):
                side = memory.await_ready(peer, piece, kind)
                for b, rb, o in zip(peer_bases, row_bytes, outs):
                    if hi > lo and rb:
                        memory.copy(peer, b + (first + lo) * rb, o[at + lo:at + hi], side)

    def _consume_in_place(self, rows, plan, base, row_bytes, own, stream):
        """Hand the own rows (in the staging) to the consumer on the caller's stream, then each
        sender's, where they are, on the side stream once the sender has signalled them."""
        memory = self.memory
        if own is not None:
            begin = plan.recv_offsets[plan.rank]
            rows.consume(begin, begin + plan.recv_counts[plan.rank], own, stream)
        for peer, first, peer_bases in self._senders(plan, row_bytes):
            count = plan.recv_counts[peer]
            side = memory.await_ready(peer, 0, kind_word(base, count))
            if count:
                views = tuple(memory.peer_view(peer, b + first * rb, (count,) + shape, dtype)
                              for b, rb, (shape, dtype) in zip(peer_bases, row_bytes,
                                                               rows.arrays))
                begin = plan.recv_offsets[peer]
                rows.consume(begin, begin + count, views, side)

    def close(self):
        self.memory.close()
