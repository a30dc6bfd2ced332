"""Sortable int64 keys of (float32 value, column) pairs: the top-k sampler (sampling/topk_sample.py)
and the logprobs pass (sampling/logprobs_kernel.py) rank a row's values with them, one reduction
(max or tl.topk) per round instead of a value and an index compared apart.

    bits 63..32: the value's float32 bits, negatives' magnitude bits flipped (signed order = float order)
    bits 31..0 : COL_LIMIT - column (of equal values the lower column ranks first)

Equal floats give equal high words only without -0.0 (it sorts just below +0.0). Columns stay below
2**31 (any vocabulary), so COL_LIMIT - column >= 0.
"""

import triton
import triton.language as tl

COL_LIMIT = tl.constexpr(2**31 - 1)
# A key below every key of a value (-inf's included): an empty slot or a masked-out candidate.
NO_KEY = tl.constexpr(-(2**63))
# Flips the magnitude bits of negative floats, so their bits order as int32 like the values.
MAGNITUDE = tl.constexpr(0x7FFFFFFF)


@triton.jit
def pack_key(x, cols):
    """Keys of float32 values x and int32 columns cols (same shape)."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ MAGNITUDE, bits)
    return (ordered.to(tl.int64) << 32) | (cols * -1 + COL_LIMIT).to(tl.int64)


@triton.jit
def key_value(key):
    """The float32 value of a key (NO_KEY decodes to garbage: callers mask it)."""
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered < 0, ordered ^ MAGNITUDE, ordered).to(tl.float32, bitcast=True)


@triton.jit
def key_column(key):
    """The int32 column of a key (NO_KEY decodes to garbage: callers mask it)."""
    return (key & 0xFFFFFFFF).to(tl.int32) * -1 + COL_LIMIT
