"""The MPI backend: the side channel over an mpi4py communicator, and the communicator of rows of
host (NumPy) arrays (the CPU path and CI), by nonblocking ``Ialltoallv`` with one row as the MPI
datatype (counts stay in rows, far below MPI's int32 limit), every request polled until
``timeout``."""

import atexit
import math
import operator
import os
import signal
import sys
import time

import numpy

from ._hostcomm import HostCommunicator
from ._sidechannel import SideChannel

_INT32_MAX = 2**31 - 1
# MPI requests are polled: spin this long, then sleep between tests, doubling to the longest.
_SPIN_S = 2e-3
_MIN_SLEEP_S = 5e-5
_MAX_SLEEP_S = 5e-3
#: Message tag: ``_TAG`` + bytes mod ``_TAGS``, so ranks in gathers of another size time out
#: naming the rank instead of MPI failing on a truncated message.
_TAG = 17
_TAGS = 16384


class MpiSideChannel(SideChannel):
    """Bounded host collectives over ``mpi``, a private duplicate of ``mpi_comm`` (None:
    ``COMM_WORLD``) that also carries the MPI backend's data. Collective to construct
    (``MPI_Comm_dup``, unbounded)."""

    kind = "mpi"

    def __init__(self, mpi_comm, timeout):
        from mpi4py import MPI
        self.MPI = MPI
        parent = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.mpi = parent.Dup()
        super().__init__(self.mpi.Get_rank(), self.mpi.Get_size(), timeout)

    def wait(self, requests, what, keep=(), peers=None):
        """Poll MPI ``requests`` until all complete; after ``timeout`` s abandon them with the
        buffers ``keep`` and raise TimeoutError naming the ``peers`` (each request's source, or
        None) that did not arrive."""
        if len(requests) == 1:
            test = requests[0].Test
        else:
            def test(testall=self.MPI.Request.Testall):
                return testall(requests)
        if test():
            return
        start = time.monotonic()
        deadline = start + self.timeout
        sleep = _MIN_SLEEP_S
        while not test():
            now = time.monotonic()
            if now > deadline:
                self.abandoned.append((list(requests), keep))
                missing = ""
                if peers is not None:
                    late = sorted({p for p, r in zip(peers, requests)
                                   if p is not None and not r.Test()})
                    if late:
                        missing = (f" rank{'s' if len(late) > 1 else ''} "
                                   f"{', '.join(map(str, late))} did not arrive;")
                raise self._timed_out(what, missing)
            if now - start > _SPIN_S:
                time.sleep(sleep)
                sleep = min(2 * sleep, _MAX_SLEEP_S)

    def _gather(self, mine, table, what):
        """Point to point, so a timeout names the ranks that did not arrive."""
        table[self.rank] = mine
        tag = _TAG + mine.nbytes % _TAGS
        requests, peers = [], []
        for step in range(1, self.size):
            source = (self.rank - step) % self.size
            dest = (self.rank + step) % self.size
            requests.append(self.mpi.Irecv(table[source], source=source, tag=tag))
            peers.append(source)
            requests.append(self.mpi.Isend(mine, dest=dest, tag=tag))
            peers.append(None)
        self.collectives += 1
        if requests:
            self.wait(requests, what, keep=(mine, table), peers=peers)

    def free(self):
        if not self.abandoned:
            self.mpi.Free()


class MpiCommunicator(HostCommunicator):
    """All-to-all of rows of host NumPy arrays over MPI.

    Args:
        side: an ``MpiSideChannel`` (built by ``mxcomm.comm.init``); data moves on its duplicate.
        options: keywords of :class:`~mxcomm.comm.Communicator`; ``peer_memory`` pulls from MPI
            shared windows (every rank is on this node).

    Collective to construct. Every method that moves data is collective and blocks the host until
    done (or ``timeout``)."""

    def __init__(self, side, **options):
        super().__init__(side, **options)
        self._row_types = {}  # row bytes -> committed MPI contiguous datatype
        self._choose_transport()

    def _peer_memory_here(self):
        return True  # every rank is on this node: the window is plain shared memory

    def _new_peer_memory(self):
        from ._shm import HostPeerMemory
        return HostPeerMemory(self)

    def _abort_backend(self):
        """Bound the process's exit (``MPI_Finalize`` would wait for a stuck peer); tell the pull
        transport's peers this rank gave up."""
        _BOUNDED_EXIT.arm(self.timeout)
        memory = getattr(self._transport, "memory", None)
        if memory is not None:  # the pull transport: a late peer learns it at once
            memory.give_up()

    def _close_backend(self, clean):
        for datatype in self._row_types.values():
            datatype.Free()
        self._row_types.clear()

    def _row_type(self, row_bytes):
        """The committed MPI datatype of one row of ``row_bytes`` bytes (cached)."""
        datatype = self._row_types.get(row_bytes)
        if datatype is None:
            datatype = self._side.MPI.BYTE.Create_contiguous(row_bytes).Commit()
            self._row_types[row_bytes] = datatype
        return datatype

    def _move_rows(self, sends, outs, sc, so, rc, ro, stream_ptr):
        call = self._enter_exchange()
        requests = []
        for s, o in zip(sends, outs):
            row_bytes = s.dtype.itemsize * math.prod(s.shape[1:])
            if row_bytes == 0:  # rows of zero bytes (an empty row shape): nothing to move
                continue
            if not requests:  # MPI counts and displacements are C ints
                for name, ends in (("send", map(operator.add, so, sc)),
                                   ("recv", map(operator.add, ro, rc))):
                    if max(ends, default=0) > _INT32_MAX:
                        raise ValueError(f"alltoallv: {name} rows beyond 2**31 - 1 on rank "
                                         f"{self.rank}")
            datatype = self._row_type(row_bytes)
            requests.append(self._side.mpi.Ialltoallv([_bytes(s), (sc, so), datatype],
                                                      [_bytes(o), (rc, ro), datatype]))
        if requests:
            self._wait_moved(requests, (sends, outs), call)

    def _move_counts(self, counts, out, nbytes):
        byte = self._side.MPI.BYTE
        return [self._side.mpi.Ialltoall([_bytes(counts), nbytes, byte],
                                         [_bytes(out), nbytes, byte])]


class _BoundedExit:
    """The exit of a process one of whose MPI communicators was aborted (``MPI_Finalize`` would
    wait for a stuck peer): once armed, an uncaught exception ends the process with status 1 after
    its traceback; any other exit finalizes under an alarm of ``timeout`` s."""

    def __init__(self):
        self.seconds = 0
        self.uncaught = False
        self._hook = None

    def arm(self, timeout):
        """Arm it with ``timeout`` s (the longest of those armed)."""
        self.seconds = max(self.seconds, max(1, math.ceil(timeout)))
        if self._hook is None:
            self._hook = sys.excepthook
            sys.excepthook = self._excepthook
            atexit.register(self._at_exit)  # after mpi4py's: runs before its finalization

    def _excepthook(self, *info):
        self.uncaught = True
        self._hook(*info)

    def _at_exit(self):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 (a closed stream: nothing to flush)
                pass
        if self.uncaught:
            os._exit(1)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(self.seconds)


_BOUNDED_EXIT = _BoundedExit()


def _bytes(a):
    """A 1-D uint8 view of C-contiguous ``a`` (MPI sees bytes; any dtype, ml_dtypes included)."""
    return a.reshape(-1).view(numpy.uint8)
