"""The NCCL communicator's watchdog: every NCCL group (and ``wait``) is followed by a pooled CUDA
event in a queue kept in record order; a thread polls the oldest, retires the finished ones and,
past the timeout, an async NCCL error or a failed device wait of the pull transport, aborts the
communicator and keeps the error for the next call (docs/design.md, "Error model").
"""

import collections
import threading
import time

from ._board import EXCHANGE

_CUDA_SUCCESS = 0
_CUDA_NOT_READY = 600          # cudaErrorNotReady
_EVENT_DISABLE_TIMING = 0x2    # cudaEventDisableTiming
#: Watchdog polling period while operations are in flight. It only bounds how late a timeout is
#: noticed: the calls recycle finished events themselves. Polling every millisecond made the
#: calling thread wait for the interpreter lock: the host time of an MXFP8 dispatch went from
#: about 0.5 to 0.9 ms (H200 host, bench/NOTES.md).
_WATCH_POLL_S = 0.05
_ASYNC_CHECK_S = 1.0           # period of ncclCommGetAsyncError checks while in flight
_IDLE_WAKE_S = 0.5             # watchdog wake-up period while nothing is in flight
#: ``wait`` polls its event without sleeping for this long, then sleeps between polls (doubling
#: up to 1 ms): the host read of the layout exchange waits here for the work before it, and a
#: sleep overshoots its end by up to its own length (at least ~50 us on Linux) while the device
#: idles until the layout is agreed.
_WAIT_SPIN_S = 2e-3


