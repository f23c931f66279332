"""A differentiable grouped GEMM of pre-quantized fp8 rowwise rows (``mxcomm.torch.grouped_mm``).

Glossary: P permuted rows, K the reduction width (D), N the output width (H), G = E_local groups,
``offs`` (G,) int32 cumulative group ends. On SM90, over ``torch._scaled_grouped_mm``'s rowwise
recipe (aten/src/ATen/native/cuda/GroupedBlas.cpp, torch 2.11-2.13: e4m3fn operands, float32
scales per row of A and per (group, column) of B, K % 16 == 0; its 2d-2d wgrad needs every group
of tokens a multiple of 16)::

    forward  y  (P, N)    = x (P, K) fp8 rowwise (as permuted) x w (G, K, N), quantized along K
    dgrad    dx (P, K)    = grad (P, N) fp8 rowwise x w^T (G, N, K), quantized along N
    wgrad    dw (G, K, N) = x^T (K, T) x grad (T, N), both scaled per (group, column) along the
                            tokens (``wgrad="fp8"``), or in bf16 (``wgrad="bf16"``)

Elsewhere ``torch._grouped_mm`` on the dequantized rows. Weights reading the same rows are one
GEMM over ``[w_1 | w_2 | ...]`` along N. docs/design.md, "The experts' GEMMs".
"""

import functools
import weakref

import numpy
import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import colwise, rowwise
from ._torch_arrays import _Alloc, _array, _record, _stream
from .recipes import GEMMS

E4M3_MAX = 448.0
_SCALE_EXP_MIN, _SCALE_EXP_MAX = -126, 127
#: The attribute of overlapped-dispatch rows where the backward marks its dgrad (_torch_overlap).
OVERLAP_ATTRIBUTE = "_mxcomm_overlap"


def fp8_gemm_available(device):
    """True where ``torch._scaled_grouped_mm`` runs the fp8 rowwise recipe: SM90 and a torch
    that has it."""
    device = torch.device(device)
    return (device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm")
            and _major(device.index if device.index is not None
                       else torch.cuda.current_device()) == 9)


@functools.cache
def _major(index):
    """The compute capability's major number of CUDA device ``index`` (asked once)."""
    return torch.cuda.get_device_capability(index)[0]


