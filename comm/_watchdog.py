"""The NCCL communicator's watchdog (docs/design.md, "Error model"): a pooled CUDA event follows
every NCCL group in a queue in record order; a thread polls the oldest, retires finished ones and,
on a timeout, an async NCCL error or a failed device wait, aborts the communicator and keeps the
error for the next call."""

import collections
import threading
import time

from ._board import EXCHANGE

_CUDA_SUCCESS = 0
_CUDA_NOT_READY = 600          # cudaErrorNotReady
_EVENT_DISABLE_TIMING = 0x2    # cudaEventDisableTiming
#: Polling period while work is in flight (faster polls cost the caller the GIL).
_WATCH_POLL_S = 0.05
_ASYNC_CHECK_S = 1.0           # period of ncclCommGetAsyncError checks while in flight
_IDLE_WAKE_S = 0.5             # watchdog wake-up period while nothing is in flight
#: ``wait`` spins this long before sleeping (doubling to 1 ms): a sleep's overshoot idles the GPU.
_WAIT_SPIN_S = 2e-3


def _bounded(fn, seconds, name):
    """``fn()`` on a daemon thread waited for at most ``seconds``: ``(True, result)``, or ``(False,
    None)`` if still running; an exception raised in time is re-raised."""
    outcome = []

    def run():
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 (raised on the caller's thread)
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        return False, None
    ok, value = outcome[0]
    if not ok:
        raise value
    return True, value


class Watchdog:
    """The watchdog's part of :class:`~mxcomm.comm.NcclCommunicator` (a base of it): event pool and
    queue, the thread, :meth:`wait`."""

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
        """Record a pooled event on ``stream_ptr`` after exchange call ``call`` and queue it (not
        during a CUDA graph capture)."""
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
        """Return the finished events at the queue's head to the pool (under the lock); how many. On
        one stream they finish in order: a binary search finds them in O(log n) queries."""
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
            # leave the pull's device waits time to name the peer first (above)
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

    def _drain(self):
        """Block until every NCCL group in the queue, on any stream, is done: bounded as
        :meth:`wait` (past ``1.25 * timeout + 1`` s TimeoutError, the communicator aborted)."""
        start = time.monotonic()
        while True:
            with self._lock:
                self._retire_finished()
                if not self._in_flight:
                    return
                call = self._in_flight[0][2]
            self.check_usable()
            if time.monotonic() - start > self.timeout * 1.25 + 1.0:
                late = self._board.describe(EXCHANGE, call)
                self._fail(TimeoutError(
                    f"close: an NCCL exchange did not finish within {self.timeout:g} s on rank "
                    f"{self.rank} ({late}); the communicator is aborted"))
                self.check_usable()
            time.sleep(1e-3)

    def wait(self, stream=None):
        """Block the host until the work enqueued on ``stream`` (None: CuPy's current stream, a
        stream object, or a raw handle) so far is done: the only method that syncs the host. Use
        it instead of a device synchronize, so a peer that never joins raises instead of hanging.

        Raises:
            TimeoutError: a device wait of an exchange gave up after ``timeout`` s (naming the
                rank), or the work is not done within ``1.25 * timeout + 1`` s (naming by the
                arrival board this node's ranks behind); the communicator is aborted.
            RuntimeError: the communicator is aborted or closed; a peer called another exchange or
                is at another call of it (the mis-paired call's results hold 0xFF bytes)."""
        self.check_usable()
        runtime = self._runtime
        with self._lock:
            event = self._free_events.pop() if self._free_events else None
        if event is None:
            event = runtime.eventCreateWithFlags(_EVENT_DISABLE_TIMING)
        runtime.eventRecord(event, self.stream_ptr(stream))
        start = time.monotonic()
        sleep = 1e-5
        try:
            while True:
                status = runtime.eventQuery(event)
                if status == _CUDA_SUCCESS:
                    # a device wait that gave up lets the stream finish: read its status now
                    self.check_usable()
                    return
                if status != _CUDA_NOT_READY:
                    self._fail(RuntimeError(f"NcclCommunicator.wait on rank {self.rank}: CUDA "
                                            f"error {status}; the communicator is aborted"))
                    self.check_usable()
                if self._pending_error is not None or self._state != "open":
                    self.check_usable()
                # the pull's device waits start later and time out on their own, naming the
                # rank: leave them the time before the generic message
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
