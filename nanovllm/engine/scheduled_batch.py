"""What the scheduler hands the engine for one step: the batch (decode rows, then prefill chunks),
its kind, and the samples forked from prompts it completes.

    ScheduledBatch.seqs:  | decode rows (1 token each) | prefill chunks (num_new_tokens[i] each) |
                          0                       num_decode                              len(seqs)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from nanovllm.engine.sequence import Sequence


class StepKind(enum.Enum):
    PREFILL = "prefill"  # prefill chunks only
    DECODE = "decode"  # one token for each running sequence only
    MIXED = "mixed"  # decode rows and prefill chunks


@dataclass(frozen=True)
class Fork:
    """A sample started from its request's sample 0 (`parent`) at the end of its prompt: it holds
    parent's full prompt blocks (shared) and a copy of the partial last one (`block_copy`:
    (source, destination) block ids, copied on the device after the step's forward; None when
    the prompt fills its blocks)."""

    parent: Sequence
    child: Sequence
    block_copy: tuple[int, int] | None


@dataclass(frozen=True)
class ScheduledBatch:
    """One step: `num_new_tokens[i]` tokens of `seqs[i]` from position `starts[i]`.

    seqs[:num_decode] are decode rows (one token each), the rest prefill chunks.
    forks: samples 1..n-1 of requests whose prompt this step completes; each samples its first
    token from its parent's logits and computes nothing in this step.
    prompt_logprob_spans: row index -> prompt positions [a, b) whose next-token logprobs
    this step computes (rows of sequences that ask for prompt logprobs)."""

    seqs: list[Sequence]
    starts: list[int]
    num_new_tokens: list[int]
    num_decode: int
    prompt_logprob_spans: dict[int, range] = field(default_factory=dict)
    forks: list[Fork] = field(default_factory=list)

    @property
    def kind(self) -> StepKind:
        if self.num_decode == len(self.seqs):
            return StepKind.DECODE
        return StepKind.MIXED if self.num_decode else StepKind.PREFILL

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)
