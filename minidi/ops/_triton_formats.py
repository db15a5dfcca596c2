"""Triton twins of ``minidi.formats`` (a kernel cannot call torch), shared by the ops that quantise or decode:
``moe_activation.py`` (fq8 in the epilogue, or its e4m3 bytes and scales), ``fp8_quant.py`` (fq8_split),
``indexer_fp8_quant.py`` (e4m3 bytes in the interpreter), ``fp8_linear.py`` (fq8 in x's dtype, e4m3 weight bytes
decoded), ``fp4_grouped_gemm.py`` and ``fp8_grouped_gemm.py`` (E8M0 weight scales), ``hadamard.py`` (fq4_ue8m0 in
the epilogue). The op tests hold each equal to its torch original (test_moe_activation.py::test_pow2_ceil_twin and its
e4m3 grid test, test_fp4_grouped_gemm.py::test_decode_matches_formats, test_fp8_quant.py, test_fp8_linear.py: every
e4m3 byte; test_hadamard.py: fq4_ue8m0 on every e2m1 rounding boundary)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pow2_ceil(y):
    """2^ceil(log2(y)) for positive normal fp32 y, exact, from its bits: ``minidi.formats.pow2_ceil``."""
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(y):
    """|y| <= 448 fp32 -> the nearest e4m3 value (ties to even), exact, in fp32: adding and subtracting 2^(e + 20)
    (its fp32 ulp is the e4m3 step 2^(e - 3) of y's binade e, at least -6: the subnormal step 2^-9) rounds in the
    fp32 adder. The sign of a value that rounds to 0 is kept (-0)."""
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # binade of |y| (-127 for 0 and fp32 subnormals)
    e = tl.maximum(e, -6)
    c = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True)
    q = (a + c) - c
    sign = (y.to(tl.int32, bitcast=True) >> 31) << 31  # y's sign bit (a negation 0 - q would turn -0 into +0)
    return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(v):
    """fp32 with |v| <= 448 -> the e4m3 byte of its nearest value (ties to even; -0 kept), as int32: ``round_e4m3``,
    then the byte assembled from the rounded value's bits. The interpreter's stand-in for the hardware conversion
    (its own fp32 -> fp8 cast truncates, and drops the sign of -0 with some NumPy versions)."""
    r = tl.abs(round_e4m3(v))  # the rounded magnitude, an e4m3 value
    rb = r.to(tl.int32, bitcast=True)
    re = ((rb >> 23) & 0xFF) - 127
    normal = ((re + 7) << 3) | ((rb >> 20) & 7)
    sub = (r * 512.0).to(tl.int32)  # multiples of 2^-9 below 2^-6: codes 0..7
    return tl.where(re >= -6, normal, sub) | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 7)


@triton.jit
def e4m3_byte_to_fp32(b):
    """e4m3 bytes (any int dtype) -> their fp32 values, exact, from the bits (the interpreter has no fp8 loads):
    exponent 0 -> a subnormal m * 2^-9, 0x7F / 0xFF -> NaN, the sign of 0x80 kept (-0)."""
    b = b.to(tl.int32) & 0xFF
    e = (b >> 3) & 0xF
    m = b & 7
    mag = tl.where(e == 0, (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True), ((e + 120) << 23) | (m << 20))
    mag = tl.where((b & 0x7F) == 0x7F, 0x7FC00000, mag)
    return (mag | ((b >> 7) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_fp32(b):
    """E8M0 codes (any int dtype) -> fp32 2^(b-127); 0 -> 2^-127 (subnormal), 255 -> NaN: ``e8m0_to_float``."""
    b = b.to(tl.int32)
    return tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23)).to(tl.float32, bitcast=True)


_FQ4_AMAX_FLOOR = tl.constexpr(6.0 * 2.0**-126)  # formats.fq4_ue8m0's floor: E2M1_MAX * 2^-126
_RINT = tl.constexpr(12582912.0)  # 1.5 * 2^23: (w + _RINT) - _RINT rounds 0 <= w < 2^22 to an integer, ties to even


@triton.jit
def fq4_ue8m0_blocks(g):
    """fq4_ue8m0 of g [R, NB, BLOCK] fp32 (the last axis one block), in fp32: ``minidi.formats.fq4_ue8m0``, exact on
    finite blocks. s = pow2_ceil(max(amax, 6 * 2^-126) / 6) (the division correctly rounded, as torch's), the
    quotient g / s clamped to +-6 (a product with the exact 1 / s: s is a power of two in [2^-126, 2^126]), rounded to
    the e2m1 grid as ``round_e2m1`` (steps 0.5 / 1 / 2 below 2 / 4 / 6, ties to even by the fp32 adder), the sign
    kept (-0 too), times s. A block holding a NaN or an infinity comes out all NaN (the model's result there is
    whatever its bit arithmetic makes of the NaN scale). The Hadamard kernel passes its [BM, n] tile as [BM, n / BLOCK,
    BLOCK]; a 2-d caller passes [R, 1, BLOCK]."""
    a = tl.abs(g)
    amax = tl.max(tl.where(a == a, a, float("inf")), 2)  # a NaN counts as an infinity: either poisons the block
    bad = amax == float("inf")
    s = pow2_ceil(tl.div_rn(tl.maximum(amax, _FQ4_AMAX_FLOOR), 6.0))  # [R, NB]
    inv = ((254 - ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF)) << 23).to(tl.float32, bitcast=True)  # 1 / s
    v = tl.minimum(tl.maximum(g * inv[:, :, None], -6.0), 6.0)
    av = tl.abs(v)
    q = tl.where(av < 2.0, ((av * 2.0 + _RINT) - _RINT) * 0.5,
                 tl.where(av < 4.0, (av + _RINT) - _RINT, ((av * 0.5 + _RINT) - _RINT) * 2.0))
    q = (q.to(tl.int32, bitcast=True) | ((v.to(tl.int32, bitcast=True) >> 31) << 31)).to(tl.float32, bitcast=True)
    return tl.where(bad[:, :, None], float("nan"), q * s[:, :, None])
