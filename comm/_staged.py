"""Staged all-to-all: the caller produces each peer's rows, then consumes each peer's rows.

:meth:`Communicator.alltoallv_staged` moves rows the caller writes itself (``fill``), straight into
memory the transport chose, and hands back each sender's rows as soon as they can be read
(``arrived``), so a producer (a quantize kernel) and a consumer (a dequantize kernel) overlap the
transfer. Two transports, chosen per communicator (``peer_memory``):

``pull`` (all ranks on one node, with memory every rank can read: CUDA IPC, or an MPI shared
window on the host)::

    sender r, caller stream:  fill(r+1) ready[1]  fill(r+2) ready[2] ... fill(r)   (self: into out)
    ---------------------------------- host barrier ----------------------------------
    receiver r, side stream:  for s = 1, 2, ...: wait ready[s] of rank r-s, copy its rows into out
    receiver r, caller stream:  arrived(r) ... wait copy s, arrived(r-s) ...

Each rank fills its own *staging* region (a peer's rows at the row offsets of the send order),
records one event per step (one per piece: a large region is filled and pulled in up to
``MAX_PIECES`` pieces, ``pieces()``), and the receivers pull with copy engines
(``cudaMemcpyAsync`` from the peer's mapped memory), peer after peer on a side stream, so neither
the copies nor the waits take SMs from the caller's kernels. Step ``s`` pairs sender ``r`` with receiver ``r + s``: every
rank fills first the rows its step-1 receiver pulls first. Staging is reused from call to call: a
rank refills it only after every peer has recorded that its pulls of the previous call are done.

With ``direct=True`` nothing is copied: ``arrived`` runs on the side stream and reads the
sender's rows where they are (SM loads from the peer's mapped memory), beside the caller's fills,
each peer's rows whole::

    receiver r, side stream:  for s = 1, 2, ...: wait ready[s] of rank r-s, arrived(r-s) on them
    receiver r, caller stream:  fills ... arrived(r) (own rows, in the staging) ... wait side

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
#: The pull transport's copy engines move a peer's rows in pieces of about this many bytes, up to
#: MAX_PIECES, each with its own "ready" event: the first piece is pulled while the sender still
#: fills the next, so the transfer starts after a fraction of the first fill. But every piece
#: costs host time (a fill launch, event records and waits, copies). Measured on H200s, MXFP8 rows,
#: 131072 per rank (bench/NOTES.md): 128 MB pieces made a 2-rank dispatch 6-9 % faster (1.81 ->
#: 1.65 ms, 7168 wide) and left 4 ranks even, but through the torch adapters, where the host's time
#: per call is close to the device's, the combine-backward stage (5120 wide, 4 ranks, 2 pieces per
#: peer) went from 1.71 to 2.2 ms. 256 MB keeps 4-rank regions of up to 7168-wide rows whole and
#: splits 2-rank ones in two. Consumers reading in place (``direct``) take each peer's rows whole:
#: there every piece exposes an interprocess wait and a launch on the side stream, and pieces
#: measured slower (4 ranks 2.62 -> 2.70 ms at 7168 wide; 2 ranks, 2048 wide 0.78 -> 1.11 ms).
PIECE_BYTES = 256 << 20
MAX_PIECES = 4


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


def pieces(rows, layout):
    """Row ranges ``[(lo, hi), ...]`` a peer's ``rows`` are filled and pulled in: about
    ``PIECE_BYTES`` each, at most ``MAX_PIECES``, at least one (maybe empty). Sender and
    receiver compute the same from the voted counts."""
    k = min(MAX_PIECES, max(1, -(-rows * sum(layout) // PIECE_BYTES)))
    return [(rows * i // k, rows * (i + 1) // k) for i in range(k)]


class GroupedTransport:
    """Fill a staging array, then one ``alltoallv`` of it (any communicator)."""

    name = "grouped"

    def __init__(self, comm):
        self._comm = comm

    def run(self, ex):
        comm = ex.comm
        staging = ex.new_arrays(ex.rows_sent)
        for peer in send_order(comm.rank, comm.size):
            begin = ex.send_offsets[peer]
            end = begin + ex.send_counts[peer]
            ex.fill(peer, begin, end, tuple(a[begin:end] for a in staging))
        outs = ex.outs if ex.outs is not None else ex.new_arrays(sum(ex.recv_counts))
        comm.alltoallv(staging, ex.send_counts, ex.recv_counts, outs, stream=ex.stream,
                       validate=False)
        for step in range(comm.size):
            peer = (comm.rank - step) % comm.size
            ex.arrive(peer, ex.out_rows(peer, outs), ex.stream)

    def close(self):
        pass


class PullTransport:
    """Receivers pull their rows from the senders' staging (module docstring).

    Args:
        comm: the communicator.
        memory: the staging memory every rank can read: an object with
            ``reserve(nbytes, stream)`` (collective), ``local(offset, shape, dtype)``,
            ``peer_view(peer, offset, shape, dtype)``, ``begin(stream)``,
            ``ready(step, piece, stream)``, ``fetch(step, peer, pieces, stream)``,
            ``await_peer(step, piece, peer, stream)``, ``arrived(step, stream)``,
            ``finish(stream)``, ``join(stream)`` and ``close()`` (``_ipc.CudaPeerMemory``,
            ``_mpi.HostPeerMemory``).
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
        own = None
        for step, peer in enumerate(send_order(rank, size), start=1):
            begin = ex.send_offsets[peer]
            count = ex.send_counts[peer]
            if peer == rank and not ex.direct:  # own rows go straight to out
                ex.fill(peer, begin, begin + count, ex.out_rows(rank))
                continue
            parts = [(0, count)] if peer == rank else ex.pieces(count)
            for piece, (lo, hi) in enumerate(parts):
                slots = tuple(memory.local(base + (begin + lo) * rb, (hi - lo,) + shape, dtype)
                              for base, rb, (shape, dtype) in zip(bases, row_bytes, ex.arrays))
                ex.fill(peer, begin + lo, begin + hi, slots)
                if peer == rank:
                    own = slots
                else:
                    memory.ready(step, piece, ex.stream)
        comm.barrier()  # every rank's ready events are recorded before anyone waits on them
        if ex.direct:
            self._consume_in_place(ex, own)
        else:
            self._pull(ex)

    def _senders(self, ex):
        """``(step, peer, [(first row, rows, [(byte offset in the peer's memory, (shape,
        dtype)) per array]) per piece])`` for every peer, in pull order."""
        rank, size = ex.comm.rank, ex.comm.size
        for step in range(1, size):
            peer = (rank - step) % size
            peer_sent = ex.sent[peer]
            first = sum(peer_sent[:rank])          # the peer's first row for this rank
            peer_bases, _ = regions(ex.row_bytes, sum(peer_sent))
            parts = []
            for lo, hi in ex.pieces(ex.recv_counts[peer]):
                parts.append((lo, hi, [(base + (first + lo) * rb, ((hi - lo,) + shape, dtype))
                                       for base, rb, (shape, dtype) in zip(peer_bases,
                                                                           ex.row_bytes,
                                                                           ex.arrays)]))
            yield step, peer, parts

    def _pull(self, ex):
        """Copy every peer's rows into ``ex.outs``; hand each peer's over once all are there."""
        memory, rank = self._memory, ex.comm.rank
        ex.arrive(rank, ex.out_rows(rank), ex.stream)
        for step, peer, parts in self._senders(ex):
            at = ex.recv_offsets[peer]
            copies = [[(offset, o[at + lo:at + hi]) for (offset, _), o in zip(where, ex.outs)]
                      for lo, hi, where in parts]
            memory.fetch(step, peer, copies, ex.stream)
        memory.finish(ex.stream)
        for step in range(1, ex.comm.size):
            memory.arrived(step, ex.stream)
            peer = (rank - step) % ex.comm.size
            ex.arrive(peer, ex.out_rows(peer), ex.stream)

    def _consume_in_place(self, ex, own):
        """``direct``: hand over the own rows in the staging, then each peer's (whole) in its
        memory, on the side stream once the peer has filled them; the caller's stream waits for
        the side stream at the end."""
        memory = self._memory
        ex.arrive(ex.comm.rank, own, ex.stream)
        for step, peer, [(_, _, where)] in self._senders(ex):
            if ex.recv_counts[peer]:
                side = memory.await_peer(step, 0, peer, ex.stream)
                ex.arrive(peer, tuple(memory.peer_view(peer, offset, shape, dtype)
                                      for offset, (shape, dtype) in where), side)
        memory.finish(ex.stream)
        memory.join(ex.stream)

    def close(self):
        self._memory.close()


