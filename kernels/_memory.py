"""Loads and stores of row words with the least address arithmetic (docs/design.md "Arrays").

Non-negative indices only, unlike numba's indexing, which wraps them (unchecked on a GPU; the
simulator refuses negative ones); ``*_pair``: two words in one 16-byte access, the address a
multiple of 16 bytes (checked by the caller); ``*_flat``: one flat index. On a GPU each is a Numba
intrinsic; under the simulator a device function with the same result.
"""

from numba import cuda

from ._device import simulated

#: Bytes of a pair of 8-byte words: the alignment :func:`load_pair` and :func:`store_pair` need.
PAIR_BYTES = 16
#: ``alignment`` of a shared array read and written in pairs (the simulator takes none).
SHARED_PAIR_ALIGN = None if simulated() else PAIR_BYTES

if simulated():
    def _nonnegative(*indices):
        """Refuse a negative index, which the GPU forms read out of bounds, so misuse fails in the
        simulator's tests."""
        for i in indices:
            if i < 0:
                raise IndexError(f"kernels._memory: negative index {i} (the GPU form reads "
                                 f"out of bounds where NumPy indexing wraps around)")

    @cuda.jit(device=True)
    def load_pair(words, row, col):
        """Words ``2 col`` and ``2 col + 1`` of row ``row`` of the 2-D uint64 ``words``."""
        _nonnegative(row, col)
        return words[row, 2 * col], words[row, 2 * col + 1]

    @cuda.jit(device=True)
    def store_pair(words, row, col, first, second):
        """Store ``first``, ``second`` into words ``2 col``, ``2 col + 1`` of row ``row`` (2-D
        uint64)."""
        _nonnegative(row, col)
        words[row, 2 * col] = first
        words[row, 2 * col + 1] = second

    @cuda.jit(device=True)
    def load_pair_flat(words, i):
        """Words ``2 i`` and ``2 i + 1`` of the 1-D uint64 ``words`` (global or shared)."""
        _nonnegative(i)
        return words[2 * i], words[2 * i + 1]

    @cuda.jit(device=True)
    def store_pair_flat(words, i, first, second):
        """Store ``first``, ``second`` into words ``2 i``, ``2 i + 1`` of the 1-D ``words``."""
        _nonnegative(i)
        words[2 * i] = first
        words[2 * i + 1] = second

    @cuda.jit(device=True)
    def load_word(words, row, col):
        """``words[row, col]`` of a 2-D array."""
        _nonnegative(row, col)
        return words[row, col]

    @cuda.jit(device=True)
    def load_item(items, i):
        """``items[i]`` of a 1-D array (global, shared or local)."""
        _nonnegative(i)
        return items[i]

    @cuda.jit(device=True)
    def store_item(items, i, value):
        """``items[i] = value`` of a 1-D array (global, shared or local)."""
        _nonnegative(i)
        items[i] = value

    @cuda.jit(device=True)
    def store_word(words, row, col, value):
        """``words[row, col] = value`` of a 2-D array."""
        _nonnegative(row, col)
        words[row, col] = value

    @cuda.jit(device=True)
    def load_flat(words, i):
        """Element ``i`` of the C-contiguous ``words`` (any dimensions) counted flat."""
        _nonnegative(i)
        return words.reshape(-1)[i]

    @cuda.jit(device=True)
    def store_flat(words, i, value):
        """Store ``value`` as element ``i`` of the C-contiguous ``words`` counted flat."""
        _nonnegative(i)
        words.reshape(-1)[i] = value

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def _pointer(context, builder, array_type, array, indices):
        """The element pointer of ``indices`` (intp LLVM values, non-negative) in ``array``."""
        ary = context.make_array(array_type)(context, builder, value=array)
        return cgutils.get_item_pointer(context, builder, array_type, ary, indices)

    def _intp(context, builder, value, value_type):
        """The integer ``value`` of ``value_type`` as an intp LLVM value."""
        return context.cast(builder, value, value_type, types.intp)

    def _twice(builder, index):
        return builder.shl(index, index.type(1))

    def _pair_pointer(context, builder, array_type, array, indices):
        """A ``<2 x i64>`` pointer to the element of ``indices`` (its address a multiple of 16)."""
        element = _pointer(context, builder, array_type, array, indices)
        return builder.bitcast(element, ir.VectorType(ir.IntType(64), 2).as_pointer())

    def _load_pair(context, builder, pointer, return_type):
        vector = builder.load(pointer, align=PAIR_BYTES)
        first = builder.extract_element(vector, ir.IntType(32)(0))
        second = builder.extract_element(vector, ir.IntType(32)(1))
        return context.make_tuple(builder, return_type, (first, second))

    def _check_array(name, array, ndim, dtype=None):
        """TypeError unless ``array`` is a C-contiguous ``ndim``-D array (of ``dtype``)."""
        if not (isinstance(array, types.Array) and array.ndim == ndim and array.layout == "C"
                and (dtype is None or array.dtype == dtype)):
            what = f"{dtype} " if dtype is not None else ""
            raise TypeError(f"{name}: expected a {ndim}-D C-contiguous {what}array, got {array}")

    @intrinsic
    def load_pair(typingctx, words, row, col):
        """Words ``2 col``, ``2 col + 1`` of row ``row`` of the 2-D uint64 ``words``: one 16-byte
        load."""
        _check_array("load_pair", words, 2, types.uint64)
        return_type = types.UniTuple(types.uint64, 2)

        def codegen(context, builder, signature, args):
            array, r, c = args
            _, row_type, col_type = signature.args
            r = _intp(context, builder, r, row_type)
            c = _twice(builder, _intp(context, builder, c, col_type))
            pointer = _pair_pointer(context, builder, signature.args[0], array, [r, c])
            return _load_pair(context, builder, pointer, signature.return_type)

        return return_type(words, row, col), codegen

    def _store_pair(context, builder, pointer, signature, first, second):
        first = context.cast(builder, first, signature.args[-2], types.uint64)
        second = context.cast(builder, second, signature.args[-1], types.uint64)
        vector = ir.VectorType(ir.IntType(64), 2)(ir.Undefined)
        vector = builder.insert_element(vector, first, ir.IntType(32)(0))
        vector = builder.insert_element(vector, second, ir.IntType(32)(1))
        builder.store(vector, pointer, align=PAIR_BYTES)
        return context.get_dummy_value()

    @intrinsic
    def store_pair(typingctx, words, row, col, first, second):
        """Store ``first``, ``second`` into words ``2 col``, ``2 col + 1`` of row ``row`` (2-D
        uint64): one 16-byte store."""
        _check_array("store_pair", words, 2, types.uint64)

        def codegen(context, builder, signature, args):
            array, r, c, a, b = args
            _, row_type, col_type = signature.args[:3]
            r = _intp(context, builder, r, row_type)
            c = _twice(builder, _intp(context, builder, c, col_type))
            pointer = _pair_pointer(context, builder, signature.args[0], array, [r, c])
            return _store_pair(context, builder, pointer, signature, a, b)

        return types.none(words, row, col, first, second), codegen

    @intrinsic
    def load_pair_flat(typingctx, words, i):
        """Words ``2 i``, ``2 i + 1`` of the 1-D uint64 ``words`` (global or shared): one 16-byte
        load."""
        _check_array("load_pair_flat", words, 1, types.uint64)
        return_type = types.UniTuple(types.uint64, 2)

        def codegen(context, builder, signature, args):
            array, index = args
            index = _twice(builder, _intp(context, builder, index, signature.args[1]))
            pointer = _pair_pointer(context, builder, signature.args[0], array, [index])
            return _load_pair(context, builder, pointer, signature.return_type)

        return return_type(words, i), codegen

    @intrinsic
    def store_pair_flat(typingctx, words, i, first, second):
        """Store ``first``, ``second`` into words ``2 i``, ``2 i + 1`` of the 1-D uint64 ``words``:
        one 16-byte store."""
        _check_array("store_pair_flat", words, 1, types.uint64)

        def codegen(context, builder, signature, args):
            array, index, a, b = args
            index = _twice(builder, _intp(context, builder, index, signature.args[1]))
            pointer = _pair_pointer(context, builder, signature.args[0], array, [index])
            return _store_pair(context, builder, pointer, signature, a, b)

        return types.none(words, i, first, second), codegen

    @intrinsic
    def load_word(typingctx, words, row, col):
        """``words[row, col]`` of a 2-D C-contiguous array."""
        _check_array("load_word", words, 2)

        def codegen(context, builder, signature, args):
            array, r, c = args
            _, row_type, col_type = signature.args
            pointer = _pointer(context, builder, signature.args[0], array,
                               [_intp(context, builder, r, row_type),
                                _intp(context, builder, c, col_type)])
            return builder.load(pointer)

        return words.dtype(words, row, col), codegen

    @intrinsic
    def load_item(typingctx, items, i):
        """``items[i]`` of a 1-D C-contiguous array (global, shared or local)."""
        _check_array("load_item", items, 1)

        def codegen(context, builder, signature, args):
            array, index = args
            pointer = _pointer(context, builder, signature.args[0], array,
                               [_intp(context, builder, index, signature.args[1])])
            return builder.load(pointer)

        return items.dtype(items, i), codegen

    @intrinsic
    def store_item(typingctx, items, i, value):
        """``items[i] = value`` of a 1-D C-contiguous array (global, shared or local)."""
        _check_array("store_item", items, 1)

        def codegen(context, builder, signature, args):
            array, index, v = args
            items_type, index_type, value_type = signature.args
            v = context.cast(builder, v, value_type, items_type.dtype)
            pointer = _pointer(context, builder, items_type, array,
                               [_intp(context, builder, index, index_type)])
            builder.store(v, pointer)
            return context.get_dummy_value()

        return types.none(items, i, value), codegen

    @intrinsic
    def store_word(typingctx, words, row, col, value):
        """``words[row, col] = value`` of a 2-D C-contiguous array."""
        _check_array("store_word", words, 2)

        def codegen(context, builder, signature, args):
            array, r, c, v = args
            words_type, row_type, col_type, value_type = signature.args
            v = context.cast(builder, v, value_type, words_type.dtype)
            pointer = _pointer(context, builder, words_type, array,
                               [_intp(context, builder, r, row_type),
                                _intp(context, builder, c, col_type)])
            builder.store(v, pointer)
            return context.get_dummy_value()

        return types.none(words, row, col, value), codegen

    def _flat_pointer(context, builder, array_type, array, index, index_type):
        """The pointer of element ``index`` of a C-contiguous array counted flat (a 32-bit index
        stays one wide multiply-add)."""
        ary = context.make_array(array_type)(context, builder, value=array)
        return builder.gep(ary.data, [_intp(context, builder, index, index_type)])

    @intrinsic
    def load_flat(typingctx, words, i):
        """Element ``i`` of the C-contiguous ``words`` (any dimensions) counted flat: one load, no
        row and column products (index with an int32 where it fits)."""
        if not (isinstance(words, types.Array) and words.layout == "C"):
            raise TypeError(f"load_flat: expected a C-contiguous array, got {words}")

        def codegen(context, builder, signature, args):
            array, index = args
            return builder.load(_flat_pointer(context, builder, signature.args[0], array, index,
                                              signature.args[1]))

        return words.dtype(words, i), codegen

    @intrinsic
    def store_flat(typingctx, words, i, value):
        """Store ``value`` as element ``i`` of the C-contiguous ``words`` counted flat."""
        if not (isinstance(words, types.Array) and words.layout == "C"):
            raise TypeError(f"store_flat: expected a C-contiguous array, got {words}")

        def codegen(context, builder, signature, args):
            array, index, v = args
            words_type, index_type, value_type = signature.args
            v = context.cast(builder, v, value_type, words_type.dtype)
            builder.store(v, _flat_pointer(context, builder, words_type, array, index,
                                           index_type))
            return context.get_dummy_value()

        return types.none(words, i, value), codegen
