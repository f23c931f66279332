"""Timing of every benchmark: CUDA events on the work's stream, warm-up excluded, medians.

One :class:`Clock` per kind of timer: ``"cupy"`` and ``"torch"`` record CUDA events on the current
stream of that library (both the legacy default stream unless the caller changed it), ``"host"``
reads ``time.perf_counter`` (the CPU simulator, where every call is synchronous). :func:`measure`
times one callable ``iters`` times after ``warmup`` untimed calls and returns :class:`Stats`;
:func:`measure_back_to_back` enqueues the iterations one after another, as nccl-tests does, so
the host's per-call time hides behind the device's work as it does in a training step.
"""

import dataclasses
import time

import numpy


@dataclasses.dataclass(frozen=True)
class Stats:
    """Summary of per-iteration times in milliseconds."""

    median: float
    min: float
    p90: float
    iters: int

    @classmethod
    def of(cls, samples_ms):
        """Stats of a non-empty sequence of per-iteration times (ms)."""
        s = numpy.asarray(samples_ms, dtype=numpy.float64)
        if s.size == 0:
            raise ValueError("samples_ms: expected at least one sample, got none")
        return cls(float(numpy.median(s)), float(s.min()), float(numpy.percentile(s, 90)), int(s.size))

    def as_dict(self, prefix=""):
        """``{prefix + "ms": median, prefix + "min_ms": ..., prefix + "p90_ms": ...}``."""
        return {f"{prefix}ms": self.median, f"{prefix}min_ms": self.min, f"{prefix}p90_ms": self.p90}


class Clock:
    """Marks points in a stream's work and measures milliseconds between marks.

    Args:
        kind: ``"cupy"`` or ``"torch"`` (CUDA events on that library's current stream) or
            ``"host"`` (``time.perf_counter``; only right where the timed work is synchronous).
    """

    def __init__(self, kind):
        if kind not in ("cupy", "torch", "host"):
            raise ValueError(f"kind: expected 'cupy', 'torch' or 'host', got {kind!r}")
        self.kind = kind

    def mark(self):
        """Record a point on the current stream (an event) or the host clock."""
        if self.kind == "host":
            return time.perf_counter()
        if self.kind == "cupy":
            import cupy
            event = cupy.cuda.Event()
            event.record()
            return event
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end):
        """Milliseconds from ``start`` to ``end``; waits for ``end`` to complete."""
        if self.kind == "host":
            return (end - start) * 1e3
        end.synchronize()
        if self.kind == "cupy":
            import cupy
            return float(cupy.cuda.get_elapsed_time(start, end))
        return float(start.elapsed_time(end))

    def sync(self):
        """Wait for all work queued on the device (nothing to wait for on the host clock)."""
        if self.kind == "cupy":
            import cupy
            cupy.cuda.runtime.deviceSynchronize()
        elif self.kind == "torch":
            import torch
            torch.cuda.synchronize()


def measure(fn, clock, *, iters, warmup, before=None, inputs=None):
    """Time ``fn`` per iteration with ``clock``.

    Each iteration runs ``before()`` untimed (e.g. a barrier, or resetting gradients), then marks,
    calls ``fn``, marks again. Iterations are only synchronized through ``before``; the marks are
    read once all iterations are queued, so a fast ``fn`` is not slowed by host round trips.

    Args:
        fn: the work; called as ``fn()`` or, with ``inputs``, ``fn(inputs[i % len(inputs)])``
            (rotating input buffers so repeated runs do not measure the cache).
        clock: a :class:`Clock`.
        iters: timed iterations, >= 1. warmup: untimed iterations first, >= 0.
        before: optional callable run before every iteration, outside the timed region.
        inputs: optional sequence of argument sets to rotate through.
    Returns:
        :class:`Stats` of the timed iterations.
    """
    if iters < 1:
        raise ValueError(f"iters: expected >= 1, got {iters}")

    def call(i):
        return fn(inputs[i % len(inputs)]) if inputs is not None else fn()

    for i in range(warmup):
        if before is not None:
            before()
        call(i)
    marks = []
    for i in range(iters):
        if before is not None:
            before()
        start = clock.mark()
        call(warmup + i)
        marks.append((start, clock.mark()))
    return Stats.of([clock.elapsed_ms(a, b) for a, b in marks])


def measure_back_to_back(fn, clock, *, iters, warmup, before=None):
    """Time ``fn`` per iteration, the iterations enqueued back to back (throughput).

    ``before()`` (e.g. a sync and a barrier) runs once, after the warm-up; then the iterations
    are enqueued with a mark between consecutive ones and no synchronization, and an
    iteration's time is the distance between its marks. On the device the host's time per
    call overlaps the previous iteration's work unless it is longer than that work.

    Args:
        fn: the work, called as ``fn()``.
        clock: a :class:`Clock`.
        iters: timed iterations, >= 1. warmup: untimed iterations first, >= 0.
        before: optional callable run once before the timed iterations.
    Returns:
        :class:`Stats` of the timed iterations.
    """
    if iters < 1:
        raise ValueError(f"iters: expected >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    if before is not None:
        before()
    marks = [clock.mark()]
    for _ in range(iters):
        fn()
        marks.append(clock.mark())
    return Stats.of([clock.elapsed_ms(a, b) for a, b in zip(marks, marks[1:])])


def max_over_ranks(stats, allreduce_max):
    """The slowest rank's :class:`Stats`, field by field (``allreduce_max`` maps a list to the
    element-wise maximum over ranks; the identity in one process)."""
    med, lo, p90 = allreduce_max([stats.median, stats.min, stats.p90])
    return Stats(med, lo, p90, stats.iters)
