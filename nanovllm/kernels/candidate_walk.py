"""Top-p / top-k / min-p sampling without a threshold: Gumbel-max candidates checked one at a time.

The sampler's filtered path (layers/sampler.py) keeps the tokens whose probability reaches a
per-row threshold and takes argmax(log p + g) over them, g the row's Gumbel noise
(gumbel_max.py's Philox layout). Each filter keeps an *upper set* of the probabilities, so
that argmax is also found by walking candidates down the noisy scores without ever computing
the threshold:

    c = argmax_v (x[v] + g[v])                  x = logit / T (log p up to a row constant)
    while c is filtered out:                    then so is every v with x[v] <= x[c]
        c = argmax_{v : x[v] > x[c]} (x[v] + g[v])

The first candidate kept is the filtered argmax, with the same noise: the token the threshold
path picks (up to float32 rounding of the two routes' sums). Whether c is kept needs only sums
over the row:

    top-p:  M(c) < top_p * Z,  M(c) = sum_{x[v] > x[c]} e^(x[v] - m),  Z = sum_v e^(x[v] - m)
            (or nothing lies above c); ties of c are kept with it, as the sorted prefix keeps them
    top-k:  N(c) < k,          N(c) = #{v : x[v] > x[c]}   (ties of the k-th value all kept)
    min-p:  e^(x[c] - m) >= min_p,  m = max_v x[v]

One program per row: pass 1 finds m, Z and the first candidate (online softmax); each further
pass sums M of the current candidate and finds the next one (skipping what min-p already
removes; a tile wholly at or below the candidate is only read, its noise never drawn, so on
peaked rows these passes cost little more than the read). Rows whose first candidate is kept
take two passes; each rejection costs one more, and x[c] strictly rises, so the loop ends (the
row's maximum is always kept; so is a candidate with nothing above it). A row with both
top-k and top-p sums top-p's mass over the top-k survivors only, which needs the k-th value the
walk does not find: a batch using both filters keeps the threshold path (layers/sampler.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gumbel_max import _tile_uniforms
from .gumbel_torch import SUB, check_gumbel_args

NUM_WARPS = 4


@triton.jit
def _load_x(x_row, cols, vocab, t):
    """x = logit / t at `cols` (correctly rounded, as torch's division), -inf past the vocab."""
    mask = cols < vocab
    logit = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, tl.math.div_rn(logit, t + tl.zeros_like(logit)), float("-inf"))


@triton.jit
def _gumbel(u, noise):
    return -tl.log(-tl.log(u)) * noise


@triton.jit
def _first_sub(x_row, cols, vocab, t, g, m_vec, z_vec, best, best_col):
    """Pass 1 over one sub-block: per-lane running max and sum of e^(x - max), best noisy score."""
    x = _load_x(x_row, cols, vocab, t)
    m_new = tl.maximum(m_vec, x)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing finite yet: no inf - inf
    z_vec = z_vec * tl.exp(m_vec - shift) + tl.exp(x - shift)
    score = x + g
    better = score > best  # strict: the earlier column keeps a tie
    return m_new, z_vec, tl.where(better, score, best), tl.where(better, cols, best_col)


@triton.jit
def _walk_sub(x, cols, g, xc, m, min_p, mass, count, best, best_col):
    """A later pass over one sub-block (x at `cols`): mass and count above the candidate's xc, and
    the best noisy score among the tokens above it that min-p keeps (e^(x - m) >= min_p)."""
    rel = tl.exp(x - m)  # [SUB] p * Z
    above = x > xc
    mass += tl.where(above, rel, 0.0)
    count += above.to(tl.int32)
    score = tl.where(above & (rel >= min_p), x + g, float("-inf"))
    better = score > best
    return mass, count, tl.where(better, score, best), tl.where(better, cols, best_col)


@triton.jit
def _lowest_best(best, best_col, vocab):
    """The lowest column among the lanes holding the best score."""
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, best_col, vocab), axis=0)


