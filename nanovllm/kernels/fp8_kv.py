"""FP8 (e4m3) KV cache: the quantization step every Triton cache writer shares, and the
word-wise read the decode kernel takes (and the FP8 GEMVs: kernels/gemv.py, moe/decode.py).

    stored = e4m3(clamp(x / scale, -FP8_MAX, FP8_MAX))   round to nearest even, as torch's .to(float8_e4m3fn)
    read   = float(stored) * scale                       (the attention kernels fold the scales in)

The clamp comes first: a value past FP8_MAX saturates (a plain cast of it is NaN in e4m3fn).
x / scale is an IEEE division (div_rn, not the approximate one `/` compiles to), as torch's, so a
GPU store and torch_attention.store_kvcache give the same bytes. Triton's CPU interpreter casts
float32 to fp8 wrongly (a carry out of the mantissa is dropped, ties round up), so under it the
value is first snapped to the e4m3 grid by hand and the cast is then exact.

Reading, `e4m3_planes` turns int32 words of four e4m3 bytes into four fp16 planes (byte j of every
word: head dims 4c + j), two `cvt.rn.f16x2.e4m3x2` per word on the GPU (exact: every e4m3 value is
an fp16 one; what it bought end to end: kernels/decode_fp8.py)::

    word c:  | byte 3 | byte 2 | byte 1 | byte 0 |   little-endian: byte j holds dim 4c + j
               plane 3  plane 2  plane 1  plane 0
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import checks

FP8_MAX = tl.constexpr(checks.FP8_MAX)
# A tl.constexpr: jitted code may read a global only in that form (see fused_norm.round_to).
INTERPRET = tl.constexpr(checks.INTERPRET)
# e4m3: 3 mantissa bits; exponents below -6 are subnormal, spaced like exponent -6's values.
E4M3_MANTISSA_BITS = tl.constexpr(3)
E4M3_MIN_EXP = tl.constexpr(-6)
# float32 exponent bias and mantissa width, to build powers of two from bits.
F32_BIAS = tl.constexpr(127)
F32_MANTISSA_BITS = tl.constexpr(23)
# Adding and subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to an integer, ties to even.
RNE_MAGIC = tl.constexpr(12582912.0)
# An e4m3 byte: sign bit, then 4 exponent bits (bias 7), then the 3 mantissa bits.
E4M3_BIAS = tl.constexpr(7)
E4M3_SIGN = tl.constexpr(0x80)
# Smallest subnormal e4m3 step: 2**-9 (= 2**(E4M3_MIN_EXP - E4M3_MANTISSA_BITS)).
E4M3_TINY = tl.constexpr(2.0 ** -9)
BYTE_BITS = tl.constexpr(8)
# e4m3 values an int32 word holds (the word-wise reads of the cache and of FP8 weights).
PER_WORD = tl.constexpr(checks.FP8_PER_WORD)
# Two e4m3 bytes (a 16-bit half of the word) -> two fp16 (one 32-bit register), twice per word.
_PLANES_PTX = tl.constexpr("""{
    .reg .b16 lo, hi;
    .reg .b32 r0, r1;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 r0, lo;
    cvt.rn.f16x2.e4m3x2 r1, hi;
    mov.b32 {$0, $1}, r0;
    mov.b32 {$2, $3}, r1;
}""")


@triton.jit
def _snap_e4m3(y):
    """float32 y (|y| <= FP8_MAX) rounded to the nearest e4m3 value, ties to even, sign kept (-0
    too, as the cast keeps it); interpreter only."""
    bits = y.to(tl.uint32, bitcast=True)
    exp = ((bits >> F32_MANTISSA_BITS) & 0xFF).to(tl.int32) - F32_BIAS
    exp = tl.maximum(exp, E4M3_MIN_EXP)
    step = ((exp - E4M3_MANTISSA_BITS + F32_BIAS) << F32_MANTISSA_BITS).to(tl.float32, bitcast=True)
    snapped = ((tl.abs(y) / step + RNE_MAGIC) - RNE_MAGIC) * step  # |y| / step < 16: exact, as is the product
    return tl.where((bits >> 31) != 0, -snapped, snapped)


@triton.jit
def quantize_fp8(x, scale, dtype: tl.constexpr):
    """x (any float) / scale (float32 scalar), saturated to +-FP8_MAX, as `dtype` (fp8e4nv)."""
    y = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX)
    if INTERPRET:
        y = _snap_e4m3(y)
    return y.to(dtype)


@triton.jit
def _e4m3_byte(words, j: tl.constexpr):
    """float32 value of byte j of each int32 word, read as e4m3 (no NaN: stores saturate); interpreter only."""
    b = (words >> (BYTE_BITS * j)) & 0xFF
    exp = (b >> E4M3_MANTISSA_BITS) & 0xF
    man = b & 0x7
    normal = ((exp - E4M3_BIAS + F32_BIAS) << F32_MANTISSA_BITS) | (man << (F32_MANTISSA_BITS - E4M3_MANTISSA_BITS))
    mag = tl.where(exp == 0, man.to(tl.float32) * E4M3_TINY, normal.to(tl.float32, bitcast=True))
    return tl.where((b & E4M3_SIGN) != 0, -mag, mag)


@triton.jit
def e4m3_planes(words, dtype: tl.constexpr):
    """int32 words of four e4m3 bytes [..., C] -> the four planes of their values, each [..., C] of
    `dtype` (fp16 on the GPU: the hardware pair conversion; anything under the interpreter)."""
    if INTERPRET:
        return (_e4m3_byte(words, 0).to(dtype), _e4m3_byte(words, 1).to(dtype),
                _e4m3_byte(words, 2).to(dtype), _e4m3_byte(words, 3).to(dtype))
    else:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(_PLANES_PTX, "=h,=h,=h,=h,r", [words],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=1)
        return p0.to(dtype), p1.to(dtype), p2.to(dtype), p3.to(dtype)


@triton.jit
def split_planes(a, ROWS: tl.constexpr, KW: tl.constexpr):
    """a [ROWS, 4 KW] -> its four planes [ROWS, KW] (plane j: columns 4c + j), laid out as
    `e4m3_planes` lays out the words of the same columns."""
    even, odd = tl.split(tl.reshape(a, (ROWS, KW, 2, 2)))  # column 4c + 2 b1 + b0: split takes b0
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    return a0, a1, a2, a3
