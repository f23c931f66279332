"""Kernel launches: grid sizing and the launcher. On a GPU a :class:`Kernel` compiles each
argument-type combination once (``cuda.compile_ptx``), loads the PTX through CuPy and launches it
through ``mxcomm._driver.PackedLaunch``, bypassing numba's dispatcher (docs/design.md "Arrays");
under the simulator it is numba's dispatcher.
"""

import functools
import inspect
import re

import numpy
from numba import cuda, types
from numba.np.numpy_support import from_dtype

from .._driver import PackedLaunch, Words, address
from ._device import simulated

#: Threads per block on a GPU (a multiple of the 32-thread warp).
THREADS_PER_BLOCK = 256
#: Resident threads and blocks per multiprocessor a grid-stride launch aims for (Hopper's maxima).
RESIDENT_THREADS_PER_SM = 2048
RESIDENT_BLOCKS_PER_SM = 32
#: Under the simulator every CUDA thread is a Python thread: keep launches tiny.
SIM_THREADS_PER_BLOCK = 32
SIM_MAX_BLOCKS = 2


@functools.cache
def _device_properties():
    """(multiprocessor count, (major, minor) compute capability) of the current device."""
    device = cuda.get_current_device()
    return device.MULTIPROCESSOR_COUNT, device.compute_capability


