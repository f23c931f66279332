"""Staged all-to-all: the caller produces each peer's rows, then consumes each peer's rows.

:meth:`Communicator.alltoallv_staged` moves rows the caller writes itself (``fill``), straight into
memory the transport chose, and hands back each sender's rows as soon as they are in ``out``
(``arrived``), so a producer (a quantize kernel) and a consumer (a dequantize kernel) overlap the
transfer. Two transports, chosen per communicator (``peer_memory``):

``pull`` (all ranks on one node, with memory every rank can read: CUDA IPC, or an MPI shared
window on the host)::

    sender r, caller stream:  fill(r+1) ready[1]  fill(r+2) ready[2] ... fill(r)   (self: into out)
    ---------------------------------- host barrier ----------------------------------
    receiver r, side stream:  for s = 1, 2, ...: wait ready[s] of rank r-s, copy its rows into out
    receiver r, caller stream:  arrived(r) ... wait copy s, arrived(r-s) ...

Each rank fills its own *staging* region (a peer's rows at the row offsets of the send order),
records one event per step, and the receivers pull with copy engines (``cudaMemcpyAsync`` from the
peer's mapped memory), peer after peer on a side stream, so neither the copies nor the waits
take SMs from the caller's kernels. Step ``s`` pairs sender ``r`` with receiver ``r + s``: every
rank fills first the rows its step-1 receiver pulls first. Staging is reused from call to call: a rank refills it only
after every peer has recorded that its pulls of the previous call are done.

``grouped`` (any communicator): ``fill`` writes into a staging array, then one ``alltoallv``
(one NCCL group, or MPI) moves everything and ``arrived`` is called for every sender.

Ordering across processes uses the host collectives that every call makes anyway: the argument
vote (every rank has finished enqueuing its previous call, including the "done" event) and one
barrier after the fills (every peer's "ready" events are recorded before any rank waits on them).
A CUDA stream waiting on an event waits for its latest record, so this order is what makes the
cross-process waits refer to this call.
"""

import math
import operator

import numpy

from . import _validate

#: Staging regions start at multiples of this many bytes (each array of the layout, too).
ALIGN = 256


