"""Scalar bit helpers for MXFP8 (OCP Microscaling v1.0): e4m3fn elements, e8m0 scales, bf16.

Every helper is a ``@cuda.jit(device=True)`` function on integers or float32 scalars. Those that
need the hardware are inline PTX on a GPU and pure Python with the same bits under Numba's CUDA
simulator, chosen at import: the kernels' only branch on the device.

    e4m3fn  s eeee mmm   bias 7, max 448 (0x7E), no inf, NaN = 0x7F / 0xFF
    e8m0    eeeeeeee     2^(e - 127), 0xFF = NaN
    bf16    s eeeeeeee mmmmmmm   the upper half of an f32
"""

import math
import struct

import numpy

from numba import cuda, float32, int32, uint16, uint32

from ._device import simulated

#: Elements per MX block (along the last dimension).
MX_BLOCK = 32
#: Largest finite e4m3fn magnitude.
E4M3_MAX = 448.0
#: e8m0 NaN: the scale of a block holding NaN or +-Inf.
E8M0_NAN = 0xFF
#: e4m3fn NaN (positive); every element of a non-finite block is set to it.
E4M3_NAN = 0x7F
#: bf16 quiet NaN, what dequantization writes for NaN.
BF16_NAN = 0x7FC0
#: f32 quiet NaN.
F32_NAN = 0x7FC00000
#: Absolute-value bits at and above which a bf16 / f32 is Inf or NaN.
BF16_INF = 0x7F80
F32_INF = 0x7F800000
#: Mantissa of 1.75 (448 = 1.75 * 2^8) in bf16 / f32: above it, amax / 448 needs one more exponent.
BF16_MANT_1_75 = 0x60
F32_MANT_1_75 = 0x600000
#: 2^120, see :func:`f32_from_e4m3`.
E4M3_F32_SHIFT = float32(2.0 ** 120)
#: floor(log2(448)) = 8: the e4m3 exponent of the block's largest element.
E4M3_EMAX = 8


def _e4m3_value_py(b):
    """The value of the non-NaN e4m3fn byte ``b`` as a Python float (the simulator's decoder)."""
    sign = -1.0 if b & 0x80 else 1.0
    exp, mant = (b >> 3) & 0xF, b & 0x7
    if exp == 0:
        return sign * math.ldexp(mant, -9)
    return sign * math.ldexp(8 + mant, exp - 10)


def _e4m3_bits_py(x):
    """e4m3fn bits of the float ``x`` exactly as PTX ``cvt.rn.satfinite.e4m3x2.f32`` gives one lane:
    round to nearest even, saturate to +-448 (Inf too), NaN -> 0x7F|sign."""
    x = float(x)
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    if math.isnan(x):
        return 0x7F | sign
    v = abs(x)
    if v >= E4M3_MAX:  # includes Inf: satfinite
        return 0x7E | sign
    if v < 2.0 ** -6:  # subnormal range: a grid of 2^-9
        return round(v * 512.0) | sign  # 8 * 2^-9 = 2^-6 encodes as 0x08: the smallest normal
    _, e = math.frexp(v)  # v = f * 2^e, f in [0.5, 1): exponent e - 1, ulp 2^(e - 4)
    q = round(math.ldexp(v, 4 - e))  # in [8, 16]; Python's round is half-to-even
    exp = e - 1 + 7
    if q == 16:
        q, exp = 8, exp + 1
    if exp > 15 or (exp == 15 and q - 8 == 7):  # 480: never (v < 448 rounds to <= 448)
        return 0x7E | sign
    return (exp << 3) | (q - 8) | sign


