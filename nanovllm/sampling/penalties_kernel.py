"""Triton penalties: sampling/penalties.py's rules on the penalized rows of float32 logits, in one read
of each row and its token counts (the PyTorch path takes about ten passes).

Grid (P, C): program (p, c) takes columns [c * BLOCK, (c + 1) * BLOCK) of row rows[p] of the source
(the float32 rows themselves, or the model's logits in any float dtype: the copy and the penalties in
one pass) and of counts row slots[p], and writes that row of the float32 output:

    x = where(count > 0, where(x > 0, x / rep, x * rep), x) - freq * (count >> 1) - pres * (count >= 2)

Measured end to end (H200, 2026-12-03, BENCHMARKS.md "twelfth"): `bench.py` on Qwen3-0.6B with
`--repetition-penalty 1.1` / `--frequency-penalty 0.5` / `--presence-penalty 0.5` runs at 0.989 / 0.974 /
0.978 of the plain run's tok/s in the same call (0.955-0.959 when the float32 copy was a separate pass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.checks import MAX_GRID_YZ
from nanovllm.utils.validation import check_pow2

# Columns per program: 38 programs per row at a 151,936-token vocabulary, 16 values a thread.
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _penalties_kernel(src_ptr, stride_src, x_ptr, stride_x, counts_ptr, stride_counts, rows_ptr, slots_ptr, rep_ptr,
                      freq_ptr, pres_ptr, vocab, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    row = tl.load(rows_ptr + p).to(tl.int64)
    x_row = x_ptr + row * stride_x
    count_row = counts_ptr + tl.load(slots_ptr + p).to(tl.int64) * stride_counts
    rep = tl.load(rep_ptr + p)
    x = tl.load(src_ptr + row * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
    count = tl.load(count_row + cols, mask=mask, other=0)
    x = tl.where(count > 0, tl.where(x > 0, x / rep, x * rep), x)
    generated = (count >> 1).to(tl.float32)
    x = x - tl.load(freq_ptr + p) * generated - tl.load(pres_ptr + p) * (generated > 0).to(tl.float32)
    tl.store(x_row + cols, x, mask=mask)


def penalize_rows(x: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor,
                  repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                  source: torch.Tensor | None = None, block: int = BLOCK) -> None:
    """Penalize rows `rows` [P] int64 of `x` [B, V] float32 (contiguous last dim), each by its counts
    row `counts[slots[p]]` ([S, V] int32) and its `repetition` / `frequency` / `presence` [P]
    float32: in place, or from the same rows of `source` [B, V] (any float dtype, contiguous last
    dim) when given. `block`: columns per program (a power of two; tests shrink it)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be a 2-D float32 tensor with a contiguous last dim, got {x.dtype} {tuple(x.shape)}")
    if source is None:
        source = x
    elif not source.is_floating_point() or source.shape != x.shape or source.stride(-1) != 1:
        raise ValueError(f"source must be a float tensor of x's shape {tuple(x.shape)} with a contiguous last dim, "
                         f"got {source.dtype} {tuple(source.shape)}")
    if counts.dtype != torch.int32 or counts.dim() != 2 or counts.shape[1] != x.shape[1] or counts.stride(-1) != 1:
        raise ValueError(f"counts must be [slots, {x.shape[1]}] int32 with a contiguous last dim, got "
                         f"{counts.dtype} {tuple(counts.shape)}")
    check_pow2("block", block)
    num_chunks = triton.cdiv(x.shape[1], block)
    if num_chunks > MAX_GRID_YZ:
        raise ValueError(f"vocab {x.shape[1]} needs {num_chunks} chunks, more than the grid allows ({MAX_GRID_YZ})")
    if rows.shape[0] == 0:
        return
    _penalties_kernel[(rows.shape[0], num_chunks)](
        source, source.stride(0), x, x.stride(0), counts, counts.stride(0), rows, slots, repetition, frequency,
        presence, x.shape[1], BLOCK=block, num_warps=NUM_WARPS)
