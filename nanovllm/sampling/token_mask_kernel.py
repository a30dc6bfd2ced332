"""Triton token masks (structured outputs): -inf at the tokens a constrained row may not take, in
place, as sampling/token_mask.apply_token_mask (its PyTorch twin, which defines the layout).

Grid (R, column blocks): program (i, b) reads the BLOCK // 32 bitmask words of row i that cover
columns [b * BLOCK, (b + 1) * BLOCK) and stores -inf over the disallowed ones of logits row
rows[i]. Only the R masked rows are touched: the rest of the batch costs nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .token_mask import TokenMask, mask_words

# Columns per program, whole bitmask words: 1,024 (32 words) -> 149 programs a row at Qwen3's 151,936-token vocabulary.
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _token_mask_kernel(logits_ptr, rows_ptr, bitmask_ptr, vocab, stride_logits, stride_mask,
                       BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    row = tl.load(rows_ptr + i)  # int64
    words = tl.load(bitmask_ptr + i.to(tl.int64) * stride_mask + cols // 32, mask=inside, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + cols, neg_inf, mask=inside & ~allowed)


def triton_apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """apply_token_mask on the GPU: `logits` [B, V] (rows contiguous), masked rows in place."""
    rows, vocab = mask.rows.shape[0], logits.shape[1]
    if mask.bitmask.shape != (rows, mask_words(vocab)) or mask.bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32 [{rows}, {mask_words(vocab)}], got "
                         f"{mask.bitmask.dtype} {tuple(mask.bitmask.shape)}")
    if logits.stride(1) != 1 or mask.bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    if rows == 0:
        return
    _token_mask_kernel[(rows, triton.cdiv(vocab, BLOCK))](
        logits, mask.rows, mask.bitmask, vocab, logits.stride(0), mask.bitmask.stride(0),
        BLOCK=BLOCK, num_warps=NUM_WARPS,
    )

