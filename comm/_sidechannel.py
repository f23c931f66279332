"""The host side channel: small host collectives (bootstrap, layout exchange, votes), each bounded
by ``timeout``, then ``on_timeout`` (the communicator aborts) and TimeoutError. MPI and gloo cannot
cancel a collective: a timed-out one is kept in ``abandoned`` with its buffers, which a late peer
may still write. Implementations: ``_mpi.MpiSideChannel``, ``_torchdist.TorchSideChannel``."""

import abc
import pickle

import numpy

from ._board import ArrivalBoard, node_key

def _not_bound(reason):
    """``on_timeout`` before a communicator binds the channel: nothing to abort."""


class SideChannel(abc.ABC):
    """Bounded host collectives among the ranks of one communicator (the interface).

    Attributes:
        rank, size, timeout: this rank, W, and the seconds an operation may take.
        collectives: host collectives started (tests check that exchanges made none).
        abandoned: ``(operations, buffers)`` of timed-out operations, kept alive.
        on_timeout: ``on_timeout(reason)``, called before TimeoutError; the communicator's abort.
        kind: ``"mpi"`` or ``"torch"``.
        group: the torch.distributed group built over, or None.
        board: the arrival board once :meth:`open_board` made it, else None.
        nodes: the agreed ``_nodes.Nodes`` once ``init`` set them, else None."""

    kind = None
    nodes = None
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
        """Make the arrival board (collective), so timeouts name the ranks behind."""
        self.board = ArrivalBoard(self)

    @abc.abstractmethod
    def _gather(self, mine, table, what):
        """Every rank's 1-D C-contiguous ``mine`` (same shape, dtype everywhere) into
        ``table[rank]`` ((W, n)); one collective, counted."""

    def allgather_bytes(self, payload, what):
        """Every rank's ``payload`` (bytes, one length on all ranks), concatenated in rank order."""
        return self.allgather_array(numpy.frombuffer(payload, numpy.uint8).copy(), what).tobytes()

    def allgather_array(self, mine, what):
        """Every rank's 1-D array ``mine`` (one length and dtype on all ranks) as (W, n) rows."""
        mine = numpy.ascontiguousarray(mine)
        table = numpy.empty((self.size,) + mine.shape, dtype=mine.dtype)
        self._gather(mine, table, what)
        return table

    def allgather_into(self, mine, table, what, counted=True):
        """Allgather ``mine`` into the (W, n) ``table``; ``counted=False``: not in
        :attr:`collectives`."""
        collectives = self.collectives
        self._gather(mine, table, what)
        if not counted:
            self.collectives = collectives

    def barrier(self, what="barrier"):
        """Block until every rank has arrived (bounded)."""
        self._gather(numpy.zeros(1, numpy.uint8), numpy.zeros((self.size, 1), numpy.uint8), what)

    def bcast_object(self, obj, what, root=0):
        """A picklable ``obj`` from ``root`` (two allgathers: its size, then its bytes)."""
        payload = pickle.dumps(obj) if self.rank == root else b""
        n = int(self.allgather_array(numpy.array([len(payload)], numpy.int64), what)[root, 0])
        table = self.allgather_bytes(payload.ljust(n, b"\0"), what)  # n bytes from every rank
        return pickle.loads(table[root * n:(root + 1) * n])

    def local_rank(self):
        """This rank among the ranks on its host (host name and boot id); one allgather."""
        keys = self.allgather_bytes(node_key(), "node discovery (host names)")
        n = len(keys) // self.size
        return sum(keys[r * n:(r + 1) * n] == keys[self.rank * n:(self.rank + 1) * n]
                   for r in range(self.rank))

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
