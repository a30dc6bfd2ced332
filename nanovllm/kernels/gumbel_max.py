"""Triton Gumbel-max sampling: one token per row, noise from a counter-based RNG (Philox).

    score[v] = x[v] + g[v],   g[v] = -log(-log(u(key, v)))      token = argmax_v score[v]

  x = logit / T   (logits input; a row with T = 0 is greedy: no noise, plain argmax)
  x = log(p)      (probabilities input, e.g. after top-k/top-p filtering; p = 0 is never picked)

argmax(x + Gumbel noise) is distributed as softmax(x), so no normalisation is needed.
u depends only on the row's 64-bit key and the column, so a row's token never depends
on the other rows of the batch, and a key replays exactly.

Noise layout: columns come in tiles of 4 * SUB; Philox4x32-10 (Triton's randint4x)
with counter c gives four 32-bit words, used for the four sub-blocks of a tile:

    tile at column t:  | sub 0: t + j | sub 1: t + SUB + j | sub 2 ... | sub 3 ... |
    word k of Philox(key, counter = t / 4 + j), j in [0, SUB)  ->  column t + k * SUB + j
    u = (word >> 9 + 0.5) / 2**23, strictly inside (0, 1)

Grid (rows, chunks): each program reduces TILES_PER_CHUNK tiles of one row to its best
(score, column); `gumbel_sample` then picks each row's best chunk (first on ties, so the
lowest column wins, as in torch.argmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_float_dtype

# Columns per Philox word stream: 4 * SUB = 1024 columns share 256 Philox calls (one per column quadruple).
SUB = 256
TILE = 4 * SUB
# Tiles per program: 4096 columns, ~37 programs per row at Qwen3's 151,936-token vocabulary.
TILES_PER_CHUNK = 4
NUM_WARPS = 4
# Chunks ride grid axis 1, which CUDA caps at 65535.
MAX_CHUNKS = 65535


@triton.jit
def _scores(x_ptr, cols, vocab, scale, noise_scale, word, IS_PROBS: tl.constexpr):
    mask = cols < vocab
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_PROBS:
        x = tl.log(x)  # log(0) = -inf: filtered tokens never win
    else:
        x = x * scale
    u = ((word >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 2**23
    score = x - tl.log(-tl.log(u)) * noise_scale
    return tl.where(mask, score, float("-inf"))


@triton.jit
def _keep_best(best, best_col, score, cols):
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
        scale = 1.0 / tl.where(greedy, 1.0, t)
        noise_scale = tl.where(greedy, 0.0, 1.0)
    j = tl.arange(0, SUB)
    best = tl.full([SUB], float("-inf"), tl.float32)
    best_col = tl.zeros([SUB], tl.int32)
    for i in range(TILES_PER_CHUNK):
        t0 = (chunk * TILES_PER_CHUNK + i) * (4 * SUB)
        w0, w1, w2, w3 = tl.randint4x(key, t0 // 4 + j)
        w0 = w0.to(tl.uint32, bitcast=True)
        w1 = w1.to(tl.uint32, bitcast=True)
        w2 = w2.to(tl.uint32, bitcast=True)
        w3 = w3.to(tl.uint32, bitcast=True)
        c = t0 + j
        best, best_col = _keep_best(best, best_col, _scores(x_row, c, vocab, scale, noise_scale, w0, IS_PROBS), c)
        c = c + SUB
        best, best_col = _keep_best(best, best_col, _scores(x_row, c, vocab, scale, noise_scale, w1, IS_PROBS), c)
        c = c + SUB
        best, best_col = _keep_best(best, best_col, _scores(x_row, c, vocab, scale, noise_scale, w2, IS_PROBS), c)
        c = c + SUB
        best, best_col = _keep_best(best, best_col, _scores(x_row, c, vocab, scale, noise_scale, w3, IS_PROBS), c)
    top = tl.max(best, axis=0)
    # lowest column among the lanes holding the maximum (an all -inf chunk reports column vocab)
    col = tl.min(tl.where(best == top, best_col, vocab), axis=0)
    out = row.to(tl.int64) * num_chunks + chunk
    tl.store(best_ptr + out, top)
    tl.store(best_col_ptr + out, col)


def gumbel_sample(x: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor | None = None,
                  is_probs: bool = False) -> torch.Tensor:
    """One token per row of `x` [B, V]: argmax(x / T + Gumbel(key)) for logits
    (`temperatures` [B] float32, 0 = greedy), or argmax(log x + Gumbel(key)) for
    probabilities (`is_probs`). `keys` [B] int64. Returns [B] int64."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D [rows, vocab] with a contiguous last dim, got {tuple(x.shape)} / {x.stride()}")
    check_float_dtype("x", x)
    rows, vocab = x.shape
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or tuple(keys.shape) != (rows,):
        raise TypeError(f"keys must be an int64 tensor of shape ({rows},), got "
                        f"{getattr(keys, 'dtype', type(keys))} {tuple(getattr(keys, 'shape', ()))}")
    if is_probs:
        if temperatures is not None:
            raise ValueError("temperatures apply to logits, not to probabilities")
        temperatures = keys  # unused by the kernel (IS_PROBS), any pointer will do
    elif (not isinstance(temperatures, torch.Tensor) or temperatures.dtype != torch.float32
          or tuple(temperatures.shape) != (rows,)):
        raise TypeError(f"temperatures must be a float32 tensor of shape ({rows},), got "
                        f"{getattr(temperatures, 'dtype', type(temperatures))}")
    for name, t in (("keys", keys), ("temperatures", temperatures)):
        if t.device != x.device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous and on {x.device}")
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    num_chunks = triton.cdiv(vocab, TILE * TILES_PER_CHUNK)
    if num_chunks > MAX_CHUNKS:
        raise ValueError(f"vocab {vocab} needs {num_chunks} chunks, more than the grid allows ({MAX_CHUNKS})")
    best = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    best_col = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    _gumbel_sample_kernel[(rows, num_chunks)](
        x, temperatures, keys, best, best_col, vocab, x.stride(0), num_chunks,
        IS_PROBS=is_probs, SUB=SUB, TILES_PER_CHUNK=TILES_PER_CHUNK, num_warps=NUM_WARPS,
    )
    chunk = best.argmax(dim=1, keepdim=True)  # first best chunk: lowest column on ties
    return best_col.gather(1, chunk).squeeze(1).long()
