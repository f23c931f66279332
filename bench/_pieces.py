"""Timers around the pieces of a host path, for the bench scripts (``probe_host.py``,
``profile_step.py``): each named function wrapped where it is looked up, its inclusive time and
calls added up, then unwrapped. A wrapper adds ~0.3 us per entry."""

import collections
import time


class Pieces:
    """Inclusive nanoseconds (``totals``) and calls (``entries``) per piece, by label."""

    def __init__(self):
        self.totals = collections.defaultdict(int)
        self.entries = collections.Counter()
        self._undo = []

    def wrap(self, targets):
        """Wrap each ``(owner, attribute name)`` of ``targets`` (a module or a class; a
        staticmethod stays one) with a timer; return the labels of those absent (``owner`` None,
        or an older tree without the attribute), which are skipped."""
        missing = []
        for owner, name in targets:
            fn = owner.__dict__.get(name) if owner is not None else None
            label = f"{owner.__name__}.{name}" if not isinstance(owner, type) else \
                f"{owner.__module__.rsplit('.', 1)[-1]}.{owner.__name__}.{name}"
            if fn is None:
                missing.append(label)
                continue
            wrapped = staticmethod(self._timed(label, fn.__func__)) \
                if isinstance(fn, staticmethod) else self._timed(label, fn)
            setattr(owner, name, wrapped)
            self._undo.append((owner, name, fn))
        return missing

    def unwrap(self):
        """Put every wrapped function back."""
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()

    def clear(self):
        self.totals.clear()
        self.entries.clear()

    def _timed(self, label, fn):
        totals, entries = self.totals, self.entries

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter_ns() - t0
                entries[label] += 1
        wrapper.__wrapped__ = fn
        return wrapper