class Exchange:
    """One staged exchange's arguments, checked and agreed across ranks (internal).

    Attributes:
        arrays: ``((row shape, dtype), ...)`` of the arrays moved together.
        row_bytes: bytes of one row of each array.
        send_counts, recv_counts, send_offsets, recv_offsets: W ints each (rows).
        sent: W lists of W ints, ``sent[j][i]`` rows rank j sends to rank i.
        outs: the output arrays (None when ``direct``). stream: the caller's stream handle (0 on
            the host). direct: ``arrived`` reads the rows where they are (no ``out``).
    """

    def __init__(self, comm, arrays, send_counts, recv_counts, out, fill, arrived, stream,
                 direct):
        self.comm = comm
        self.fill = fill
        self._arrived = arrived
        self.stream = stream
        self.direct = bool(direct)
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
            if direct and (out is not None or arrived is None):
                raise ValueError(f"direct=True on rank {rank}: expected out=None and an arrived "
                                 f"callback (the rows are read where they are, never stored)")
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
            description += ", read in place (direct)" if direct else ""
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
        self.outs = out
        if out is None and not self.direct:
            self.outs = self.new_arrays(sum(rc))

    def pieces(self, rows):
        """The row ranges a peer's ``rows`` move in: :func:`pieces`, or whole with ``direct``
        (every rank agrees: ``direct`` is part of the voted description)."""
        return [(0, rows)] if self.direct else pieces(rows, self.row_bytes)

    def new_arrays(self, rows):
        """One new array of ``rows`` rows per entry of ``arrays``, on the caller's stream."""
        return tuple(self.comm._empty((rows,) + shape, dtype) for shape, dtype in self.arrays)

    def out_rows(self, peer, outs=None):
        """The slices of ``outs`` (default: the output arrays) that hold ``peer``'s rows."""
        at = self.recv_offsets[peer]
        return tuple(o[at:at + self.recv_counts[peer]]
                     for o in (self.outs if outs is None else outs))

    def arrive(self, peer, rows, stream):
        """Hand ``peer``'s ``rows`` (one array per entry of ``arrays``) over, readable on
        ``stream``; nothing for a peer that sends nothing."""
        if self._arrived is not None and self.recv_counts[peer]:
            begin = self.recv_offsets[peer]
            self._arrived(peer, begin, begin + self.recv_counts[peer], rows, stream)


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
