"""The online-softmax step the attention kernels share: fold one tile of scores into the running
row max m, the running sum l and (by the caller, with alpha) the accumulator.

    m' = max(m, c max_j s_j)      alpha = 2^(m - m')      p_j = 2^(c s_j - m')      l' = l * alpha + sum_j p_j

s are the raw q.k products and c > 0 the softmax scale in log2 units (it carries LOG2E), so m, alpha
and p are in log2 units. c multiplies inside the exponent (one fused multiply-add a score, not a
multiply and a subtract) and once a row for the max: c > 0 keeps the max where it was, and rounding
is monotonic, so m is the max of the rounded products c s_j. Masked scores are -inf; m starts at a
finite M_START, so a row with every score masked gets p = 0 and alpha = 1, never NaN.
sm_90 loop bodies (Triton 3.6, scripts/sass_loops.py), instructions a thread, scaled first -> inside
the exponent: decode over an FP8 cache 759 -> 745 a 128-key tile, over a 16-bit one 367 -> 363 a
64-key tile; the paged prefill kernel's key loops 665 -> 635 and 412 -> 382 (over an FP8 cache 674 -> 644
and 473 -> 443). Measured with paging.tile_rows's change (H100, BENCHMARKS.md, sixty-sixth session):
the paged prefill kernel 1.03-1.09x faster, decode as before; end to end (bench.py, Qwen3-0.6B), steps
with prefill 353,492 -> 365,159 tok/s (+3.3%, FP8 cache) and scoring +0.5%.
"""

import triton
import triton.language as tl

# The running max's start: finite, below any score, so an all-masked tile never gives -inf - -inf.
M_START = tl.constexpr(-1.0e30)


@triton.jit
def online_softmax(qk, scale, m_i, l_i):
    """qk [rows, keys] (float32, unscaled), scale (> 0, log2 units), m_i / l_i [rows]
    -> (p [rows, keys], alpha [rows], m_new, l_new)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * scale - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