def quantize_rows_pow2(t):
    """fp8 rowwise quantization of the last axis of ``t``.

    Args:
        t: (..., K) float tensor. Read.
    Returns:
        (q, scale): (..., K) float8_e4m3fn and (...,) float32 with t ~= q * scale[..., None];
        scale = 2^clamp(ceil(log2(amax / 448)), -126, 127) (amax 0: 2^-126; non-finite: NaN).
        On CUDA, bf16/fp32 with K % 16 == 0: ``mxcomm.rowwise.quantize_fp8_rowwise`` (exact);
        else torch ops in float32 (at a power of two of amax / 448, maybe one binade off).
    """
    k = t.shape[-1]
    if t.is_cuda and t.dtype in (torch.bfloat16, torch.float32) and k % 16 == 0 and t.numel():
        rows = t.detach().reshape(-1, k)  # _array makes it contiguous
        alloc = _Alloc(t.device)  # torch's memory: stream-ordered, and a graph's under capture
        data = alloc(rows.shape, numpy.dtype(numpy.uint8))
        scales = alloc(rows.shape[:1], numpy.dtype(numpy.float32))
        rowwise.quantize_fp8_rowwise(_array(rows, "t"), out=(data, scales), stream=_stream(rows))
        return (alloc.tensor(data, torch.float8_e4m3fn).view(t.shape),
                alloc.tensor(scales).view(t.shape[:-1]))
    amax = t.detach().abs().amax(dim=-1).float()
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(_SCALE_EXP_MIN, _SCALE_EXP_MAX)
    exponent = torch.where(amax == 0, torch.full_like(exponent, _SCALE_EXP_MIN), exponent)
    scale = torch.where(torch.isfinite(amax), torch.exp2(exponent),
                        torch.full_like(amax, float("nan")))
    q = (t.float() / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _fp8_operand_a(t):
    """(data (M, K) e4m3fn, scales (M,) float32): an fp8_rowwise QuantizedTensor's own bits,
    else quantized here."""
    fmt = getattr(t, "format", None)
    if fmt is not None and getattr(fmt, "name", None) == "fp8_rowwise":
        _record(t)  # read on this stream (a gradient or rows made on another, kept for the wgrad)
        return t.qdata.contiguous(), t.scales.contiguous()
    plain = t.dequantize() if fmt is not None else t
    return quantize_rows_pow2(plain.detach().contiguous())


def _fp8_weight(w):
    """``w`` (G, K, N) as B of the forward: (G, K, N) e4m3fn column-major, scales (G, N)."""
    q, scale = quantize_rows_pow2(w.detach().transpose(-2, -1).contiguous())  # (G, N, K) along K
    return q.transpose(-2, -1), scale


def _fp8_weight_t(w):
    """``w^T`` (G, N, K) as B of dgrad: e4m3fn column-major, scales (G, K); no contiguous copy
    of a CUDA transposed view."""
    stored = w.detach().transpose(-2, -1)  # (G, N, K)
    if (w.is_cuda and w.dtype == torch.bfloat16 and stored.is_contiguous() and stored.numel()
            and stored.shape[-1] % 16 == 0 and stored.shape[-2] % 16 == 0):
        alloc = _Alloc(w.device)
        data, scales = colwise._transposed(_array(stored, "w"), _stream(stored), alloc)
        return alloc.tensor(data, torch.float8_e4m3fn).transpose(-2, -1), alloc.tensor(scales)
    q, scale = quantize_rows_pow2(w.detach().contiguous())  # (G, K, N) along N
    return q.transpose(-2, -1), scale


def _plain(t):
    """A bf16 tensor of ``t``'s values (dequantized for a QuantizedTensor), no autograd."""
    return (t.dequantize() if hasattr(t, "qdata") else t).detach().to(torch.bfloat16)


def _fp8_wgrad(x_rows, grad_rows, offs, fast, transposed):
    """dw (G, K, N) bf16 = x^T grad per group from (data, scales) fp8 rowwise pairs, converted
    by ``colwise`` without its checks (these are the GEMM's own operands). ``transposed``: made
    as grad^T x (G, N, K) and returned as its transposed view (:func:`_weights_transposed`)."""
    ends, stream, alloc = _array(offs, "offs"), _stream(offs), _Alloc(offs.device)
    a, scale_a, aligned = colwise._to_group_colwise(                 # x^T (K, T), (G, K)
        _array(x_rows[0], "x"), _array(x_rows[1], "x scales"), ends, stream, alloc)
    b, scale_b, _ = colwise._to_group_colwise(                       # grad^T (N, T), (G, N)
        _array(grad_rows[0], "grad"), _array(grad_rows[1], "grad scales"), ends, stream, alloc)
    tensor = alloc.tensor  # the host backend's own arrays: through DLPack
    a, b = tensor(a, torch.float8_e4m3fn), tensor(b, torch.float8_e4m3fn)
    scale_a, scale_b = tensor(scale_a).reshape(-1), tensor(scale_b).reshape(-1)
    if transposed:  # grad^T x
        a, b, scale_a, scale_b = b, a, scale_b, scale_a
    dw = torch._scaled_grouped_mm(a, b.t(), scale_a, scale_b, offs=tensor(aligned),
                                  out_dtype=torch.bfloat16, use_fast_accum=fast)
    return dw.transpose(-2, -1) if transposed else dw


def _weights_transposed(ws):
    """Whether every (G, K, N_i) weight is stored as (G, N_i, K) (a transposed view: torchtitan's
    ``w.transpose(-2, -1)``). Their gradient is then made as (G, N, K) and handed over as its
    transposed view, in the weights' own layout: made (G, K, N), autograd's accumulation into
    such a weight copied it transposed, 0.73 ms per step at 32768 rows of 7168 -> 2048 and 8
    experts per rank on H200 (bench/NOTES.md, 2026-11-28)."""
    return all(w.stride(-2) == 1 and w.stride(-1) != 1 for w in ws)


class WeightCache:
    """Quantized expert weights, reused while the weight is unchanged.

    Keyed weakly by the tensor owning the storage, the view's geometry, the operand and
    ``w._version``; every ``torch.optim`` step empties it. Writes that neither bump the version
    nor follow such a step (``w.data``, FSDP2's all-gather after ``load_state_dict``) are not
    seen: call :meth:`clear`. docs/design.md, "The weight cache".

    Attributes:
        hits, misses: counts of :meth:`get` calls that reused / made an operand.
        steps: optimizer steps seen (each emptied the cache).
    """

    def __init__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook
        self._entries = WeakIdKeyDictionary()
        self.hits = self.misses = self.steps = 0
        this = weakref.ref(self)

        def stepped(optimizer, args, kwargs):
            cache = this()
            if cache is not None:
                cache.steps += 1
                cache.clear()
        self._hook = register_optimizer_step_post_hook(stepped)

    def __del__(self):
        hook = getattr(self, "_hook", None)
        if hook is not None:
            hook.remove()

    def get(self, w, operand, make):
        """``make(w)`` for ``w`` (a tensor or view, or a tuple of them) of this version and
        geometry and the name ``operand``, made once and then reused."""
        key, version, owners = [operand], [], []
        for t in w if isinstance(w, tuple) else (w,):
            owners.append(t if t._base is None else t._base)
            key.append((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device))
            version.append(t._version)
        key = tuple(key)
        entries = self._entries.get(owners[0])
        if entries is None:
            entries = self._entries[owners[0]] = {}
        found = entries.get(key)
        # the other weights are held weakly: the entry lives as long as the first one does
        if found is not None and found[0] == version and \
                all(ref() is o for ref, o in zip(found[2], owners[1:])):
            self.hits += 1
            return found[1]
        self.misses += 1
        value = make(w)
        entries[key] = (version, value, [weakref.ref(o) for o in owners[1:]])
        return value

    def clear(self):
        """Forget every operand (after writes the cache cannot see; see the class docstring)."""
        self._entries = WeakIdKeyDictionary()


#: The cache :func:`grouped_mm` uses unless given another (``weight_cache=``).
default_weight_cache = WeightCache()


def _weight_operand(cache, ws, operand, make):
    """``make(joined(ws))``, through ``cache`` (None: made afresh)."""
    if cache is None:
        return make(joined(ws))
    return cache.get(ws, operand, lambda ws: make(joined(ws)))


def joined(ws):
    """(G, K, N_i) weights joined along N (one: itself), as the transpose of a contiguous
    (G, sum N_i, K), as torchtitan lays weights out (the dgrad's quantizer reads it in place)."""
    if len(ws) == 1:
        return ws[0]
    return torch.cat([w.transpose(-2, -1) for w in ws], dim=-2).transpose(-2, -1)


class _GroupedMM(torch.autograd.Function):
    """y = x @ [w_1 | w_2 | ...] per group, x given as fp8 rowwise rows (module docstring).

    Forward:  x (P, K), ws (G, K, N_i) bf16, offs (G,) int32 -> y (P, sum N_i) bf16. Saved:
              x (bf16 wgrad) or its fp8 rowwise rows (fp8 wgrad).
    Backward: grad (P, sum N_i) -> dx (P, K), dw_i (G, K, N_i) bf16 in the weights' layout
              (:func:`_weights_transposed`). dgrad first, then dx is
              marked for an overlapped dispatch (its gradient exchange waits for dgrad only).
    """

    @staticmethod
    def forward(ctx, x, offs, fp8, wgrad, fast, cache, *ws):
        ctx.fp8 = fp8
        ctx.cache = cache
        # the weights as given, for the cache: a saved tensor unpacks as a new object
        ctx.weights = ws if cache is not None else None
        ctx.fp8_wgrad = fp8 and wgrad == "fp8"
        ctx.fast = fast
        ctx.overlap = getattr(x, OVERLAP_ATTRIBUTE, None)
        kept = x.detach() if hasattr(x, "qdata") else x
        if not fp8:
            ctx.save_for_backward(kept, offs, *ws)
            return torch._grouped_mm(_plain(x), joined([w.detach() for w in ws]), offs=offs)
        a, scale_a = _fp8_operand_a(x)
        ctx.save_for_backward(*((a, scale_a) if ctx.fp8_wgrad else (kept,)), offs, *ws)
        ctx.rows = 2 if ctx.fp8_wgrad else 1
        b, scale_b = _weight_operand(cache, ws, "forward", _fp8_weight)
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs,
                                        out_dtype=torch.bfloat16,
                                        use_fast_accum="forward" in fast)

    @staticmethod
    def backward(ctx, grad):
        dx = dw = None
        saved = ctx.saved_tensors  # (a, scale_a) for the fp8 wgrad, else (x,); offs; ws
        kept = getattr(ctx, "rows", 1)
        rows, offs, ws = saved[:kept], saved[kept], saved[kept + 1:]
        if ctx.fp8 and (ctx.needs_input_grad[0] or ctx.fp8_wgrad):
            g, scale_g = _fp8_operand_a(grad)
        if ctx.needs_input_grad[0]:
            if ctx.fp8:
                b, scale_b = _weight_operand(ctx.cache, ctx.weights if ctx.cache is not None
                                             else ws, "dgrad", _fp8_weight_t)
                dx = torch._scaled_grouped_mm(g, b, scale_g, scale_b, offs=offs,
                                              out_dtype=torch.bfloat16,
                                              use_fast_accum="dgrad" in ctx.fast)
            else:
                dx = torch._grouped_mm(_plain(grad), joined([w.detach() for w in ws])
                                       .transpose(-2, -1), offs=offs)
            overlap = getattr(ctx, "overlap", None)
            if overlap is not None:  # dx is complete here: the dispatch's backward may start
                overlap.mark(dx)
        dws = (None,) * len(ws)
        if any(ctx.needs_input_grad[6:]):
            transposed = _weights_transposed(ws)
            if ctx.fp8_wgrad:
                dw = _fp8_wgrad(rows, (g, scale_g), offs, "wgrad" in ctx.fast, transposed)
            elif transposed:
                dw = torch._grouped_mm(_plain(grad).t(), _plain(rows[0]), offs=offs) \
                    .transpose(-2, -1)
            else:
                dw = torch._grouped_mm(_plain(rows[0]).t(), _plain(grad), offs=offs)
            dws = tuple(d.to(w.dtype) for d, w in
                        zip(dw.split([w.shape[-1] for w in ws], dim=-1), ws))
        # None for: offs, fp8, wgrad, fast, cache
        return (dx, None, None, None, None, None) + dws


