"""Tensors as the array API's rows and back (mxcomm.torch). Glossary: N = M_recv rows received,
P permuted rows, D hidden.
"""

import torch
from torch.utils._pytree import tree_map

from .. import permutation as _permutation
from .._torch_arrays import _Alloc, _array, _record, _stream, _tensor
from ..formats import QuantizedArray
from ._quantized import _DATA_DTYPE, _SCALE_DTYPES, QuantizedTensor, _quantized_tensor


def _rows(t, name):
    """A tensor as the array API's rows: QuantizedArray, GatheredRows or an array."""
    if isinstance(t, QuantizedTensor):
        _record(t)  # read on this stream: t may have been made on another
        return t.format.wrap(_array(t.qdata, f"{name}.qdata"), _array(t.scales, f"{name}.scales"))
    if isinstance(t, _PendingGather):
        _record(t.source)  # read on this stream: made on the permute's
        _record(t.inverse)
        return _permutation.GatheredRows(_array(t.source, f"{name}.source"),
                                         _array(t.inverse, f"{name}.inverse"))
    return _array(t, name)


def _wrap(result, alloc=None):
    """An array API result as a tensor (a QuantizedTensor for a QuantizedArray, made unchecked),
    reusing the tensors ``alloc`` made."""
    tensor = _tensor if alloc is None else alloc.tensor
    if isinstance(result, QuantizedArray):
        return _quantized_tensor(tensor(result.data, _DATA_DTYPE),
                                 tensor(result.scales, _SCALE_DTYPES[result.scales.dtype]),
                                 result.format)
    return tensor(result)


def _index_tensors(layout, align, indices, offsets, alloc):
    """The permute index and group offsets of ``layout`` for ``align`` as tensors, cached on the
    layout with the arrays (so :func:`_index_array` finds the array again)."""
    key = ("torch permute index", align)
    cached = layout._cache.get(key) if layout is not None else None
    if cached is None or cached[0] is not indices:
        cached = (indices, alloc.tensor(indices), alloc.tensor(offsets))
        if layout is not None:
            layout._cache[key] = cached
            layout._cache["torch index array", id(cached[1])] = (cached[1], indices)
    return cached[1], cached[2]


def _index_array(t, layout):
    """The permute index tensor ``t`` as an array: the one cached on ``layout``, else a view."""
    if layout is not None:
        kept = layout._cache.get(("torch index array", id(t)))
        if kept is not None and kept[0] is t:
            return kept[1]
    return _array(t, "permuted_indices")


class _PendingGather(torch.Tensor):
    """Permute's gradient to the dispatch's backward, not written yet: (N, D), row i =
    ``source[inverse[i]]`` of the permuted (P, D) gradient, which a quantized dispatch gradient
    reads in place (docs/design.md, "The permute's backward folded into a quantized dispatch
    gradient"). Any other torch op materializes it first (the same bits).
    """

    @staticmethod
    def __new__(cls, source, inverse):
        shape = (inverse.shape[0],) + tuple(source.shape[1:])
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=source.dtype,
                                                   device=source.device)
        self.source, self.inverse = source, inverse
        return self

    def __init__(self, *args, **kwargs):
        pass  # everything happens in __new__

    def __repr__(self):
        return f"_PendingGather(shape={tuple(self.shape)}, device={self.device})"

    def materialize(self):
        """The rows as a plain tensor, gathered from ``source`` on torch's current stream."""
        alloc = _Alloc(self.source.device)
        return _wrap(_rows(self, "grad").materialize(_stream(self.source), alloc), alloc)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(lambda a: a.materialize() if isinstance(a, _PendingGather) else a,
                                (args, kwargs or {}))
        return func(*args, **kwargs)