class Watchdog:
    """The watchdog's part of :class:`~mxcomm.comm.NcclCommunicator` (a base of it): the event
    pool and queue, the thread, and :meth:`wait`. The communicator supplies ``_runtime``,
    ``_board``, ``_stream``, ``_nccl``, ``timeout``, ``device``, ``rank``, ``size``, the
    lifecycle (``_fail``, ``check_usable``, ``_device_failure``) and ``_stalled`` (what a
    stalled exchange's call headers show, raised instead of a bare timeout)."""

    def _start_watchdog(self):
        """The watchdog's state, shared with its thread under ``self._lock``, and the thread."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._free_events = []                   # event handles ready for reuse
        self._in_flight = collections.deque()    # (event, host time recorded, call, stream)
        self._mixed = False      # in-flight events on more than one stream (else in order)
        self._stopping = False
        self._board = self._side.board  # made by mxcomm.comm.init
        self._watchdog = threading.Thread(target=self._watch, name=f"mxcomm-nccl-watchdog-"
                                          f"{self.rank}", daemon=True)
        self._watchdog.start()

    def _record(self, stream_ptr, call):
        """Record a pooled event on ``stream_ptr`` after exchange call number ``call`` and hand
        it to the watchdog (not while the stream is being captured into a CUDA graph: the
        graph's launches are the caller's)."""
        if self._runtime.streamIsCapturing(stream_ptr):
            self._captured = True  # a CUDA graph now holds NCCL work of this communicator
            return
        runtime = self._runtime
        with self._lock:  # recorded and queued together: the queue is in record order
            free = self._free_events
            if not free:  # finished events not yet recycled by the watchdog's poll
                self._retire_finished()
            event = free.pop() if free else runtime.eventCreateWithFlags(_EVENT_DISABLE_TIMING)
            runtime.eventRecord(event, stream_ptr)
            flight = self._in_flight
            if flight and flight[-1][3] != stream_ptr:
                self._mixed = True
            flight.append((event, time.monotonic(), call, stream_ptr))
            if len(flight) == 1:
                self._wake.notify()

    def _retire_finished(self):
        """Move the finished events at the head of the in-flight queue back to the pool (under
        the lock); returns how many. The queue is in record order (``_record``); while every
        in-flight event is on one stream they finish in that order, so a binary search finds
        the finished ones in O(log n) queries, and the watchdog's work per poll does not grow
        with the calls made since (its Python competes with the calling thread for the GIL).
        Events on several streams are retired from the head, one query each."""
        flight, query = self._in_flight, self._runtime.eventQuery
        if not flight or query(flight[0][0]) != _CUDA_SUCCESS:
            return 0
        if self._mixed:
            done = 1
            while done < len(flight) and query(flight[done][0]) == _CUDA_SUCCESS:
                done += 1
        else:  # the first not finished, in [1, len]
            done, end = 1, len(flight)
            while done < end:
                mid = (done + end) // 2
                if query(flight[mid][0]) == _CUDA_SUCCESS:
                    done = mid + 1
                else:
                    end = mid
        free = self._free_events
        for _ in range(done):
            free.append(flight.popleft()[0])
        if not flight:
            self._mixed = False
        return done

    def _watch(self):
        """Watchdog thread: recycle finished events; abort NCCL on a timeout or async error."""
        runtime = self._runtime
        try:
            runtime.setDevice(self.device)
        except Exception:  # event queries work across devices anyway
            pass
        oldest_since = None  # when the current oldest event became the oldest
        last_async_check = 0.0
        while True:
            with self._lock:
                if self._stopping:
                    return
                head = self._in_flight[0] if self._in_flight else None
                if head is None:
                    oldest_since = None
                    self._wake.wait(min(_IDLE_WAKE_S, self.timeout / 4))
            failure = self._device_failure()
            if failure is not None:
                self._fail(failure)
                return
            host_since = self._host_since
            if host_since is not None and time.monotonic() - host_since > self.timeout:
                late = self._board.describe(EXCHANGE, self._host_call)
                self._fail(TimeoutError(
                    f"alltoallv: NCCL did not accept an exchange within {self.timeout:g} s on "
                    f"rank {self.rank} of {self.size} (blocked in ncclGroupEnd, e.g. connecting "
                    f"to a peer that does not call; {late}); the communicator is aborted"))
                return
            if head is None:
                continue
            event, recorded, call, _ = head
            status = runtime.eventQuery(event)
            now = time.monotonic()
            if status == _CUDA_SUCCESS:
                with self._lock:
                    self._retire_finished()
                oldest_since = now
                continue
            oldest_since = recorded if oldest_since is None else max(oldest_since, recorded)
            if status != _CUDA_NOT_READY:
                self._fail(RuntimeError(f"NcclCommunicator on rank {self.rank}: CUDA error "
                                        f"{status} while waiting for an NCCL group; the "
                                        f"communicator is aborted"))
                return
            # A device wait of the pull transport gives up after `timeout` and names the peer
            # it missed (above): leave it the time to, before the generic message.
            if now - oldest_since > self.timeout * 1.25 + 1.0:
                late = self._board.describe(EXCHANGE, call)
                self._fail(self._stalled() or TimeoutError(
                    f"alltoallv: an NCCL exchange did not finish within {self.timeout:g} s on "
                    f"rank {self.rank} of {self.size} ({late}); the communicator is aborted"))
                return
            if now - last_async_check > _ASYNC_CHECK_S:
                last_async_check = now
                try:
                    with self._lock:
                        if self._state == "open" and self._nccl is not None:
                            self._nccl.check_async_error()
                except Exception as exc:  # NcclError: a peer or the network failed
                    self._fail(RuntimeError(f"NcclCommunicator on rank {self.rank}: NCCL "
                                            f"reported an asynchronous error ({exc}); the "
                                            f"communicator is aborted"))
                    return
            time.sleep(_WATCH_POLL_S)

    def wait(self, stream=None):
        """Block the host until the work enqueued on ``stream`` so far is done, or ``timeout``.

        Use it instead of a device synchronize before the host reads a result, e.g. the output
        of :meth:`alltoall_counts`: it polls a CUDA event, so a peer that never joins produces a
        ``TimeoutError`` rather than a hang. This is the only method that syncs the host.

        Args:
            stream: None for CuPy's current stream, a stream object (``.ptr``/``.cuda_stream``),
                or a raw handle.
        Raises:
            TimeoutError: a device wait of an exchange on the stream gave up after ``timeout`` s
                (naming the rank that did not arrive), or the stream's work is not done within
                ``1.25 * timeout + 1`` s (naming, by the arrival board, this node's ranks that
                had not entered the last exchange call); the communicator is aborted.
            RuntimeError: the communicator is aborted or closed; a peer called a different
                exchange, or is at another call of it (its ready words, or the NCCL call
                header: then the mis-paired call's results hold 0xFF bytes).
        """
        self.check_usable()
        runtime = self._runtime
        with self._lock:
            event = self._free_events.pop() if self._free_events else None
        if event is None:
            event = runtime.eventCreateWithFlags(_EVENT_DISABLE_TIMING)
        runtime.eventRecord(event, self._stream(stream))
        start = time.monotonic()
        sleep = 1e-5
        try:
            while True:
                status = runtime.eventQuery(event)
                if status == _CUDA_SUCCESS:
                    # A device wait that gave up lets its stream go on, so the work completes
                    # either way: what it missed is in the status it wrote, read here (the
                    # watchdog may not have polled it yet).
                    self.check_usable()
                    return
                if status != _CUDA_NOT_READY:
                    self._fail(RuntimeError(f"NcclCommunicator.wait on rank {self.rank}: CUDA "
                                            f"error {status}; the communicator is aborted"))
                    self.check_usable()
                if self._pending_error is not None or self._state != "open":
                    self.check_usable()
                # The pull transport's device waits give up after `timeout` from when they
                # start, which is after this call starts: leave them the time to name the rank
                # (the watchdog finds their status within its poll, aborts NCCL on its own
                # thread, and the check above raises the error it kept) before the generic
                # message.
                if time.monotonic() - start > self.timeout * 1.25 + 1.0:
                    late = self._board.describe(EXCHANGE, self._board.entered[EXCHANGE])
                    self._fail(self._stalled() or TimeoutError(
                        f"wait: the stream's work did not finish within {self.timeout:g} s on "
                        f"rank {self.rank} ({late}); the communicator is aborted"))
                    self.check_usable()
                if time.monotonic() - start > _WAIT_SPIN_S:
                    time.sleep(sleep)
                    sleep = min(2 * sleep, 1e-3)
        finally:
            with self._lock:
                self._free_events.append(event)
