"""Triton logprobs: log_softmax of a few tokens per row and each row's k most likely tokens, in
one pass over the logits (no [rows, vocab] float32 log_softmax written, no full-row top-k).

    grid (rows, chunks): program (r, c) reads columns [c * BLOCK, (c + 1) * BLOCK) of row r once
      -> chunk max m[r, c], sum of exp(x - m[r, c]) s[r, c], and the chunk's K largest (value, column)
    host (small tensors): lse[r] = M + log(sum_c s[r, c] * exp(m[r, c] - M)),  M = max_c m[r, c]
      chosen[r] = x[r, token[r]] - lse[r];  top k = the k largest of the rows' chunk candidates - lse[r]

The chunk's K largest come from K rounds of (max, lowest column holding it, mask it out), so
among equal logits the lower token id ranks first. Logits are read in their dtype and
computed on in float32; offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import LOG2E as _LOG2E_VALUE, check_float_dtype

# Kernels read module globals only as constexprs (compiled Triton refuses plain floats).
LOG2E = tl.constexpr(_LOG2E_VALUE)

# Columns per program: 38 programs per row at a 151,936-token vocabulary, 32 values a thread at
# NUM_WARPS = 4 (one tile in registers while the K rounds of max run over it).
BLOCK = 4096
NUM_WARPS = 4
# Chunks ride grid axis 1, which CUDA caps at 65535.
MAX_CHUNKS = 65535


@triton.jit
def _chunk_stats_kernel(x_ptr, max_ptr, sum_ptr, top_val_ptr, top_col_ptr, vocab, stride_x, num_chunks,
                        K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)  # every chunk holds at least one column: finite for finite logits
    s = tl.sum(tl.exp2((x - m) * LOG2E), axis=0)  # masked columns: exp2(-inf) = 0
    out = row.to(tl.int64) * num_chunks + chunk
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, s)
    for i in tl.static_range(K):
        best = tl.max(x, axis=0)
        col = tl.min(tl.where(x == best, cols, vocab), axis=0)  # lowest column among ties
        tl.store(top_val_ptr + out * K + i, best)
        tl.store(top_col_ptr + out * K + i, col)
        x = tl.where(cols == col, float("-inf"), x)


def row_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int,
                 block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as layers/sampler.token_logprobs: `logits` [R, V] (float16/bfloat16/float32,
    contiguous last dim; not modified), `token_ids` [R] int64 -> (chosen [R] float32 logprob of
    each row's token, top_ids [R, k] int64 by descending logprob, top_logprobs [R, k] float32).
    `block`: columns per program (a power of two; tests shrink it)."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {k!r}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be 2-D [rows, vocab] with a contiguous last dim, got "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    check_float_dtype("logits", logits)
    rows, vocab = logits.shape
    if not 0 <= k <= min(vocab, block):
        raise ValueError(f"k must be in [0, {min(vocab, block)}], got {k}")
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype != torch.int64 or tuple(token_ids.shape) != (rows,):
        raise TypeError(f"token_ids must be an int64 tensor of shape ({rows},), got "
                        f"{getattr(token_ids, 'dtype', type(token_ids))} {tuple(getattr(token_ids, 'shape', ()))}")
    if token_ids.device != logits.device:
        raise ValueError(f"token_ids is on {token_ids.device}, logits on {logits.device}")
    num_chunks = triton.cdiv(vocab, block)
    if num_chunks > MAX_CHUNKS:
        raise ValueError(f"vocab {vocab} needs {num_chunks} chunks, more than the grid allows ({MAX_CHUNKS})")
    dev = logits.device
    if rows == 0:
        empty = torch.empty((0, k), device=dev)
        return torch.empty(0, device=dev), empty.long(), empty
    chunk_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)  # [R, C]
    chunk_sum = torch.empty_like(chunk_max)  # [R, C]
    top_val = torch.empty((rows, num_chunks * k), dtype=torch.float32, device=dev)  # [R, C * k]
    top_col = torch.empty((rows, num_chunks * k), dtype=torch.int32, device=dev)  # [R, C * k]
    _chunk_stats_kernel[(rows, num_chunks)](
        logits, chunk_max, chunk_sum, top_val, top_col, vocab, logits.stride(0), num_chunks,
        K=k, BLOCK=block, num_warps=NUM_WARPS,
    )
    row_max = chunk_max.amax(dim=1, keepdim=True)  # [R, 1]
    lse = row_max.squeeze(1) + (chunk_sum * torch.exp(chunk_max - row_max)).sum(dim=1).log()  # [R]
    chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1).float() - lse  # [R]
    best = top_val.topk(k, dim=1, sorted=True)  # [R, k] among the rows' chunk candidates
    top_ids = top_col.gather(1, best.indices).long()
    return chosen, top_ids, best.values - lse.unsqueeze(1)
