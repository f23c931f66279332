"""The base of the host backends (MPI, torch.distributed over gloo): rows are NumPy arrays."""

import numpy

from ._agreement import counts_verdict
from ._board import EXCHANGE
from ._communicator import Communicator
from ._validate import check_counts_array


class HostCommunicator(Communicator):
    """A communicator of host (NumPy) arrays: the array hooks the MPI and gloo backends share."""

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
        ranks), then wait (bounded) for the requests ``move(counts, out, nbytes)`` returns."""
        self.check_usable()
        counts, k = check_counts_array(self, counts)
        counts = numpy.ascontiguousarray(counts)
        out = numpy.empty_like(counts)
        nbytes = k * counts.dtype.itemsize
        if nbytes:
            self._side.wait(move(counts, out, nbytes), what, keep=(counts, out))
        return out

    def alltoallv_plan(self, sends, outs, plan, stream_ptr):
        """:meth:`Communicator.alltoallv_plan`; a layout's plan (``plan.generation`` set) is first
        checked across ranks in one agreement round not counted in ``host_collectives``, since MPI
        would move garbage and gloo abort the process: every rank shows its layout, call number
        (``plan.calls``), rows' dtypes and row shapes, and counts.

        Raises:
            ValueError (on every rank, before any data moves): the ranks use different layouts, rows
                of other dtypes or row shapes, or are at different calls of the layout; the message
                names the ranks and what each has.
            TimeoutError, RuntimeError: as :meth:`alltoallv`."""
        self.check_usable()
        if plan.generation is not None:
            text = f"layout {plan.generation}, call {plan.calls} of it, " + " + ".join(
                f"{a.dtype.name} rows of shape {a.shape[1:]}" for a in sends)
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
        """Count this rank into the next exchange call on the arrival board; its number (0 without
        one)."""
        board = self._side.board
        return board.enter(EXCHANGE) if board is not None else 0

    def _wait_moved(self, requests, keep, call):
        """Wait (bounded) for exchange call ``call``'s data movement; a timeout names, by the
        arrival board, this node's ranks that had not entered it."""
        try:
            self._side.wait(requests, "alltoallv", keep=keep)
        except TimeoutError as exc:
            board = self._side.board
            if board is None:
                raise
            raise TimeoutError(f"{exc}; {board.describe(EXCHANGE, call)}") from None