def _align(n):
    return -(-n // ALIGN) * ALIGN


def regions(layout, rows):
    """Byte offsets of each array of ``layout`` in a staging region of ``rows`` rows, and its size.

    Args:
        layout: ``(row_bytes, ...)``, one per array moved together.
        rows: rows the region holds.
    Returns:
        ``([offset per array], total bytes)``.
    """
    offsets, total = [], 0
    for row_bytes in layout:
        offsets.append(total)
        total += _align(rows * row_bytes)
    return offsets, total


def send_order(rank, size):
    """Peers in the order their rows are filled: ``rank+1, rank+2, ..., rank`` (self last)."""
    return [(rank + s) % size for s in range(1, size)] + [rank]


class GroupedTransport:
    """Fill a staging array, then one ``alltoallv`` of it (any communicator)."""

    name = "grouped"

    def __init__(self, comm):
        self._comm = comm

    def run(self, ex):
        comm = ex.comm
        staging = tuple(comm._empty((ex.rows_sent,) + shape, dtype) for shape, dtype in ex.arrays)
        for peer in send_order(comm.rank, comm.size):
            begin = ex.send_offsets[peer]
            end = begin + ex.send_counts[peer]
            ex.fill(peer, begin, end, tuple(a[begin:end] for a in staging))
        comm.alltoallv(staging, ex.send_counts, ex.recv_counts, ex.outs, stream=ex.stream,
                       validate=False)
        for step in range(comm.size):
            peer = (comm.rank - step) % comm.size
            ex.arrive(peer)

    def close(self):
        pass


class PullTransport:
    """Receivers pull their rows from the senders' staging (module docstring).

    Args:
        comm: the communicator.
        memory: the staging memory every rank can read: an object with
            ``reserve(nbytes, stream)`` (collective), ``local(offset, shape, dtype)``,
            ``begin(stream)``, ``ready(step, stream)``, ``fetch(step, peer, copies, stream)``,
            ``arrived(step, stream)``, ``finish(stream)`` and ``close()``
            (``_ipc.CudaPeerMemory``, ``_mpi.HostPeerMemory``).
    """

    name = "pull"

    def __init__(self, comm, memory):
        self._comm = comm
        self._memory = memory

    def run(self, ex):
        comm, memory = ex.comm, self._memory
        rank, size = comm.rank, comm.size
        row_bytes = ex.row_bytes
        sent = ex.sent  # sent[j][i]: rows rank j sends to rank i (all ranks agreed in the vote)
        memory.reserve(max([ALIGN] + [regions(row_bytes, sum(row))[1] for row in sent]),
                       ex.stream)
        memory.begin(ex.stream)  # the peers' pulls of the previous call are done
        bases, _ = regions(row_bytes, ex.rows_sent)
        for step, peer in enumerate(send_order(rank, size), start=1):
            begin = ex.send_offsets[peer]
            count = ex.send_counts[peer]
            if peer == rank:  # own rows go straight to out
                at = ex.recv_offsets[rank]
                ex.fill(peer, begin, begin + count, tuple(o[at:at + count] for o in ex.outs))
                continue
            slots = tuple(memory.local(base + begin * rb, (count,) + shape, dtype)
                          for base, rb, (shape, dtype) in zip(bases, row_bytes, ex.arrays))
            ex.fill(peer, begin, begin + count, slots)
            memory.ready(step, ex.stream)
        comm.barrier()  # every rank's ready events are recorded before anyone waits on them
        ex.arrive(rank)
        for step in range(1, size):
            peer = (rank - step) % size
            peer_sent = sent[peer]
            first = sum(peer_sent[:rank])          # the peer's first row for this rank
            peer_bases, _ = regions(row_bytes, sum(peer_sent))
            at, count = ex.recv_offsets[peer], ex.recv_counts[peer]
            copies = [(base + first * rb, o[at:at + count])
                      for base, rb, o in zip(peer_bases, row_bytes, ex.outs)]
            memory.fetch(step, peer, copies, ex.stream)
        memory.finish(ex.stream)
        for step in range(1, size):
            memory.arrived(step, ex.stream)
            ex.arrive((rank - step) % size)

    def close(self):
        self._memory.close()


class Exchange:
    """One staged exchange's arguments, checked and agreed across ranks (internal).

    Attributes:
        arrays: ``((row shape, dtype), ...)`` of the arrays moved together.
        row_bytes: bytes of one row of each array.
        send_counts, recv_counts, send_offsets, recv_offsets: W ints each (rows).
        sent: W lists of W ints, ``sent[j][i]`` rows rank j sends to rank i.
        outs: the output arrays. stream: the caller's stream handle (0 on the host).
    """

    def __init__(self, comm, arrays, send_counts, recv_counts, out, fill, arrived, stream):
        self.comm = comm
        self.fill = fill
        self._arrived = arrived
        self.stream = stream
        rank, size = comm.rank, comm.size
        error = None
        sc = rc = None
        description = ""
        try:
            self.arrays = tuple(_check_array_spec(spec, i) for i, spec in enumerate(arrays))
            if not self.arrays:
                raise ValueError("arrays: expected one or more (row shape, dtype) pairs")
            sc = _validate.as_counts(send_counts, "send_counts", rank, size)
            rc = _validate.as_counts(recv_counts, "recv_counts", rank, size)
            if out is not None:
                out = tuple(comm._as_array(a, "out") for a in out)
                if len(out) != len(self.arrays):
                    raise ValueError(f"out on rank {rank} holds {len(out)} arrays, expected "
                                     f"{len(self.arrays)} (one per entry of arrays)")
                rows = comm._check_arrays(out, "out")
                for i, (o, (shape, dtype)) in enumerate(zip(out, self.arrays)):
                    if o.dtype != dtype or o.shape[1:] != shape:
                        raise TypeError(f"out[{i}] on rank {rank} is {o.dtype} rows of shape "
                                        f"{o.shape[1:]}, expected {dtype} rows of shape {shape}")
                _validate.check_region(rc, _validate.exclusive_cumsum(rc), rows, "recv", rank,
                                       False)
            description = " + ".join(f"{dtype.name} rows of shape {shape}"
                                     for shape, dtype in self.arrays)
        except (TypeError, ValueError) as exc:
            error = exc
        # Always checked across ranks: the pull transport reads every rank's counts off the vote.
        comm._vote(_validate.OP_ALLTOALLV, error, sc, rc, description, True)
        self.sent = comm._ballot.sent_counts()
        self.send_counts, self.recv_counts = sc, rc
        self.send_offsets = _validate.exclusive_cumsum(sc)
        self.recv_offsets = _validate.exclusive_cumsum(rc)
        self.rows_sent = sum(sc)
        self.row_bytes = tuple(dtype.itemsize * math.prod(shape) for shape, dtype in self.arrays)
        self.outs = out if out is not None else tuple(
            comm._empty((sum(rc),) + shape, dtype) for shape, dtype in self.arrays)

    def arrive(self, peer):
        if self._arrived is not None and self.recv_counts[peer]:
            begin = self.recv_offsets[peer]
            self._arrived(peer, begin, begin + self.recv_counts[peer])


def _check_array_spec(spec, i):
    try:
        shape, dtype = spec
        shape = tuple(operator.index(n) for n in shape)
        dtype = numpy.dtype(dtype)
    except (TypeError, ValueError):
        raise TypeError(f"arrays[{i}]: expected a (row shape, dtype) pair, got {spec!r}") from None
    if any(n < 0 for n in shape):
        raise ValueError(f"arrays[{i}]: row shape {shape} has a negative extent")
    return shape, dtype
