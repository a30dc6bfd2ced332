"""What one scheduled step computes, without Sequence objects: small and picklable, so that
tensor-parallel workers receive it (engine/tp_workers.py) and every rank runs the same forward.

For each sequence a plan holds the tokens to compute this step and the position of the first
one. Decode rows come first (one token each), then prefill chunks; every row attends over its
cached context plus its own tokens:

    seq A (decode):  cached |##########|  new |.|       q: 1 token,  k: 11 tokens
    seq B (chunk):   cached |#######|     new |....|    q: 4 tokens, k: 11 tokens
    seq C (prompt):                       new |......|  q: 6 tokens, k: 6 tokens
      input_ids = [A1 | B4 | C6], cu_seqlens_q = [0, 1, 5, 11], cu_seqlens_k = [0, 11, 22, 28]

A carried row's input is a token still on the device (the previous step's sample at
row carried_rows[i]); carried rows lead the step, and the model runner gathers their
ids on the device before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nanovllm.engine.scheduled_batch import ScheduledBatch, StepKind
from nanovllm.engine.sequence import Sequence


@dataclass(frozen=True)
class StepPlan:
    kind: StepKind
    starts: list[int]  # per sequence: position of its first new token
    num_new_tokens: list[int]  # per sequence: tokens computed this step
    token_ids: list[int]  # the step's input ids, flat in row order (0 for carried rows)
    block_tables: list[list[int]]  # per sequence: covers at least start + num_new tokens
    sampled: list[bool]  # per sequence: a token is sampled after this step
    num_decode: int = 0  # sequences [0, num_decode) are decode rows
    # Rows [0, len(carried_rows)) take their input from the previous step's sample at these rows.
    carried_rows: list[int] = field(default_factory=list)
    # Prompt logprobs: the step's token indices whose hidden states score the next prompt
    # token, that token's id at each, and the most alternatives any of them asks for.
    prompt_logprob_rows: list[int] = field(default_factory=list)
    prompt_logprob_targets: list[int] = field(default_factory=list)
    prompt_logprobs_k: int = 0
    # Forked samples (scheduler.Fork): each samples from the logits of this sampled row (an
    # index among the step's sampled rows), after the cache blocks (source, destination) are
    # copied once the forward has written them.
    fork_rows: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # No KV a later step may read was held when the step was scheduled (ScheduledBatch.fresh_cache):
    # FP8 KV scales set in this step leave no entry written under other ones (model_runner.prepare).
    fresh_cache: bool = False

    @classmethod
    def from_batch(cls, batch: ScheduledBatch, previous_sampled: list[Sequence] | None = None) -> "StepPlan":
        """`previous_sampled`: the sequences sampled by the step launched just before, in
        row order (needed when `batch` has rows whose input is still in flight)."""
        seqs, starts, d = batch.seqs, batch.starts, batch.num_decode
        in_flight = [start == len(seq) for seq, start in zip(seqs, starts)]  # only decode rows can be
        num_carried = in_flight.index(False) if False in in_flight else len(seqs)
        if any(in_flight[num_carried:]):
            raise RuntimeError("rows whose input is in flight must lead the step")
        previous = previous_sampled or []
        if len(previous) >= num_carried and all(a is b for a, b in zip(previous, seqs[:num_carried])):
            carried = list(range(num_carried))  # steady decode: the same rows, in the same order
        else:
            row = {s.seq_id: i for i, s in enumerate(previous)}
            missing = [s.seq_id for s in seqs[:num_carried] if s.seq_id not in row]
            if missing:
                raise ValueError(f"sequence {missing[0]}'s input token is not among the previous step's samples")
            carried = [row[s.seq_id] for s in seqs[:num_carried]]
        token_ids = [0] * num_carried
        for seq, start, n in zip(seqs[num_carried:], starts[num_carried:], batch.num_new_tokens[num_carried:]):
            token_ids.extend(seq.token_ids[start : start + n])
        sampled = [True] * d + [a + n == len(s) for s, a, n in zip(seqs[d:], starts[d:], batch.num_new_tokens[d:])]
        lp_rows, lp_targets, lp_k = _prompt_logprob_rows(batch)
        return cls(
            kind=batch.kind,
            starts=list(batch.starts),
            num_new_tokens=list(batch.num_new_tokens),
            token_ids=token_ids,
            block_tables=[s.block_table for s in batch.seqs],
            sampled=sampled,
            num_decode=batch.num_decode,
            carried_rows=carried,
            prompt_logprob_rows=lp_rows,
            prompt_logprob_targets=lp_targets,
            prompt_logprobs_k=lp_k,
            fork_rows=_fork_rows(batch, sampled),
            block_copies=[f.block_copy for f in batch.forks if f.block_copy is not None],
            fresh_cache=batch.fresh_cache,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _prompt_logprob_rows(batch: ScheduledBatch) -> tuple[list[int], list[int], int]:
    """(the step's token indices that score a prompt token, those tokens, the largest k asked);
    empty for a step without prompt-logprob spans (no per-step work then)."""
    if not batch.prompt_logprob_spans:
        return [], [], 0
    offsets = np.concatenate([[0], np.cumsum(batch.num_new_tokens)]).tolist()  # first token index of each row
    rows: list[int] = []
    targets: list[int] = []
    for i, span in batch.prompt_logprob_spans.items():
        seq, start = batch.seqs[i], batch.starts[i]
        first = offsets[i] - start  # token index of position p: first + p
        rows.extend(range(first + span.start, first + span.stop))
        targets.extend(seq.token_ids[span.start + 1 : span.stop + 1])
    k = max(batch.seqs[i].params.prompt_logprobs for i in batch.prompt_logprob_spans)
    return rows, targets, k


def _fork_rows(batch: ScheduledBatch, sampled: list[bool]) -> list[int]:
    """For each fork of `batch`, its parent's index among the step's sampled rows."""
    if not batch.forks:
        return []
    sampled_ids = [seq.seq_id for seq, on in zip(batch.seqs, sampled) if on]
    sample_row = {seq_id: r for r, seq_id in enumerate(sampled_ids)}
    return [sample_row[f.parent.seq_id] for f in batch.forks]


def sampled_positions(plan: StepPlan) -> list[int]:
    """Position of the token each sampled row of `plan` samples: the sampled sequences in row
    order, then the forked samples (at their parent's position)."""
    rows = [a + n for a, n, s in zip(plan.starts, plan.num_new_tokens, plan.sampled) if s]
    return rows + [rows[r] for r in plan.fork_rows]