def _fast_set(fast_accum):
    """``fast_accum`` as a frozenset of :data:`GEMMS` names; else ValueError."""
    if fast_accum is True or fast_accum is False:
        return frozenset(GEMMS if fast_accum else ())
    try:
        chosen = frozenset((fast_accum,) if isinstance(fast_accum, str) else fast_accum)
    except TypeError:
        chosen = None
    if chosen is None or not chosen <= set(GEMMS):
        raise ValueError(f"grouped_mm: fast_accum: expected True, False or some of {GEMMS}, got "
                         f"{fast_accum!r}")
    return chosen


def _decide_fp8(fp8, ws, quantized):
    """``grouped_mm``'s ``fp8`` (None: SM90 fp8 GEMMs for ``quantized`` rows where available)
    as a bool for weights ``ws``; raises as :func:`grouped_mm` documents."""
    device = ws[0].device
    available = fp8_gemm_available(device)
    if fp8 and not available:
        raise RuntimeError(f"grouped_mm: fp8=True needs an SM90 CUDA GPU and "
                           f"torch._scaled_grouped_mm; {device} has none (pass fp8=None for "
                           f"the bf16 fallback)")
    fp8 = available and quantized if fp8 is None else bool(fp8)
    n = sum(wi.shape[2] for wi in ws)
    if fp8 and n % 16:
        raise ValueError(f"grouped_mm: N = {n} is not a multiple of 16, which the fp8 "
                         f"dgrad needs (its reduction width); pass fp8=False for the bf16 GEMMs")
    return fp8


