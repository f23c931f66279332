"""MPI communicator: all-to-all of rows of host (NumPy) arrays with mpi4py.

The CPU path and CI use it, and it is the fallback where NCCL is unavailable. Data moves with
nonblocking ``Ialltoallv`` whose MPI datatype is one whole row (a contiguous run of the row's
bytes), so counts and displacements are in rows and stay far below the int32 limit of MPI counts
even for arrays of many GiB. Every request is polled until ``timeout`` (``_sidechannel``).
"""

import atexit
import math
import operator
import os
import signal
import sys

import numpy

from ._hostcomm import HostCommunicator

_INT32_MAX = 2**31 - 1


class MpiCommunicator(HostCommunicator):
    """All-to-all of rows of host NumPy arrays over MPI.

    Args:
        side: an ``MpiSideChannel`` (``mxcomm.comm.init`` builds it over an mpi4py communicator,
            ``MPI.COMM_WORLD`` by default); data moves on its private duplicate.
        validate: default of the per-call ``validate`` flag (cross-rank count checks).
        peer_memory: transport of :meth:`exchange`: None (auto) pulls from MPI shared-memory
            windows where every rank is on this node; True requires that; False uses one
            ``alltoallv``.
        small_exchange_bytes, medium_exchange_bytes: see ``mxcomm.comm.init``; None: 0.

    Collective: every rank of the MPI communicator constructs it. Every method that moves data
    is collective and blocks the host until done (or ``timeout``).
    """

    def __init__(self, side, *, validate=True, peer_memory=None, small_exchange_bytes=None,
                 medium_exchange_bytes=None):
        super().__init__(side, validate=validate, peer_memory=peer_memory,
                         small_exchange_bytes=small_exchange_bytes,
                         medium_exchange_bytes=medium_exchange_bytes)
        self._row_types = {}  # row bytes -> committed MPI contiguous datatype
        self._choose_transport()

    # --------------------------------------------------------------------------------- hooks
    def _peer_memory_here(self):
        return True  # every rank is on this node: the window is plain shared memory

    def _new_peer_memory(self):
        from ._shm import HostPeerMemory
        return HostPeerMemory(self)

    def _abort_backend(self):
        """An aborted MPI communicator may leave a peer stuck (in a collective, or anywhere),
        and ``MPI_Finalize`` at the process's exit would wait for it: bound that exit
        (:class:`_BoundedExit`). With the pull transport, tell the peers this rank gave up on
        its exchange (``HostPeerMemory.give_up``)."""
        _BOUNDED_EXIT.arm(self.timeout)
        memory = getattr(self._transport, "memory", None)
        if memory is not None:  # the pull transport: a late peer learns it at once
            memory.give_up()

    def _close_backend(self, clean):
        for datatype in self._row_types.values():
            datatype.Free()
        self._row_types.clear()

    def _row_type(self, row_bytes):
        """The committed MPI datatype of one row of ``row_bytes`` bytes (cached)."""
        datatype = self._row_types.get(row_bytes)
        if datatype is None:
            datatype = self._side.MPI.BYTE.Create_contiguous(row_bytes).Commit()
            self._row_types[row_bytes] = datatype
        return datatype

    # ----------------------------------------------------------------------------- collectives
    def alltoallv(self, send, send_counts, recv_counts, out=None, *, send_offsets=None,
                  recv_offsets=None, stream=None, validate=None):
        """Send rows to every rank: ``send_counts[r]`` rows of ``send`` go to rank ``r``.

        Rows are first-axis slices. Rows for rank ``r`` start at row ``send_offsets[r]`` of
        ``send``; rows from rank ``r`` land at row ``recv_offsets[r]`` of ``out``. Collective;
        blocks the host until the exchange is done.

        Args:
            send: (M, ...) C-contiguous NumPy array of any dtype (bf16 as ``ml_dtypes.bfloat16``,
                uint8 fp8 bits, int32, ...), or a tuple of such arrays with equal M moved
                together (e.g. fp8 data (M, D) and scales (M, D/32)). Read.
            send_counts: W non-negative host ints, rows sent to each rank.
            recv_counts: W non-negative host ints, rows received from each rank.
            out: (N, ...) arrays like ``send`` (same dtypes and row shapes, same tuple
                structure), or None to allocate N = sum(recv_counts) rows (max(recv_offsets +
                recv_counts) with explicit offsets). Written.
            send_offsets: W host ints, first row sent to each rank; default the exclusive
                cumulative sum of ``send_counts`` (then sum(send_counts) must equal M).
            recv_offsets: W host ints, first row of ``out`` received from each rank; default the
                exclusive cumulative sum of ``recv_counts`` (then sum(recv_counts) must equal N).
            stream: ignored (host arrays); accepted for a backend-independent call.
            validate: check counts across ranks first (one small MPI allgather); None for the
                communicator's default.
        Returns:
            ``out`` (an array, or a tuple if ``send`` was a tuple).
        Raises:
            ValueError: counts of the wrong length, negative, beyond the arrays or not adding up
                to the rows; counts inconsistent across ranks (same message on every rank).
            TypeError: a non-host array, non-integer counts, or ``out`` of another dtype.
            TimeoutError: not done within ``timeout`` s; the communicator is aborted.
            RuntimeError: the communicator is aborted or closed.
        """
        self.check_usable()
        sends, outs, single, sc, rc, so, ro = self._plan(
            send, send_counts, recv_counts, out, send_offsets, recv_offsets, validate)
        self._move_rows(sends, outs, sc, so, rc, ro, None)
        return outs[0] if single else outs

    def _move_rows(self, sends, outs, sc, so, rc, ro, stream_ptr):
        call = self._enter_exchange()
        requests = []
        for s, o in zip(sends, outs):
            row_bytes = s.dtype.itemsize * math.prod(s.shape[1:])
            if row_bytes == 0:  # rows of zero bytes (an empty row shape): nothing to move
                continue
            if not requests:  # MPI counts and displacements are C ints
                for name, ends in (("send", map(operator.add, so, sc)),
                                   ("recv", map(operator.add, ro, rc))):
                    if max(ends, default=0) > _INT32_MAX:
                        raise ValueError(f"alltoallv: {name} rows beyond 2**31 - 1 on rank "
                                         f"{self.rank}")
            datatype = self._row_type(row_bytes)
            requests.append(self._side.mpi.Ialltoallv([_bytes(s), (sc, so), datatype],
                                                 [_bytes(o), (rc, ro), datatype]))
        if requests:
            self._wait_moved(requests, (sends, outs), call)

    def alltoall_counts(self, counts, *, stream=None):
        """Exchange equal-size chunks of a counts vector: chunk ``r`` goes to rank ``r``.

        Collective; blocks the host until done.

        Args:
            counts: (W·k,) integer NumPy array; entries ``[r·k, (r+1)·k)`` go to rank ``r``.
                Read.
            stream: ignored (host arrays).
        Returns:
            (W·k,) array of the same dtype: entries ``[r·k, (r+1)·k)`` came from rank ``r``.
        Raises:
            ValueError: a length not a multiple of W, or different k across ranks (same message
                on every rank).
            TypeError: not a 1-D integer host array.
            TimeoutError: not done within ``timeout`` s; the communicator is aborted.
        """
        def move(counts, out, nbytes):
            byte = self._side.MPI.BYTE
            return [self._side.mpi.Ialltoall([_bytes(counts), nbytes, byte],
                                             [_bytes(out), nbytes, byte])]
        return self._host_alltoall_counts(counts, move)


