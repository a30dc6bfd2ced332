"""Vocab-parallel token embedding and LM head.

Each rank holds rows [rank * V/tp, (rank + 1) * V/tp) of the vocabulary. The embedding
zeroes ids outside its slice and all-reduces; the LM head computes its slice of the
logits and gathers them on rank 0 (the only rank that samples).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.distributed import tp_rank, tp_size
from nanovllm.utils.ints import cdiv


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.shard_size = cdiv(vocab_size, self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        # Padding rows (ids >= vocab_size, on the last shard when tp does not divide the vocabulary):
        # zeros, as vLLM's, never loaded; uninitialized memory (NaN at times) reached apply_model's functions.
        self.weight.data[max(0, vocab_size - self.vocab_start):].zero_()
        self.weight.weight_slice = self.weight_slice

    def weight_slice(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the full [vocab, hidden] table; padding rows of the last shard
        (ids >= vocab_size, zeros) are never read (masked in the embedding, sliced off the logits)."""
        if loaded.dim() != 2 or loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"embedding weight: expected shape ({self.vocab_size}, {param.shape[1]}), "
                f"checkpoint has {tuple(loaded.shape)}"
            )
        shard = loaded[self.vocab_start : self.vocab_start + self.shard_size]
        return param.data[: shard.shape[0]], shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        mask = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mask.unsqueeze(-1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_seqs, hidden] -> logits [num_seqs, vocab] on rank 0, None on other ranks."""
        logits = F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits[:, : self.vocab_size]
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, dst=0)
        if self.tp_rank != 0:
            return None
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]
