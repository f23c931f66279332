"""The base of the host backends (MPI, torch.distributed over gloo): rows are NumPy arrays."""

import numpy

from ._board import EXCHANGE
from ._communicator import Communicator
from ._validate import check_counts_array


class HostCommunicator(Communicator):
    """A communicator whose rows are host arrays (NumPy): the MPI and torch.distributed (gloo)
    backends. Holds the array hooks they share."""

    def _as_array(self, x, name):
        if isinstance(x, numpy.ndarray):
            return x
        if hasattr(x, "__cuda_array_interface__") or not (
                hasattr(x, "__array__") or hasattr(x, "__array_interface__")):
            raise TypeError(f"{name} on rank {self.rank}: {type(self).__name__} moves host "
                            f"arrays (NumPy), got {type(x).__name__}")
        return numpy.asarray(x)

    def _empty(self, shape, dtype):
        return numpy.empty(shape, dtype=dtype)

    def _host_alltoall_counts(self, counts, move, what="alltoall_counts"):
        """:meth:`alltoall_counts` of the host backends: check ``counts`` (locally and across
        ranks), then ``move(counts, out, nbytes)`` returns the pending requests that exchange
        ``nbytes`` per rank; waited for with the timeout."""
        self._check_usable()
        counts, k = check_counts_array(self, counts)
        counts = numpy.ascontiguousarray(counts)
        out = numpy.empty_like(counts)
        nbytes = k * counts.dtype.itemsize
        if nbytes:
            self._side.wait(move(counts, out, nbytes), what, keep=(counts, out))
        return out

    def _enter_exchange(self):
        """Count this rank into the next exchange call on the arrival board; its number (0
        without a board)."""
        board = self._side.board
        return board.enter(EXCHANGE) if board is not None else 0

    def _wait_moved(self, requests, keep, call):
        """Wait (bounded) for the data movement of exchange call number ``call``; a timeout
        names, by the arrival board, this node's ranks that had not entered the call (a
        collective ``alltoallv`` cannot say which peer it waits for)."""
        try:
            self._side.wait(requests, "alltoallv", keep=keep)
        except TimeoutError as exc:
            board = self._side.board
            if board is None:
                raise
            raise TimeoutError(f"{exc}; {board.describe(EXCHANGE, call)}") from None