def grouped_mm(x, w, offs, *, fp8=None, wgrad="fp8", fast_accum=True, weight_cache=True):
    """Differentiable grouped GEMM of pre-quantized permuted rows and bf16 expert weights.

    Args:
        x: (P, K) fp8_rowwise QuantizedTensor, or any QuantizedTensor / bf16 tensor (quantized
            per call on the fp8 path); K % 16 == 0. Its gradient is (P, K) bf16.
        w: (G, K, N) bf16 tensor; or a tuple or list of (G, K, N_i) ones reading the same rows
            (one GEMM, N = sum N_i, each its own gradient).
        offs: (G,) int32 tensor on ``x``'s device, cumulative group ends; any group sizes.
        fp8: None: SM90 fp8 GEMMs for quantized rows where :func:`fp8_gemm_available`, bf16
            GEMMs otherwise; True: require them; False: the bf16 fallback. Compiled, the custom
            op ``mxcomm::grouped_mm`` decides and raises alike.
        wgrad: the weight gradient's GEMM, ``"fp8"`` (default) or ``"bf16"``.
        fast_accum: the fp8 products accumulated without fp32 promotion: some of
            :data:`GEMMS`, or True (all, as torchao's fp8 rowwise MoE GEMM) / False.
        weight_cache: True: :data:`default_weight_cache`; a :class:`WeightCache`; False:
            quantize per call. Same values either way.
    Returns:
        (P, N) bf16, several weights' outputs side by side. The backward runs dgrad, then
        wgrad (docs/design.md, "Overlap").
    Raises:
        RuntimeError: ``fp8=True`` where SM90 fp8 grouped GEMMs are unavailable.
        ValueError: shapes that do not fit (K mismatch, K % 16 != 0, or N % 16 != 0 on the
            fp8 path, weights of different G or K); ``wgrad`` not "fp8" or "bf16";
            ``fast_accum`` naming something else; an empty tuple of weights.
        TypeError: ``w`` not bf16; ``offs`` not (G,) int32; ``weight_cache`` of another type.
    """
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    if not ws:
        raise ValueError("grouped_mm: w: expected a (G, K, N) tensor or a tuple of them, got "
                         "an empty tuple")
    for i, wi in enumerate(ws):
        name = "w" if len(ws) == 1 else f"w[{i}]"
        if wi.dim() != 3 or x.dim() != 2 or wi.shape[1] != x.shape[1] or \
                wi.shape[0] != ws[0].shape[0]:
            raise ValueError(f"grouped_mm: expected x (P, K) and {name} (G, K, N) (G alike for "
                             f"every weight), got x {tuple(x.shape)} and {name} "
                             f"{tuple(wi.shape)}")
        if wi.dtype != torch.bfloat16:
            raise TypeError(f"grouped_mm: {name}: expected dtype bfloat16, got {wi.dtype}")
    w = ws[0]
    if x.shape[1] % 16:
        raise ValueError(f"grouped_mm: K = {x.shape[1]} is not a multiple of 16")
    if wgrad not in ("fp8", "bf16"):
        raise ValueError(f"grouped_mm: wgrad: expected 'fp8' or 'bf16', got {wgrad!r}")
    fast = _fast_set(fast_accum)
    if offs.dtype != torch.int32 or tuple(offs.shape) != (w.shape[0],):
        raise TypeError(f"grouped_mm: offs: expected ({w.shape[0]},) int32, got "
                        f"{tuple(offs.shape)} {offs.dtype}")
    if torch.compiler.is_compiling():  # its kernels do not trace: the op (mxcomm.torch._gemm_op)
        # a pair goes in as it is (the op joins it as eager does: the same bits, no joined
        # copy in the graph or saved for the backward); more weights joined in the graph
        flags = [name in fast for name in GEMMS]
        if len(ws) == 2:
            return torch.ops.mxcomm.grouped_mm(x, ws[0], offs, fp8, wgrad, flags, w_b=ws[1])
        return torch.ops.mxcomm.grouped_mm(x, joined(ws), offs, fp8, wgrad, flags)
    fp8 = _decide_fp8(fp8, ws, hasattr(x, "qdata"))
    cache = default_weight_cache if weight_cache is True else \
        None if weight_cache is False else weight_cache
    if weight_cache is not False and not isinstance(cache, WeightCache):  # None included
        raise TypeError(f"grouped_mm: weight_cache: expected True, False or a WeightCache, got "
                        f"{type(weight_cache).__name__}")
    return _GroupedMM.apply(x, offs, fp8, wgrad, fast, cache, *ws)
