"""`llm.llm_engine`: vLLM's LLMEngine surface over an LLM, for code written against it.

Scripts drive vLLM's engine by the caller's request ids:

    engine = llm.llm_engine
    engine.add_request("req-0", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():          # RequestOutputs, out.request_id == "req-0"
            if out.finished: ...

and clients read `llm.llm_engine.model_config` (lm-eval; scripts: `get_model_config()`), `.model_executor`
(TRL's weight sync), `.reset_prefix_cache()` (OpenRLHF), `.tokenizer`, `.get_supported_tasks()`, `.reset_mm_cache()`, `.sleep` /
`.wake_up` / `.collective_rpc`. Those
are the LLM's own. `step()` returns each request's outputs as its SamplingParams.output_kind asks
(vLLM's RequestOutputKind: CUMULATIVE, its default, and DELTA while it runs, then the final one;
FINAL_ONLY the final one alone; engine/output_streams.py). nano-vllm's step API (int ids,
StepResult: finished requests only) stays on the LLM itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import torch

from nanovllm.engine.llm_engine import LLMEngine, one_call_at_a_time
from nanovllm.engine.output_streams import OutputStreams
from nanovllm.engine.tasks import SUPPORTED_TASKS, SupportedTask
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import TRUNCATE_TO_MODEL_LEN, SamplingParams
from nanovllm.utils.validation import check_bool, check_int, is_unset, is_zero, plain_number

if TYPE_CHECKING:
    from nanovllm.config import ServedModel


def check_no_lora(lora_request: object, num_prompts: int | None = None) -> None:
    """vLLM's lora_request argument: accepted as None (lm-eval and verl pass it) or a list of Nones
    (one per prompt: as many as `num_prompts`, where given, as vLLM requires), refused otherwise."""
    none_per_prompt = isinstance(lora_request, (list, tuple)) and all(r is None for r in lora_request)
    if lora_request is not None and not none_per_prompt:
        raise ValueError(f"LoRA adapters are not supported: lora_request must be None (or a list of Nones), "
                         f"got {lora_request!r}")
    if none_per_prompt and num_prompts is not None and len(lora_request) != num_prompts:
        raise ValueError(f"lora_request is a list of {len(lora_request)} for {num_prompts} prompts: "
                         f"a per-prompt list has one entry per prompt")


# The one tokenization_kwargs key served: vLLM 0.17 moved SamplingParams.truncate_prompt_tokens there
# (clients pass {"truncate_prompt_tokens": k}); the tokenizer's own keywords (truncation, max_length,
# add_special_tokens) are refused, prompts being tokenized as the tokenizer does by default.
TRUNCATE_KEY = "truncate_prompt_tokens"


def tokenization_truncation(tokenization_kwargs: dict | None, how: str) -> int | None:
    """vLLM's tokenization_kwargs argument: None, {} or {"truncate_prompt_tokens": k} (k >= 1, or -1 for
    max_model_len; None: none), refused otherwise (`how`: how the call tokenizes instead, for the
    message). Returns k, None when no truncation is asked for."""
    if is_unset(tokenization_kwargs):
        return None
    if not isinstance(tokenization_kwargs, dict) or set(tokenization_kwargs) != {TRUNCATE_KEY}:
        raise ValueError(f"tokenization_kwargs={tokenization_kwargs!r} are not supported{how} (of its keys "
                         f"only {TRUNCATE_KEY!r} is)")
    keep = plain_number(tokenization_kwargs[TRUNCATE_KEY])  # a NumPy count, as SamplingParams takes it
    if keep is not None:
        check_int(f"tokenization_kwargs[{TRUNCATE_KEY!r}]", keep)
        if keep < 1 and keep != TRUNCATE_TO_MODEL_LEN:
            raise ValueError(f"tokenization_kwargs[{TRUNCATE_KEY!r}] must be >= 1 or {TRUNCATE_TO_MODEL_LEN} "
                             f"(max_model_len), got {keep!r}")
    return keep


def with_prompt_truncation(params: object, keep: int | None) -> object:
    """`params` truncating prompts to their last `keep` tokens (tokenization_truncation's): a copy, the
    caller's left as given; `params` itself when keep is None or params are no SamplingParams (the
    intake refuses those). A different SamplingParams.truncate_prompt_tokens is a ValueError."""
    if keep is None or not isinstance(params, SamplingParams):
        return params
    if params.truncate_prompt_tokens not in (None, keep):
        raise ValueError(f"tokenization_kwargs[{TRUNCATE_KEY!r}]={keep} and SamplingParams.truncate_prompt_tokens="
                         f"{params.truncate_prompt_tokens} disagree: pass one of them")
    return dataclasses.replace(params.validated(), truncate_prompt_tokens=keep)


class WeightSyncPath:
    """The path RL code written for vLLM walks to load new weights in place:
    `llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)` (TRL's
    colocate mode; vLLM V1's `driver_worker.worker.model_runner.model` too). Each step of the path
    but its end is this object; the end is a DriverModel, whose `load_weights` is LLM.update_weights
    (every tensor checked first, the prefix cache emptied, every rank updated). The executor's
    `collective_rpc` (OpenRLHF's weight broadcast, scripts reading worker state) is LLM.collective_rpc."""

    def __init__(self, llm: LLMEngine):
        self._llm = llm

    @property
    def driver_worker(self) -> WeightSyncPath:
        return self

    worker = model_runner = driver_worker

    @property
    def model(self) -> DriverModel:
        return DriverModel(self._llm)

    def get_model(self) -> DriverModel:
        """vLLM's Worker / GPUModelRunner.get_model(): `model`."""
        return self.model

    def collective_rpc(self, method: object, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's Executor.collective_rpc: LLM.collective_rpc (a function of the worker on every
        rank, or "reload_weights"; another method name raises NotImplementedError naming it)."""
        return self._llm.collective_rpc(method, timeout, args, kwargs)


class DriverModel:
    """`...driver_worker.model_runner.model`: vLLM's driver worker's model. `load_weights` is
    LLM.update_weights; every other attribute is rank 0's nn.Module's (its shard of the weights
    under tensor parallelism, as vLLM's driver worker holds), read (and set) where it is asked for, so
    what clients read there is the model serving: verl takes the weights' device from
    `next(model.parameters())`, scripts walk `named_parameters()` to check or edit a synced weight
    (an edit in place is the caller's to follow with llm.reset_prefix_cache(), as in vLLM)."""

    def __init__(self, llm: LLMEngine):
        object.__setattr__(self, "_llm", llm)

    def __getattr__(self, name: str) -> object:
        if name == "_llm":  # not set yet: a copy or unpickling asks before __init__ ran
            raise AttributeError(name)
        return getattr(self._module(), name)

    def __setattr__(self, name: str, value: object) -> None:
        """Set on the module, as on vLLM's model (this object is made anew at each access: kept
        here, it would be lost)."""
        setattr(self._module(), name, value)

    def _module(self) -> torch.nn.Module:
        self._llm._check_open()
        return self._llm.model_runner.model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """update_weights(weights) (a generator streamed: loader.weight_chunks); the names loaded
        (vLLM returns its loaded names: verl counts them)."""
        if isinstance(weights, Collection):
            self._llm.update_weights(weights)
            return {pair[0] for pair in weights}
        names: set[str] = set()

        def noting(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for pair in pairs:
                if isinstance(pair, tuple) and pair:  # update_weights names anything else
                    names.add(pair[0])
                yield pair

        self._llm.update_weights(noting(weights))
        return names


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    cache_dtype: str


@dataclass(frozen=True)
class VllmConfig:
    """What clients read from vLLM's `llm_engine.vllm_config` (TRL's vllm_serve: the tensor-parallel
    size), a read-only view of this engine's settings under vLLM's names."""

    model_config: ServedModel
    parallel_config: ParallelConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig


class VllmEngine:
    """vLLM's LLMEngine API of one LLM (module docstring). Invariant: `_ids` maps the engine id of
    every pending request added here to its caller's id, `_names` the other way; they may also hold
    requests ended through the LLM's own API until nothing is pending (_forget_ended)."""

    def __init__(self, llm: LLMEngine):
        self._llm = llm
        self._lock = llm._lock  # the LLM's: one call at a time across both APIs
        self._ids: dict[int, str] = {}
        self._names: dict[str, int] = {}
        self._streams = OutputStreams(llm.detokenizer)

    # ----- what clients read on vLLM's llm_engine: the LLM's own -----
    @property
    def model_config(self) -> ServedModel:
        return self._llm.model_config

    @property
    def vllm_config(self) -> VllmConfig:
        """vLLM's engine settings, as far as clients read them (VllmConfig)."""
        llm, cfg = self._llm, self._llm.config
        return VllmConfig(llm.model_config, ParallelConfig(cfg.tensor_parallel_size),
                          SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len),
                          CacheConfig(cfg.kvcache_block_size, llm.num_kvcache_blocks, cfg.enable_prefix_caching,
                                      cfg.kv_cache_dtype))

    @property
    def cache_config(self) -> CacheConfig:
        """vLLM's `llm_engine.cache_config` (scripts read num_gpu_blocks, block_size, cache_dtype):
        vllm_config's."""
        return self.vllm_config.cache_config

    @property
    def model_executor(self) -> WeightSyncPath:
        """As far as RL code reaches it to sync weights (WeightSyncPath)."""
        return WeightSyncPath(self._llm)

    @model_executor.deleter
    def model_executor(self) -> None:
        """`del llm.llm_engine.model_executor` (distilabel's unload, to free vLLM's workers): nothing to
        drop here, each access makes a fresh WeightSyncPath; llm.exit() frees the engine."""

    @property
    def tokenizer(self):
        return self._llm.get_tokenizer()

    def get_tokenizer(self):
        return self._llm.get_tokenizer()

    def get_model_config(self) -> ServedModel:
        """vLLM's LLMEngine.get_model_config(): model_config."""
        return self._llm.model_config

    def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        """vLLM's LLMEngine.get_supported_tasks(): ("generate",) (engine/tasks.py)."""
        self._llm._check_open()
        return SUPPORTED_TASKS

    def reset_mm_cache(self) -> None:
        self._llm.reset_mm_cache()

    def get_metrics(self) -> NoReturn:
        """vLLM's LLMEngine.get_metrics(): the LLM's (a NotImplementedError: no Prometheus metrics)."""
        self._llm.get_metrics()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self._llm.reset_prefix_cache(reset_running_requests, reset_connector)

    def is_sleeping(self) -> bool:
        return self._llm.is_sleeping()

    def sleep(self, level: int = 1) -> None:
        self._llm.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._llm.wake_up(tags)

    def apply_model(self, func) -> list:
        return self._llm.apply_model(func)

    def collective_rpc(self, method: object, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        return self._llm.collective_rpc(method, timeout, args, kwargs)

    # ----- vLLM's step API -----
    @one_call_at_a_time
    def add_request(self, request_id: str, prompt: object, params: SamplingParams, arrival_time: float | None = None,
                    lora_request: object = None, tokenization_kwargs: dict | None = None,
                    trace_headers: object = None, priority: int = 0) -> str:
        """Queue `prompt` under the caller's `request_id` (a str, not one pending); returns it.
        `arrival_time` and `trace_headers` are ignored; `priority` must be 0 (no priority
        scheduling); `tokenization_kwargs` None or {"truncate_prompt_tokens": k}."""
        self._llm._check_open()  # after exit() no id is pending (its requests were dropped with the engine)
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str (vLLM's engine API), got {request_id!r}")
        self._forget_ended()
        if self._names.get(request_id) in self._llm.scheduler.requests:  # (its own abort_request may have ended it)
            raise ValueError(f"request_id {request_id!r} is already pending")
        check_no_lora(lora_request)
        if not is_zero(priority):
            raise ValueError(f"priority={priority!r}: requests are served in arrival order (priority must be 0)")
        keep = tokenization_truncation(tokenization_kwargs, "")
        ours = self._llm.add_request(prompt, with_prompt_truncation(params, keep))
        self._ids[ours], self._names[request_id] = request_id, ours
        return request_id

    @one_call_at_a_time
    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of the requests it finished and, as their output_kind asks,
        of those it advanced (engine/output_streams.py), under their callers' ids (a request added
        through the LLM's own add_request keeps its int id and gives its final output only)."""
        finished = self._llm.step().finished
        outputs = []
        for out in finished:
            name = self._ids.pop(out.request_id, None)
            if name is not None:
                del self._names[name]
                out = dataclasses.replace(self._streams.final(out), request_id=name)
            outputs.append(out)
        for ours, name in self._ids.items():
            request = self._llm.scheduler.requests.get(ours)
            running = None if request is None else self._streams.running(request)
            if running is not None:
                outputs.append(dataclasses.replace(running, request_id=name))
        return outputs

    def _forget_ended(self) -> None:
        """With nothing pending, no id is: drop entries of requests that ended through the LLM's own
        API (abort_all, abort_request by engine id), which this object never saw end."""
        if not self._llm.scheduler.requests:
            self._ids.clear()
            self._names.clear()
            self._streams = OutputStreams(self._llm.detokenizer)

    def has_unfinished_requests(self) -> bool:
        return not self._llm.is_finished()

    @classmethod
    def validate_outputs(cls, outputs: list, output_type: type) -> list:
        """vLLM's LLMEngine.validate_outputs: `outputs` as they are (its V1 engine's outputs need no
        check; loops copied from vLLM's LLM._run_engine end with it)."""
        return outputs

    @one_call_at_a_time
    def get_num_unfinished_requests(self) -> int:
        """vLLM V1's count (its output processor's request states): a request of n > 1 fans out into
        n child requests there, so each sample not ended yet counts once."""
        self._llm._check_open()
        return sum(request.num_unfinished for request in self._llm.scheduler.requests.values())

    @one_call_at_a_time
    def abort_request(self, request_ids: str | Iterable[str], internal: bool = False) -> None:
        """Drop the pending requests of these caller ids (vLLM's: a list; one str too); ids of no
        pending request are ignored, anything but a str is refused (TypeError) before any is dropped.
        `internal` (vLLM's: the ids are its engine's own rather than the caller's): the same ids
        here, where a request's id is the one add_request returned."""
        self._llm._check_open()
        check_bool("abort_request: internal", internal)
        many = isinstance(request_ids, Iterable) and not isinstance(request_ids, (str, bytes))
        names = list(request_ids) if many else [request_ids]
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"abort_request takes a request id (a str) or an iterable of them, got {bad[0]!r}")
        ours = [self._names.pop(n) for n in names if n in self._names]
        for i in ours:
            del self._ids[i]
            self._streams.forget(i)
        self._llm.abort_request(ours)
