"""Row formats (one :class:`Format` each, registered by name), quantized rows, and the SQNR.

Glossary: M rows, D hidden. The unscaled formats live here; each quantized format's module
(``mxcomm.mxfp8``, ``rowwise``, ``block128``) registers its Format when imported.
"""

import dataclasses
import functools
import math

import numpy

from ._array import (bfloat16, check_array, check_rows, float32, on_stream, out_array, out_dtype,
                     out_pair, stream_ptr)
from .kernels import address, array_module

#: ``Format.scale_block`` of a format with one scale per row.
PER_ROW = "row"
_OUT_DTYPES = (bfloat16, float32)


@dataclasses.dataclass(frozen=True, eq=False)
class Format:
    """One row format: how (M, D) rows are stored and quantized. Compare by identity or ``name``.

    Attributes:
        name: the precision string that selects it (``get_format``).
        element: the element type in words: ``"bf16"``, ``"input"`` (native) or ``"e4m3fn"``.
        element_dtype: dtype of the stored elements (uint8 bits for fp8); None: the input's dtype.
        scale_dtype: dtype of the scales (uint8 e8m0 bits, or float32), None if unscaled.
        scale_block: elements per scale (32, 128), :data:`PER_ROW`, or None if unscaled.
        d_multiple: D must be a multiple of it.
        padding_scale: the scale of the zero rows ``permute`` pads with (e8m0 code 0; 1.0 for fp32
            scales, so consumers that invert scales get 0).
        scale_modes: the scale roundings a caller may pick (MXFP8's ``"rceil"``, ``"floor"``);
            empty where the format fixes its own (the caller's is ignored).
        source: where its definition comes from.
        input_align: bytes the address of rows to quantize must be a multiple of (the kernel's
            loads); 1 for the unscaled formats.

    The private fields are the format module's launchers, called with the ``launch_*`` methods'
    arguments; ``_quantizer`` and ``_round_tripper`` return a call prepared for a signature, or
    None where the general launcher serves.
    """

    name: str
    element: str
    element_dtype: object
    scale_dtype: object = None
    scale_block: object = None
    d_multiple: int = 1
    padding_scale: float = 0.0
    scale_modes: tuple = ()
    source: str = ""
    _quantize: object = None
    _dequantize: object = None
    _array_class: object = None
    input_align: int = 1
    _quantize_gather: object = None
    _round_trip: object = None
    _quantizer: object = None
    _round_tripper: object = None

    def _mode(self, scale_mode):
        return scale_mode or (self.scale_modes or (None,))[0]

    @property
    def quantized(self):
        """True if rows of this format are a QuantizedArray (data + scales)."""
        return self.scale_dtype is not None

    def scales_shape(self, m, d):
        """Shape of the scales of (m, d) rows: (m, d // block), or (m,) per row."""
        if self.scale_block == PER_ROW:
            return (m,)
        return (m, d // self.scale_block)

    @functools.lru_cache(maxsize=256)  # asked per exchange; formats live as long as the process
    def row_arrays(self, d, input_dtype=bfloat16):
        """``((row shape, dtype), ...)`` one row of width ``d`` travels as in ``mxcomm.comm``'s
        exchange; a per-row scale as a (1,) row."""
        if not self.quantized:
            dtype = numpy.dtype(self.element_dtype or input_dtype)
            return (((d,), dtype),)
        scale_row = (1,) if self.scale_block == PER_ROW else (d // self.scale_block,)
        return (((d,), numpy.dtype(self.element_dtype)), (scale_row, numpy.dtype(self.scale_dtype)))

    def bytes_per_row(self, d, input_dtype=bfloat16):
        """Bytes one row of width ``d`` takes in this format (``input_dtype``: native's)."""
        return sum(dtype.itemsize * int(numpy.prod(shape))
                   for shape, dtype in self.row_arrays(d, input_dtype))

    def check_input(self, x, name="x"):
        """Raise ValueError unless the (M, D) rows ``x`` (array or QuantizedArray) have D a multiple
        of ``d_multiple`` and an array's address a multiple of ``input_align``."""
        d = x.shape[1]
        if d % self.d_multiple:
            raise ValueError(f"{name}: D = {d} is not a multiple of {self.d_multiple}, which "
                             f"the {self.name!r} format needs")
        if isinstance(x, QuantizedArray):
            return
        if self.input_align > 1 and x.size and address(x) % self.input_align:
            raise ValueError(f"{name}: the rows start at address {address(x):#x}, not a multiple "
                             f"of {self.input_align} bytes, which the {self.name!r} quantize "
                             f"kernel needs (a view starting inside a row?); pass a copy")

    def wrap(self, data, scales):
        """``data`` and ``scales`` as a QuantizedArray of this format (MXFP8Array for mxfp8)."""
        return self._array_class(data, scales) if self._array_class else \
            QuantizedArray(data, scales, self)

    def view(self, data, scales):
        """:meth:`wrap` unchecked, for arrays made with this format's dtypes and shapes."""
        q = object.__new__(self._array_class or QuantizedArray)
        q.data, q.scales, q.format = data, scales, self
        return q

    def empty(self, m, d, alloc=None):
        """An uninitialized (m, d) QuantizedArray from ``alloc(shape, dtype)`` (None: the backend's)."""
        alloc = alloc or array_module().empty
        return self.view(alloc((m, d), self.element_dtype),
                         alloc(self.scales_shape(m, d), self.scale_dtype))

    def _needs(self, launcher, what):
        if launcher is None:
            raise RuntimeError(f"format {self.name!r} does not {what}")
        return launcher

    def launch_quantize(self, x, out, stream, share=1.0, scale_mode=None):
        """Quantize ``x`` (M, D) bf16/fp32, C-contiguous, checked, into the QuantizedArray ``out`` on
        raw stream ``stream`` with ``share`` of the grid (done on return on the host backend);
        ``scale_mode`` None: the first of ``scale_modes``. Returns ``out``. Raises RuntimeError
        for an unquantized format."""
        self._needs(self._quantize, "quantize")(x, out, stream, share, self._mode(scale_mode))
        return out

    def quantizes_gathered(self, dtype):
        """True if :meth:`launch_quantize_gather` takes rows of ``dtype`` (MXFP8 of bf16 so far)."""
        return self._quantize_gather is not None and dtype == bfloat16

    def launch_quantize_gather(self, x, rows, out, stream, share=1.0, scale_mode=None):
        """:meth:`launch_quantize` of rows ``rows`` (R,) int32 of ``x`` (M, D) into ``out`` (R, D)
        in one pass. Returns ``out``."""
        self._needs(self._quantize_gather, "quantize gathered rows")(
            x, rows, out, stream, share, self._mode(scale_mode))
        return out

    def quantizer(self, dtype, width, scale_mode=None, share=1.0):
        """:meth:`launch_quantize` of ``dtype`` (bf16/fp32) rows of width ``width``, prepared once
        (docs/design.md, "A direct call's launch, prepared with its signature"):
        ``quantize(x, data, scales, rows, stream)`` quantizes ``rows`` rows of ``x`` into
        C-contiguous ``data`` and ``scales`` (``Words``, CuPy or NumPy); nothing for 0 rows.
        Raises RuntimeError for an unquantized format."""
        scale_mode = self._mode(scale_mode)
        prepared = self._needs(self._quantizer, "quantize")(numpy.dtype(dtype), width,
                                                              scale_mode, share)
        return prepared or functools.partial(_quantize_rows, self, scale_mode, share)

    def round_tripper(self, width, scale_mode=None):
        """:meth:`launch_round_trip` of bf16 rows of width ``width`` prepared once, as
        :meth:`quantizer`: ``round_trip(x, out, rows, stream)``; None if not ``round_trips(bf16)``."""
        if not self.round_trips(bfloat16):
            return None
        scale_mode = self._mode(scale_mode)
        return self._round_tripper(width, scale_mode) or \
            functools.partial(_round_trip_rows, self, scale_mode)

    def round_trips(self, dtype):
        """True if :meth:`launch_round_trip` takes rows of ``dtype`` (MXFP8 of bf16 so far)."""
        return self._round_trip is not None and dtype == bfloat16

    def launch_round_trip(self, x, rows, out, stream, share=1.0, scale_mode=None):
        """Quantize rows of ``x`` (M, D) bf16 and decode them into ``out`` (R, D) bf16 in one pass,
        bit for bit :meth:`launch_quantize` then :meth:`launch_dequantize`: row r of ``out`` is row
        r of ``x`` (``rows`` None) or row ``rows[r]`` (``rows`` (R,) int32). ``out``: C-contiguous,
        16-byte aligned. Returns ``out``."""
        self._needs(self._round_trip, "round trip in one pass")(
            x, rows, out, stream, share, self._mode(scale_mode))
        return out

    def launch_dequantize(self, q, out, stream, share=1.0):
        """Decode the QuantizedArray ``q`` (M, D) into ``out`` (M, D) bf16/fp32, C-contiguous.
        Returns ``out``."""
        self._needs(self._dequantize, "dequantize")(q, out, stream, share)
        return out

    def quantize(self, x, *, scale_mode=None, out=None, stream=None):
        """Quantize ``x`` (M, D) bf16/fp32 device array, C-contiguous, D % ``d_multiple`` == 0, into
        a new (or the given) QuantizedArray. Raises TypeError (dtype, ``out`` of another format),
        ValueError (shape, address alignment, ``scale_mode``)."""
        x = check_rows(x, "x", 1, _OUT_DTYPES)
        self.check_input(x)
        if out is None:
            with on_stream(stream):  # from the stream the quantize runs on
                out = self.empty(*x.shape)
        elif not isinstance(out, QuantizedArray) or out.format is not self:
            raise TypeError(f"out: expected a {self.name} QuantizedArray, got {out!r}")
        elif out.shape != tuple(x.shape):
            raise ValueError(f"out: expected shape {tuple(x.shape)}, got {out.shape}")
        if scale_mode is not None and scale_mode not in self.scale_modes:
            raise ValueError(f"scale_mode: expected one of {self.scale_modes} for "
                             f"{self.name!r}, got {scale_mode!r}")
        return self.launch_quantize(x, out, stream_ptr(stream), 1.0, scale_mode)

    def __repr__(self):
        return f"Format({self.name!r})"


def quantize_pair(fmt, x, out, stream):
    """:meth:`Format.quantize` of ``x`` into ``out``, a (data, scales) pair (None: new): the fp8
    formats' public quantize, D checked first. Returns (data, scales); raises as ``quantize``
    does, and TypeError for ``out`` not a pair."""
    x = check_rows(x, "x", fmt.d_multiple, _OUT_DTYPES)
    m, d = x.shape
    q = fmt.view(*out_pair(out, (m, d), fmt.scales_shape(m, d), stream))
    fmt.quantize(x, out=q, stream=stream)
    return q.data, q.scales


def _quantize_rows(fmt, scale_mode, share, x, data, scales, rows, stream):
    """``Format.quantizer``'s call where the format prepares none: its general launcher."""
    if rows:
        fmt._quantize(x, fmt.view(data, scales), stream, share, scale_mode)


def _round_trip_rows(fmt, scale_mode, x, out, rows, stream):
    """``Format.round_tripper``'s call where the format prepares none: its general launcher."""
    if rows:
        fmt._round_trip(x, None, out, stream, 1.0, scale_mode)


@dataclasses.dataclass(frozen=True)
class RowLaunch:
    """A kernel's sized launch called per row (``Format.quantizer``'s call on the kernels):
    ``(*arrays, rows, stream)`` launches ``rows * per_row`` units, nothing for 0 rows."""

    launch: object
    per_row: int

    def __call__(self, *args):
        *arrays, rows, stream = args
        if rows:
            self.launch(stream, rows * self.per_row, *arrays)


class QuantizedArray:
    """(M, D) rows of a quantized format: ``data`` (M, D) ``format.element_dtype`` (uint8 e4m3fn
    bits), ``scales`` ``format.scales_shape(M, D)`` of ``format.scale_dtype``, both C-contiguous,
    and the :class:`Format` ``format``.

    Raises:
        TypeError: not device arrays, wrong dtypes, or ``format`` not a quantized Format.
        ValueError: ``data`` not 2-D or D not a multiple of the format's; scales of another shape;
            not C-contiguous.
    """

    __slots__ = ("data", "scales", "format")

    def __init__(self, data, scales, format):  # noqa: A002 (the attribute's name)
        if not isinstance(format, Format) or not format.quantized:
            raise TypeError(f"format: expected a quantized Format, got {format!r}")
        data = check_rows(data, "data", format.d_multiple, (numpy.dtype(format.element_dtype),))
        scales = check_array(scales, "scales", numpy.dtype(format.scale_dtype),
                             format.scales_shape(*data.shape))
        self.data, self.scales, self.format = data, scales, format

    @property
    def shape(self):
        """(M, D): the shape of the tensor (of ``data``)."""
        return tuple(self.data.shape)

    def dequantize(self, dtype=bfloat16, *, out=None, stream=None):
        """These rows as (M, D) ``dtype`` (bf16 or fp32) into ``out`` (None: allocated), on
        ``stream`` (None: CuPy's current), not synchronized. Raises TypeError (``dtype``, ``out``'s
        dtype), ValueError (``out``'s shape, not C-contiguous)."""
        out = out_array(out, self.shape, out_dtype(dtype), stream)
        return self.format.launch_dequantize(self, out, stream_ptr(stream))

    def __repr__(self):
        return (f"{type(self).__name__}(format={self.format.name!r}, shape={self.shape}, "
                f"data={type(self.data).__module__}.ndarray)")


_FORMATS = {}  # name -> Format, in the order registered
_CONVERSIONS = {}  # (source name, target name) -> the gather that permutes and converts


def register(fmt):
    """Add ``fmt`` to the names :func:`get_format` accepts; return it. Raises ValueError if the
    name is registered already."""
    if fmt.name in _FORMATS:
        raise ValueError(f"format {fmt.name!r} is registered already")
    _FORMATS[fmt.name] = fmt
    return fmt


def register_conversion(source, target, launcher):
    """Let a permute convert rows of format ``source`` to ``target`` in its gather
    (:func:`conversion`)."""
    _CONVERSIONS[source, target] = launcher


def format_names():
    """The names ``get_format`` accepts, in registration order."""
    return tuple(_FORMATS)


def get_format(name, what="precision"):
    """The Format named ``name`` (a Format as is). Raises ValueError for an unknown name, naming
    ``what`` and listing every format."""
    if isinstance(name, Format):
        return name
    fmt = _FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"{what}: expected one of {', '.join(map(repr, format_names()))}, "
                         f"got {name!r}")
    return fmt


def conversion(source, target):
    """The gather that permutes rows of Format ``source`` into Format ``target`` in one pass:
    ``convert(x, indices, stream, alloc)`` -> QuantizedArray (a plain array for an unscaled target):
    rows ``indices`` (P,) int32 of ``x``, -1 a padding row; results from ``alloc(shape, dtype)``
    (None: the array module's ``empty``). Raises ValueError for no such conversion (lists those
    there are)."""
    launcher = _CONVERSIONS.get((getattr(source, "name", None), target.name))
    if launcher is None:
        have = ", ".join(f"{a} -> {b}" for a, b in _CONVERSIONS)
        raise ValueError(f"out_format: cannot convert {getattr(source, 'name', 'plain')} rows "
                         f"to {target.name!r} in the permute; conversions: {have}")
    return launcher


register(Format("bf16", "bf16", bfloat16, source="bf16 on the wire (torch's EP path)"))
register(Format("native", "input", None,
                source="the input's dtype as is: fp32 stays fp32, bit for bit"))


def sqnr(ref, out, *, chunk_rows=4096):
    """Signal-to-quantization-noise ratio in dB, 20 log10(||ref|| / ||ref - out||) (docs/design.md
    "Correctness references"); sums of squares in float64, in chunks.

    Args:
        ref, out: arrays of one shape: NumPy, CuPy or torch (CPU or CUDA; dequantized by the
            caller). Read.
        chunk_rows: rows (first dimension) converted to float64 at a time.
    Returns:
        float: inf when ``out`` equals ``ref`` (both all zero included); NaN when either holds a
        non-finite value, or ``ref`` is all zero and ``out`` is not.
    Raises:
        ValueError: the shapes differ.
    Host syncs: one per chunk on a GPU.
    """
    return sqnr_from_sums(*squared_sums(ref, out, chunk_rows=chunk_rows))


def squared_sums(ref, out, *, chunk_rows=4096):
    """``(||ref||^2, ||ref - out||^2)`` in float64 on the arrays' device (:func:`sqnr`'s sums, to
    combine several arrays). Raises ValueError if the shapes differ."""
    if tuple(ref.shape) != tuple(out.shape):
        raise ValueError(f"out: expected shape {tuple(ref.shape)} like ref, got {tuple(out.shape)}")
    rows = ref.shape[0] if len(ref.shape) else 1
    ref, out = ref.reshape(rows, -1), out.reshape(rows, -1)
    signal = noise = 0.0
    for i in range(0, rows, chunk_rows):
        r, o = _float64(ref[i:i + chunk_rows]), _float64(out[i:i + chunk_rows])
        signal += float((r * r).sum())
        noise += float(((r - o) ** 2).sum())
    return signal, noise


def sqnr_from_sums(signal, noise):
    """:func:`sqnr` of sums already made: inf for no noise, NaN for a non-finite sum or noise
    without signal."""
    if not (math.isfinite(signal) and math.isfinite(noise)):
        return math.nan
    if noise == 0:
        return math.inf
    return math.nan if signal <= 0 else 10 * math.log10(signal / noise)


def _float64(a):
    """``a`` (a NumPy, CuPy or torch array) as float64 on its device."""
    return a.detach().double() if hasattr(a, "detach") else a.astype(numpy.float64)
