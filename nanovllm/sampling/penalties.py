"""Repetition, frequency and presence penalties (vLLM's rules), from token counts kept on the device.

Each sequence that uses a penalty holds a row ("slot") of one int32 slab, `TokenCounts`:

    counts[slot, t] = PROMPT_MARK * (t in the prompt) + OUTPUT_STEP * (times t was generated)

set from the host's tokens once, when the sequence is first sampled, and then advanced on the device
by each step's sampled tokens (`record`, queued right after the sampler). So the counts of step N+1
include the token of step N even while that token is still on its way to the host (overlap
scheduling), and a penalty row costs no per-step host work beyond its slot number.

On the logits of penalized rows (float32, vLLM V1's order, after logit_bias):

    seen = counts > 0                                   (prompt or output)
    x = where(seen, where(x > 0, x / repetition, x * repetition), x)
    x -= frequency * output_count + presence * (output_count > 0)
"""

from __future__ import annotations

import torch
from torch import Tensor

# counts[slot, t]: bit 0 marks a prompt token, the rest counts generated tokens.
PROMPT_MARK = 1
OUTPUT_STEP = 2
# Slots the slab starts with; it doubles when more sequences hold one at once.
INITIAL_SLOTS = 8


class TokenCounts:
    """The [capacity, vocab] int32 count rows of the sequences that use penalties, on one device.
    Allocated at first use and grown by doubling (outside the KV cache's budget: about
    4 * vocab bytes a sequence, 0.6 MB at a 151,936-token vocabulary)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.slab: Tensor | None = None  # [capacity, vocab] int32

    @property
    def capacity(self) -> int:
        return 0 if self.slab is None else self.slab.shape[0]

    def ensure(self, num_slots: int) -> None:
        """Room for slots [0, num_slots); existing rows keep their counts."""
        if num_slots <= self.capacity:
            return
        capacity = max(INITIAL_SLOTS, self.capacity)
        while capacity < num_slots:
            capacity *= 2
        slab = torch.zeros(capacity, self.vocab_size, dtype=torch.int32, device=self.device)
        if self.slab is not None:
            slab[: self.slab.shape[0]] = self.slab
        self.slab = slab

    def reset(self, slots: Tensor, prompt_slots: Tensor, prompt_tokens: Tensor, output_slots: Tensor,
              output_tokens: Tensor) -> None:
        """Rows `slots` [I] set from their tokens: (prompt_slots [Ep], prompt_tokens [Ep]) mark prompt
        tokens, (output_slots [Eo], output_tokens [Eo]) count generated ones (int64, on the device)."""
        self.slab.index_fill_(0, slots, 0)
        if prompt_tokens.numel():
            self.slab[prompt_slots, prompt_tokens] = PROMPT_MARK
        if output_tokens.numel():
            self.slab.index_put_((output_slots, output_tokens), self._step(output_tokens), accumulate=True)

    def record(self, slots: Tensor, tokens: Tensor) -> None:
        """Count one more generation of `tokens` [P] in rows `slots` [P] (int64, on the device)."""
        # one atomic add per pair (an accumulating index_put_ sorts its indices first: several launches)
        self.slab.view(-1).index_add_(0, slots * self.vocab_size + tokens, self._step(tokens))

    def _step(self, like: Tensor) -> Tensor:
        return torch.full(like.shape, OUTPUT_STEP, dtype=torch.int32, device=like.device)


def penalize_rows(x: Tensor, rows: Tensor, counts: Tensor, slots: Tensor, repetition: Tensor, frequency: Tensor,
                  presence: Tensor, source: Tensor | None = None) -> None:
    """Penalize rows `rows` [P] of `x` [B, V] float32, each by its counts row `counts[slots[p]]`
    ([S, V] int32) and its penalties [P]: in place, or from the same rows of `source` [B, V] (any
    float dtype) when given (the PyTorch path; on CUDA the Triton kernel of
    sampling/penalties_kernel.py keeps this contract)."""
    rows_in = (x if source is None else source)[rows].to(torch.float32)
    x[rows] = apply_penalties(rows_in, counts.index_select(0, slots), repetition, frequency, presence)


def apply_penalties(logits: Tensor, counts: Tensor, repetition: Tensor, frequency: Tensor,
                    presence: Tensor) -> Tensor:
    """`logits` [P, V] float32 penalized by `counts` [P, V] int32 (TokenCounts' encoding) and each
    row's `repetition`, `frequency`, `presence` [P] float32; returns a new tensor."""
    rep = repetition.unsqueeze(1)  # [P, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(counts > 0, penalized, logits)
    generated = counts >> 1  # [P, V] output counts
    return logits - frequency.unsqueeze(1) * generated - presence.unsqueeze(1) * (generated > 0)
