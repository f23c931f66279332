"""The host side channel of a communicator: small collectives, each bounded by a timeout.

The communicators bootstrap over it (NCCL's unique id, IPC handles, the transport choice), the
layout exchange gathers every rank's counts over it, and explicit-splits calls vote over it. The
data of a layout-path exchange never touches it: :attr:`SideChannel.collectives` counts what it did,
so tests can check that a run of exchanges made no host collective.

:class:`SideChannel` is the interface; two implementations carry it:

- :class:`MpiSideChannel` (here): a private duplicate of an mpi4py communicator (``mpirun``). It
  also gives the MPI backend its data path and the host pull transport its shared windows.
- ``TorchSideChannel`` (``_torchside``): a private gloo group over the ranks of a
  ``torch.distributed`` process group (``torchrun``); no MPI needed.

Every operation waits at most ``timeout`` seconds; then the channel calls ``on_timeout`` (the
communicator aborts itself) and raises ``TimeoutError``. An operation abandoned that way is kept
alive, with its buffers, in :attr:`SideChannel.abandoned`, since neither MPI nor gloo can cancel a
collective: the peer that was late may still complete it and write into them.
"""

import abc
import pickle
import time

import numpy

from ._board import ArrivalBoard

# Polling of MPI requests: spin for this long (low latency for small, frequent collectives), then
# sleep between tests, doubling up to the longest sleep.
_SPIN_S = 2e-3
_MIN_SLEEP_S = 5e-5
_MAX_SLEEP_S = 5e-3
#: Tags of the side channel's point-to-point messages (on its private duplicate communicator):
#: ``_TAG`` plus the message's bytes modulo ``_TAGS``, so that ranks in two different gathers
#: (a rank in another call) do not match each other's messages of another size (MPI would fail
#: on the truncation, or abort the process on a partial element) but time out, naming the rank.
_TAG = 17
_TAGS = 16384


def _not_bound(reason):
    """``on_timeout`` of a channel no communicator has bound yet: nothing to abort."""


class SideChannel(abc.ABC):
    """Bounded host collectives among the ranks of one communicator (the interface).

    Attributes:
        rank, size: this process's rank and the number of ranks.
        timeout: seconds an operation may take.
        collectives: how many host collectives this channel has started.
        abandoned: ``(operations, buffers)`` of timed-out operations, kept alive.
        on_timeout: ``on_timeout(reason)``, called before ``TimeoutError`` is raised; the
            communicator binds its abort here.
        kind: ``"mpi"`` or ``"torch"``.
        shared_windows: True where MPI shared-memory windows can be allocated over the ranks
            (the host pull transport); False elsewhere, where the host takes the grouped
            transport.
        group: the ``torch.distributed`` process group the channel was built over, or None.
        board: the communicator's arrival board (``_board.ArrivalBoard``) once
            :meth:`open_board` made it, else None.
        nodes: the ranks' nodes (``_nodes.Nodes``) once ``mxcomm.comm.init`` agreed on them,
            else None.
    """

    kind = None
    nodes = None
    shared_windows = False
    group = None
    board = None

    def __init__(self, rank, size, timeout):
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.collectives = 0
        self.abandoned = []
        self.on_timeout = _not_bound

    def open_board(self):
        """Make the arrival board of the ranks of each node (collective; ``mxcomm.comm.init``
        does, right after making the channel), so timeouts can name the ranks behind."""
        self.board = ArrivalBoard(self)

    @abc.abstractmethod
    def _gather(self, mine, table, what):
        """Every rank's 1-D C-contiguous ``mine`` (one shape and dtype on all ranks) into
        ``table[rank]`` ((W, n) C-contiguous, same dtype); one collective, counted."""

    def allgather_bytes(self, payload, what):
        """Every rank's ``payload`` (bytes, one length on all ranks), concatenated in rank order."""
        mine = numpy.frombuffer(payload, dtype=numpy.uint8).copy()
        table = numpy.empty((self.size, mine.size), dtype=numpy.uint8)
        self._gather(mine, table, what)
        return table.tobytes()

    def allgather_array(self, mine, what):
        """Every rank's 1-D array ``mine`` (one length and dtype on all ranks) as (W, n) rows."""
        mine = numpy.ascontiguousarray(mine)
        table = numpy.empty((self.size,) + mine.shape, dtype=mine.dtype)
        self._gather(mine, table, what)
        return table

    def allgather_into(self, mine, table, what, counted=True):
        """Allgather the buffer ``mine`` into ``table`` ((W, n), rank order); the vote reuses
        both buffers from call to call. ``counted=False``: not counted in :attr:`collectives`
        (the host backends' check of a layout-path exchange, which travels with its rows)."""
        collectives = self.collectives
        self._gather(mine, table, what)
        if not counted:
            self.collectives = collectives

    def barrier(self, what="barrier"):
        """Block until every rank has arrived (bounded)."""
        self._gather(numpy.zeros(1, numpy.uint8), numpy.zeros((self.size, 1), numpy.uint8), what)

    @abc.abstractmethod
    def bcast_object(self, obj, what, root=0):
        """Broadcast a picklable ``obj`` from ``root``; one collective, counted."""

    @abc.abstractmethod
    def node_info(self):
        """``(local_rank, one_node)``: this rank among the ranks on its node, and whether every
        rank shares that node (collective)."""

    @abc.abstractmethod
    def free(self):
        """Release the channel, unless an abandoned operation may still touch it (then leak it)."""

    def _timed_out(self, what, missing=""):
        """Call ``on_timeout`` and return the ``TimeoutError`` to raise."""
        self.on_timeout(f"{what} timed out after {self.timeout:g} s"
                        + (f":{missing.rstrip(';')}" if missing else ""))
        return TimeoutError(
            f"{what}: did not finish within {self.timeout:g} s on rank {self.rank} of "
            f"{self.size};{missing} the communicator is aborted (a rank may have "
            f"stopped calling it, failed before it, or called another collective)")


