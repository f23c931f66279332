"""The arrival board: how far each rank of a node has got, readable by its peers without a
collective, so a timeout names the ranks that did not arrive (NCCL and gloo cannot say).

Each rank owns one slot ``(side-channel collectives entered, exchange calls entered, pid)`` of a
small int64 file mapped by its node's ranks (``/dev/shm`` or the temporary directory). Entering is
one store into the own slot (one writer, no lock); the others' slots are read only to explain a
timeout. Ranks on other nodes are reported as unknown. Leaf module: NumPy and the standard library
only."""

import hashlib
import os
import socket
import tempfile

import numpy

#: The kinds of calls a board counts (its columns), and what a message calls them.
SIDE, EXCHANGE = 0, 1
_KIND_NAMES = ("side-channel collective", "exchange call")
_PID = 2


def node_key():
    """20 bytes naming this process's machine: host name and boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    return hashlib.sha1(socket.gethostname().encode() + b"/" + boot).digest()


def _running(pid):
    """Whether a process ``pid`` exists (signal 0; one that exists but is not ours counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists
        return True
    return True


def _ranks(ranks):
    """'rank 3' or 'ranks 1, 4'."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class ArrivalBoard:
    """Every rank's counts of entered calls (:data:`SIDE`, :data:`EXCHANGE`) and pid, for this
    node's ranks.

    Collective: one allgather and two barriers of ``side``, each bounded. The file is unlinked once
    the node's ranks have mapped it; the mapping lives with the board (a watchdog may read it after
    its communicator closed).

    Attributes:
        entered: calls of each kind this rank has entered (:meth:`enter`).
        local: the communicator's ranks on this node, in rank order."""

    def __init__(self, side):
        self._rank, self._size = side.rank, side.size
        token = os.urandom(8)
        mine = node_key() + os.getpid().to_bytes(8, "little") + token
        table = side.allgather_bytes(mine, "arrival board setup (nodes)")
        rows = [table[36 * r:36 * (r + 1)] for r in range(self._size)]
        here = rows[self._rank][:20]
        self.local = [r for r in range(self._size) if rows[r][:20] == here]
        first = self.local[0]
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(folder, f"mxcomm-board-{rows[first][28:].hex()}")
        if self._rank == first:
            numpy.zeros((self._size, 3), numpy.int64).tofile(path)
        try:
            side.barrier("arrival board setup (file)")
            self._slots = numpy.memmap(path, numpy.int64, "r+", shape=(self._size, 3))
            self._slots[self._rank] = (0, 0, os.getpid())
            side.barrier("arrival board setup (mapped)")
        finally:  # also when a peer never came: no file is left behind
            if self._rank == first:
                os.unlink(path)
        self.entered = [0, 0]

    def enter(self, kind):
        """Count one more call of ``kind`` entered by this rank; returns its number (1, 2, ...)."""
        n = self.entered[kind] = self.entered[kind] + 1
        self._slots[self._rank, kind] = n
        return n

    def late(self, kind, call):
        """``(behind, gone, unknown)`` for call ``call`` of ``kind``: (rank, calls entered) of this
        node's ranks not in it yet, this node's ranks whose process is gone, the ranks elsewhere."""
        slots = numpy.array(self._slots)  # one consistent copy
        behind = [(r, int(slots[r, kind])) for r in self.local if slots[r, kind] < call]
        gone = [r for r in self.local
                if r != self._rank and slots[r, _PID] and not _running(int(slots[r, _PID]))]
        unknown = [r for r in range(self._size) if r not in self.local]
        return behind, gone, unknown

    def describe(self, kind, call):
        """A clause for a timeout's message from :meth:`late`, e.g. "by this node's arrival board,
        rank 1 had not entered this exchange call (number 7; entered: rank 1: 6)". Never raises."""
        try:
            behind, gone, unknown = self.late(kind, call)
        except Exception as exc:  # noqa: BLE001
            return f"the arrival board could not be read ({exc})"
        name = _KIND_NAMES[kind]
        parts = []
        if behind:
            counts = ", ".join(f"rank {r}: {n}" for r, n in behind)
            parts.append(f"{_ranks([r for r, _ in behind])} had not entered this {name} "
                         f"(number {call}; entered: {counts})")
        else:
            parts.append(f"every rank of this node had entered this {name} (number {call}): "
                         f"the stall is past the hosts (device, network, or a rank in another "
                         f"collective)")
        if gone:
            parts.append(f"{_ranks(gone)}: process gone")
        if unknown:
            parts.append(f"{_ranks(unknown)} on other nodes, unknown")
        return "by this node's arrival board, " + "; ".join(parts)
