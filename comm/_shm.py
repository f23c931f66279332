"""Peer memory of the pull transport on the host: MPI shared windows (all ranks on one node). The
protocol of ``_ipc`` (docs/design.md, "Signals on the device") with the generation on the host:
signals are stores into a peer's flags after a memory barrier, waits are host spins bounded by the
timeout. A rank's flags, 64-bit words: ``ready[W * MAX_PIECES]`` (generation << 32 | kind) then
``done[W]`` (generation << 32)."""

import math
import time

import numpy

from ._board import _ranks
from ._staged import MAX_PIECES, describe_mismatch

_GROWTH = 1.25
_MASK = 0xFFFFFFFF
#: The kind an aborted rank writes in its ready words for the exchange it gave up: a later peer
#: raises at once naming it, instead of timing out and blaming the ranks that were there.
_GAVE_UP = 0xFFFFFFFF
#: The same where it gave up on finding the exchange mis-paired: peers raise that error too.
_MISPAIRED = 0xFFFFFFFE
_SPIN_S = 1e-3
_MAX_SLEEP_S = 1e-3


def reached(have, want):
    """True when 32-bit generation ``have`` is at or past ``want``, modulo 2^32."""
    return ((have - want) & _MASK) < 0x80000000


class HostPeerMemory:
    """Staging and flags of all ranks of one node in MPI shared windows; ``comm``: the MPI
    communicator (windows, timeout, its transport's ``kinds``); ``generation``: the first exchange's
    minus one (tests start near 2^32)."""

    def __init__(self, comm, generation=0):
        self._comm = comm
        self._size = comm.size
        self._rank = comm.rank
        self._ready_words = self._size * MAX_PIECES
        self.generation = generation & _MASK
        self._current = self.generation  # the generation of the exchange begun last
        self._mispaired = False  # this rank gave up on finding its exchange mis-paired
        self._flags_window = None  # allocated with the first staging (collective)
        self._flags = []
        self._window = None
        self._segments = {}
        self.capacity = 0
        #: Counts the staging allocations: views of the staging are valid while it stays.
        self.epoch = 0

    def _allocate_flags(self):
        """The flags window at the starting generation (collective). ``MPI_Win_allocate_shared``
        cannot be bounded, so a bounded side-channel barrier comes first: a rank that never arrives
        is named by a TimeoutError (the communicator aborted) instead of hanging its peers."""
        side = self._comm._side
        words = self._ready_words + self._size
        side.barrier("peer memory setup (every rank in its first exchange)")
        self._flags_window = side.MPI.Win.Allocate_shared(8 * words, 8, comm=side.mpi)
        self._flags_window.Lock_all()
        self._flags = [numpy.frombuffer(self._flags_window.Shared_query(p)[0], dtype=numpy.uint64)
                       for p in range(self._size)]
        self._flags[self._rank][:] = numpy.uint64(self.generation << 32)
        side.barrier("peer memory setup (flags)")

    # ------------------------------------------------------------------------------- staging
    def reserve(self, nbytes, stream):
        """Make every rank's segment hold ``nbytes`` (equal on every rank; collective when it
        grows). The barrier before freeing the old window follows every rank's "done", so no read is
        in flight."""
        if nbytes <= self.capacity:
            return
        side = self._comm._side
        if self._flags_window is None:
            self._allocate_flags()
        if self._window is not None:
            side.barrier("peer memory growth")
            self._free_staging()
        capacity = max(1, int(nbytes * _GROWTH))
        self.epoch += 1
        self._window = side.MPI.Win.Allocate_shared(capacity, 1, comm=side.mpi)
        side.collectives += 1
        for peer in range(self._size):
            buf, _ = self._window.Shared_query(peer)
            self._segments[peer] = numpy.frombuffer(buf, dtype=numpy.uint8)
        self.capacity = capacity

    def local(self, offset, shape, dtype):
        """A NumPy view of this rank's segment: ``shape`` of ``dtype`` from byte ``offset``."""
        return self.peer_view(self._rank, offset, shape, dtype)

    def peer_view(self, peer, offset, shape, dtype):
        """A NumPy view of ``peer``'s segment: ``shape`` of ``dtype`` from byte ``offset``."""
        dtype = numpy.dtype(dtype)
        raw = self._segments[peer][offset:offset + math.prod(shape) * dtype.itemsize]
        return raw.view(dtype).reshape(shape)

    def copy_all(self, copies, outs, side):
        """Copy each ``(peer, offset, array index, out_offset, nbytes)`` of ``copies`` from
        ``peer``'s segment into the C-contiguous ``outs[array index]``."""
        segments = self._segments
        for peer, offset, index, out_offset, nbytes in copies:
            out = outs[index].reshape(-1).view(numpy.uint8)
            out[out_offset:out_offset + nbytes] = segments[peer][offset:offset + nbytes]

    # --------------------------------------------------------------------------------- flags
    def begin(self, stream):
        """Open the next generation: wait until every peer is done reading this rank's staging."""
        want = self.generation
        self._current = (want + 1) & _MASK
        done = self._flags[self._rank][self._ready_words:]
        for p in range(self._size):  # no spin where no peer is still reading (not reached)
            if p != self._rank and ((int(done[p]) >> 32) - want) & _MASK >= 0x80000000:
                self._spin(lambda: [p for p in range(self._size)
                                    if p != self._rank and not reached(int(done[p]) >> 32, want)],
                           "finish reading this rank's rows of the previous exchange")
                break
        self.generation = (want + 1) & _MASK

    def signal_ready(self, signals, tag, stream):
        """Signal each ``(peer, piece, kind)`` of ``signals``, the call's ``tag`` OR-ed into the
        kind: its rows of ``piece`` are staged here."""
        self._flags_window.Sync()  # the rows are stored before the flags
        for peer, piece, kind in signals:
            self._flags[peer][self._rank * MAX_PIECES + piece] = numpy.uint64(
                (self.generation << 32) | kind | tag)

    def await_ready(self, awaits, tag):
        """Wait until each ``(peer, piece, kind)`` of ``awaits`` is signalled, the call's ``tag``
        OR-ed into the kind; returns 0 (the host's stream). RuntimeError at once for another kind
        or a peer that gave up or found the exchange mis-paired; TimeoutError naming the ranks
        still missing."""
        flags = self._flags[self._rank]
        gen = self.generation

        def fail(what, mispaired):
            self._mispaired = self._mispaired or mispaired
            error = RuntimeError(f"exchange on rank {self._rank}: {what}; the communicator is "
                                 f"aborted")
            self._comm._fail(error, raised=True)
            raise error

        def missing():
            late, gave_up, mispaired = [], [], []
            for peer, piece, kind in awaits:
                kind |= tag
                value = int(flags[peer * MAX_PIECES + piece])
                if value >> 32 != gen:
                    late.append(peer)
                elif value & _MASK in (_GAVE_UP, _MISPAIRED):
                    seen = gave_up if value & _MASK == _GAVE_UP else mispaired
                    if peer not in seen:
                        seen.append(peer)
                elif value & _MASK != kind:
                    fail(describe_mismatch(peer, kind, value & _MASK,
                                           self._comm._transport.kinds), True)
            if mispaired and not late:  # every peer came; some found the exchange mis-paired
                fail(f"{_ranks(mispaired)} found this exchange (generation {gen}) mis-paired, a "
                     f"rank at another call or kind of exchange, and gave up on it", True)
            if gave_up and not late:  # the others gave up, and no other rank is missing
                fail(f"{_ranks(gave_up)} had given up on this exchange (generation {gen}) before "
                     f"this rank came to it: this rank is late (its peers timed out waiting for "
                     f"it), or they failed", False)
            return late

        for peer, piece, kind in awaits:  # no spin where every peer has signalled
            if int(flags[peer * MAX_PIECES + piece]) != (gen << 32) | kind | tag:
                self._spin(missing, "send its rows")
                break
        self._flags_window.Sync()
        return 0

    def end(self, stream, outs=()):
        """Tell every peer this rank is done reading its staging (``outs`` unused: a failed wait
        raised)."""
        value = numpy.uint64(self.generation << 32)
        slot = self._ready_words + self._rank
        for p in range(self._size):
            if p != self._rank:
                self._flags[p][slot] = value

    def give_up(self):
        """Mark this rank's ready words to every peer :data:`_GAVE_UP` (or :data:`_MISPAIRED`) for
        the exchange begun last, as its communicator was aborted. Local stores, never blocks."""
        if self._flags_window is None:
            return
        value = numpy.uint64((self._current << 32) | (_MISPAIRED if self._mispaired else
                                                       _GAVE_UP))
        for peer in range(self._size):
            if peer != self._rank:
                self._flags[peer][self._rank * MAX_PIECES:(self._rank + 1) * MAX_PIECES] = value

    def _spin(self, missing, what):
        """Spin (then sleep) until ``missing()`` is empty; after the timeout abort the communicator
        and raise TimeoutError naming the ranks."""
        late = missing()
        if not late:
            return
        comm = self._comm
        start = time.monotonic()
        sleep = 1e-5
        while late:
            now = time.monotonic()
            if now - start > comm.timeout:
                error = TimeoutError(
                    f"exchange on rank {self._rank}: {_ranks(late)} did not {what} within "
                    f"{comm.timeout:g} s (generation {self.generation}); the communicator is "
                    f"aborted")
                comm._fail(error, raised=True)
                raise error
            if now - start > _SPIN_S:
                time.sleep(sleep)
                sleep = min(2 * sleep, _MAX_SLEEP_S)
            late = missing()

    def _free_staging(self):
        self._segments.clear()
        self._window.Free()
        self._window = None
        self.capacity = 0

    def abandon(self):
        """After an abort: nothing (a window is freed only collectively, by :meth:`close`)."""

    def close(self):
        """Free the windows (collective, as their allocation was)."""
        if self._window is not None:
            self._free_staging()
        if self._flags_window is not None:
            self._flags.clear()
            self._flags_window.Unlock_all()
            self._flags_window.Free()
            self._flags_window = None