class MpiSideChannel(SideChannel):
    """Bounded host collectives over a private duplicate of an mpi4py communicator.

    Every MPI request is polled (``MPI.Request.Test``) until it completes or ``timeout`` s pass.
    Collective: every rank of ``mpi_comm`` constructs it (``MPI_Comm_dup``, unbounded).

    Args:
        mpi_comm: an mpi4py communicator, or None for ``MPI.COMM_WORLD`` (duplicated, not consumed).
        timeout: seconds a collective may take.

    Attributes:
        mpi: the private duplicate (the MPI backend moves its data on it); ``MPI``: the module.
        (and those of :class:`SideChannel`)
    """

    kind = "mpi"
    shared_windows = True

    def __init__(self, mpi_comm, timeout):
        from mpi4py import MPI
        self.MPI = MPI
        parent = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.mpi = parent.Dup()
        super().__init__(self.mpi.Get_rank(), self.mpi.Get_size(), timeout)

    def wait(self, requests, what, keep=(), peers=None):
        """Poll MPI ``requests`` until all complete or ``timeout`` s pass.

        Args:
            requests: a list of ``MPI.Request``.
            what: the operation, for the message.
            keep: buffers the requests use; kept alive with them if they are abandoned.
            peers: the rank each request receives from (or None): a timeout names the ranks
                whose requests did not complete.
        Raises:
            TimeoutError: not complete in time (``on_timeout`` was called first).
        """
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

    def bcast_object(self, obj, what, root=0):
        """Broadcast a picklable ``obj`` from ``root`` (two bounded broadcasts: size, bytes)."""
        size = numpy.zeros(1, dtype=numpy.int64)
        payload = pickle.dumps(obj) if self.rank == root else b""
        size[0] = len(payload)
        self.collectives += 1
        self.wait([self.mpi.Ibcast(size, root=root)], what, keep=(size,))
        buf = numpy.frombuffer(payload, dtype=numpy.uint8).copy() if self.rank == root else \
            numpy.empty(int(size[0]), dtype=numpy.uint8)
        self.wait([self.mpi.Ibcast(buf, root=root)], what, keep=(buf,))
        return pickle.loads(buf.tobytes())

    def node_info(self):
        """``(local_rank, one_node)``: this rank among the processes of its node, and whether
        every rank shares that node (an MPI shared-memory split; collective)."""
        node = self.mpi.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
        info = node.Get_rank(), node.Get_size() == self.size
        node.Free()
        return info

    def free(self):
        """Free the duplicate, unless a timed-out request may still touch it (then leak it)."""
        if not self.abandoned:
            self.mpi.Free()
