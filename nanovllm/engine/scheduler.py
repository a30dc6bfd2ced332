"""Continuous batching with one token budget per step (mixed steps).

Each step gives every running sequence its next token first (a decode row), then
spends what is left of `max_num_batched_tokens` on prefill chunks of waiting
sequences, in arrival order. A prompt longer than the rest of the budget is
chunked across steps (it stays at the head of `waiting`, holding its blocks) while
the running sequences keep decoding:

    budget 8, running A, B; waiting C (10 prompt tokens)
    step 1:  [A | B | C0 C1 C2 C3 C4 C5]          decode rows, then C's first chunk
    step 2:  [A | B | C6 C7 C8 C9]                C completes its prompt and samples
    step 3:  [A | B | C]                          C decodes with the others

Where a step's size is paid in padded graph buckets (`fill_sizes`), a mixed step whose tokens
end just above a bucket may be trimmed down to it (engine/step_trim.py has the rule).

With `mixed_steps=False` a step that can admit waiting sequences prefills only
(nano-vllm's policy). When blocks run short the newest running sequences are preempted
(recompute: their blocks are freed and they return to `waiting`) and nobody new is admitted.

Work is booked when it is scheduled: `num_computed_tokens` advances by the step's
tokens at once, so a step can be planned while the one before it runs (overlap).
A sequence whose num_computed_tokens equals len(token_ids) has a sampled token in
flight; its next input is that token, which the step takes from the device:

    step N   : computes token L-1 -> samples token L (not yet on the host)
    step N+1 : input token L (carried) -> samples token L+1
    host     : postprocess(N) appends token L while N+1 runs

A step planned ahead (`schedule(ahead=True)`) leaves out sequences that step N surely
ends (max_tokens, max_model_len) and never preempts (it returns None instead); a
sequence that N ends by a stop token is computed once more and its result dropped.

The scheduler owns the requests' lifecycle: it queues a request's sample 0, forks the
other samples from it when its prompt completes (engine/request.py), records each step's
tokens (and logprobs), advances constrained samples' grammars on them, ends samples by the
rules of engine/finish_rules.py (EOS, stop token ids, stop strings, lengths), frees a finished
sample's blocks, reports a request once all its samples are done, and aborts requests (one, some
or all). An aborted request is dropped, never reported.
"""

from __future__ import annotations

import logging
from collections import deque