def launch_1d(n, stream=0, *, threads=None, share=1.0):
    """Launch configuration ``(blocks, threads, stream)`` for ``n`` work items of a grid-stride
    kernel: a grid never empty, capped at ``share`` of ``RESIDENT_THREADS_PER_SM`` threads per
    multiprocessor (persistent).

    Args:
        n: work items, >= 0.
        stream: the raw CUDA stream handle (int); ignored under the simulator.
        threads: threads per block, a multiple of 32; default ``THREADS_PER_BLOCK``.
        share: the fraction of the device's resident threads the grid may take, in (0, 1]: below
            1 for a kernel running beside another's persistent grid.
    Returns:
        A tuple to index a :class:`Kernel` with: ``kernel[launch_1d(n, stream)](...)``.
    """
    if simulated():
        threads = min(threads or SIM_THREADS_PER_BLOCK, SIM_THREADS_PER_BLOCK)
        blocks = max(1, min(SIM_MAX_BLOCKS, -(-n // threads)))
        return blocks, threads, 0
    threads = threads or THREADS_PER_BLOCK
    per_sm = max(1, min(RESIDENT_BLOCKS_PER_SM, RESIDENT_THREADS_PER_SM // threads))
    cap = max(1, int(per_sm * _device_properties()[0] * share))
    blocks = max(1, min(-(-n // threads), cap))
    return blocks, threads, int(stream)


#: Hopper's (sm_90) registers and warp slots per multiprocessor (registers go per warp in units
#: of 256), shared memory per multiprocessor and the driver's reserve per block.
REGISTERS_PER_SM = 65536
WARPS_PER_SM = 64
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED = 1024


def resident_launch(n, threads, registers, stream, share, shared=0):
    """:func:`launch_1d` for a kernel of ``registers`` per thread and ``shared`` bytes per block,
    its persistent grid capped at the blocks that stay resident together (beyond them, a grid-stride
    loop would run a second, partial wave)."""
    warps = threads // 32
    warp_registers = -(-registers // 8) * 8 * 32
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED) if shared else RESIDENT_BLOCKS_PER_SM
    resident = max(1, min(RESIDENT_BLOCKS_PER_SM, WARPS_PER_SM // warps, by_shared,
                          REGISTERS_PER_SM // (warp_registers * warps)))
    per_sm = max(1, min(RESIDENT_BLOCKS_PER_SM, RESIDENT_THREADS_PER_SM // threads))
    fit = min(1.0, resident / per_sm + 1e-9)  # + 1e-9: launch_1d truncates its product
    return launch_1d(n, stream, threads=threads, share=share * fit)


def _loads(itemsize, align):
    """How a kernel reads words, for alignment messages."""
    if align == itemsize:
        return f"{itemsize}-byte words"
    return f"{itemsize}-byte words, loaded {align // itemsize} at a time"


def words(a, dtype, name, *, rows=False, align=None):
    """The C-contiguous array ``a`` as a kernel argument of ``dtype`` words, zero-copy: flat, or
    with ``rows`` the 2-D ``a``'s rows as words. A :class:`Words` on a GPU, a NumPy view under the
    simulator.

    Args:
        a: a C-contiguous CuPy (GPU) or NumPy (simulator) array; 2-D with ``rows``.
        dtype: the NumPy dtype of a word.
        name: the argument's name, for the error message.
        align: bytes the address and the row size must be multiples of (default: the word's
            size; 16 for kernels that load word pairs).
    Raises:
        ValueError: ``a``'s address or row bytes not aligned to ``align``.
    """
    align = align or dtype.itemsize
    ptr = address(a)
    row_bytes = a.shape[1] * a.itemsize if rows else a.nbytes
    if a.size and (ptr % align or row_bytes % align):
        raise ValueError(f"{name}: expected an address and row size aligned to {align} bytes "
                         f"({_loads(dtype.itemsize, align)}), got address {ptr:#x} and "
                         f"{row_bytes} bytes per row")
    if simulated():
        return a.view(dtype) if rows else a.reshape(-1).view(dtype)
    if rows:
        return Words(ptr, (a.shape[0], row_bytes // dtype.itemsize), dtype, align)
    return Words(ptr, (row_bytes // dtype.itemsize,), dtype, align)


def _argument_key(a):
    """A hashable key equal for kernel arguments of the same numba type: ``"b"`` (a bool), ``"i"``
    (an int), or (dtype, ndim, C-contiguous) of a device array or :class:`Words`."""
    if isinstance(a, Words):
        return a.dtype, a.ndim, True
    if isinstance(a, (bool, numpy.bool_)):
        return "b"
    if isinstance(a, (int, numpy.integer)):
        return "i"
    return a.dtype, a.ndim, a.flags.c_contiguous


def _argument_type(a):
    """The numba type of a kernel argument (:func:`_argument_key`)."""
    key = _argument_key(a)
    if isinstance(key, str):
        return types.boolean if key == "b" else types.int64
    dtype, ndim, contiguous = key
    return types.Array(from_dtype(dtype), ndim, "C" if contiguous else "A")


def _abi_format(a):
    """The ``struct`` codes of ``a`` in numba's kernel ABI: an array is (meminfo, parent, nitems,
    itemsize, data, *shape, *strides), 8 bytes each; a bool one byte, an int 8."""
    key = _argument_key(a)
    if isinstance(key, str):
        return "B" if key == "b" else "q"
    return "QQqqQ" + "q" * (2 * key[1])


def _abi_values(args):
    """The values of ``args`` in :func:`_abi_format`'s layout (Python ints)."""
    values = []
    for a in args:
        if isinstance(a, Words):
            values += a.abi()
        elif isinstance(a, (bool, int, numpy.bool_, numpy.integer)):
            values.append(int(a))
        else:
            values += (0, 0, a.size, a.itemsize, a.data.ptr)
            values += a.shape
            values += a.strides
    return values


class Kernel:
    """A numba CUDA kernel with a cheap launch: ``kernel[blocks, threads, stream](*args)``.

    Args:
        pyfunc: the kernel's Python function, written for ``numba.cuda.jit``.
        launch_bounds: ``(max threads per block, min blocks per multiprocessor)`` for the
            compiler (to cap registers per thread), or None.
    """

    def __init__(self, pyfunc, launch_bounds=None):
        functools.update_wrapper(self, pyfunc)
        self.py_func = pyfunc
        self.launch_bounds = launch_bounds
        self._dispatcher = cuda.jit(pyfunc) if simulated() else None
        self._functions = {}  # argument kinds -> PackedLaunch
        self.parameters = tuple(inspect.signature(pyfunc).parameters)  # for messages

    def __getitem__(self, config):
        blocks, threads, stream = config[:3]
        shared = config[3] if len(config) > 3 else 0
        if self._dispatcher is not None:
            return self._dispatcher[blocks, threads, 0, shared]
        if shared:
            raise ValueError("dynamic shared memory: launch through a prepared Launch")
        return functools.partial(self._launch, blocks, threads, stream)

    def _function(self, args):
        """The launcher of the compiled function for ``args``, found by a cheap key of their kinds;
        compiled for this device on a kind's first launch."""
        key = tuple(map(_argument_key, args))
        function = self._functions.get(key)
        if function is None:
            import cupy
            ptx, _ = cuda.compile_ptx(self.py_func, tuple(map(_argument_type, args)),
                                      cc=_device_properties()[1], launch_bounds=self.launch_bounds)
            name = re.search(r"\.entry\s+([\w$]+)\s*\(", ptx).group(1)
            module = cupy.cuda.function.Module()
            module.load(ptx.encode())
            fmt = "".join(map(_abi_format, args))
            # (a CuPy Function keeps its Module alive)
            function = self._functions[key] = PackedLaunch(module.get_function(name), fmt)
        return function

    def _launch(self, blocks, threads, stream, *args):
        self._function(args)(blocks, threads, stream, _abi_values(args))


class Launch:
    """One launch of a :class:`Kernel` prepared for arrays of fixed shapes: the compiled function,
    grid and every parameter but the arrays' addresses and the stream are found once.

    Args:
        kernel: the :class:`Kernel`.
        config: ``(blocks, threads, stream[, shared])`` from :func:`launch_1d` (stream ignored),
            ``shared`` the bytes of dynamic shared memory (default 0).
        args: the kernel's arguments in order: a :class:`Words` placeholder per array (its shape
            and word dtype; the array comes at call time); ints and bools, fixed here.

    ``launch(stream, *arrays)``: one C-contiguous array per placeholder, holding the placeholder's
    words (not checked: the caller's cache key guarantees it): a CuPy array, :class:`Words` or int
    address on a GPU; a NumPy array under the simulator. ``stream``: a raw handle. Enqueues the
    kernel; no synchronization. Raises ValueError naming the argument for a misaligned address.
    """

    __slots__ = ("_kernel", "_blocks", "_threads", "_shared", "_args", "_names", "_function",
                 "_values", "_slots", "_aligns")

    def __init__(self, kernel, config, *args):
        self._kernel = kernel
        self._blocks, self._threads = config[0], config[1]
        self._shared = config[3] if len(config) > 3 else 0
        self._args = args
        self._names = tuple(p for p, a in zip(kernel.parameters, args) if isinstance(a, Words))
        if kernel._dispatcher is None:
            self._function = kernel._function(args)
            if self._shared:  # a no-op up to the driver's default cap (PackedLaunch keeps it)
                self._function.allow_shared(self._shared)
            self._values = _abi_values(args)
            self._slots, self._aligns, at = [], [], 0
            for a in args:  # the data field of each array's ABI (meminfo, parent, nitems,
                if isinstance(a, Words):  # itemsize, data, shape, strides)
                    self._slots.append(at + 4)
                    self._aligns.append(a.align)
                at += len(a.abi()) if isinstance(a, Words) else 1

    def __call__(self, stream, *arrays):
        if self._kernel._dispatcher is not None:
            self._simulate(self._blocks, arrays)
            return
        self._function(self._blocks, self._threads, stream, self._filled(self._values, arrays),
                       self._shared)

    def _filled(self, values, arrays):
        """A copy of the ABI ``values`` with the addresses of ``arrays`` in their data fields."""
        values = values.copy()
        for slot, align, a in zip(self._slots, self._aligns, arrays):
            ptr = a if type(a) is int else a.ptr if type(a) is Words else a.data.ptr
            if ptr % align:
                self._misaligned(arrays)
            values[slot] = ptr
        return values

    def _simulate(self, blocks, arrays, ints=None):
        """Numba's dispatcher on NumPy views of ``arrays`` as the placeholders' words; ``ints``:
        ``{argument index: value}`` of a sized launch's counted integers."""
        given = iter(zip(arrays, self._names))
        args = []
        for index, a in enumerate(self._args):
            if isinstance(a, Words):
                array, name = next(given)
                a = words(array, a.dtype, name, rows=a.ndim == 2, align=a.align)
            elif ints and index in ints:
                a = ints[index]
            args.append(a)
        self._kernel._dispatcher[blocks, self._threads, 0, self._shared](*args)

    def _misaligned(self, arrays):
        """Raise the ValueError of :func:`words` for the first misaligned array."""
        placeholders = [a for a in self._args if isinstance(a, Words)]
        for a, p, name in zip(arrays, placeholders, self._names):
            ptr = a if type(a) is int else a.ptr if type(a) is Words else a.data.ptr
            if ptr % p.align:
                raise ValueError(f"{name}: expected an address aligned to {p.align} bytes "
                                 f"({_loads(p.dtype.itemsize, p.align)}), got {ptr:#x}")


class SizedLaunch(Launch):
    """A :class:`Launch` whose arrays' sizes and grid scale with counts given at each call: prepared
    once per what stays fixed (kernel, dtypes, row width, grid share), told the *units* of work
    (MX blocks, 128-element blocks or rows) at each call (docs/design.md "What a call builds, and
    what it reuses").

    Args:
        kernel: the :class:`Kernel`.
        config: the grid at its cap (``launch_1d`` of :data:`UNBOUNDED` items): a call takes
            ``min(cap, needed)`` blocks.
        threads_per_unit: ``(num, den)``: ``units`` units take ``ceil(units * num / den)`` threads.
        args: as :class:`Launch`, each placeholder giving ONE unit's words: ``(k,)``, or ``(1, c)``
            for one row of c words; a pair ``(placeholder, i)`` scales with count ``i`` (default
            0). An int is fixed, or ``(None, i)``: count ``i`` of each call.

    ``launch(stream, units, *arrays)``: ``units`` an int > 0, or a tuple of counts whose first
    drives the grid; the arrays as :class:`Launch` takes them, each its placeholder's words times
    its count (not checked).
    """

    __slots__ = ("_num", "_den", "_sizes", "_counted_ints")

    def __init__(self, kernel, config, threads_per_unit, *args):
        counted = [a if isinstance(a, tuple) else (a, 0) for a in args]
        # a counted integer: 0 until a call gives it (the ABI slot of an int64)
        super().__init__(kernel, config, *(0 if a is None else a for a, _ in counted))
        self._num, self._den = threads_per_unit
        self._sizes = []  # (ABI index of nitems, of shape[0], words and rows per unit, count)
        self._counted_ints = []  # (argument index, ABI index, count)
        at = 0
        for index, (a, count) in enumerate(counted):
            if isinstance(a, Words):
                if a.ndim == 2 and a.shape[0] != 1:
                    raise ValueError(f"a sized launch's 2-D placeholder holds one row, got "
                                     f"{a.shape}")
                self._sizes.append((at + 2, at + 5, a.size, 1 if a.ndim == 2 else a.size, count))
            elif a is None:
                self._counted_ints.append((index, at, count))
            at += len(a.abi()) if isinstance(a, Words) else 1

    def __call__(self, stream, units, *arrays):
        counts = units if type(units) is tuple else (units,)
        need = -(-counts[0] * self._num // self._den)
        blocks = max(1, min(self._blocks, -(-need // self._threads)))
        if self._kernel._dispatcher is not None:
            self._simulate(blocks, arrays, {index: counts[count]
                                            for index, _, count in self._counted_ints})
            return
        values = self._filled(self._values, arrays)
        for nitems, shape, per_unit, rows_per_unit, count in self._sizes:
            values[nitems] = per_unit * counts[count]
            values[shape] = rows_per_unit * counts[count]
        for _, at, count in self._counted_ints:
            values[at] = counts[count]
        self._function(blocks, self._threads, stream, values, self._shared)


#: Work items of a grid at its cap: ``launch_1d(UNBOUNDED, ...)`` is the config a
#: :class:`SizedLaunch` takes.
UNBOUNDED = 1 << 62

_PREPARED = []


def prepared(factory):
    """Decorator: ``factory(*key)`` -> :class:`Launch`, cached per key (the shapes, dtypes and grid
    share that fix a launch); :func:`clear_prepared` empties every such cache."""
    cached = functools.lru_cache(maxsize=1024)(factory)
    _PREPARED.append(cached)
    return cached


def clear_prepared():
    """Forget every prepared launch (for tests that record what gets compiled)."""
    for cached in _PREPARED:
        cached.cache_clear()


def kernel(pyfunc=None, *, launch_bounds=None):
    """Decorator: a :class:`Kernel` from a function written for ``numba.cuda.jit``;
    ``@kernel(launch_bounds=(threads, blocks))`` passes launch bounds to the compiler."""
    if pyfunc is None:
        return functools.partial(Kernel, launch_bounds=launch_bounds)
    return Kernel(pyfunc, launch_bounds)
