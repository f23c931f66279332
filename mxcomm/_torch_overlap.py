"""The expert-parallel layer's backward overlap (``ExpertParallel(overlap=True)``): the
dispatch's gradient exchange (and the permute's backward before it) on a side stream, beside the
expert weight-gradient GEMM (docs/design.md, "Overlap"). The rows an overlapped dispatch returns
carry a :class:`_Slot` (:data:`ATTRIBUTE`) where ``grouped_mm``'s backward marks its dgrad; the
side stream waits for the mark only when autograd hands it exactly the marked tensor at its
version, else for the whole main stream: the same bits either way. Without a GPU the marks are
still matched and counted (``beside``, ``behind``). Glossary: P permuted rows, D dim.
"""

import weakref

import torch

from . import a2a as _a2a
from ._torch_arrays import _record
from ._torch_gemm import OVERLAP_ATTRIBUTE as ATTRIBUTE
from .formats import get_format
from .torch._ops import _A2A
from .torch._permute import _Permute


def slot_of(rows):
    """The :class:`_Slot` that ``rows`` (an overlapped dispatch's output) carries, or None."""
    return getattr(rows, ATTRIBUTE, None)


class BackwardOverlap:
    """The side streams of one ``ExpertParallel`` object and what its overlapped backwards did.

    Attributes:
        beside: backwards that waited for a mark only (beside the weight-gradient GEMM).
        behind: backwards that waited for the whole current stream.
    """

    def __init__(self):
        self._streams = {}  # CUDA device index -> the side stream
        self._cupy_streams = {}  # the side stream's raw handle -> CuPy's object over it
        self.beside = 0
        self.behind = 0

    def side_stream(self, device):
        """The high-priority side stream on ``device`` (None for a CPU device)."""
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            # -1: above the default (0) in every torch version
            stream = self._streams[index] = torch.cuda.Stream(index, priority=-1)
        return stream

    def cupy_stream(self, side):
        """CuPy's stream over ``side``, current while the side work runs (so that CuPy's pool
        never hands out blocks the main stream may still read)."""
        ptr = side.cuda_stream
        stream = self._cupy_streams.get(ptr)
        if stream is None:
            from ._driver import external_stream
            stream = self._cupy_streams[ptr] = external_stream(ptr)
        return stream

    def dispatch(self, x, layout, *, precision, grad_precision, align, fused, out_format=None):
        """``a2a_dispatch`` then ``permute`` (``fused``: ``a2a_dispatch(..., permute_align=
        align)``), bit for bit, their backward on the side stream; arguments and errors as
        theirs (``layout``: the step's Layout). Returns ``(rows (P, D), permuted_indices (P,)
        int32, group_offsets (E_local,) int32)``, ``rows`` carrying its :class:`_Slot`. No host
        sync, no collective."""
        _a2a._check_precision(precision)
        _a2a._check_precision(grad_precision, "grad_precision")
        slot = _Slot(self, self.side_stream(x.device))
        call = ("a2a_dispatch", None, None, None, precision, grad_precision, layout,
                align if fused else None)
        if fused:
            rows, indices, offsets = _OverlappedA2A.apply(slot, x, call)
        else:
            if out_format is not None:
                get_format(out_format, "out_format")
            received = _OverlappedA2A.apply(slot, x, call)
            # the received rows are this layout's (permute's own check holds by construction)
            rows, indices, offsets = _OverlappedPermute.apply(slot, received, layout, None, align,
                                                              out_format, False)
        setattr(rows, ATTRIBUTE, slot)
        return rows, indices, offsets


class _Slot:
    """One overlapped dispatch's meeting point: the last mark (tensor, version, event) and the
    side stream."""

    __slots__ = ("owner", "side", "_marked", "_version", "_event")

    def __init__(self, owner, side):
        self.owner = owner
        self.side = side
        self._marked = None
        self._version = None
        self._event = None

    def mark(self, t, event=None):
        """Note that ``t`` is complete at ``event`` (None: the current stream's position now)."""
        self._marked = weakref.ref(t)
        self._version = t._version
        if event is None and self.side is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.side.device))
        self._event = event

    def run_beside(self, grad, work):
        """``work()`` (a backward reading ``grad``) on the side stream after the mark (``grad``
        the marked tensor) or the current stream, which waits for it; its first result marked."""
        # no side stream while a CUDA graph captures (that failed with
        # cudaErrorStreamCaptureInvalidated): the backward runs here, counted behind
        capturing = (self.side is not None and torch.cuda.is_available()
                     and torch.cuda.is_current_stream_capturing())
        marked = not capturing and self._marked is not None and self._marked() is grad and \
            grad._version == self._version
        if marked:
            self.owner.beside += 1
        else:
            self.owner.behind += 1
        if self.side is None or capturing:
            out = work()
            done = None
        else:
            current = torch.cuda.current_stream(self.side.device)
            if marked:
                self.side.wait_event(self._event)
            else:
                self.side.wait_stream(current)
            with torch.cuda.stream(self.side), self.owner.cupy_stream(self.side):
                out = work()
            done = torch.cuda.Event()
            done.record(self.side)
            current.wait_event(done)
            for t in out if isinstance(out, tuple) else (out,):
                _record(t, current)
        first = out[0] if isinstance(out, tuple) else out
        if first is not None:
            self.mark(first, done)
        return out


def _overlapped(function):
    """The autograd Function ``function`` with a :class:`_Slot` as its first argument, its
    backward run by :meth:`_Slot.run_beside` (a permute's never folded into the dispatch's
    pending gather)."""

    def forward(ctx, slot, *args):
        ctx.slot = slot
        return function.forward(ctx, *args)

    def backward(ctx, grad, *grads):
        out = ctx.slot.run_beside(grad, lambda: function.backward(ctx, grad, *grads))
        return (None, *out)  # None for the slot

    # named per Function: torch names the backward node (profiles, anomaly mode) by the class
    return type(f"_Overlapped{function.__name__.lstrip('_')}", (function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


_OverlappedA2A = _overlapped(_A2A)
_OverlappedPermute = _overlapped(_Permute)
