"""Loads and stores of row words with the least address arithmetic (docs/design.md "Arrays"):
``load_word(words, row, col)``, ``store_word(words, row, col, value)`` (2-D);
``load_item(items, i)``, ``store_item(items, i, value)`` (1-D: global, shared or local);
``load_flat(words, i)``, ``store_flat(words, i, value)`` (element i of a C-contiguous array of any
dimensions counted flat: no row and column products; index with an int32 where it fits); and in one
16-byte access (the address a multiple of 16, checked by the caller) the uint64 words 2 col and
2 col + 1 of a row, ``load_pair(words, row, col)``, ``store_pair(words, row, col, first, second)``,
or 2 i and 2 i + 1 of a 1-D array, ``load_pair_flat(words, i)``, ``store_pair_flat(words, i,
first, second)``. Non-negative indices only (numba's indexing wraps them): Numba intrinsics on a
GPU, device functions with the same results under the simulator, refusing a negative index.
"""

from numba import cuda

from ._device import simulated

#: Bytes of a pair of 8-byte words: the alignment :func:`load_pair` and :func:`store_pair` need.
PAIR_BYTES = 16
#: ``alignment`` of a shared array read and written in pairs (the simulator takes none).
SHARED_PAIR_ALIGN = None if simulated() else PAIR_BYTES

if simulated():
    def _nonnegative(*indices):
        for i in indices:
            if i < 0:
                raise IndexError(f"kernels._memory: negative index {i} (the GPU form reads "
                                 f"out of bounds where NumPy indexing wraps around)")

    @cuda.jit(device=True)
    def _load(words, *index):
        _nonnegative(*index)
        return words[index]

    @cuda.jit(device=True)
    def _store(words, *index_value):
        *index, value = index_value
        _nonnegative(*index)
        words[tuple(index)] = value

    @cuda.jit(device=True)
    def _load_pair(words, *index):
        _nonnegative(*index)
        *lead, last = index
        return words[(*lead, 2 * last)], words[(*lead, 2 * last + 1)]

    @cuda.jit(device=True)
    def _store_pair(words, *index_values):
        *index, first, second = index_values
        _nonnegative(*index)
        *lead, last = index
        words[(*lead, 2 * last)] = first
        words[(*lead, 2 * last + 1)] = second

    @cuda.jit(device=True)
    def load_flat(words, i):
        _nonnegative(i)
        return words.reshape(-1)[i]

    @cuda.jit(device=True)
    def store_flat(words, i, value):
        _nonnegative(i)
        words.reshape(-1)[i] = value

    load_word = load_item = _load
    store_word = store_item = _store
    load_pair = load_pair_flat = _load_pair
    store_pair = store_pair_flat = _store_pair

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _PAIR = ir.VectorType(ir.IntType(64), 2)

    def _check_array(name, array, ndim, dtype=None):
        """TypeError unless ``array`` is a C-contiguous ``ndim``-D (any with None) array (of
        ``dtype``)."""
        if not (isinstance(array, types.Array) and ndim in (None, array.ndim)
                and array.layout == "C" and (dtype is None or array.dtype == dtype)):
            what = f"{dtype} " if dtype is not None else ""
            shape = f"{ndim}-D " if ndim is not None else ""
            raise TypeError(f"{name}: expected a {shape}C-contiguous {what}array, got {array}")

    def _element(context, builder, signature, args, values, kind):
        """The pointer that ``args`` (array, indices..., then ``values`` values) address: of an
        element (``kind`` "item"), of an element counted flat ("flat") or a ``<2 x i64>`` pair
        ("pair": the last index doubled)."""
        array_type = signature.args[0]
        ends = len(args) - values
        indices = [context.cast(builder, v, t, types.intp)
                   for v, t in zip(args[1:ends], signature.args[1:ends])]
        ary = context.make_array(array_type)(context, builder, value=args[0])
        if kind == "flat":
            return builder.gep(ary.data, indices)
        if kind == "pair":
            indices[-1] = builder.shl(indices[-1], indices[-1].type(1))
        pointer = cgutils.get_item_pointer(context, builder, array_type, ary, indices)
        return builder.bitcast(pointer, _PAIR.as_pointer()) if kind == "pair" else pointer

    def _loader(kind):
        """The codegen of a load of ``kind`` (:func:`_element`)."""

        def codegen(context, builder, signature, args):
            pointer = _element(context, builder, signature, args, 0, kind)
            if kind != "pair":
                return builder.load(pointer)
            vector = builder.load(pointer, align=PAIR_BYTES)
            first = builder.extract_element(vector, ir.IntType(32)(0))
            second = builder.extract_element(vector, ir.IntType(32)(1))
            return context.make_tuple(builder, signature.return_type, (first, second))

        return codegen

    def _storer(kind):
        """The codegen of a store of ``kind`` (:func:`_element`): one value, or two uint64."""
        values = 2 if kind == "pair" else 1

        def codegen(context, builder, signature, args):
            dtype = types.uint64 if kind == "pair" else signature.args[0].dtype
            stored = [context.cast(builder, v, t, dtype)
                      for v, t in zip(args[-values:], signature.args[-values:])]
            pointer = _element(context, builder, signature, args, values, kind)
            if kind == "pair":
                vector = _PAIR(ir.Undefined)
                vector = builder.insert_element(vector, stored[0], ir.IntType(32)(0))
                vector = builder.insert_element(vector, stored[1], ir.IntType(32)(1))
                builder.store(vector, pointer, align=PAIR_BYTES)
            else:
                builder.store(stored[0], pointer)
            return context.get_dummy_value()

        return codegen

    _PAIR_TYPE = types.UniTuple(types.uint64, 2)

    @intrinsic
    def load_pair(typingctx, words, row, col):
        _check_array("load_pair", words, 2, types.uint64)
        return _PAIR_TYPE(words, row, col), _loader("pair")

    @intrinsic
    def store_pair(typingctx, words, row, col, first, second):
        _check_array("store_pair", words, 2, types.uint64)
        return types.none(words, row, col, first, second), _storer("pair")

    @intrinsic
    def load_pair_flat(typingctx, words, i):
        _check_array("load_pair_flat", words, 1, types.uint64)
        return _PAIR_TYPE(words, i), _loader("pair")

    @intrinsic
    def store_pair_flat(typingctx, words, i, first, second):
        _check_array("store_pair_flat", words, 1, types.uint64)
        return types.none(words, i, first, second), _storer("pair")

    @intrinsic
    def load_word(typingctx, words, row, col):
        _check_array("load_word", words, 2)
        return words.dtype(words, row, col), _loader("item")

    @intrinsic
    def store_word(typingctx, words, row, col, value):
        _check_array("store_word", words, 2)
        return types.none(words, row, col, value), _storer("item")

    @intrinsic
    def load_item(typingctx, items, i):
        _check_array("load_item", items, 1)
        return items.dtype(items, i), _loader("item")

    @intrinsic
    def store_item(typingctx, items, i, value):
        _check_array("store_item", items, 1)
        return types.none(items, i, value), _storer("item")

    @intrinsic
    def load_flat(typingctx, words, i):
        _check_array("load_flat", words, None)
        return words.dtype(words, i), _loader("flat")

    @intrinsic
    def store_flat(typingctx, words, i, value):
        _check_array("store_flat", words, None)
        return types.none(words, i, value), _storer("flat")
