"""Top-p / min-p sampling without a threshold: Gumbel-max candidates checked one at a time.

The sampler's filtered path (sampling/sampler.py) keeps the tokens whose probability reaches a
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

    min-p:  e^(x[c] - m) >= min_p,  m = max_v x[v]
    top-p:  M(c) < top_p * Z,  M(c) = sum_{x[v] > x[c]} e^(x[v] - m),  Z = sum_{v kept by min-p} e^(x[v] - m)
            (or nothing lies above c); ties of c are kept with it, as the sorted prefix keeps them.
            Top-p weighs the min-p survivors only (vLLM's order: min-p first); a c that min-p
            keeps has only survivors above it, so M(c) needs no min-p test, while Z of a row
            with both filters is summed over the survivors in the first walk pass (the steps
            whose largest value passes min-p: few, on a peaked row).

One program per row: pass 1 finds m, Z and the first candidate (online softmax); each further
pass sums M of the current candidate and finds the next one (skipping what min-p already
removes; a tile wholly at or below the candidate is only read, its noise never drawn, so on
peaked rows these passes cost little more than the read). Rows whose first candidate is kept
take two passes; each rejection costs one more. The loop ends within V rounds, whatever the
logits: the next candidate is taken only among tokens with x > x[c], so x[c] strictly rises over
the row's values, and a candidate with nothing above it is kept (the row's maximum, a +inf, a
row of all -inf), even where NaN sums make the filters' tests false. A NaN never becomes a later
candidate: it compares false, so it is neither above c nor a better noisy score (the noise is
finite: the uniforms lie in (0, 1)). Rows of all -inf, with NaN and with +inf:
tests/test_walk_sample.py (each ends on a column of its row; a +inf row on its first +inf).

Top-k is left to the threshold path (sampling/sampler.py): top-p within top-k needs the k-th value, and on near-flat rows
(random-weight models) a small k takes ~log2(V / k) rounds, each drawing the noise of half the row.

Measured end to end (H200, bench.py --top-p 0.9): 24,397 tok/s (65.5% of the roofline) against
21,821 (58.5%) with the radix threshold path (7f7c44f; BENCHMARKS.md "Session of 2026-12-02 (fourth)").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gumbel_max import gumbel_noise, keep_best, tile_uniforms
from nanovllm.kernels.checks import check_row_vector
from .gumbel_torch import SUB, check_gumbel_args

# Noise tiles (4 x SUB columns each) a loop step covers: 8,192 columns, enough loads in flight for
# one program to stream its row. With one tile a step a pass was latency-bound (H200: a peaked
# top-p row took 0.41 ms for its two passes; 0.15 ms with 8 tiles and 8 warps).
STEP_TILES = 8
NUM_WARPS = 8


@triton.jit
def load_scaled(x_row, cols, vocab, t):
    """x = logit / t at `cols` (correctly rounded, as torch's division), -inf past the vocab."""
    mask = cols < vocab
    logit = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, tl.math.div_rn(logit, t + tl.zeros_like(logit)), float("-inf"))


@triton.jit
def _max2(x):
    return tl.max(tl.max(x, axis=1), axis=0)


@triton.jit
def _first_sub(x, cols, g, m_acc, z_acc, best, best_col):
    """Pass 1 over one sub-block: per-lane running max and sum of e^(x - max), best noisy score."""
    m_new = tl.maximum(m_acc, x)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing finite yet: no inf - inf
    z_acc = z_acc * tl.exp(m_acc - shift) + tl.exp(x - shift)
    best, best_col = keep_best(best, best_col, x + g, cols)
    return m_new, z_acc, best, best_col


@triton.jit
def _walk_sub(x, cols, g, xc, m, min_p, mass, best, best_col):
    """A later pass over one sub-block: mass above the candidate's xc, and the best noisy score
    among the tokens above it that min-p keeps (e^(x - m) >= min_p)."""
    rel = tl.exp(x - m)  # p * Z
    above = x > xc
    mass += tl.where(above, rel, 0.0)
    best, best_col = keep_best(best, best_col, tl.where(above & (rel >= min_p), x + g, float("-inf")), cols)
    return mass, best, best_col


@triton.jit
def _survivors_mass(x, m, min_p):
    """sum of e^(x - m) over the tokens min-p keeps (e^(x - m) >= min_p), per lane."""
    rel = tl.exp(x - m)
    return tl.where(rel >= min_p, rel, 0.0)


@triton.jit
def _lowest_best(best, best_col, vocab):
    """The lowest column among the lanes holding the best score."""
    top = _max2(best)
    return tl.min(tl.min(tl.where(best == top, best_col, vocab), axis=1), axis=0)


