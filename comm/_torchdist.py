"""torch.distributed host communicator (CPU under ``torchrun``): the MPI backend's contract, each
array moved as a zero-copy uint8 tensor in one gloo ``alltoall_base`` over the side channel's
private group; exchanges take the grouped transport."""

import math
import warnings

import numpy

from ._hostcomm import HostCommunicator
from ._validate import exclusive_cumsum


class TorchHostCommunicator(HostCommunicator):
    """All-to-all of rows of host NumPy arrays over a ``torch.distributed`` (gloo) group.

    Args:
        side: a ``TorchSideChannel`` (built by ``mxcomm.comm.init(group=...)``).
        options: keywords of :class:`~mxcomm.comm.Communicator`; ``peer_memory=True`` raises
            RuntimeError on every rank (no peer memory).

    Collective to construct. Every method that moves data is collective and blocks the host until
    done (or ``timeout``)."""

    def __init__(self, side, **options):
        super().__init__(side, **options)
        import torch
        self._torch = torch
        self._options = torch.distributed.AllToAllOptions
        self._choose_transport()

    def _bytes(self, a):
        """A 1-D uint8 tensor on the memory of C-contiguous ``a`` (read-only arrays too)."""
        flat = a.reshape(-1).view(numpy.uint8)
        if flat.flags.writeable:
            return self._torch.from_numpy(flat)
        with warnings.catch_warnings():  # only read: torch warns about non-writable arrays
            warnings.simplefilter("ignore", UserWarning)
            return self._torch.from_numpy(flat)

    def _move_rows(self, sends, outs, sc, so, rc, ro, stream_ptr):
        call = self._enter_exchange()
        works, keep, unpack = [], [], []
        for s, o in zip(sends, outs):
            row_bytes = s.dtype.itemsize * math.prod(s.shape[1:])
            if row_bytes == 0:  # rows of zero bytes (an empty row shape): nothing to move
                continue
            elements = math.prod(s.shape[1:])
            s_flat = s.reshape(s.shape[0], elements)
            o_flat = o.reshape(o.shape[0], elements)
            s_rows, s_packed = _packed(s_flat, sc, so, gather=True)
            o_rows, o_packed = _packed(o_flat, rc, ro, gather=False)
            works.append(self._side.pg.alltoall_base(
                self._bytes(o_rows), self._bytes(s_rows), [n * row_bytes for n in rc],
                [n * row_bytes for n in sc], self._options()))
            keep.append((s_rows, o_rows))
            if o_packed:
                unpack.append((o_rows, o_flat))
        if works:
            self._wait_moved(works, (sends, outs, keep), call)
        for packed, o_flat in unpack:
            _scatter(packed, o_flat, rc, ro)

    def _move_counts(self, counts, out, nbytes):
        splits = [nbytes] * self.size
        return [self._side.pg.alltoall_base(self._bytes(out), self._bytes(counts), splits, splits,
                                            self._options())]


def _packed(rows, counts, offsets, gather):
    """``(regions, packed)``: each rank's region of ``rows`` in rank order: a view where they
    already follow each other, else a new array (filled from ``rows`` if ``gather``)."""
    begin = offsets[0] if offsets else 0
    if list(offsets) == [begin + o for o in exclusive_cumsum(counts)]:
        return rows[begin:begin + sum(counts)], False
    packed = numpy.empty((sum(counts),) + rows.shape[1:], dtype=rows.dtype)
    if gather:
        at = 0
        for n, o in zip(counts, offsets):
            packed[at:at + n] = rows[o:o + n]
            at += n
    return packed, True


def _scatter(packed, rows, counts, offsets):
    """Write the packed regions of :func:`_packed` back to their offsets in ``rows``."""
    at = 0
    for n, o in zip(counts, offsets):
        rows[o:o + n] = packed[at:at + n]
        at += n
