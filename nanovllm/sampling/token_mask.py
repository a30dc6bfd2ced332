"""Token masks of structured outputs: the tokens each constrained row of a batch may take, applied
to its logits before any sampling (disallowed tokens -> -inf).

A mask row is a bitmask over the vocabulary, xgrammar's layout: int32 word w holds tokens
[32 w, 32 w + 32), bit j (least significant first) allowing token 32 w + j.

    rows    = [2, 5]              the constrained rows of a batch of B rows (others untouched)
    bitmask = [[w0 w1 ... ],      row 2's allowed tokens
               [w0 w1 ... ]]      row 5's
              [R, ceil(V / 32)] int32

`apply_token_mask` is the PyTorch path (CPU); sampling/token_mask_kernel.py the Triton one (CUDA).
Both change the masked rows of the logits in place and touch nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nanovllm.utils.ints import cdiv

# Tokens per bitmask word (int32).
TOKENS_PER_WORD = 32


def mask_words(vocab_size: int) -> int:
    """Words of one bitmask row over a vocabulary of `vocab_size` tokens."""
    return cdiv(vocab_size, TOKENS_PER_WORD)


@dataclass(frozen=True)
class TokenMask:
    """The allowed tokens of R constrained rows of a batch, on the logits' device."""

    rows: Tensor  # [R] int64: batch rows, distinct
    bitmask: Tensor  # [R, mask_words(V)] int32


def allowed_tokens(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[R, vocab_size] bool: token t of row i is allowed when bit t % 32 of word t // 32 is set."""
    bits = torch.arange(TOKENS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def apply_token_mask(logits: Tensor, mask: TokenMask) -> None:
    """In place: -inf at every token of each masked row of `logits` [B, V] that its bitmask does
    not allow; the other rows are left as they are."""
    sub = logits.index_select(0, mask.rows)  # [R, V]
    sub.masked_fill_(~allowed_tokens(mask.bitmask, logits.shape[1]), float("-inf"))
    logits.index_copy_(0, mask.rows, sub)