if simulated():  # each the Python twin of the GPU form below, bit for bit
    @cuda.jit(device=True)
    def cvt_e4m3x2(a, b):
        return uint16((_e4m3_bits_py(a) << 8) | _e4m3_bits_py(b))

    @cuda.jit(device=True)
    def f32_from_bits(bits):
        return float32(struct.unpack("<f", struct.pack("<I", int(bits) & 0xFFFFFFFF))[0])

    @cuda.jit(device=True)
    def bits_from_f32(x):
        return uint32(struct.unpack("<I", struct.pack("<f", float32(x)))[0])

    @cuda.jit(device=True)
    def cvt_f16x2_e4m3x2(a):
        hi = numpy.float16(_e4m3_value_py(int(a) >> 8)).view(numpy.uint16)
        lo = numpy.float16(_e4m3_value_py(int(a) & 0xFF)).view(numpy.uint16)
        return uint32((int(hi) << 16) | int(lo))

    @cuda.jit(device=True)
    def f32_from_f16_bits(h):
        return float32(numpy.uint16(h).view(numpy.float16))

    def _f16_py(h):
        return float(numpy.uint16(h).view(numpy.float16))

    def _f16_bits_py(x):
        return int(numpy.float16(x).view(numpy.uint16))  # round to nearest even, subnormals kept

    @cuda.jit(device=True)
    def mul_f16x2(a, b):
        with numpy.errstate(all="ignore"):
            hi = _f16_bits_py(_f16_py(int(a) >> 16) * _f16_py(int(b) >> 16))
            lo = _f16_bits_py(_f16_py(int(a) & 0xFFFF) * _f16_py(int(b) & 0xFFFF))
        return uint32((hi << 16) | lo)

    @cuda.jit(device=True)
    def cvt_e4m3x2_f16x2(h):
        return uint16((_e4m3_bits_py(_f16_py(int(h) >> 16)) << 8)
                      | _e4m3_bits_py(_f16_py(int(h) & 0xFFFF)))

    @cuda.jit(device=True)
    def cvt_bf16x2_f32(a, b):
        return uint32((int(bf16_bits_from_f32_bits(bits_from_f32(a))) << 16)
                      | int(bf16_bits_from_f32_bits(bits_from_f32(b))))

    @cuda.jit(device=True)
    def max_u16x2(a, b):
        a, b = int(a), int(b)
        return uint32(max(a & 0xFFFF, b & 0xFFFF) | (max(a >> 16, b >> 16) << 16))

    @cuda.jit(device=True)
    def byte_perm(a, b, selector):
        both = (int(b) << 32) | int(a)
        sel = int(selector)
        return uint32(sum(((both >> (8 * ((sel >> (4 * k)) & 7))) & 0xFF) << (8 * k)
                          for k in range(4)))

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _instruction(text, constraints, signature):
        """An intrinsic's (signature, codegen) of one inline PTX instruction ``text`` with operands
        ``$0`` (the result), ``$1``... and LLVM ``constraints`` (``h`` 16-bit, ``r`` 32-bit, ``f``
        f32)."""

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(context.get_value_type(sig.return_type),
                                   [context.get_value_type(a) for a in sig.args])
            return builder.call(ir.InlineAsm(fnty, text, constraints), list(args))

        return signature, codegen

    def _bitcast(signature, llvm_type):
        """An intrinsic's (signature, codegen) reading its one argument's bits as ``llvm_type``."""

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], llvm_type)

        return signature, codegen

    @intrinsic
    def cvt_e4m3x2(typingctx, a, b):
        """e4m3fn bits of f32 ``a`` (upper byte) and ``b`` (lower) in one uint16: PTX
        ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+): round to nearest even, saturate to +-448 (Inf
        too), NaN -> 0x7F with its sign."""
        return _instruction("cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f",
                            types.uint16(types.float32, types.float32))

    @intrinsic
    def f32_from_bits(typingctx, bits):
        """The float32 whose bit pattern is the uint32 ``bits``."""
        return _bitcast(types.float32(types.uint32), ir.FloatType())

    @intrinsic
    def cvt_f16x2_e4m3x2(typingctx, a):
        """Two f16 (a uint32) of the two e4m3fn in the uint16 ``a``, upper byte to upper half: PTX
        ``cvt.rn.f16x2.e4m3x2`` (sm_89+), exact; NaN bytes are the caller's to avoid."""
        return _instruction("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h",
                            types.uint32(types.uint16))

    @intrinsic
    def f32_from_f16_bits(typingctx, h):
        """The float32 value of the f16 with bits ``h`` (uint16): PTX ``cvt.f32.f16``, exact."""
        return _instruction("cvt.f32.f16 $0, $1;", "=f,h",
                            types.float32(types.uint16))

    @intrinsic
    def mul_f16x2(typingctx, a, b):
        """The two f16 products of the f16 pairs (uint32 bits) ``a`` and ``b``: PTX ``mul.rn.f16x2``
        (round to nearest even, subnormals kept, never fused)."""
        return _instruction("mul.rn.f16x2 $0, $1, $2;", "=r,r,r",
                            types.uint32(types.uint32, types.uint32))

    @intrinsic
    def cvt_e4m3x2_f16x2(typingctx, h):
        """e4m3fn bits (uint16) of the two f16 in the uint32 ``h``, upper half to upper byte: PTX
        ``cvt.rn.satfinite.e4m3x2.f16x2`` (sm_89+; NaN -> 0x7F with its sign)."""
        return _instruction("cvt.rn.satfinite.e4m3x2.f16x2 $0, $1;", "=h,r",
                            types.uint16(types.uint32))

    @intrinsic
    def cvt_bf16x2_f32(typingctx, a, b):
        """Two bf16 (a uint32) of f32 ``a`` (upper half) and ``b`` (lower): PTX
        ``cvt.rn.bf16x2.f32`` (sm_80+), round to nearest even (finite inputs)."""
        return _instruction("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                            types.uint32(types.float32, types.float32))

    @intrinsic
    def max_u16x2(typingctx, a, b):
        """The unsigned 16-bit maxima of the halves of the uint32s ``a`` and ``b``: PTX
        ``max.u16x2`` (sm_90+)."""
        return _instruction("max.u16x2 $0, $1, $2;", "=r,r,r",
                            types.uint32(types.uint32, types.uint32))

    @intrinsic
    def byte_perm(typingctx, a, b, selector):
        """The uint32 whose byte k is byte ``selector``'s nibble k (0-7) of the 8 bytes of ``b``
        (bytes 4-7) and ``a`` (0-3): PTX ``prmt.b32``, default mode (sign replication unused)."""
        return _instruction("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                            types.uint32(types.uint32, types.uint32, types.uint32))

    @intrinsic
    def bits_from_f32(typingctx, x):
        """The uint32 bit pattern of the float32 ``x``."""
        return _bitcast(types.uint32(types.float32), ir.IntType(32))


@cuda.jit(device=True)
def e8m0_from_bf16_amax(amax_bits, rceil):
    """Biased e8m0 scale of a block from its max-abs bf16 bits (finite: < 0x7F80).

    With exp = amax_bits >> 7 (biased) and mant = amax_bits & 0x7F, exactly:
      floor (OCP): clamp(floor(log2 amax) - 8, -127, 127) + 127 = clamp(exp - 8, 0, 254)
      rceil (NVIDIA/TransformerEngine): clamp(ceil(log2(amax / 448)), -127, 127) + 127
            = clamp(exp - 8 + (mant > 0x60), 0, 254), since 448 = 1.75 * 2^8 and 0x60 is .75.
    Zero and subnormal amax give 0 (2^-127).
    """
    e = int32(amax_bits >> uint32(7))
    if rceil and (amax_bits & uint32(0x7F)) > uint32(BF16_MANT_1_75):
        e = int32(e + int32(1))
    return uint32(min(max(int32(e - int32(E4M3_EMAX)), int32(0)), int32(254)))


@cuda.jit(device=True)
def e8m0_from_f32_amax(amax_bits, rceil):
    """:func:`e8m0_from_bf16_amax` of f32 bits: exp = bits >> 23, the 1.75 threshold 0x600000."""
    e = int32(amax_bits >> uint32(23))
    if rceil and (amax_bits & uint32(0x7FFFFF)) > uint32(F32_MANT_1_75):
        e = int32(e + int32(1))
    return uint32(min(max(int32(e - int32(E4M3_EMAX)), int32(0)), int32(254)))


@cuda.jit(device=True)
def inv_scale_f32_bits(s):
    """f32 bits of 2^(127 - s) for a biased scale 0 <= s <= 253: the quantization multiplier."""
    return uint32(254 - s) << uint32(23)


@cuda.jit(device=True)
def scale_f32_bits(s):
    """f32 bits of 2^(s - 127) for a biased scale 0 <= s <= 254 (s = 0: the subnormal 2^-127)."""
    if s == 0:
        return uint32(0x00400000)
    return uint32(s) << uint32(23)


@cuda.jit(device=True)
def bf16_bits_from_f32_bits(bits):
    """bf16 bits (a uint32) of the f32 bits ``bits``: round to nearest even; NaN -> 0x7FC0."""
    if (bits & uint32(0x7FFFFFFF)) > uint32(F32_INF):
        return uint32(BF16_NAN)
    return (bits + uint32(0x7FFF) + ((bits >> uint32(16)) & uint32(1))) >> uint32(16)


@cuda.jit(device=True)
def f32_from_e4m3(b):
    """The float32 value of the non-NaN e4m3fn bits ``b`` (a uint32, 0..255), exact and branch-free:
    the f32 with bits (sign << 31) | (magnitude << 20) is the e4m3 value times 2^-120 (normal or
    subnormal), so one exact multiply by 2^120 decodes. NaN bits (0x7F, 0xFF) decode as +-480:
    callers test for them."""
    bits = ((b & uint32(0x80)) << uint32(24)) | ((b & uint32(0x7F)) << uint32(20))
    return f32_from_bits(bits) * E4M3_F32_SHIFT


@cuda.jit(device=True)
def rescale_e4m3x4(d, mult_lo, mult_hi):
    """The 4 e4m3 in the uint32 ``d`` times f16 pairs (uint32 bits), bytes 0 and 1 by ``mult_lo``,
    2 and 3 by ``mult_hi``: exact decode to f16, f16 products, one RNE to e4m3 (satfinite)."""
    lo = cvt_e4m3x2_f16x2(mul_f16x2(cvt_f16x2_e4m3x2(uint16(d & uint32(0xFFFF))), mult_lo))
    hi = cvt_e4m3x2_f16x2(mul_f16x2(cvt_f16x2_e4m3x2(uint16(d >> uint32(16))), mult_hi))
    return uint32(lo) | (uint32(hi) << uint32(16))
