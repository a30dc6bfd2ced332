"""Continuous batching: picks which sequences run in the next step.

Prefill first: while waiting sequences fit (blocks, `max_num_seqs`, token budget)
the step is a prefill; a prompt longer than the remaining budget is prefilled in
chunks over several steps (it stays at the head of `waiting` holding its blocks).
Otherwise the step decodes every running sequence, preempting the newest ones
(recompute: their blocks are freed and they return to the head of `waiting`) when
blocks run out.

Overlap: while a decode step runs on the device, `schedule_next_decode` plans the
step after it without knowing its tokens. Each sequence then has one token in
flight, which the next step takes as input straight from the device:

    step N   : input token L-1 -> samples token L (not yet on the host)
    step N+1 : input token L (carried)  -> samples token L+1
    host     : postprocess(N) appends token L while N+1 runs

Sequences that N surely ends (max_tokens, max_model_len) are left out of N+1; one
that N ends by a stop token is computed once more in N+1 and its result dropped.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import FinishReason, Sequence, SequenceStatus


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: `num_new_tokens[i]` tokens of `seqs[i]`, from its num_computed_tokens."""

    kind: StepKind
    seqs: list[Sequence]
    num_new_tokens: list[int]
    # Decode only: the input tokens are the previous step's samples, still on the device.
    carried: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0  # running total, for tests and stats

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule_prefill() or self._schedule_decode()
        if batch is None:
            raise RuntimeError(
                f"scheduler could not schedule any of {len(self.waiting)} waiting and "
                f"{len(self.running)} running sequences (free blocks: {self.block_manager.num_free_blocks})"
            )
        return batch

    def _schedule_prefill(self) -> ScheduledBatch | None:
        seqs: list[Sequence] = []
        num_new: list[int] = []
        budget = self.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) + len(seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
            n = min(len(seq) - seq.num_computed_tokens, budget)
            self.block_manager.publish_full_blocks(seq, seq.num_computed_tokens + n)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
            if seq.num_computed_tokens + n < len(seq):
                break  # a partial chunk ends the batch; the sequence stays at the head
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return ScheduledBatch(StepKind.PREFILL, seqs, num_new) if seqs else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        seqs: list[Sequence] = []
        while self.running and len(seqs) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq, len(seq))
                self.block_manager.publish_full_blocks(seq, len(seq))
                seqs.append(seq)
        self.running.extendleft(reversed(seqs))
        # Longest first: the decode attention kernel starts its programs in batch order, so the
        # short sequences fill the tail of the launch (a carried step keeps this order).
        seqs.sort(key=len, reverse=True)
        return ScheduledBatch(StepKind.DECODE, seqs, [1] * len(seqs)) if seqs else None

    def schedule_next_decode(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after `batch`, planned while `batch` runs (its tokens unknown).

        None when the next step needs `batch`'s results first: `batch` is not a decode,
        requests are waiting for admission, every sequence ends with `batch`, or blocks
        run short (preemption decisions are left to `schedule`)."""
        if batch.kind is not StepKind.DECODE or self.waiting:
            return None
        # After `batch`, each of its live sequences holds len(seq) + 1 tokens.
        seqs = [s for s in batch.seqs if not s.is_finished and not self._ends_by_length(s, len(s) + 1)]
        bm = self.block_manager
        # The next step computes position len(seq): room for len(seq) + 1 tokens.
        new_blocks = sum(1 for s in seqs if bm.blocks_needed(len(s) + 1) > len(s.block_table))
        if not seqs or new_blocks > bm.num_free_blocks:
            return None
        for seq in seqs:
            bm.may_append(seq, len(seq) + 1)
            bm.publish_full_blocks(seq, len(seq))  # only tokens known on the host
        return ScheduledBatch(StepKind.DECODE, seqs, [1] * len(seqs), carried=True)

    def _ends_by_length(self, seq: Sequence, num_tokens: int) -> bool:
        """True if `seq` is done once it holds `num_tokens` tokens (max_tokens / max_model_len)."""
        return num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= self.max_model_len

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.free(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, int]) -> list[Sequence]:
        """Record a step's results; `sampled` maps seq_id to its new token. Returns finished seqs."""
        finished: list[Sequence] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.is_finished:
                continue  # a carried step's sequence that its previous step ended: result dropped
            seq.num_computed_tokens += n
            token = sampled.get(seq.seq_id)
            if token is None:
                continue
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            return FinishReason.STOP
        if self._ends_by_length(seq, len(seq)):
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End `seq` now (also used for stop strings found by the engine)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
