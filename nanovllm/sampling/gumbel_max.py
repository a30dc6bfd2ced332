"""Triton Gumbel-max sampling: one token per row, noise from a counter-based RNG (Philox).

    score[v] = x[v] + g[v],   g[v] = -log(-log(u(key, v)))      token = argmax_v score[v]

  x = logit / T   (logits input; a row with T = 0 is greedy: no noise, plain argmax)
  x = log(p)      (probabilities input, e.g. after top-k/top-p filtering; p = 0 is never picked)

argmax(x + Gumbel noise) is distributed as softmax(x), so no normalisation is needed.
u depends only on the row's 64-bit key and the column, so a row's token never depends
on the other rows of the batch, and a key replays exactly.

Noise layout (defined in gumbel_torch.py, whose PyTorch twin draws the same uniforms bit for
bit): columns come in tiles of 4 * SUB; Philox4x32-10 (Triton's randint4x) with counter c
gives four 32-bit words, used for the four sub-blocks of a tile:

    tile at column t:  | sub 0: t + j | sub 1: t + SUB + j | sub 2 ... | sub 3 ... |
    word k of Philox(key, counter = t / 4 + j), j in [0, SUB)  ->  column t + k * SUB + j
    u = ((word >> 9) + 0.5) / 2**23, strictly inside (0, 1)

Grid (rows, chunks): each program reduces TILES_PER_CHUNK tiles of one row to its best
(score, column); `gumbel_sample` then picks each row's best chunk (first on ties, so the
lowest column wins, as in torch.argmax). `tile_uniforms` is the one definition of a tile's
uniforms: this kernel and sampling/candidate_walk.py's draw them through it.

Measured end to end (H200): with overlap scheduling, the decode step 5.97 -> 4.93 ms and the default
workload 20,773 -> 24,824 tok/s (69aec77, "Throughput and latency history"); alone 0.703 -> 0.144 ms
for plain temperature sampling at 256 rows ("Sampler").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.checks import MAX_GRID_YZ
from nanovllm.utils.validation import check_int

from .gumbel_torch import SUB, TILE, UNIFORM_BITS, check_gumbel_args

# Tiles per program: 4096 columns, ~37 programs per row at Qwen3's 151,936-token vocabulary.
TILES_PER_CHUNK = 4
NUM_WARPS = 4
# A uniform keeps a Philox word's top UNIFORM_BITS bits (a float32 mantissa: exact).
_WORD_SHIFT = tl.constexpr(32 - UNIFORM_BITS)
_UNIFORM_SCALE = tl.constexpr(1.0 / 2**UNIFORM_BITS)


@triton.jit
def tile_uniforms(key, t0, j):
    """The uniforms of sub-blocks 0..3 of the tile at column t0, lanes j ([SUB] each)."""
    w0, w1, w2, w3 = tl.randint4x(key, t0 // 4 + j)
    u0 = ((w0.to(tl.uint32, bitcast=True) >> _WORD_SHIFT).to(tl.float32) + 0.5) * _UNIFORM_SCALE
    u1 = ((w1.to(tl.uint32, bitcast=True) >> _WORD_SHIFT).to(tl.float32) + 0.5) * _UNIFORM_SCALE
    u2 = ((w2.to(tl.uint32, bitcast=True) >> _WORD_SHIFT).to(tl.float32) + 0.5) * _UNIFORM_SCALE
    u3 = ((w3.to(tl.uint32, bitcast=True) >> _WORD_SHIFT).to(tl.float32) + 0.5) * _UNIFORM_SCALE
    return u0, u1, u2, u3


@triton.jit
def _scores(x_ptr, cols, vocab, scale, noise_scale, u, IS_PROBS: tl.constexpr):
    mask = cols < vocab
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_PROBS:
        x = tl.log(x)  # log(0) = -inf: filtered tokens never win
    else:
        x = x * scale
    score = x + gumbel_noise(u, noise_scale)
    return tl.where(mask, score, float("-inf"))


@triton.jit
def gumbel_noise(u, scale):
    """Gumbel noise -log(-log u) of uniforms u in (0, 1), times scale (0 for greedy rows). Negated
    after the product, so `x + gumbel_noise` compiles to the sampling kernel's x - log(-log u) * scale
    (the same sm_90 PTX as before it was shared); (-a) * s and -(a * s) are the same float."""
    return -(tl.log(-tl.log(u)) * scale)


@triton.jit
def keep_best(best, best_col, score, cols):
    """Per lane, the better of (best, best_col) and (score, cols)."""
    better = score > best  # strict: the earlier column keeps a tie
    return tl.where(better, score, best), tl.where(better, cols, best_col)


@triton.jit
def _gumbel_sample_kernel(
    x_ptr, temperature_ptr, key_ptr, best_ptr, best_col_ptr,
    vocab, stride_x, num_chunks,
    IS_PROBS: tl.constexpr, SUB: tl.constexpr, TILES_PER_CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    key = tl.load(key_ptr + row)
    if IS_PROBS:
        scale = 1.0
        noise_scale = 1.0
    else:
        t = tl.load(temperature_ptr + row)
        greedy = t == 0.0  # plain argmax of the logits
        # correctly rounded (plain `/` on CUDA is div.full, up to 2 ulp off): the same scale as torch's 1 / t
        scale = tl.math.div_rn(1.0, tl.where(greedy, 1.0, t))
        noise_scale = tl.where(greedy, 0.0, 1.0)
    j = tl.arange(0, SUB)
    best = tl.full([SUB], float("-inf"), tl.float32)
    best_col = tl.zeros([SUB], tl.int32)
    for i in range(TILES_PER_CHUNK):
        t0 = (chunk * TILES_PER_CHUNK + i) * (4 * SUB)
        u0, u1, u2, u3 = tile_uniforms(key, t0, j)
        c = t0 + j
        best, best_col = keep_best(best, best_col, _scores(x_row, c, vocab, scale, noise_scale, u0, IS_PROBS), c)
        c = c + SUB
        best, best_col = keep_best(best, best_col, _scores(x_row, c, vocab, scale, noise_scale, u1, IS_PROBS), c)
        c = c + SUB
        best, best_col = keep_best(best, best_col, _scores(x_row, c, vocab, scale, noise_scale, u2, IS_PROBS), c)
        c = c + SUB
        best, best_col = keep_best(best, best_col, _scores(x_row, c, vocab, scale, noise_scale, u3, IS_PROBS), c)
    top = tl.max(best, axis=0)
    # lowest column among the lanes holding the maximum (an all -inf chunk reports column 0, its lanes
    # never having taken a score: such a chunk wins only when the whole row is -inf)
    col = tl.min(tl.where(best == top, best_col, vocab), axis=0)
    out = row.to(tl.int64) * num_chunks + chunk
    tl.store(best_ptr + out, top)
    tl.store(best_col_ptr + out, col)


def gumbel_sample(x: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor | None = None,
                  is_probs: bool = False, *, tiles_per_chunk: int = TILES_PER_CHUNK) -> torch.Tensor:
    """One token per row of `x` [B, V]: argmax(x / T + Gumbel(key)) for logits
    (`temperatures` [B] float32, 0 = greedy), or argmax(log x + Gumbel(key)) for
    probabilities (`is_probs`). `keys` [B] int64. Returns [B] int64, the same whatever
    `tiles_per_chunk` (tiles a program reduces; fewer: more programs a row)."""
    check_gumbel_args(x, keys, temperatures, is_probs)
    check_int("tiles_per_chunk", tiles_per_chunk, 1)
    rows, vocab = x.shape
    if is_probs:
        temperatures = keys  # unused by the kernel (IS_PROBS), any pointer will do
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    num_chunks = triton.cdiv(vocab, TILE * tiles_per_chunk)
    if num_chunks > MAX_GRID_YZ:
        raise ValueError(f"vocab {vocab} needs {num_chunks} chunks, more than the grid allows ({MAX_GRID_YZ})")
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    best_col = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    _gumbel_sample_kernel[(rows, num_chunks)](
        x, temperatures, keys, best, best_col, vocab, x.stride(0), num_chunks,
        IS_PROBS=is_probs, SUB=SUB, TILES_PER_CHUNK=tiles_per_chunk, num_warps=NUM_WARPS,
    )
    chunk = best.argmax(dim=1, keepdim=True)  # first best chunk: lowest column on ties
    return best_col.gather(1, chunk).squeeze(1).long()