@triton.jit
def _walk_sample_kernel(x_ptr, temperature_ptr, key_ptr, top_p_ptr, min_p_ptr, out_ptr, vocab, stride_x,
                        HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, SUB: tl.constexpr,
                        STEP_TILES: tl.constexpr):
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
    min_p = 0.0
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row)
    j = tl.arange(0, SUB)[None, :]
    tiles = tl.arange(0, STEP_TILES)[:, None] * (4 * SUB)  # [STEP_TILES, 1] tile offsets in a step

    # pass 1: m, Z and the first candidate
    m_acc = tl.full([STEP_TILES, SUB], float("-inf"), tl.float32)
    z_acc = tl.zeros([STEP_TILES, SUB], tl.float32)
    best = tl.full([STEP_TILES, SUB], float("-inf"), tl.float32)
    best_col = tl.zeros([STEP_TILES, SUB], tl.int32)
    for s0 in range(0, vocab, STEP_TILES * 4 * SUB):
        t0 = s0 + tiles
        u0, u1, u2, u3 = tile_uniforms(key, t0, j)
        c = t0 + j  # [STEP_TILES, SUB] columns of sub-block 0
        m_acc, z_acc, best, best_col = _first_sub(load_scaled(x_row, c, vocab, t), c, gumbel_noise(u0, noise),
                                                  m_acc, z_acc, best, best_col)
        m_acc, z_acc, best, best_col = _first_sub(load_scaled(x_row, c + SUB, vocab, t), c + SUB,
                                                  gumbel_noise(u1, noise), m_acc, z_acc, best, best_col)
        m_acc, z_acc, best, best_col = _first_sub(load_scaled(x_row, c + 2 * SUB, vocab, t), c + 2 * SUB,
                                                  gumbel_noise(u2, noise), m_acc, z_acc, best, best_col)
        m_acc, z_acc, best, best_col = _first_sub(load_scaled(x_row, c + 3 * SUB, vocab, t), c + 3 * SUB,
                                                  gumbel_noise(u3, noise), m_acc, z_acc, best, best_col)
    m = _max2(m_acc)
    z = tl.sum(tl.sum(z_acc * tl.exp(m_acc - m), axis=1), axis=0)
    cand = _lowest_best(best, best_col, vocab)
    # greedy rows and rows without a filter keep their first candidate
    done = greedy | ((top_p >= 1.0) & (min_p <= 0.0))
    z_top = z  # top-p's total: the min-p survivors' mass where min-p is on (first walk pass)
    first_pass = tl.full([], 1, tl.int32)  # a tensor: the loop carries it
    while not done:
        xc = tl.math.div_rn(tl.load(x_row + cand).to(tl.float32), t)
        mass = tl.zeros([STEP_TILES, SUB], tl.float32)
        survivors = tl.zeros([STEP_TILES, SUB], tl.float32)
        best = tl.full([STEP_TILES, SUB], float("-inf"), tl.float32)
        best_col = tl.zeros([STEP_TILES, SUB], tl.int32)
        for s0 in range(0, vocab, STEP_TILES * 4 * SUB):
            t0 = s0 + tiles
            c = t0 + j
            x0 = load_scaled(x_row, c, vocab, t)
            x1 = load_scaled(x_row, c + SUB, vocab, t)
            x2 = load_scaled(x_row, c + 2 * SUB, vocab, t)
            x3 = load_scaled(x_row, c + 3 * SUB, vocab, t)
            step_max = tl.maximum(tl.maximum(_max2(x0), _max2(x1)), tl.maximum(_max2(x2), _max2(x3)))
            if HAS_TOP_P and HAS_MIN_P:  # (constexprs) the first pass sums min-p's survivors, in steps holding one
                if (first_pass == 1) & (min_p > 0.0) & (tl.exp(step_max - m) >= min_p):
                    survivors += (_survivors_mass(x0, m, min_p) + _survivors_mass(x1, m, min_p)
                                  + _survivors_mass(x2, m, min_p) + _survivors_mass(x3, m, min_p))
            if step_max > xc:
                # (a step wholly at or below the candidate adds nothing: its noise is never drawn)
                u0, u1, u2, u3 = tile_uniforms(key, t0, j)
                mass, best, best_col = _walk_sub(x0, c, gumbel_noise(u0, noise), xc, m, min_p, mass, best, best_col)
                mass, best, best_col = _walk_sub(x1, c + SUB, gumbel_noise(u1, noise), xc, m, min_p, mass, best,
                                                 best_col)
                mass, best, best_col = _walk_sub(x2, c + 2 * SUB, gumbel_noise(u2, noise), xc, m, min_p, mass, best,
                                                 best_col)
                mass, best, best_col = _walk_sub(x3, c + 3 * SUB, gumbel_noise(u3, noise), xc, m, min_p, mass, best,
                                                 best_col)
        if HAS_TOP_P and HAS_MIN_P:
            if first_pass == 1:
                z_top = tl.where(min_p > 0.0, tl.sum(tl.sum(survivors, axis=1), axis=0), z)
        first_pass = first_pass * 0
        above = tl.sum(tl.sum(mass, axis=1), axis=0)
        kept_p = (top_p >= 1.0) | (above == 0.0) | (above < top_p * z_top)
        kept_min_p = tl.exp(xc - m) >= min_p
        # nothing left above c (it is the row's max, or the row holds NaN): keep c, so the walk
        # always ends; otherwise x[c] strictly rises each round
        done = (kept_p & kept_min_p) | (_max2(best) == float("-inf"))
        if not done:
            cand = _lowest_best(best, best_col, vocab)
    tl.store(out_ptr + row, cand.to(tl.int64))


def walk_sample(logits: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor | None,
                min_ps: torch.Tensor | None) -> torch.Tensor:
    """One token per row of `logits` [B, V]: the Gumbel-max sample (noise of `keys` [B] int64, as
    gumbel_sample) of softmax(logits / T) restricted to the row's top-p set and min-p floor.
    `temperatures` [B] float32 (0: greedy argmax); `top_ps` [B] float32 (1.0: off) and `min_ps`
    [B] float32 (0.0: off), each None when no row uses it. Returns [B] int64."""
    check_gumbel_args(logits, keys, temperatures, is_probs=False)
    rows, vocab = logits.shape
    for name, values in (("top_ps", top_ps), ("min_ps", min_ps)):
        if values is not None:
            check_row_vector(name, values, rows, torch.float32, logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _walk_sample_kernel[(rows,)](
            logits, temperatures, keys, top_ps if top_ps is not None else temperatures,
            min_ps if min_ps is not None else temperatures, out, vocab, logits.stride(0),
            HAS_TOP_P=top_ps is not None, HAS_MIN_P=min_ps is not None, SUB=SUB, STEP_TILES=STEP_TILES,
            num_warps=NUM_WARPS)
    return out
