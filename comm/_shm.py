"""Peer memory of the pull transport on the host: MPI shared-memory windows, with flags.

Every rank of the communicator (all on one node) owns a segment of a staging window and a segment
of a flags window and reads the peers' segments directly (``MPI_Win_shared_query``). Work on the
host is synchronous, so signals are plain stores into a peer's flags (after a memory barrier) and
waits are host spins bounded by the communicator's timeout; the protocol is the device one of
``_ipc`` (docs/design.md, "Signals on the device"), with the generation kept on the host.

Flags of one rank, 64-bit words: ``ready[W * MAX_PIECES]`` (written by the senders: generation
<< 32 | kind) then ``done[W]`` (written by the receivers: generation << 32).
"""

import math
import time

import numpy

from ._staged import MAX_PIECES, describe_mismatch

_GROWTH = 1.25
_MASK = 0xFFFFFFFF
#: The kind a rank whose communicator was aborted writes into its ready words to the peers, for
#: the exchange it gave up: a peer that comes later raises at once, naming it, instead of
#: waiting a timeout and blaming the ranks that were there.
_GAVE_UP = 0xFFFFFFFF
#: What it writes instead where it gave up on finding the exchange mis-paired (a peer at another
#: call or kind): a peer that reads it before the mis-paired word raises the same kind of error.
_MISPAIRED = 0xFFFFFFFE
_SPIN_S = 1e-3
_MAX_SLEEP_S = 1e-3


def reached(have, want):
    """True when 32-bit generation ``have`` is at or past ``want``, modulo 2^32."""
    return ((have - want) & _MASK) < 0x80000000