@triton.jit
def _walk_sample_kernel(x_ptr, temperature_ptr, key_ptr, top_p_ptr, top_k_ptr, min_p_ptr, out_ptr, vocab, stride_x,
                         HAS_TOP_P: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_MIN_P: tl.constexpr,
                         SUB: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    key = tl.load(key_ptr + row)
    temp = tl.load(temperature_ptr + row)
    greedy = temp == 0.0  # plain argmax: no noise, no filter
    t = tl.where(greedy, 1.0, temp)
    noise = tl.where(greedy, 0.0, 1.0)
    top_p = 1.0
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + row)
    top_k = vocab
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + row).to(tl.int32)
    min_p = 0.0
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row)
    j = tl.arange(0, SUB)

    # pass 1: m, Z and the first candidate
    m_vec = tl.full([SUB], float("-inf"), tl.float32)
    z_vec = tl.zeros([SUB], tl.float32)
    best = tl.full([SUB], float("-inf"), tl.float32)
    best_col = tl.zeros([SUB], tl.int32)
    for t0 in range(0, vocab, 4 * SUB):
        u0, u1, u2, u3 = _tile_uniforms(key, t0, j)
        c = t0 + j
        m_vec, z_vec, best, best_col = _first_sub(x_row, c, vocab, t, _gumbel(u0, noise), m_vec, z_vec, best, best_col)
        c += SUB
        m_vec, z_vec, best, best_col = _first_sub(x_row, c, vocab, t, _gumbel(u1, noise), m_vec, z_vec, best, best_col)
        c += SUB
        m_vec, z_vec, best, best_col = _first_sub(x_row, c, vocab, t, _gumbel(u2, noise), m_vec, z_vec, best, best_col)
        c += SUB
        m_vec, z_vec, best, best_col = _first_sub(x_row, c, vocab, t, _gumbel(u3, noise), m_vec, z_vec, best, best_col)
    m = tl.max(m_vec, axis=0)
    z = tl.sum(z_vec * tl.exp(m_vec - m), axis=0)
    cand = _lowest_best(best, best_col, vocab)
    # greedy rows and rows without a filter keep their first candidate
    done = greedy | ((top_p >= 1.0) & (top_k >= vocab) & (min_p <= 0.0))
    while not done:
        xc = tl.load(x_row + cand).to(tl.float32)
        xc = tl.math.div_rn(xc, t)
        mass = tl.zeros([SUB], tl.float32)
        count = tl.zeros([SUB], tl.int32)
        best = tl.full([SUB], float("-inf"), tl.float32)
        best_col = tl.zeros([SUB], tl.int32)
        for t0 in range(0, vocab, 4 * SUB):
            c = t0 + j
            x0 = _load_x(x_row, c, vocab, t)
            x1 = _load_x(x_row, c + SUB, vocab, t)
            x2 = _load_x(x_row, c + 2 * SUB, vocab, t)
            x3 = _load_x(x_row, c + 3 * SUB, vocab, t)
            top = tl.maximum(tl.maximum(tl.max(x0, axis=0), tl.max(x1, axis=0)),
                             tl.maximum(tl.max(x2, axis=0), tl.max(x3, axis=0)))
            if top > xc:  # a tile wholly at or below the candidate adds nothing: no noise drawn
                u0, u1, u2, u3 = _tile_uniforms(key, t0, j)
                mass, count, best, best_col = _walk_sub(x0, c, _gumbel(u0, noise), xc, m, min_p, mass, count,
                                                        best, best_col)
                mass, count, best, best_col = _walk_sub(x1, c + SUB, _gumbel(u1, noise), xc, m, min_p, mass, count,
                                                        best, best_col)
                mass, count, best, best_col = _walk_sub(x2, c + 2 * SUB, _gumbel(u2, noise), xc, m, min_p, mass,
                                                        count, best, best_col)
                mass, count, best, best_col = _walk_sub(x3, c + 3 * SUB, _gumbel(u3, noise), xc, m, min_p, mass,
                                                        count, best, best_col)
        above = tl.sum(mass, axis=0)
        kept_p = (top_p >= 1.0) | (above == 0.0) | (above < top_p * z)
        kept_k = tl.sum(count, axis=0) < top_k
        kept_min_p = tl.exp(xc - m) >= min_p
        # nothing left above c (it is the row's max, or the row holds NaN): keep c, so the walk
        # always ends; otherwise x[c] strictly rises each round
        done = (kept_p & kept_k & kept_min_p) | (tl.max(best, axis=0) == float("-inf"))
        if not done:
            cand = _lowest_best(best, best_col, vocab)
    tl.store(out_ptr + row, cand.to(tl.int64))


def check_filter(name: str, values: torch.Tensor | None, x: torch.Tensor, dtype: torch.dtype) -> None:
    """A per-row filter parameter: None, or `dtype` [rows] contiguous on x's device."""
    if values is None:
        return
    if (not isinstance(values, torch.Tensor) or values.dtype != dtype
            or tuple(values.shape) != (x.shape[0],) or not values.is_contiguous() or values.device != x.device):
        raise TypeError(f"{name} must be a contiguous {dtype} tensor of shape ({x.shape[0]},) on {x.device}, got "
                        f"{getattr(values, 'dtype', type(values))} {tuple(getattr(values, 'shape', ()))}")


def walk_sample(logits: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor | None,
                 top_ks: torch.Tensor | None, min_ps: torch.Tensor | None) -> torch.Tensor:
    """One token per row of `logits` [B, V]: the Gumbel-max sample (noise of `keys` [B] int64, as
    gumbel_sample) of softmax(logits / T) restricted to the row's top-p set, top-k set and min-p
    floor. `temperatures` [B] float32 (0: greedy argmax); `top_ps` [B] float32 (1.0: off),
    `top_ks` [B] int64 (>= V: off), `min_ps` [B] float32 (0.0: off), each None when no row uses
    it. top_ps and top_ks together are refused (ValueError): top-p within top-k needs the k-th
    value, which the walk does not find. Returns [B] int64."""
    check_gumbel_args(logits, keys, temperatures, is_probs=False)
    if top_ps is not None and top_ks is not None:
        raise ValueError("walk_sample takes top_ps or top_ks, not both (top-p within top-k needs the k-th value)")
    check_filter("top_ps", top_ps, logits, torch.float32)
    check_filter("top_ks", top_ks, logits, torch.int64)
    check_filter("min_ps", min_ps, logits, torch.float32)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _walk_sample_kernel[(rows,)](
            logits, temperatures, keys, top_ps if top_ps is not None else temperatures,
            top_ks if top_ks is not None else keys, min_ps if min_ps is not None else temperatures, out, vocab,
            logits.stride(0), HAS_TOP_P=top_ps is not None, HAS_TOP_K=top_ks is not None,
            HAS_MIN_P=min_ps is not None, SUB=SUB, num_warps=NUM_WARPS)
    return out
