"""The base of the host backends (MPI, torch.distributed over gloo): rows are NumPy arrays."""

import numpy

from mxcomm._array import as_device_array

from ._validate import counts_verdict
from ._board import EXCHANGE
from ._communicator import Communicator
from ._validate import check_counts_array, rows_text


class HostCommunicator(Communicator):
    """A communicator of host (NumPy) arrays: what the MPI and gloo backends share. A subclass
    supplies ``_move_rows`` and ``_move_counts(counts, out, nbytes)`` (the requests to wait for)."""

    def _as_array(self, x, name):
        return as_device_array(x, f"{name} on rank {self.rank}", device=False)

    def _empty(self, shape, dtype):
        return numpy.empty(shape, dtype=dtype)

    def alltoall_counts(self, counts, *, stream=None):
        """:meth:`Communicator.alltoall_counts` (same arguments, returns and errors) in one host
        collective; blocks until done (bounded)."""
        self.check_usable()
        counts, k = check_counts_array(self, counts)
        counts = numpy.ascontiguousarray(counts)
        out = numpy.empty_like(counts)
        nbytes = k * counts.dtype.itemsize
        if nbytes:
            self._side.wait(self._move_counts(counts, out, nbytes), "alltoall_counts",
                            keep=(counts, out))
        return out

    def alltoallv_plan(self, sends, outs, plan, stream_ptr):
        """:meth:`Communicator.alltoallv_plan`; a layout's plan (``plan.generation`` set) is first
        checked in one agreement round not counted in ``host_collectives`` (MPI would move garbage
        and gloo abort the process): every rank shows its layout, call number, rows and counts.

        Raises:
            ValueError (on every rank, before any data moves): the ranks use different layouts,
                rows of other dtypes or row shapes, or are at different calls of the layout.
            TimeoutError, RuntimeError: as :meth:`alltoallv`."""
        self.check_usable()
        if plan.generation is not None:
            text = f"layout {plan.generation}, call {plan.calls} of it, " + rows_text(sends)
            size = self.size
            table = self.agree("alltoallv", None, (*plan.send_counts, *plan.recv_counts),
                               text=text, what="alltoallv of a layout", counted=False)
            verdict = counts_verdict(table[:, :size].tolist(), table[:, size:].tolist(),
                                     "alltoallv of a layout", "rows")
            if verdict is not None:
                raise verdict
        self._move_rows(sends, outs, plan.send_counts, plan.send_offsets, plan.recv_counts,
                        plan.recv_offsets, stream_ptr)

    def _enter_exchange(self):
        """Count this rank into the next exchange call on the arrival board: its number."""
        board = self._side.board
        return board.enter(EXCHANGE) if board is not None else 0

    def _wait_moved(self, requests, keep, call):
        """Wait (bounded) for exchange call ``call``'s requests; a timeout names, by the arrival
        board, this node's ranks that had not entered it."""
        try:
            self._side.wait(requests, "alltoallv", keep=keep)
        except TimeoutError as exc:
            board = self._side.board
            if board is None:
                raise
            raise TimeoutError(f"{exc}; {board.describe(EXCHANGE, call)}") from None
