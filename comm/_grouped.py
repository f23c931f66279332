"""The ``grouped`` transport: produce into one staging array, one ``alltoallv``, then consume. Works
on any communicator; nothing overlaps the transfer."""

from mxcomm._driver import copy_bytes, row_range

from ._staged import landed


class GroupedTransport:
    """Produce every peer's rows into a staging array, then one ``alltoallv`` (no overlap)."""

    name = "grouped"

    def __init__(self, comm):
        self._comm = comm

    def run(self, rows, plan, outs, in_place, stream, landing=None):
        comm = self._comm
        staging = comm._new_arrays(rows.arrays, plan.rows_sent)
        if plan.rows_sent:  # every peer's rows in one launch: the staging is in send order
            rows.produce(0, plan.rows_sent, staging, stream)
        if outs is None:
            outs = comm._new_arrays(rows.arrays, plan.rows_received)
        if landing is not None:  # received in order, then each run copied into place
            received = comm._new_arrays(rows.arrays, plan.rows_received)
            comm.alltoallv_plan(staging, received, plan, stream)
            land(received, outs, landing, 0, plan.rows_received, stream)
            return outs
        comm.alltoallv_plan(staging, outs, plan, stream)
        if in_place:
            for step in range(comm.size):
                peer = (comm.rank - step) % comm.size
                begin = plan.recv_offsets[peer]
                end = begin + plan.recv_counts[peer]
                if end > begin:
                    rows.consume(begin, end, tuple(o[begin:end] for o in outs), stream)
        return outs

    def close(self):
        pass

    def abandon(self):
        pass


def land(received, outs, landing, lo, hi, stream):
    """Copy received rows ``[lo, hi)`` of ``received`` to where ``landing`` puts them in
    ``outs``."""
    for r, at, n in landed(landing, lo, hi):
        for src, dst in zip(received, outs):
            copy_bytes(row_range(dst, at, at + n), row_range(src, r, r + n), stream)
