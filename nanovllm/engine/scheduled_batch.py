"""What the scheduler hands the engine for one step: the batch (decode rows, then prefill chunks),
its kind, and the samples forked from prompts it completes.

    ScheduledBatch.seqs:  | decode rows (1 token each) | prefill chunks (num_new_tokens[i] each) |
                          0                       num_decode                              len(seqs)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from operator import attrgetter

from nanovllm.engine.sequence import Sequence

_COMPUTED = attrgetter("num_computed_tokens")


def input_in_flight(seq: Sequence) -> bool:
    """True if seq's next input token was sampled by a step whose result is not on the host yet."""
    return seq.num_computed_tokens == len(seq)


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
    this step computes (rows of sequences that ask for prompt logprobs).
    fresh_cache: no block held KV a later step may read when this step was scheduled (no sequence
    held blocks, the prefix cache published none)."""

    seqs: list[Sequence]
    starts: list[int]
    num_new_tokens: list[int]
    num_decode: int
    prompt_logprob_spans: dict[int, range] = field(default_factory=dict)
    forks: list[Fork] = field(default_factory=list)
    fresh_cache: bool = False

    @property
    def kind(self) -> StepKind:
        if self.num_decode == len(self.seqs):
            return StepKind.DECODE
        return StepKind.MIXED if self.num_decode else StepKind.PREFILL

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @classmethod
    def book(cls, rows: list[Sequence], prefill: list[tuple[Sequence, int]], forks: list[Fork],
             fresh_cache: bool) -> ScheduledBatch:
        """The batch of decode rows and prefill chunks (sequence, tokens), its tokens (and the
        prompt logprobs they yield) booked as computed on the sequences."""
        # Longest first: the decode attention kernel starts its programs in batch order, so
        # short sequences fill the tail of the launch. Rows with an input in flight lead.
        # (Two stable descending sorts by a C key: the order of sorting by (not in flight, -computed).)
        in_flight = [s for s in rows if input_in_flight(s)]
        rest = [s for s in rows if not input_in_flight(s)] if len(in_flight) < len(rows) else []
        in_flight.sort(key=_COMPUTED, reverse=True)
        rest.sort(key=_COMPUTED, reverse=True)
        rows = in_flight + rest
        seqs = rows + [s for s, _ in prefill]
        starts = [s.num_computed_tokens for s in seqs]
        num_new = [1] * len(rows) + [n for _, n in prefill]
        spans: dict[int, range] = {}
        for i, (seq, n) in enumerate(zip(seqs, num_new)):
            if seq.needs_prompt_logprobs:
                # hidden state at position p gives the logprob of prompt token p + 1
                end = min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1)
                span = range(max(seq.num_computed_tokens, seq.num_prompt_logprobs_booked), end)
                if span:
                    spans[i] = span
                    seq.num_prompt_logprobs_booked = end
            seq.num_computed_tokens += n
        return cls(seqs, starts, num_new, len(rows), spans, forks, fresh_cache)