from tokenizers import Tokenizer

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.finish_rules import ends_by_length, finish_reason, watch_stop_strings
from nanovllm.engine.logprobs import SampledRow
from nanovllm.engine.request import Request
from nanovllm.engine.scheduled_batch import Fork, ScheduledBatch
from nanovllm.engine.sequence import FinishReason, Sequence, SequenceStatus
from nanovllm.engine.structured_outputs import SampleGrammar, accept_tokens
from nanovllm.engine.step_trim import trimmed_prefill_budget

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        mixed_steps: bool = True,
        decoder: Tokenizer | None = None,
        fill_sizes: tuple[int, ...] = (),
    ):
        if list(fill_sizes) != sorted(set(fill_sizes)) or any(n < 1 for n in fill_sizes):
            raise ValueError(f"fill_sizes must be increasing positive token counts, got {fill_sizes!r}")
        self.block_manager = block_manager
        self.mixed_steps = mixed_steps
        # Token counts a step is padded up to (the runner's compute-bound graph buckets); () on
        # paths that run a step at its own size: nothing is trimmed there.
        self.fill_sizes = tuple(fill_sizes)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # EOS ids that end a request with stop_reason None (the tokenizer's; a checkpoint's other EOS
        # ids reach the scheduler inside each request's stop_token_ids: utils/tokenizer.EosTokens)
        self.eos_token_ids = eos_token_ids
        # tokenizers.Tokenizer that decodes completions for stop strings (text_stream.stream_decoder;
        # None: no tokenizers backend, where LLMEngine refuses stop strings)
        self.decoder = decoder
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.requests: dict[int, Request] = {}  # unfinished requests by id
        # samples 1..n-1 of requests whose sample 0 has not completed its prompt yet, by request id
        self._unstarted: dict[int, list[Sequence]] = {}
        self.num_preemptions = 0  # running total, for tests and stats
        # Unfinished samples with a grammar (structured outputs): while 0, steps look for none.
        self.num_constrained = 0

    def add(self, request: Request) -> None:
        """Queue a request: its sample 0 computes the prompt; the other samples start from it
        when it completes the prompt (forked, see _start_samples)."""
        watch_stop_strings(request.samples, self.decoder)
        if request.samples[0].grammar is not None:
            self.num_constrained += len(request.samples)
        self.waiting.append(request.samples[0])
        self.requests[request.request_id] = request
        self._unstarted[request.request_id] = request.samples[1:]

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self, ahead: bool = False) -> ScheduledBatch | None:
        """The next step. `ahead`: planned while the previous step runs (see the module
        docstring); None when nothing can be planned that way. Without `ahead` the
        previous step's results are all on the host and a step is always found."""
        budget = self.max_num_batched_tokens
        fresh = not self.block_manager.holds_kv  # before this step's blocks are taken
        if not self.mixed_steps:
            prefill, forks = self._schedule_waiting(budget)
            if prefill:
                return ScheduledBatch.book([], prefill, forks, fresh)
        decode = self._schedule_running(budget, ahead)
        if decode is None:
            return None
        rows, preempted = decode
        prefill: list[tuple[Sequence, int]] = []
        forks: list[Fork] = []
        if not preempted or not rows:  # after preempting, admit only into an idle step
            prefill, forks = self._schedule_waiting(self._prefill_budget(len(rows), budget - len(rows)))
        if not rows and not prefill:
            if ahead:
                return None
            raise RuntimeError(
                f"scheduler could not schedule any of {len(self.waiting)} waiting and "
                f"{len(self.running)} running sequences (free blocks: {self.block_manager.num_free_blocks})"
            )
        return ScheduledBatch.book(rows, prefill, forks, fresh)

    def _schedule_running(self, budget: int, ahead: bool) -> tuple[list[Sequence], bool] | None:
        """Decode rows for the running sequences (and whether any were preempted), or None
        when an ahead plan would need a preemption."""
        bm = self.block_manager
        rows: list[Sequence] = []
        preempted = False
        candidates = list(self.running)
        if ahead:
            # A sequence whose in-flight token ends it by length gets no further step.
            max_len = self.max_model_len
            candidates = [s for s in candidates if not ends_by_length(s, s.num_computed_tokens + 1, max_len)]
            needed = sum(bm.needs_new_block(s, s.num_computed_tokens + 1) for s in candidates[:budget])
            if needed > bm.num_free_blocks:
                return None
        for seq in candidates:
            if len(rows) == budget:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below while making room for an earlier row
            num_tokens = seq.num_computed_tokens + 1
            if bm.needs_new_block(seq, num_tokens):  # most rows fit their blocks: nothing to grow
                # make room by preempting the newest running sequences, seq itself last
                while not bm.can_append(seq, num_tokens) and seq.status is SequenceStatus.RUNNING:
                    self._preempt(self.running[-1])
                    preempted = True
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                bm.may_append(seq, num_tokens)
            bm.publish_full_blocks(seq, min(len(seq), num_tokens))
            rows.append(seq)
        return rows, preempted

    def _prefill_budget(self, num_rows: int, budget: int) -> int:
        """Prompt tokens a step with `num_rows` decode rows may take: `budget`, or fewer to land
        the step on a fill size (engine/step_trim.py)."""
        if not num_rows or not self.fill_sizes:
            return budget
        reached = self._waiting_reached(budget)
        waiting_tokens = sum(len(s) - s.num_computed_tokens for s in reached)
        return trimmed_prefill_budget(num_rows, budget, self.fill_sizes, waiting_tokens)

    def _waiting_reached(self, budget: int) -> list[Sequence]:
        """The waiting sequences `_schedule_waiting(budget)` reaches as far as the budget and
        the free seats tell; blocks, prefix-cache hits and forks re-queued at the head can make
        the step take other tokens (a trim then lands off its size, or is missed: never wrong)."""
        reached, tokens, seats = [], 0, self.max_num_seqs - len(self.running)
        for seq in self.waiting:
            if tokens >= budget or seats <= 0:
                break
            reached.append(seq)
            tokens += len(seq) - seq.num_computed_tokens
            seats -= 1
        return reached

    def _schedule_waiting(self, budget: int) -> tuple[list[tuple[Sequence, int]], list[Fork]]:
        """Prefill chunks (sequence, tokens) of waiting sequences within `budget` tokens, and
        the samples forked from the prompts they complete."""
        chunks: list[tuple[Sequence, int]] = []
        forks: list[Fork] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                # Cached blocks have no logits: a prompt whose logprobs are asked is computed whole.
                use_cache = not seq.needs_prompt_logprobs
                if not self.block_manager.can_allocate(seq, use_cache):
                    break
                self.block_manager.allocate(seq, use_cache)
            n = min(len(seq) - seq.num_computed_tokens, budget)
            self.block_manager.publish_full_blocks(seq, seq.num_computed_tokens + n)
            chunks.append((seq, n))
            budget -= n
            if seq.num_computed_tokens + n < len(seq):
                break  # a partial chunk ends the batch; the sequence stays at the head
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            forks += self._start_samples(seq)
        return chunks, forks

    def _start_samples(self, parent: Sequence) -> list[Fork]:
        """Start the other samples of `parent`'s request as its prompt completes: forked from it
        (sharing its blocks) when running slots and blocks allow; otherwise queued right behind,
        to find its prompt blocks in the prefix cache."""
        samples = self._unstarted.pop(parent.request_id, [])
        if not samples:
            return []
        partial = len(parent) % self.block_manager.block_size != 0  # each fork then copies one block
        if (len(self.running) + len(samples) > self.max_num_seqs
                or partial and self.block_manager.num_free_blocks < len(samples)):
            self.waiting.extendleft(reversed(samples))
            return []
        forks = []
        for child in samples:
            copy = self.block_manager.fork(parent, child)
            child.num_computed_tokens = len(child)  # computed by parent's step; its first token in flight
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
            forks.append(Fork(parent, child, copy))
        return forks

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it for recompute, behind a prompt whose prefill is under
        way (that one holds blocks for its whole prompt: ahead of it, seq could wait for them forever)."""
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.free(seq)
        self.running.remove(seq)
        self.waiting.insert(1 if self.waiting and self.waiting[0].block_table else 0, seq)

    def advance_grammars(self, batch: ScheduledBatch, sampled: dict[int, int]) -> None:
        """Advance the grammar of each constrained sample of `batch` past its new token (`sampled`:
        seq_id -> token, as postprocess takes), in one batch call; the engine calls this before
        `postprocess`, so that the next step's masks can be filled while postprocess runs."""
        if not self.num_constrained:
            return
        grammars: list[SampleGrammar] = []
        tokens: list[int] = []
        for seq in batch.seqs + [f.child for f in batch.forks]:
            token = sampled.get(seq.seq_id)
            if token is not None and seq.grammar is not None and not seq.is_finished:
                grammars.append(seq.grammar)
                tokens.append(token)
        if grammars:
            accept_tokens(grammars, tokens)

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, int],
                    logprobs: dict[int, SampledRow] | None = None) -> list[Request]:
        """Record a step's results: `sampled` maps seq_id to its new token, `logprobs` seq_id
        to its row's logprobs (sequences that ask). Returns the requests that
        finished (all their samples done), no longer tracked here. Grammars are advanced apart
        (`advance_grammars`)."""
        done: list[Request] = []
        eos_token_ids, max_model_len = self.eos_token_ids, self.max_model_len
        for seq in batch.seqs + [f.child for f in batch.forks]:
            token = sampled.get(seq.seq_id)
            if token is None or seq.is_finished:
                continue  # a chunk that samples nothing, or a sequence an earlier step ended
            rejected = seq.grammar is not None and seq.grammar.rejected
            rules = seq.rules  # asked once a step a row only where they can ban (not penalties / biases alone)
            if rejected or (rules is not None and rules.can_ban and rules.bans(token, seq.token_ids,
                                                                               seq.num_completion_tokens)):
                # its rules (with its grammar, if any: SampleGrammar) left no token allowed, so the row's
                # logits were all -inf and the sampler's fallback came out: it ends here, alone, whether
                # a grammar refused that pick or took it (an EOS the rules ban)
                logger.warning("request %d: its rules (allowed_token_ids, bad_words, min_tokens%s) leave no "
                               "token allowed; its sample ends here", seq.request_id,
                               ", its grammar" if seq.grammar is not None else "")
                self._finish_and_collect(seq, FinishReason.STOP, done)
                continue
            seq.token_ids.append(token)
            if seq.logprobs is not None and logprobs is not None:
                row = logprobs[seq.seq_id]
                seq.logprobs.add_row(token, row.logprob, row.rank, row.top_ids, row.top_logprobs)
                seq.cumulative_logprob += row.logprob
            reason = finish_reason(seq, token, eos_token_ids, max_model_len)
            if reason is not None:
                self._finish_and_collect(seq, reason, done)
        return done

    def _finish_and_collect(self, seq: Sequence, reason: FinishReason, done: list[Request]) -> None:
        """End `seq`; its request joins `done` (and leaves this scheduler) once all its samples have ended."""
        self._end(seq, reason)
        if seq in self.running:
            self.running.remove(seq)
        request = self.requests[seq.request_id]
        request.num_finished += 1
        if request.is_finished:
            del self.requests[seq.request_id]
            done.append(request)

    def abort(self, request_ids: set[int]) -> None:
        """Drop the requests with these ids (ids of no pending request are ignored): every sample
        ends now, its blocks are freed, and the request is never reported. A step already queued
        on the device that computes one of them still writes its KV into the freed blocks, before
        any later step can reuse them (one stream); postprocess then drops its tokens."""
        dropped = [self.requests.pop(i) for i in request_ids if i in self.requests]
        if not dropped:
            return
        gone = {request.request_id for request in dropped}
        for queue in (self.waiting, self.running):  # one pass each, however many samples go
            kept = [s for s in queue if s.request_id not in gone]
            queue.clear()
            queue.extend(kept)
        for request in dropped:
            self._unstarted.pop(request.request_id, None)
            for seq in request.samples:
                if not seq.is_finished:
                    self._end(seq, FinishReason.ABORT)

    def abort_all(self) -> None:
        """Drop every request (after an error or interrupt) and reset the KV bookkeeping.

        An interrupt can land anywhere, even inside an allocation, so rather than trusting
        per-sequence block tables the block manager starts over: nothing is running."""
        for request in self.requests.values():
            for seq in request.samples:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = FinishReason.ABORT
                seq.block_table = []
        self.requests.clear()
        self._unstarted.clear()
        self.waiting.clear()
        self.running.clear()
        self.num_constrained = 0
        self.block_manager.reset()

    def _end(self, seq: Sequence, reason: FinishReason) -> None:
        """`seq` finished for `reason`, its blocks freed (the queues are the caller's)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        self.num_constrained -= seq.grammar is not None