class _BoundedExit:
    """The exit of a process one of whose MPI communicators was aborted (process-wide, as the
    exit is). mpi4py finalizes MPI at exit, after the ``atexit`` functions, and
    ``MPI_Finalize`` waits for every peer, a stuck one too. So, once armed:

    - an exception that reaches the top (``sys.excepthook``) ends the process with status 1
      right after its traceback, without finalizing: mpiexec then ends the job;
    - any other exit finalizes as usual (keeping its status: pytest's, ``sys.exit``'s) under
      an alarm of ``timeout`` s, whose default action ends the process if the finalization
      waits on a stuck peer.
    """

    def __init__(self):
        self.seconds = 0
        self.uncaught = False
        self._hook = None

    def arm(self, timeout):
        """Arm it with the communicator's ``timeout`` s (the longest of those armed)."""
        self.seconds = max(self.seconds, max(1, math.ceil(timeout)))
        if self._hook is None:
            self._hook = sys.excepthook
            sys.excepthook = self._excepthook
            atexit.register(self._at_exit)  # after mpi4py's: runs before its finalization

    def _excepthook(self, *info):
        self.uncaught = True
        self._hook(*info)

    def _at_exit(self):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 (a closed stream: nothing to flush)
                pass
        if self.uncaught:
            os._exit(1)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(self.seconds)


_BOUNDED_EXIT = _BoundedExit()


def _bytes(a):
    """A 1-D uint8 view of C-contiguous ``a`` (MPI sees bytes; any dtype, ml_dtypes included)."""
    return a.reshape(-1).view(numpy.uint8)


