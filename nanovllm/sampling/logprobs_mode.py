"""What a request's sample logprobs report (vLLM's `LLM(logprobs_mode=...)`), and the processed
logits the "processed" modes read:

    raw_logprobs        log_softmax of the model's logits (the default)
    raw_logits          the model's logits
    processed_logprobs  log_softmax of the logits the sampler draws from (RL frameworks' importance
                        weights: TRL, prime-rl): after the logits rules (allowed ids, bad words,
                        min_tokens, logit_bias, the penalties), divided by the temperature (greedy
                        rows: 1), and -inf where min-p, top-k or top-p filter a token
    processed_logits    those logits

Ranks and the top-k lists are taken over the same values. Prompt logprobs are always raw (vLLM's).
Rows made greedy by top_k=1 are greedy rows here (vLLM samples them at their temperature among the
top token's ties: the same token, and a processed logprob of 0 where ours is the unfiltered one).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch
from torch import Tensor

from nanovllm.sampling.batch import SamplingBatch


class LogprobsMode(Enum):
    RAW_LOGPROBS = "raw_logprobs"
    RAW_LOGITS = "raw_logits"
    PROCESSED_LOGPROBS = "processed_logprobs"
    PROCESSED_LOGITS = "processed_logits"

    @classmethod
    def parse(cls, value: object) -> LogprobsMode:
        """A mode or its vLLM name; ValueError naming anything else."""
        if isinstance(value, cls):
            return value
        names = [mode.value for mode in cls]
        if value not in names:
            raise ValueError(f"logprobs_mode must be one of {names}, got {value!r}")
        return cls(value)

    @property
    def processed(self) -> bool:
        return self in (LogprobsMode.PROCESSED_LOGPROBS, LogprobsMode.PROCESSED_LOGITS)

    @property
    def logits(self) -> bool:
        """The values reported are logits, not logprobs."""
        return self in (LogprobsMode.RAW_LOGITS, LogprobsMode.PROCESSED_LOGITS)


def processed_logits(ruled: Tensor, batch: SamplingBatch, tokens: Tensor,
                     threshold: Callable[[Tensor, SamplingBatch], Tensor]) -> Tensor:
    """The logits the sampler drew `tokens` [B] from: `ruled` [B, V] (after the token mask and
    the logits rules; not modified) / T, -inf where min-p or top-k / top-p (`threshold`: the
    sampler's) drop a token -> [B, V] float32. Each row's sampled token is kept whatever the
    rounding of the sampler's own filter (a kernel may decide a tie at the threshold otherwise)."""
    is_greedy = batch.temperatures == 0.0
    scaled = ruled.to(torch.float32) / torch.where(is_greedy, 1.0, batch.temperatures).unsqueeze(-1)
    if batch.min_ps is None and batch.top_ks is None and batch.top_ps is None:
        return scaled
    probs = torch.softmax(scaled, dim=-1)
    drop = torch.zeros_like(probs, dtype=torch.bool)
    if batch.min_ps is not None:  # min-p first, then top-k / top-p over its survivors (the sampler's order)
        drop |= probs < batch.min_ps.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(drop, 0.0)
    if batch.top_ks is not None or batch.top_ps is not None:
        drop |= probs < threshold(probs, batch)
    drop.scatter_(1, tokens.unsqueeze(1), False)
    return scaled.masked_fill_(drop, float("-inf"))
