"""The torch.distributed backend. Its side channel (``init(group=...)``, any backend) is a private
``ProcessGroupGloo`` over a group's ranks, rendezvoused through the group's store under a prefix
each rank numbers alike, so any group works (NCCL's cannot carry host bytes) and a timed-out
operation stays off the caller's group; timeouts name late ranks by the arrival board. Its host
communicator (CPU under ``torchrun``) has the MPI backend's contract, each array moved as a
zero-copy uint8 tensor in one gloo ``alltoall_base``; exchanges take the grouped transport."""

import datetime
import math
import time
import warnings

import numpy

from ._board import SIDE
from ._hostcomm import HostCommunicator
from ._sidechannel import SideChannel
from ._validate import exclusive_cumsum

#: Store prefix of the channels' keys (under the group's own store prefix).
_PREFIX = "mxcomm/side"


def resolve_group(group):
    """The ``ProcessGroup`` of ``group`` (a ``ProcessGroup`` as is, a 1-D ``DeviceMesh``'s group).

    Raises:
        TypeError: neither a ProcessGroup nor a DeviceMesh.
        ValueError: a DeviceMesh of more than one dimension; this process not in the group."""
    import torch.distributed as dist
    pg = group
    if not isinstance(group, dist.ProcessGroup):
        try:
            from torch.distributed.device_mesh import DeviceMesh
        except ImportError:  # a torch without DeviceMesh
            DeviceMesh = ()
        if not isinstance(group, DeviceMesh):
            raise TypeError(f"group: expected a torch.distributed ProcessGroup or a 1-D "
                            f"DeviceMesh, got {type(group).__name__}")
        if group.ndim != 1:
            raise ValueError(f"group: expected a 1-D DeviceMesh, got one of shape "
                             f"{tuple(group.shape)} (take one dimension: mesh['ep'])")
        pg = group.get_group()
    if dist.get_rank(pg) < 0:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member "
                         f"of the group (ranks {dist.get_process_group_ranks(pg)})")
    return pg


class TorchSideChannel(SideChannel):
    """Bounded host collectives over a private gloo group spanning ``group``'s ranks (a ProcessGroup
    of any backend or a 1-D DeviceMesh; torch.distributed initialized).

    Collective to construct (a store counter update, then gloo connects, bounded by ``timeout``).
    Attributes beside :class:`SideChannel`'s: ``pg``, the private gloo group, which the torch host
    backend moves data on.

    Raises:
        TypeError, ValueError: as :func:`resolve_group`.
        TimeoutError: the ranks did not connect within ``timeout`` s."""

    kind = "torch"

    def __init__(self, group, timeout):
        import torch
        import torch.distributed as dist
        self._torch = torch
        pg = resolve_group(group)
        super().__init__(pg.rank(), pg.size(), timeout)
        self.group = pg
        store = pg.get_group_store()
        index = store.add(f"{_PREFIX}/{self.rank}/count", 1)
        try:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{_PREFIX}/{index}/", store),
                                            self.rank, self.size,
                                            datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:  # gloo could not connect every rank in time
            raise self._timed_out("side channel setup (gloo connect)",
                                  f" gloo: {_first_line(exc)};") from None
        self._tensors = {}  # id(array) -> (array, tensor): the vote's buffers, wrapped once

    def wait(self, works, what, keep=()):
        """Wait for gloo ``works`` until all complete, else abandon them with the buffers ``keep``,
        call ``on_timeout`` and raise TimeoutError (late, naming by the arrival board this node's
        ranks that had not entered) or RuntimeError (gloo failed: a peer crashed or gave up)."""
        call = self.board.enter(SIDE) if self.board is not None else None
        deadline = time.monotonic() + self.timeout
        for i, work in enumerate(works):
            remaining = deadline - time.monotonic()
            try:
                if remaining > 0:
                    work.wait(datetime.timedelta(seconds=remaining))
                    continue
                if work.is_completed():
                    continue
                failure = None
            except RuntimeError as exc:
                failure = exc
            self.abandoned.append((list(works[i:]), keep))
            if failure is None or time.monotonic() >= deadline - 1e-3 or \
                    "timed out" in str(failure).lower():
                late = "" if call is None else f" {self.board.describe(SIDE, call)};"
                raise self._timed_out(what, late) from None
            self.on_timeout(f"{what} failed: {_first_line(failure)}")
            raise RuntimeError(f"{what}: gloo failed on rank {self.rank} of {self.size} "
                               f"({_first_line(failure)}); a peer may have crashed or given up; "
                               f"the communicator is aborted") from None

    def tensor(self, a):
        """A 1-D uint8 tensor on the memory of the C-contiguous host array ``a`` (no copy; read-only
        arrays too)."""
        flat = a.reshape(-1).view(numpy.uint8)
        if flat.flags.writeable:
            return self._torch.from_numpy(flat)
        with warnings.catch_warnings():  # only read: torch warns about non-writable arrays
            warnings.simplefilter("ignore", UserWarning)
            return self._torch.from_numpy(flat)

    def _cached(self, a):
        """:meth:`tensor` of ``a``, reused while ``a`` lives (the vote's buffers)."""
        entry = self._tensors.get(id(a))
        if entry is None or entry[0] is not a:
            if len(self._tensors) > 8:
                self._tensors.clear()
            entry = self._tensors[id(a)] = (a, self.tensor(a))
        return entry[1]

    def _gather(self, mine, table, what):
        """One gloo allgather into ``table`` (zero-copy views of both buffers)."""
        self.collectives += 1
        if self.size == 1:
            table[0] = mine
            return
        out, inp = self._cached(table), self._cached(mine)
        self.wait([self.pg._allgather_base(out, inp)], what, keep=(mine, table))

    def free(self):
        self._tensors.clear()
        if not self.abandoned:
            self.pg = None


def _first_line(exc):
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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
        self._options = torch.distributed.AllToAllOptions
        self._bytes = side.tensor
        self._choose_transport()

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