class HostPeerMemory:
    """Staging and flags of all ranks of one node in MPI shared windows.

    Args:
        comm: the MPI communicator (its side channel allocates the windows; its timeout bounds
            the waits; its transport's ``kinds`` name mismatches).
        generation: the generation of the first exchange minus one (tests start near 2^32).
    """

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
        """The flags window, every rank's words set to the starting generation (collective).

        ``MPI_Win_allocate_shared`` cannot be bounded, so every rank first meets the others in a
        barrier of the side channel, which the timeout bounds: a rank that failed before its
        first exchange (or called another one) makes its peers time out there, naming it,
        instead of leaving them in the allocation. The staging's allocations follow a barrier
        too (this one's closing barrier, or that of its growth).

        Raises:
            TimeoutError: a rank did not come within the timeout (the communicator is aborted).
        """
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
        """Make every rank's segment hold ``nbytes`` (the same value on every rank: collective,
        only when it grows). Before freeing the old window every rank's reads of it are over:
        the barrier follows this rank's last "done" signals, which follow its reads."""
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
        """For each ``(peer, offset, array index, out_offset, nbytes)`` of ``copies``: copy
        ``nbytes`` bytes of ``peer``'s segment from byte ``offset`` into the C-contiguous array
        ``outs[array index]`` from its byte ``out_offset``."""
        segments = self._segments
        for peer, offset, index, out_offset, nbytes in copies:
            out = outs[index].reshape(-1).view(numpy.uint8)
            out[out_offset:out_offset + nbytes] = segments[peer][offset:offset + nbytes]

    # --------------------------------------------------------------------------------- flags
    def begin(self, stream):
        """Open the next generation: wait until every peer is done reading this rank's staging
        of the previous one."""
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

    def signal_ready(self, signals, stream):
        """Tell each ``peer`` of ``signals`` (``(peer, piece, kind)``) that its rows of
        ``piece`` are in this rank's staging."""
        self._flags_window.Sync()  # the rows are stored before the flags
        for peer, piece, kind in signals:
            self._flags[peer][self._rank * MAX_PIECES + piece] = numpy.uint64(
                (self.generation << 32) | kind)

    def await_ready(self, awaits):
        """Wait until each ``(peer, piece, kind)`` of ``awaits`` is signalled (a timeout names
        every rank still missing); return the stream to read the rows on (0: the host)."""
        flags = self._flags[self._rank]
        gen = self.generation

        def missing():
            late, gave_up, mispaired = [], [], []
            for peer, piece, kind in awaits:
                value = int(flags[peer * MAX_PIECES + piece])
                if value >> 32 != gen:
                    late.append(peer)
                elif value & _MASK == _GAVE_UP:
                    if peer not in gave_up:
                        gave_up.append(peer)
                elif value & _MASK == _MISPAIRED:
                    if peer not in mispaired:
                        mispaired.append(peer)
                elif value & _MASK != kind:
                    error = RuntimeError(
                        f"exchange on rank {self._rank}: "
                        + describe_mismatch(peer, kind, value & _MASK,
                                            self._comm._transport.kinds)
                        + "; the communicator is aborted")
                    self._mispaired = True
                    self._comm._fail(error, raised=True)
                    raise error
            if mispaired and not late:  # every peer came; some found the exchange mis-paired
                ranks = ", ".join(map(str, mispaired))
                error = RuntimeError(
                    f"exchange on rank {self._rank}: rank{'s' if len(mispaired) > 1 else ''} "
                    f"{ranks} found this exchange (generation {gen}) mis-paired, a rank at "
                    f"another call or kind of exchange, and gave up on it; the communicator "
                    f"is aborted")
                self._mispaired = True
                self._comm._fail(error, raised=True)
                raise error
            if gave_up and not late:  # the others gave up, and no other rank is missing
                ranks = ", ".join(map(str, gave_up))
                error = RuntimeError(
                    f"exchange on rank {self._rank}: rank{'s' if len(gave_up) > 1 else ''} "
                    f"{ranks} had given up on this exchange (generation {gen}) before this "
                    f"rank came to it: this rank is late (its peers timed out waiting for it), "
                    f"or they failed; the communicator is aborted")
                self._comm._fail(error, raised=True)
                raise error
            return late

        for peer, piece, kind in awaits:  # no spin where every peer has signalled
            if int(flags[peer * MAX_PIECES + piece]) != (gen << 32) | kind:
                self._spin(missing, "send its rows")
                break
        self._flags_window.Sync()
        return 0

    def end(self, stream, outs=()):
        """Tell every peer that this rank is done reading its staging of this generation
        (``outs``: unused; a failed wait here raised before any copy)."""
        value = numpy.uint64(self.generation << 32)
        slot = self._ready_words + self._rank
        for p in range(self._size):
            if p != self._rank:
                self._flags[p][slot] = value

    def give_up(self):
        """Tell every peer that this rank gave up on the exchange it began last (its
        communicator was aborted): its ready words to them say so (:data:`_GAVE_UP`, or
        :data:`_MISPAIRED` where it found the exchange mis-paired). Local
        stores, never blocks; nothing after the flags window's setup."""
        if self._flags_window is None:
            return
        value = numpy.uint64((self._current << 32) | (_MISPAIRED if self._mispaired else
                                                       _GAVE_UP))
        for peer in range(self._size):
            if peer != self._rank:
                self._flags[peer][self._rank * MAX_PIECES:(self._rank + 1) * MAX_PIECES] = value

    def _spin(self, missing, what):
        """Spin (then sleep) until ``missing()`` is empty; TimeoutError naming the ranks after
        the communicator's timeout (the communicator is aborted)."""
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
                    f"exchange on rank {self._rank}: rank{'s' if len(late) > 1 else ''} "
                    f"{', '.join(map(str, late))} did not {what} within {comm.timeout:g} s "
                    f"(generation {self.generation}); the communicator is aborted")
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

    def close(self):
        """Free the windows (collective, as their allocation was)."""
        if self._window is not None:
            self._free_staging()
        if self._flags_window is not None:
            self._flags.clear()
            self._flags_window.Unlock_all()
            self._flags_window.Free()
            self._flags_window = None
