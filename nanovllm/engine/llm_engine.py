"""The engine: takes requests, steps the scheduler and model runner, returns outputs.

Step-wise use (nano-vllm's API):
    engine.add_request(prompt, params) -> request id
    while not engine.is_finished(): result = engine.step()   # StepResult (finished RequestOutputs)
    engine.abort_request(request_id)   # drop one (or several); it is never returned
RL use: engine.update_weights(state_dict.items()) swaps the weights in place between calls;
engine.sleep(level) / engine.wake_up(tags) give the device memory back and take it again (engine/sleep.py).
Structured outputs: SamplingParams(structured_outputs=StructuredOutputsParams(...)) constrains a
completion (engine/structured_outputs.py; needs the optional xgrammar package).
After engine.exit() every call raises RuntimeError (exit() itself stays harmless).
The batch API (generate, chat) is the LLM class's (nanovllm/llm.py).

A request's SamplingParams are checked when it is added and the engine keeps its own checked copy
(later edits of the caller's object do not reach a queued request).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.engine.launched_step import LaunchedStep, PreparedStep, StepLogits
from nanovllm.engine.logprobs import logprob_entries, record_prompt_logprobs
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.prompts import PreparedPrompt, PromptValidator
from nanovllm.engine.request import Request
from nanovllm.engine.request_rules import RequestRules, check_in_vocab
from nanovllm.engine.scheduled_batch import ScheduledBatch, StepKind
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.sleep import WEIGHTS, sleep_level, wake_tags
from nanovllm.engine.step_plan import StepPlan
from nanovllm.engine.stop_strings import stream_decoder
from nanovllm.engine.structured_outputs import GrammarBackend, SampleGrammar
from nanovllm.engine.tp_workers import WorkerGroup
from nanovllm.outputs import Logprob, RequestOutput
from nanovllm.sampling.token_mask import TokenMask
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.deferred_signals import deferred_signals
from nanovllm.utils.tokenizer import load_eos_token_ids, load_tokenizer


@dataclass(frozen=True)
class StepResult:
    """One completed step. With overlap scheduling the call that returns it has already
    queued the next decode step, so `launch_s` may belong partly to that one. A step() with
    nothing to do returns an empty result (kind None)."""

    kind: StepKind | None  # None: nothing was pending, no step ran
    num_tokens: int  # tokens processed by the forward (prefill chunk tokens plus one per decode row)
    num_seqs: int
    finished: list[RequestOutput]
    # ids of the sequences (the requests, when n = 1) whose token of this step was kept: not one
    # that an earlier step ended (overlap scheduling computed it once more) or that was aborted
    sampled: list[int]
    launch_s: float  # host: scheduling, input preparation, queuing work on the device
    prepare_s: float  # the input-preparation part of launch_s
    wait_s: float  # host blocked until the step's tokens arrived (device time not hidden)
    postprocess_s: float  # host: appending tokens, finishing, stop strings; the next step's token masks
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


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        self._exited = False
        self.config = Config.from_kwargs(model, kwargs)
        cfg = self.config
        self.tokenizer = load_tokenizer(cfg.model)
        self.detokenizer = Detokenizer(self.tokenizer)
        # Ranks 1..N-1 run in spawned processes; this process is rank 0.
        self.workers = WorkerGroup(cfg) if cfg.tensor_parallel_size > 1 else None
        try:
            self.model_runner = ModelRunner(cfg)
        except BaseException:
            self._close_workers()
            raise
        self.num_kvcache_blocks = self.model_runner.num_blocks
        self.block_manager = BlockManager(self.num_kvcache_blocks, cfg.kvcache_block_size, cfg.enable_prefix_caching)
        self.eos_token_ids = load_eos_token_ids(cfg.model, self.tokenizer, cfg.model_config.eos_token_ids)
        self.scheduler = Scheduler(
            self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, self.eos_token_ids,
            mixed_steps=cfg.mixed_steps, decoder=stream_decoder(self.tokenizer), fill_sizes=self.model_runner.fill_sizes,
        )
        self.validator = PromptValidator(
            self.tokenizer, cfg.model_config.vocab_size, cfg.max_model_len,
            self.num_kvcache_blocks * cfg.kvcache_block_size,
        )
        self._ids = itertools.count()
        # Tensor-parallel workers get each step's plan with its input ids: no overlap there.
        self._overlap = cfg.overlap_scheduling and self.workers is None
        self._in_flight: _InFlight | None = None
        # Under overlap scheduling with constrained rows: the step after _in_flight, its forward
        # queued (while its masks were filled) and its sampling not yet (engine.step's next call).
        self._forwarded: _Forwarded | None = None
        self.grammars = GrammarBackend(self.tokenizer, cfg.model_config.vocab_size, self.eos_token_ids,
                                       self.model_runner.device)
        atexit.register(self.exit)

    # ----- step-wise API -----
    def _check_open(self) -> None:
        """Every call but exit() refuses an exited engine: its model and workers are gone."""
        if self._exited:
            raise RuntimeError("this LLM has exited (exit() was called): create a new LLM to generate again")

    def add_request(self, prompt: str | list[int] | dict, sampling_params: SamplingParams) -> int:
        """Queue one request; returns its id. Bad input raises before anything is queued."""
        self._check_open()
        params, rules, grammar = self._check_params(sampling_params)
        return self._enqueue(self.validator.validate(prompt, params), params, rules, grammar)

    def _check_params(self, params: object) -> tuple[SamplingParams, RequestRules | None, object | None]:
        """A checked copy of `params` as they are now (every SamplingParams check again, then the
        model's: token ids within the vocabulary, bad words tokenized, the structured-outputs
        grammar compiled), its logits rules and its compiled grammar (None without
        structured_outputs). Raises before anything is queued."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        checked = params.validated()
        vocab_size = self.config.model_config.vocab_size
        check_in_vocab("stop_token_ids", checked.stop_token_ids, vocab_size)
        if checked.stop and self.tokenizer is not None and self.scheduler.decoder is None:
            raise ValueError(f"SamplingParams.stop {checked.stop!r} needs a tokenizers-backed tokenizer (a "
                             f"tokenizer.json); this model's {type(self.tokenizer).__name__} has none")
        rules = RequestRules.of(checked, self.eos_token_ids, self.tokenizer, vocab_size)
        grammar = None
        if checked.structured_outputs is not None:
            grammar = self.grammars.compile(checked.structured_outputs)
        return checked, rules, grammar

    def _enqueue(self, prompt: PreparedPrompt, params: SamplingParams, rules: RequestRules | None,
                 grammar: object | None = None) -> int:
        """Queue a request already checked (_check_params, validator.validate); returns its id.
        `grammar`: its compiled grammar (structured outputs) or None."""
        if self.model_runner.sleeping:
            raise RuntimeError(f"the engine is asleep ({self._sleep_state()}): call wake_up() before generating")
        seq_ids = [next(self._ids) for _ in range(params.n)]
        request = Request.create(seq_ids[0], seq_ids, prompt.token_ids, params, rules, prompt.text,
                                 prompt.max_tokens)
        if grammar is not None:
            for seq in request.samples:
                seq.grammar = self.grammars.sample_grammar(grammar)
        self.scheduler.add(request)
        self.model_runner.rules.admit(request.samples)
        return request.request_id

    def step(self) -> StepResult:
        """Complete one step and return what it finished. With overlap scheduling, the
        next step is queued on the device before this one's tokens are read. Nothing pending:
        an empty result, no work.

        Overlap scheduling with constrained rows (structured outputs): the next step's sampling
        waits for its token masks, which need this step's tokens accepted by the grammars. Their
        fill then runs on the grammar backend's thread while this thread records this step and
        prepares the step after the next on the host; the next step's sampling and the forward of
        the one after it are queued once the masks are in:

            this thread:  read N | accept N | postprocess N, plan + prepare N+2 | sample N+1 | queue N+2
            fill thread:                    | masks of N+1 ..................... |
        """
        self._check_open()
        if self.is_finished():
            return StepResult(None, 0, 0, [], [], launch_s=0.0, prepare_s=0.0, wait_s=0.0, postprocess_s=0.0)
        t0 = time.perf_counter()
        current = self._in_flight or self._sample_now(self._launch(self.scheduler.schedule(), previous=None))
        prepare_s = current.launched.prepare_s
        self._in_flight = None
        following, self._forwarded = self._forwarded, None  # queued by the previous call, if any
        if following is None and self._overlap:
            ahead = self.scheduler.schedule(ahead=True)
            if ahead is not None:
                following = self._launch(ahead, previous=current)
                prepare_s += following.logits.prepare_s
        if following is not None and not following.constrained_rows:  # sampled at once, as it needs no mask
            self._in_flight, following = self._sample(following, None), None
        t1 = time.perf_counter()
        with self._worker_errors():
            tokens = current.launched.tokens()
        # A sequence ended since this step was queued (a stop in the step before it, under overlap
        # scheduling, or abort_request) gets nothing: its token is dropped.
        sampled = {s.seq_id: t for s, t in zip(current.sample_seqs, tokens) if not s.is_finished}
        t2 = time.perf_counter()
        batch = current.batch
        self.scheduler.advance_grammars(batch, sampled)
        mask_wait_s = 0.0
        if following is None:
            outputs = self._postprocess(current, tokens, sampled)
        else:  # its masks follow this step's tokens: filled while this thread does the rest
            rows, grammars = self._live_grammars(following)
            fill = self.grammars.filling(rows, grammars) if rows else contextlib.nullcontext()
            with fill as masks:
                outputs = self._postprocess(current, tokens, sampled)
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

    def _postprocess(self, step: _InFlight, tokens: list[int], sampled: dict[int, int]) -> list[RequestOutput]:
        """Record a step's results (its grammars advanced already) and return its finished requests' outputs."""
        self._record_prompt_logprobs(step)
        done = self.scheduler.postprocess(step.batch, sampled, self._sample_logprobs(step, tokens))
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
        with self._worker_errors(), shielded:
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

    @contextlib.contextmanager
    def _worker_errors(self) -> Iterator[None]:
        """A collective that fails because a tensor-parallel worker died names that worker."""
        try:
            yield
        except RuntimeError as e:
            if self.workers is None:
                raise
            raise (self.workers.dead_worker_error(e) or e) from e

    def _sample_logprobs(self, step: _InFlight, tokens: list[int]) -> dict[int, dict[int, Logprob]] | None:
        """{seq_id: {token_id: Logprob}} for the sampled rows that ask for logprobs."""
        host = step.launched.logprobs()
        if host is None:
            return None
        seqs = [step.sample_seqs[r] for r in host.rows]
        entries = logprob_entries(host, [tokens[r] for r in host.rows], [s.params.logprobs for s in seqs])
        return {s.seq_id: e for s, e in zip(seqs, entries)}

    def _record_prompt_logprobs(self, step: _InFlight) -> None:
        """Append the step's prompt logprobs to the sequences that asked, in position order."""
        spans = step.batch.prompt_logprob_spans
        host = step.launched.prompt_logprobs()
        if not spans or host is None:
            return
        record_prompt_logprobs([(step.batch.seqs[i].prompt_logprobs, len(span)) for i, span in spans.items()],
                               host, step.plan.prompt_logprob_targets)

    def is_finished(self) -> bool:
        self._check_open()
        return self.scheduler.is_finished() and self._in_flight is None and self._forwarded is None

    def abort_request(self, request_id: int | Iterable[int]) -> None:
        """Drop one pending request, or each of an iterable of ids (vLLM's LLMEngine.abort_request);
        ids of no pending request (finished, aborted, never given) are ignored. The request's KV
        blocks are freed now; it is not returned by any later step (nor counted in `sampled`)."""
        self._check_open()
        many = isinstance(request_id, Iterable) and not isinstance(request_id, (str, bytes))
        ids = list(request_id) if many else [request_id]
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)]
        if bad:
            raise TypeError(f"abort_request takes a request id (an int) or an iterable of them, got {bad[0]!r}")
        dropped = [self.scheduler.requests[i] for i in set(ids) if i in self.scheduler.requests]
        self.scheduler.abort(set(ids))
        self.model_runner.rules.release([s for request in dropped for s in request.samples])

    def abort_all(self) -> None:
        """Drop every pending request (after an error or interrupt); see Scheduler.abort_all."""
        self._check_open()
        self._in_flight = self._forwarded = None  # results not wanted; their KV writes land in freed blocks
        self.scheduler.abort_all()
        self.model_runner.rules.reset()

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights in place, between generate() calls (an RL step's policy update).

        `weights`: (name, tensor) pairs with Hugging Face checkpoint names and full (unsharded)
        shapes, e.g. a transformers model's `state_dict().items()` (a tied model's
        lm_head.weight is accepted and ignored); any subset of the weights may be given.
        Unknown names, wrong shapes and tensors without data (meta) raise ValueError, tensors that
        are not dense floating-point ones TypeError, before any parameter changes. The prefix
        cache is emptied (its KV belongs to the old weights); CUDA graphs stay valid (parameters
        keep their storage)."""
        self._check_open()
        if not self.is_finished():
            raise RuntimeError("update_weights() called while requests are pending; finish or abort them first")
        if WEIGHTS in self.model_runner.sleeping:
            raise RuntimeError(f"update_weights() called while the weights sleep ({self._sleep_state()}): "
                               "call wake_up(tags=['weights']) first")
        weights = list(weights)
        # An interrupt waits for the update to end on every rank: no half-updated model.
        with self._worker_errors(), deferred_signals():
            self.model_runner.update_weights(weights)  # checks everything before changing anything
            if self.workers is not None:
                self.workers.send("update_weights", [(n, t.detach().cpu()) for n, t in weights])
            self.block_manager.clear_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's LLM.sleep (engine/sleep.py): frees the KV cache, the CUDA graphs and the prefix
        cache, and the weights: level 1 to host memory, level 2 discarded (zeros after wake_up until
        update_weights). Refused while requests are pending or anything sleeps already."""
        self._check_open()
        level = sleep_level(level)
        if self.model_runner.sleeping:
            raise RuntimeError(f"sleep() called while already asleep ({self._sleep_state()}): wake_up() first")
        if not self.is_finished():
            raise RuntimeError("sleep() called while requests are pending; finish or abort them first")
        self._on_every_rank("sleep", level)
        self.block_manager.clear_prefix_cache()  # the KV it indexes is gone

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's LLM.wake_up: restores the sleeping parts among `tags` ("weights", "kv_cache";
        None: both); awake ones are skipped (waking an awake engine does nothing). Once both are
        awake the CUDA graphs are captured again; after level 1, outputs are as before sleep()."""
        self._check_open()
        parts = [tag for tag in wake_tags(tags) if tag in self.model_runner.sleeping]
        if parts:
            self._on_every_rank("wake_up", parts)

    def is_sleeping(self) -> bool:
        """True while any part sleeps (vLLM's LLM.is_sleeping)."""
        self._check_open()
        return bool(self.model_runner.sleeping)

    def _sleep_state(self) -> str:
        return ", ".join(f"{tag} asleep" for tag in self.model_runner.sleeping)

    def _on_every_rank(self, method: str, *args) -> None:
        """ModelRunner.<method>(*args) on the workers, then here (on CUDA, capturing graphs runs
        collectives every rank joins); an interrupt waits for every rank to finish it."""
        with self._worker_errors(), deferred_signals():
            if self.workers is not None:
                self.workers.send(method, *args)
            getattr(self.model_runner, method)(*args)

    def exit(self) -> None:
        """Release the model, cache and any workers. Safe to call more than once; any other
        call afterwards raises RuntimeError."""
        if self._exited:
            return
        self._exited = True
        atexit.unregister(self.exit)
        self._in_flight = self._forwarded = None  # queued steps' device tensors
        grammars = getattr(self, "grammars", None)
        if grammars is not None:
            grammars.close()
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            runner.exit()
        self._close_workers()

    def _close_workers(self) -> None:
        workers = getattr(self, "workers", None)
        if workers is not None:
            self.workers = None
            workers.close()
