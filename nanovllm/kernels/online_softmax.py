"""The online-softmax step the attention kernels share: fold one tile of scores into the running
row max m, the running sum l and (by the caller, with alpha) the accumulator.

    m' = max(m, max_j s_j)      alpha = 2^(m - m')      p_j = 2^(s_j - m')      l' = l * alpha + sum_j p_j

Scores are in log2 units (the softmax scale carries LOG2E). Masked scores are -inf; m starts at a
finite M_START, so a row with every score masked gets p = 0 and alpha = 1, never NaN.
"""

import triton
import triton.language as tl

# The running max's start: finite, below any score, so an all-masked tile never gives -inf - -inf.
M_START = tl.constexpr(-1.0e30)


@triton.jit
def online_softmax(qk, m_i, l_i):
    """qk [rows, keys] (float32), m_i / l_i [rows] -> (p [rows, keys], alpha [rows], m_new, l_new)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
