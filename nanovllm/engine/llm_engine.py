"""The engine: takes requests, steps the scheduler and model runner, returns outputs.

Step-wise use (nano-vllm's API):
    engine.add_request(prompt, params) -> request id
    while not engine.is_finished(): result = engine.step()   # StepResult (finished RequestOutputs)
    engine.abort_request(request_id)   # drop one (or several); it is never returned
RL use: engine.update_weights(state_dict.items()) swaps the weights in place between calls;
engine.sleep(level) / engine.wake_up(tags) give the device memory back and take it again (engine/sleep.py).
Structured outputs: SamplingParams(structured_outputs=StructuredOutputsParams(...)) constrains a
completion (engine/structured_outputs.py; needs the optional xgrammar package).
One call at a time: every public method holds the engine's lock (a re-entrant one: generate calls
step), so calls from several threads are served one after another, each complete (a thread's
generate waits for another's to end). After engine.exit() every call raises RuntimeError (exit()
itself stays harmless). An engine
dropped without exit() is collectable (`del llm; gc.collect()` frees its device memory, as RL
loops that rebuild engines expect); one still alive when the interpreter ends is exited then.
The batch API (generate, chat) is the LLM class's (nanovllm/llm.py).

A request's SamplingParams are checked when it is added and the engine keeps its own checked copy
(later edits of the caller's object do not reach a queued request): engine/request_intake.py.
What every rank runs (update_weights, apply_model, collective_rpc, sleep, wake_up) goes through
engine/ranks.py: rank 0's model runner and any tensor-parallel workers.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import ParamSpec, TypeVar

import torch

from nanovllm.config import Config, ServedModel
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.engine.prompts import PreparedPrompt
from nanovllm.engine.rank_calls import model_call, worker_call
from nanovllm.engine.ranks import Ranks
from nanovllm.engine.request_intake import CheckedParams, RequestIntake, eos_tokens
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sleep import sleep_level, wake_tags
from nanovllm.engine.step_pipeline import StepPipeline, StepResult
from nanovllm.engine.structured_outputs import GrammarBackend
from nanovllm.engine.tp_workers import WorkerGroup
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.generation_defaults import read_generation_config
from nanovllm.utils.tokenizer import load_tokenizer
from nanovllm.utils.validation import check_bool, plain_number

logger = logging.getLogger(__name__)

# Engines not yet exited, held weakly: the interpreter's exit closes them (their tensor-parallel
# workers above all), while a dropped engine stays collectable (atexit.register(self.exit)
# would hold every engine until the interpreter ends).
_LIVE_ENGINES: weakref.WeakSet[LLMEngine] = weakref.WeakSet()


def _exit_live_engines() -> None:
    for engine in list(_LIVE_ENGINES):
        if engine._lock.acquire(blocking=False):
            try:
                engine.exit()
            finally:
                engine._lock.release()
        else:  # a daemon thread is mid-call (it may never return): released under it
            engine._release()


# The one worker method collective_rpc runs (vLLM's name).
RELOAD_WEIGHTS = "reload_weights"

_P = ParamSpec("_P")
_R = TypeVar("_R")


def one_call_at_a_time(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """`method` runs holding its engine's lock: calls from other threads wait until it returns."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        self._lock = threading.RLock()  # one_call_at_a_time
        self._exited = False
        self._generating = False  # LLM.generate is stepping its requests (_check_not_generating)
        self.config = Config.from_kwargs(model, kwargs)
        cfg = self.config
        tokenizer = None if cfg.skip_tokenizer_init else load_tokenizer(cfg.tokenizer)
        # generation_config.json's keys: the EOS ids below, and generate()'s defaults (nanovllm.llm)
        self.generation_values = read_generation_config(cfg.generation_dir)
        self.detokenizer = Detokenizer(tokenizer)
        # checked before any model or worker exists: an EOS id outside the vocabulary is refused here
        eos = eos_tokens(tokenizer, cfg, self.generation_values)
        self.ranks = Ranks(cfg)  # rank 0's model runner and any tensor-parallel workers (engine/ranks.py)
        self.model_runner = self.ranks.model_runner
        self.num_kvcache_blocks = self.model_runner.num_blocks
        self.block_manager = BlockManager(self.num_kvcache_blocks, cfg.kvcache_block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len,
            eos.ending,
            mixed_steps=cfg.mixed_steps, decoder=self.detokenizer.decoder, fill_sizes=self.model_runner.fill_sizes,
        )
        self.grammars = GrammarBackend(tokenizer, cfg.model_config.vocab_size, eos.all, self.model_runner.device)
        # checks each request's params and prompt and builds its Request (engine/request_intake.py)
        self.intake = RequestIntake(cfg, tokenizer, eos, self.num_kvcache_blocks * cfg.kvcache_block_size,
                                    self.grammars)
        self.validator = self.intake.validator
        # Tensor-parallel workers get each step's plan with its input ids: no overlap there.
        overlap = cfg.overlap_scheduling and self.workers is None
        self.pipeline = StepPipeline(self.scheduler, self.model_runner, self.workers, self.grammars,
                                     self.detokenizer, overlap)
        _LIVE_ENGINES.add(self)
        atexit.unregister(_exit_live_engines)  # one registration, however many engines were built
        atexit.register(_exit_live_engines)

    # ----- step-wise API -----
    def _check_open(self) -> None:
        """Every call but exit() refuses an exited engine: its model and workers are gone."""
        if self._exited:
            raise RuntimeError("this LLM has exited (exit() was called): create a new LLM to generate again")

    def _check_not_generating(self, call: str) -> None:
        """RuntimeError naming `call` while LLM.generate runs its requests: a call from inside it
        (its progress bar's methods) would take outputs generate returns (step) or queue a request
        whose output generate would run and drop (add_request). Calls from other threads wait for
        generate to return instead (one_call_at_a_time)."""
        if self._generating:
            raise RuntimeError(f"{call} called from inside generate() (its progress bar): generate steps its "
                               "own requests to the end; call it after generate() returns")

    @one_call_at_a_time
    def add_request(self, prompt: str | list[int] | dict, sampling_params: SamplingParams) -> int:
        """Queue one request; returns its id. Bad input raises before anything is queued."""
        self._check_open()
        self._check_not_generating("add_request()")
        checked = self.intake.check(sampling_params)
        return self._enqueue(self.validator.validate(prompt, checked.params), checked)

    @one_call_at_a_time
    def check_params(self, params: object) -> None:
        """Raise as add_request would for `params` (TypeError / ValueError naming the bad value: the
        model's checks too, such as max_logprobs and token ids within the vocabulary); queues nothing."""
        self._check_open()
        self.intake.check(params)

    def _enqueue(self, prompt: PreparedPrompt, checked: CheckedParams) -> int:
        """Queue a request already checked (validator.validate, intake.check); returns its id."""
        if self.model_runner.sleeping:
            raise RuntimeError(f"the engine is asleep ({self.ranks.sleep_state()}): call wake_up() before generating")
        request = self.intake.request(prompt, checked)
        self.scheduler.add(request)
        self.model_runner.rules.admit(request.samples)
        return request.request_id

    @one_call_at_a_time
    def step(self) -> StepResult:
        """Complete one step and return what it finished. With overlap scheduling, the
        next step is queued on the device before this one's tokens are read. Nothing pending:
        an empty result, no work. An exception or interrupt inside the step drops every pending
        request (abort_all) and is raised. The steps themselves: engine/step_pipeline.py."""
        self._check_open()
        self._check_not_generating("step()")
        return self._step()

    def _step(self) -> StepResult:
        """step() for a caller holding the engine's lock (LLM.generate's loop)."""
        if self.is_finished():
            return StepResult(None, 0, 0, [], [])
        try:
            result = self.pipeline.step()
        except BaseException:
            # A step cut short (Ctrl-C, an error) leaves its sequences booked for tokens that never
            # come: every pending request is dropped, so the engine serves the next ones.
            self.abort_all()
            raise
        self._drop_steps_of_no_request()
        return result

    @one_call_at_a_time
    def is_finished(self) -> bool:
        self._check_open()
        return self.scheduler.is_finished() and self.pipeline.idle

    @one_call_at_a_time
    def abort_request(self, request_id: int | Iterable[int]) -> None:
        """Drop one pending request, or each of an iterable of ids (vLLM's LLMEngine.abort_request);
        ids of no pending request (finished, aborted, never given) are ignored. The request's KV
        blocks are freed now; it is not returned by any later step (nor counted in `sampled`)."""
        self._check_open()
        many = isinstance(request_id, Iterable) and not isinstance(request_id, (str, bytes))
        ids = [plain_number(i) for i in (request_id if many else [request_id])]  # NumPy ids as ints
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)]
        if bad:
            raise TypeError(f"abort_request takes a request id (an int) or an iterable of them, got {bad[0]!r}")
        dropped = [self.scheduler.requests[i] for i in set(ids) if i in self.scheduler.requests]
        self.scheduler.abort(set(ids))
        self.model_runner.rules.release([s for request in dropped for s in request.samples])
        self._drop_steps_of_no_request()

    def _drop_steps_of_no_request(self) -> None:
        """With no request left (the last one finished by a stop or was aborted), the steps overlap
        scheduling queued hold only tokens nobody reads: forget them, so the engine is finished now
        (generate, sleep and update_weights are not refused for them). Their device work still runs
        before anything queued later (one stream), as after abort_all."""
        if self.scheduler.is_finished():
            self.pipeline.drop()

    @one_call_at_a_time
    def abort_all(self) -> None:
        """Drop every pending request (after an error or interrupt); see Scheduler.abort_all."""
        self._check_open()
        self.pipeline.drop()  # results not wanted; their KV writes land in freed blocks
        self.scheduler.abort_all()
        self.model_runner.rules.reset()

    @one_call_at_a_time
    def set_tokenizer(self, tokenizer) -> None:
        """vLLM's LLM.set_tokenizer: `tokenizer` (transformers') takes over from the loaded one for
        later requests: it tokenizes prompts, bad words and chat conversations, decodes texts, stop
        strings and logprobs, builds structured-outputs grammars, and its eos_token_id replaces the
        loaded tokenizer's among the EOS ids (as vLLM reads the EOS from its current tokenizer).
        Refused while requests are pending (they were tokenized with the old one)."""
        self._check_open()
        self._check_not_generating("set_tokenizer()")
        if not all(callable(getattr(tokenizer, name, None)) for name in ("encode", "decode")):
            raise TypeError(f"set_tokenizer takes a tokenizer (transformers', with encode and decode), got "
                            f"{tokenizer!r:.200}")
        if not self.is_finished():
            raise RuntimeError("set_tokenizer() called while requests are pending; finish or abort them first")
        eos = eos_tokens(tokenizer, self.config, self.generation_values)  # an EOS id outside the vocabulary: refused
        # Every holder of the tokenizer, or of what __init__ derived from it, in one place:
        self.intake.set_tokenizer(tokenizer, eos)  # prompts, params' checks, structured-outputs grammars
        self.detokenizer.set_tokenizer(tokenizer)  # in place: the pipeline and llm_engine's streams hold it
        self.scheduler.decoder = self.detokenizer.decoder
        self.scheduler.eos_token_ids = eos.ending

    @one_call_at_a_time
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights in place, between generate() calls (an RL step's policy update).

        `weights`: (name, tensor) pairs with Hugging Face checkpoint names and full (unsharded)
        shapes, e.g. a transformers model's `state_dict().items()` (a tied model's
        lm_head.weight is accepted and ignored); any subset of the weights may be given.
        Unknown names, wrong shapes, tensors without data (meta) and float8 ones (full-precision
        weights only: an FP8 engine quantizes them) raise ValueError, tensors that are not dense
        floating-point ones (or are DTensors: pass their full_tensor()) TypeError, before any
        parameter changes; a generator's tensors are checked and copied a chunk (~1 GiB) at a time
        instead (loader.weight_chunks: the memory of one chunk, not of a model copy), so a refusal
        leaves earlier chunks in. The prefix cache is emptied (its KV belongs to the old weights); CUDA graphs stay valid (parameters
        keep their storage)."""
        self._check_weights_can_change("update_weights()")
        self.ranks.update_weights(weights, on_loaded=self.block_manager.clear_prefix_cache)

    def _check_weights_can_change(self, call: str) -> None:
        """RuntimeError naming `call` unless the weights may be written now: the engine open, no
        request pending (its KV belongs to the old weights), the weights awake."""
        self._check_open()
        if not self.is_finished():
            raise RuntimeError(f"{call} called while requests are pending; finish or abort them first")
        self.ranks.check_weights_awake(call)

    @one_call_at_a_time
    def apply_model(self, func: Callable[[torch.nn.Module], object]) -> list:
        """vLLM's LLM.apply_model: func(model) on every rank (its nn.Module, with that rank's shard
        of the weights), their results in rank order (engine/rank_calls.py). A func that changes
        the weights leaves the prefix cache's KV stale: call reset_prefix_cache() after it."""
        call = model_call(func)  # a TypeError before the engine's state is looked at
        self._check_open()
        return self.ranks.call(call, "apply_model()", None)

    @one_call_at_a_time
    def collective_rpc(self, method: object, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's LLM.collective_rpc: a callable runs as method(worker, *args, **kwargs) on every
        rank (engine/rank_calls.Worker), its results in rank order; of the worker methods named by
        a string, the one vLLM's sleep-mode docs have callers run, "reload_weights" (the
        checkpoint's weights again, in place: after sleep(level=2) and wake_up(tags=["weights"]));
        one result (None) per rank. Any other name raises NotImplementedError, as vLLM does for a
        method its workers lack (TRL catches it). `timeout` (seconds) bounds the wait for the
        tensor-parallel workers' answers to a callable (TimeoutError; the workers are then out of
        step, as after an interrupt: exit() and build a new LLM); rank 0's own part is not timed."""
        self._check_open()
        if callable(method):
            return self.ranks.call(worker_call(method, args, kwargs, timeout), "collective_rpc()", timeout)
        if method != RELOAD_WEIGHTS:
            raise NotImplementedError(f"Method {method!r} is not implemented: nanovllm's collective_rpc runs "
                                      f"{RELOAD_WEIGHTS!r} or a function of the worker only")
        if args or kwargs:
            raise ValueError(f"collective_rpc({RELOAD_WEIGHTS!r}) takes no arguments here (the model directory's "
                             f"checkpoint is reloaded), got args={args!r}, kwargs={kwargs!r}")
        self._check_weights_can_change(f"collective_rpc({RELOAD_WEIGHTS!r})")
        self.ranks.run_method(RELOAD_WEIGHTS)
        self.block_manager.clear_prefix_cache()
        return [None] * self.config.tensor_parallel_size

    @one_call_at_a_time
    def sleep(self, level: int = 1) -> None:
        """vLLM's LLM.sleep (engine/sleep.py): frees the KV cache, the CUDA graphs and the prefix
        cache, and the weights: level 1 to host memory, level 2 discarded (zeros after wake_up until
        update_weights). Refused while requests are pending. While anything sleeps it does nothing but
        warn, as vLLM's (RL frameworks may call it twice; what a first sleep kept stays kept)."""
        self._check_open()
        level = sleep_level(level)
        if self.model_runner.sleeping:
            logger.warning("sleep(level=%d) called while already asleep (%s): nothing to do", level,
                           self.ranks.sleep_state())
            return
        if not self.is_finished():
            raise RuntimeError("sleep() called while requests are pending; finish or abort them first")
        self.ranks.run_method("sleep", level)
        self.block_manager.clear_prefix_cache()  # the KV it indexes is gone

    @one_call_at_a_time
    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's LLM.wake_up: restores the sleeping parts among `tags` ("weights", "kv_cache";
        None: both); awake ones are skipped (waking an awake engine does nothing). Once both are
        awake the CUDA graphs are captured again; after level 1, outputs are as before sleep()."""
        self._check_open()
        parts = [tag for tag in wake_tags(tags) if tag in self.model_runner.sleeping]
        if parts:
            self.ranks.run_method("wake_up", parts)

    @one_call_at_a_time
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's LLM.reset_prefix_cache (RL clients call it after a weight sync): later requests
        find nothing cached. As vLLM's, it resets only while no KV block is held: True when it
        reset, False (a warning, nothing reset) while running requests hold blocks (waiting ones
        hold none). `reset_running_requests=True` asks vLLM to preempt running requests so their KV
        is computed again: with nothing pending it is the same reset, with requests pending a
        RuntimeError (they keep their KV here). `reset_connector`: no KV connector exists, nothing
        more to reset."""
        self._check_open()
        for name, value in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
            check_bool(f"reset_prefix_cache: {name}", value)
        if reset_running_requests and not self.is_finished():
            raise RuntimeError("reset_prefix_cache(reset_running_requests=True) while requests are pending: "
                               "running requests are not preempted to recompute their KV; finish or abort them first")
        if self.block_manager.reset_prefix_cache():
            return True
        logger.warning("reset_prefix_cache: not reset, running requests hold %d KV blocks; finish or abort them first",
                       self.block_manager.num_used_blocks)
        return False

    @functools.cached_property
    def model_config(self) -> ServedModel:
        """vLLM's `llm_engine.model_config`: the served model's directories, max_model_len, dtype and
        quantization method."""
        return self.config.served_model

    # ----- what set_tokenizer and exit() change, read from its one holder -----
    @property
    def tokenizer(self):
        """The tokenizer (transformers': the loaded one or set_tokenizer's), None without one."""
        return self.intake.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every EOS id: the tokenizer's, generation_config.json's (config.json's without one)."""
        return self.intake.eos.all

    @property
    def workers(self) -> WorkerGroup | None:
        """The tensor-parallel workers (ranks 1..N-1); None without tensor parallelism, or after exit()."""
        return self.ranks.workers

    @one_call_at_a_time
    def is_sleeping(self) -> bool:
        """True while any part sleeps (vLLM's LLM.is_sleeping)."""
        self._check_open()
        return bool(self.model_runner.sleeping)

    @one_call_at_a_time
    def exit(self) -> None:
        """Release the model, cache and any workers. Safe to call more than once; any other
        call afterwards raises RuntimeError."""
        self._release()

    def _release(self) -> None:
        if self._exited:
            return
        self._exited = True
        _LIVE_ENGINES.discard(self)
        self.pipeline.drop()  # queued steps' device tensors
        self.grammars.close()
        self.ranks.close()
