"""The step pipeline: schedules, queues and completes the engine's steps (LLMEngine.step).

It owns the steps queued on the device whose results the host has not read yet. With overlap
scheduling the next step is queued before this one's tokens are read. With constrained rows
(structured outputs, docs/structured_outputs.md) the next step's sampling waits for its token
masks, which need this step's tokens accepted by the grammars; their fill runs on the grammar
backend's thread while this thread records this step and prepares the step after the next on the
host, and the next step's sampling and the forward of the one after it are queued once the masks
are in:

    this thread:  read N | accept N | postprocess N, plan + prepare N+2 | sample N+1 | queue N+2
    fill thread:                    | masks of N+1 ..................... |
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.engine.launched_step import LaunchedStep, PreparedStep, StepLogits
from nanovllm.engine.logprobs import SampledRow, record_prompt_logprobs, sampled_rows
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduled_batch import ScheduledBatch, StepKind
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_plan import StepPlan
from nanovllm.engine.structured_outputs import GrammarBackend, SampleGrammar
from nanovllm.engine.tp_workers import WorkerGroup, worker_errors
from nanovllm.outputs import RequestOutput
from nanovllm.sampling.token_mask import TokenMask
from nanovllm.utils.deferred_signals import deferred_signals


@dataclass(frozen=True)
class StepResult:
    """One completed step. With overlap scheduling the call that returns it has already
    queued the next step, so `launch_s` may belong partly to that one. A step() with
    nothing to do returns an empty result (kind None)."""

    kind: StepKind | None  # None: nothing was pending, no step ran
    num_tokens: int  # tokens processed by the forward (prefill chunk tokens plus one per decode row)
    num_seqs: int
    finished: list[RequestOutput]
    # ids of the sequences (the requests, when n = 1) whose token of this step was kept: not one
    # that an earlier step ended (overlap scheduling computed it once more) or that was aborted
    sampled: list[int]
    launch_s: float = 0.0  # host: scheduling, input preparation, queuing work on the device
    prepare_s: float = 0.0  # the input-preparation part of launch_s
    wait_s: float = 0.0  # host blocked until the step's tokens arrived (device time not hidden)
    postprocess_s: float = 0.0  # host: appending tokens, finishing, stop strings; the next step's token masks
    num_prompt_tokens: int = 0  # of num_tokens, those of prefill chunks (prompts, or recomputed ones)
    # of postprocess_s, the host blocked until the next step's token masks were filled (overlap
    # scheduling fills them beside the host's other work: the part of the fill not hidden)
    mask_wait_s: float = 0.0


@dataclass(frozen=True)
class _Step:
    """A step queued on the device."""

    batch: ScheduledBatch
    plan: StepPlan
    sample_seqs: list[Sequence]  # the sequences it samples, in row order


@dataclass(frozen=True)
class _Prepared(_Step):
    """A step whose inputs are built on the host and which is not queued yet."""

    prepared: PreparedStep


@dataclass(frozen=True)
class _Forwarded(_Step):
    """A step whose forward is queued and whose sampling is not yet."""

    logits: StepLogits
    constrained_rows: list[int]  # rows of sample_seqs with a grammar (structured outputs)


@dataclass(frozen=True)
class _InFlight(_Step):
    """A step queued whole (forward and sampling) whose tokens the host has not read yet."""

    launched: LaunchedStep


class StepPipeline:
    """The engine's steps, from scheduling to finished outputs, and the steps queued between calls."""

    def __init__(self, scheduler: Scheduler, model_runner: ModelRunner, workers: WorkerGroup | None,
                 grammars: GrammarBackend, detokenizer: Detokenizer, overlap: bool):
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.workers = workers  # tensor-parallel ranks 1..N-1, or None
        self.grammars = grammars
        self.detokenizer = detokenizer
        self.overlap = overlap  # queue the next step before this one's tokens are read
        self._in_flight: _InFlight | None = None
        # Under overlap scheduling with constrained rows: the step after _in_flight, its forward
        # queued (while its masks were filled) and its sampling not yet (step()'s next call).
        self._forwarded: _Forwarded | None = None

    @property
    def idle(self) -> bool:
        """No step is queued on the device."""
        return self._in_flight is None and self._forwarded is None

    @property
    def in_flight_batch(self) -> ScheduledBatch | None:
        """The batch of the step queued whole whose tokens the host has not read yet, if any."""
        return self._in_flight.batch if self._in_flight is not None else None

    def drop(self) -> None:
        """Forget the queued steps: their results are never read."""
        self._in_flight = self._forwarded = None

    def step(self) -> StepResult:
        """Complete one step (something must be pending) and return what it finished. With
        overlap scheduling, the next step is queued on the device before this one's tokens are
        read; with constrained rows, the next step's masks are filled beside this step's
        recording (the step order: the module docstring)."""
        t0 = time.perf_counter()
        current, self._in_flight = self._in_flight, None
        prepare_s = 0.0  # preparation done inside this call's launch window only
        if current is None:  # (a step queued by the call before was prepared and counted there)
            current = self._sample_now(self._launch(self.scheduler.schedule(), previous=None))
            prepare_s = current.launched.prepare_s
        following, self._forwarded = self._forwarded, None  # queued by the previous call, if any
        if following is None and self.overlap:
            ahead = self.scheduler.schedule(ahead=True)
            if ahead is not None:
                following = self._launch(ahead, previous=current)
                prepare_s += following.logits.prepare_s
        if following is not None and not following.constrained_rows:  # sampled at once, as it needs no mask
            self._in_flight, following = self._sample(following, None), None
        t1 = time.perf_counter()
        with worker_errors(self.workers):
            tokens = current.launched.tokens()
        # A sequence ended since this step was queued (a stop in the step before it, under overlap
        # scheduling, or abort_request) gets nothing: its token is dropped.
        sampled = {s.seq_id: t for s, t in zip(current.sample_seqs, tokens) if not s.is_finished}
        t2 = time.perf_counter()
        batch = current.batch
        self.scheduler.advance_grammars(batch, sampled)
        mask_wait_s = 0.0
        if following is None:
            outputs = self._postprocess(current, sampled)
        else:  # its masks follow this step's tokens: filled while this thread does the rest
            rows, grammars = self._live_grammars(following)
            fill = self.grammars.filling(rows, grammars) if rows else contextlib.nullcontext()
            with fill as masks:
                outputs = self._postprocess(current, sampled)
                after = self._prepare_ahead(following)
                t3 = time.perf_counter()
                mask = masks.mask() if masks is not None else None
                mask_wait_s = time.perf_counter() - t3
            self._in_flight = self._sample(following, mask)
            if after is not None:
                self._forwarded = self._queue(after, previous=self._in_flight)
        return StepResult(batch.kind, batch.num_tokens, len(batch.seqs), outputs, list(sampled),
                          launch_s=t1 - t0, prepare_s=prepare_s, wait_s=t2 - t1,
                          postprocess_s=time.perf_counter() - t2,
                          num_prompt_tokens=batch.num_tokens - batch.num_decode, mask_wait_s=mask_wait_s)

    def _postprocess(self, step: _InFlight, sampled: dict[int, int]) -> list[RequestOutput]:
        """Record a step's results (its grammars advanced already) and return its finished requests' outputs."""
        self._record_prompt_logprobs(step)
        done = self.scheduler.postprocess(step.batch, sampled, self._sample_logprobs(step))
        outputs = [request.output(self.detokenizer) for request in done]
        self.model_runner.rules.release([s for request in done for s in request.samples])
        return outputs

    def _prepare_ahead(self, following: _Forwarded) -> _Prepared | None:
        """The step after `following` (whose sampling is not queued yet), planned ahead and built on
        the host, or None when none can be planned ahead."""
        ahead = self.scheduler.schedule(ahead=True)
        return self._prepare(ahead, previous=following) if ahead is not None else None

    def _launch(self, batch: ScheduledBatch, previous: _InFlight | None) -> _Forwarded:
        """Queue `batch`'s forward (its sampling: `_sample`)."""
        return self._queue(self._prepare(batch, previous), previous)

    def _prepare(self, batch: ScheduledBatch, previous: _Step | None) -> _Prepared:
        """Plan `batch` and build its inputs on the host; `previous`: the step queued before it."""
        plan = StepPlan.from_batch(batch, previous.sample_seqs if previous is not None else None)
        sample_seqs = [s for s, sampled in zip(batch.seqs, plan.sampled) if sampled] + [f.child for f in batch.forks]
        return _Prepared(batch, plan, sample_seqs, self.model_runner.prepare(plan, sample_seqs))

    def _queue(self, step: _Prepared, previous: _InFlight | None) -> _Forwarded:
        """Queue a prepared step's forward on the device (the workers' too), after `previous`'s sampling."""
        # Once the workers have the plan, rank 0 runs its part of the step whatever signal comes (an
        # interrupt is raised after it): a forward stopped half-way would leave the workers inside a
        # collective, which the next step's first collective would then be paired with.
        shielded = deferred_signals() if self.workers is not None else contextlib.nullcontext()
        with worker_errors(self.workers), shielded:
            if self.workers is not None:
                self.workers.send("run", step.plan)
            logits = self.model_runner.queue(step.prepared, previous.launched if previous else None)
        constrained = ([r for r, s in enumerate(step.sample_seqs) if s.grammar is not None]
                       if self.scheduler.num_constrained else [])
        return _Forwarded(step.batch, step.plan, step.sample_seqs, logits, constrained)

    @staticmethod
    def _live_grammars(step: _Forwarded) -> tuple[list[int], list[SampleGrammar]]:
        """(rows, grammars) of `step`'s constrained rows whose sequence goes on and whose grammar
        has not ended: the rows its sampling masks (the others are left unmasked)."""
        rows = [r for r in step.constrained_rows
                if not step.sample_seqs[r].is_finished and not step.sample_seqs[r].grammar.ended]
        return rows, [step.sample_seqs[r].grammar for r in rows]

    def _sample(self, step: _Forwarded, mask: TokenMask | None) -> _InFlight:
        """Queue the sampling of a forwarded step, its constrained rows masked by `mask`."""
        launched = self.model_runner.sample(step.logits, mask)
        return _InFlight(step.batch, step.plan, step.sample_seqs, launched)

    def _sample_now(self, step: _Forwarded) -> _InFlight:
        """Queue the sampling of a forwarded step, its masks filled here from its grammars as they stand now."""
        mask = None
        if step.constrained_rows:
            rows, grammars = self._live_grammars(step)
            mask = self.grammars.token_mask(rows, grammars) if rows else None
        return self._sample(step, mask)

    def _sample_logprobs(self, step: _InFlight) -> dict[int, SampledRow] | None:
        """{seq_id: its row's logprobs} for the sampled rows that ask for logprobs."""
        host = step.launched.logprobs()
        if host is None:
            return None
        seqs = [step.sample_seqs[r] for r in host.rows]
        return {s.seq_id: row for s, row in zip(seqs, sampled_rows(host, [s.params.logprobs for s in seqs]))}

    def _record_prompt_logprobs(self, step: _InFlight) -> None:
        """Append the step's prompt logprobs to the sequences that asked, in position order."""
        spans = step.batch.prompt_logprob_spans
        host = step.launched.prompt_logprobs()
        if not spans or host is None:
            return
        record_prompt_logprobs([(step.batch.seqs[i].prompt_logprobs, len(span)) for i, span in spans.items()],
                               host, step.plan.prompt_logprob_targets)
