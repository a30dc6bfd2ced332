"""FP8 (e4m3) KV cache: the quantization step every Triton cache writer shares.

    stored = e4m3(clamp(x / scale, -FP8_MAX, FP8_MAX))   round to nearest even, as torch's .to(float8_e4m3fn)
    read   = float(stored) * scale                       (the attention kernels fold the scales in)

The clamp comes first: a value past FP8_MAX saturates (a plain cast of it is NaN in e4m3fn).
x / scale is an IEEE division (div_rn, not the approximate one `/` compiles to), as torch's, so a
GPU store and torch_attention.store_kvcache give the same bytes. Triton's CPU interpreter casts
float32 to fp8 wrongly (a carry out of the mantissa is dropped, ties round up), so under it the
value is first snapped to the e4m3 grid by hand and the cast is then exact.
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
