"""The public entry point: `LLM(model, **config)`, the engine (engine/llm_engine.py) with vLLM's
batch API on top:

    outputs = llm.generate(prompts, sampling_params=None, use_tqdm=True, lora_request=None)
    outputs = llm.chat(messages, sampling_params=None, ...)     # chat template, then generate
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32))  # nanovllm/beam_search.py
    params = llm.get_default_sampling_params()                 # generation_config's defaults
    llm.supported_tasks, llm.llm_engine.get_supported_tasks()  # ("generate",)
    llm.reset_mm_cache()                                       # no multimodal cache: nothing to do
    llm.get_metrics()                                          # NotImplementedError: no Prometheus metrics
    llm.encode / embed / classify / score / reward(...)        # ValueError: not a pooling model (engine/tasks.py)
    llm.start_profile(); ...; llm.stop_profile()               # a torch.profiler trace in $VLLM_TORCH_PROFILER_DIR
    llm.get_tokenizer(), llm.set_tokenizer(tokenizer), llm.llm_engine.model_config.max_model_len, llm.reset_prefix_cache()
    llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)  # = update_weights

Both return one RequestOutput per prompt / conversation, in input order (nanovllm/outputs.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import NoReturn

import numpy as np
from tqdm.auto import tqdm

from nanovllm.beam_search import BeamSearchOutput, beam_search
from nanovllm.beam_search_params import BeamSearchParams
from nanovllm.engine.chat import ChatOptions, render_chat
from nanovllm.engine.llm_engine import LLMEngine, one_call_at_a_time
from nanovllm.engine.profiler import TorchProfiler
from nanovllm.engine.run_rates import RunRates
from nanovllm.engine.tasks import SUPPORTED_TASKS, SupportedTask, pooling_method
from nanovllm.engine.vllm_engine import (
    VllmEngine,
    check_no_lora,
    tokenization_truncation,
    with_prompt_truncation,
)
from nanovllm.inputs import PromptType, legacy_token_prompts, prompt_batch
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.generation_defaults import default_sampling_params
from nanovllm.utils.validation import is_unset, is_zero


def check_use_tqdm(use_tqdm: object) -> None:
    """use_tqdm must not be a list or other sequence: generate's third argument was prompt_token_ids in
    vLLM before 0.11 (`llm.generate(None, params, ids)`), so ids there are refused naming that; any
    other value is read for its truth (use_tqdm=verbose, an int, as vLLM reads it) or called (a factory)."""
    if isinstance(use_tqdm, (SequenceABC, np.ndarray)) and not callable(use_tqdm):
        raise TypeError(f"use_tqdm must be a bool or a tqdm-like factory, got a {type(use_tqdm).__name__} "
                        f"{use_tqdm!r:.80}: vLLM before 0.11 took prompt_token_ids as generate()'s third argument, "
                        f"pass them as prompt_token_ids=... (or as the prompts)")


def _progress_bar(use_tqdm: bool | Callable[..., tqdm], total: int) -> tqdm:
    """generate's bar: tqdm's (hidden with use_tqdm=False), or (vLLM's other form) the one a tqdm
    class or factory makes, called as vLLM calls it (no `disable`: a partial of tqdm may set it)."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)


class LLM(LLMEngine):
    supported_tasks: tuple[SupportedTask, ...] = SUPPORTED_TASKS  # vLLM's attribute: ("generate",)
    # vLLM's pooling methods: a ValueError at the call, naming the method and the supported task
    encode, embed, classify, score, reward = map(pooling_method, ("encode", "embed", "classify", "score", "reward"))

    def __init__(self, model: str, **kwargs):
        super().__init__(model, **kwargs)
        self._vllm_engine = VllmEngine(self)
        self._profiler = TorchProfiler()
        try:
            self._default_params = default_sampling_params(self.config.generation_config, self.config.generation_dir,
                                                          self.generation_values, self.config.override_generation_config)
        except BaseException:
            self.exit()
            raise

    @property
    def llm_engine(self) -> VllmEngine:
        """vLLM's `llm.llm_engine`: its engine API over this LLM (engine/vllm_engine.py)."""
        return self._vllm_engine

    def get_tokenizer(self):
        """The tokenizer (transformers'), None for a model directory without one (vLLM's LLM.get_tokenizer)."""
        self._check_open()
        return self.tokenizer

    def get_metrics(self) -> NoReturn:
        """vLLM's LLM.get_metrics: a snapshot of its Prometheus registry, which nanovllm keeps none of
        (generate's progress bar shows the run's token rates), so a NotImplementedError naming it."""
        self._check_open()
        raise NotImplementedError("LLM.get_metrics() is not supported: nanovllm keeps no Prometheus metrics "
                                  "(generate()'s progress bar shows a run's token rates; RequestOutput.metrics is None)")

    def reset_mm_cache(self) -> None:
        """vLLM's LLM.reset_mm_cache: clears the multimodal processor and encoder caches, which a
        text-only engine has none of, so it does nothing (as vLLM's with no such cache); the
        prefix cache stays (reset_prefix_cache empties that)."""
        self._check_open()

    def _release(self) -> None:
        profiler = getattr(self, "_profiler", None)  # None: __init__ failed before it was made
        if profiler is not None:
            profiler.close()  # a recording still running ends with the engine, its trace written
        super()._release()

    @one_call_at_a_time
    def start_profile(self) -> None:
        """vLLM's LLM.start_profile: torch.profiler records from here to stop_profile(), which writes
        the trace into $VLLM_TORCH_PROFILER_DIR; RuntimeError without it (engine/profiler.py)."""
        self._check_open()
        self._profiler.start(self.model_runner.device)

    @one_call_at_a_time
    def stop_profile(self) -> None:
        """vLLM's LLM.stop_profile: ends the recording start_profile() began and writes its trace."""
        self._check_open()
        self._profiler.stop()

    @one_call_at_a_time
    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams generate() uses when given none: LLM(generation_config=...)'s
        (the checkpoint's temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens
        under "auto"); a fresh copy each call."""
        self._check_open()
        return self._default_params.validated()

    @one_call_at_a_time
    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType] | None = None,
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: object = None,
        priority: list[int] | None = None,
        *,
        prompt_token_ids: SequenceABC | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` to completion; returns one RequestOutput per prompt, in input order.
        Every request is checked before any is queued (bad input leaves the engine untouched).
        `priority`: vLLM's per-prompt priorities, None or all 0 (requests are served in arrival order).
        `prompt_token_ids`: vLLM's older spelling of token-id prompts (inputs.legacy_token_prompts);
        `tokenization_kwargs`: None, or vLLM 0.17's {"truncate_prompt_tokens": k} (where it moved
        SamplingParams.truncate_prompt_tokens); prompts are tokenized as the tokenizer does by default."""
        self._check_open()
        self._check_not_generating("generate()")
        check_use_tqdm(use_tqdm)
        keep = tokenization_truncation(tokenization_kwargs, ": prompts are tokenized as the tokenizer does by "
                                       "default (pass token ids to tokenize otherwise)")
        if prompt_token_ids is not None:
            prompts = legacy_token_prompts(prompts, prompt_token_ids)
        elif prompts is None:
            raise TypeError("generate() needs prompts (or vLLM's older prompt_token_ids=)")
        prompts = prompt_batch(prompts)  # one prompt (a str, a dict, a list of token ids) or a list of them
        if not isinstance(prompts, SequenceABC):
            raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        prompts = list(prompts)
        check_no_lora(lora_request, len(prompts))
        if sampling_params is None:
            sampling_params = self._default_params
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, SequenceABC) and not isinstance(sampling_params, str):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        else:
            raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {sampling_params!r}")
        if priority is not None:
            if not isinstance(priority, SequenceABC) or len(priority) != len(prompts):
                raise ValueError(f"priority must be a list of one int per prompt ({len(prompts)}), got {priority!r}")
            if not all(map(is_zero, priority)):
                raise ValueError(f"priority={priority!r}: requests are served in arrival order (no priority "
                                 "scheduling); pass None or zeros")
        checked = {}  # one checked copy per distinct SamplingParams object
        for sp in params:
            if id(sp) not in checked:
                checked[id(sp)] = self.intake.check(with_prompt_truncation(sp, keep))
        requests = [(self.validator.validate(p, checked[id(sp)].params), checked[id(sp)])
                    for p, sp in zip(prompts, params)]
        if not self.is_finished():
            raise RuntimeError("generate() called while step-wise requests are still pending")
        # made before anything is queued: a bar factory that raises leaves the engine as it was
        bar = _progress_bar(use_tqdm, len(requests))
        try:  # an error or interrupt while queueing or stepping leaves nothing queued
            self._generating = True  # the bar's methods may not step or add requests meanwhile
            ids = [self._enqueue(*request) for request in requests]
            return self._run(ids, bar)
        except BaseException:
            self.abort_all()
            raise
        finally:
            self._generating = False
            bar.close()

    def _run(self, ids: list[int], bar: tqdm) -> list[RequestOutput]:
        """Step until the requests `ids` finish (or are aborted); `bar` counts them and shows the
        run's average token rates. Outputs carry their id as a str, as vLLM's LLM names requests
        (str of a counter); the step API's stay the engine's ints."""
        outputs: dict[int, RequestOutput] = {}
        rates = RunRates(time.perf_counter())
        while not self.is_finished():
            result = self._step()
            rates.add(result.num_prompt_tokens, len(result.sampled))
            bar.set_postfix(rates.postfix(time.perf_counter()), refresh=False)
            for out in result.finished:
                outputs[out.request_id] = out
            bar.update(len(result.finished))
        # one aborted meanwhile is left out (as vLLM)
        return [dataclasses.replace(outputs[i], request_id=str(i)) for i in ids if i in outputs]

    @one_call_at_a_time
    def beam_search(self, prompts: SequenceABC[PromptType], params: BeamSearchParams, lora_request: object = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: the params.beam_width most likely continuations of each prompt
        (a TokensPrompt / TextPrompt dict, a string or token ids), best first (nanovllm/beam_search.py)."""
        self._check_open()
        self._check_not_generating("beam_search()")
        batch = prompt_batch(prompts)  # (beam_search checks it is a list)
        check_no_lora(lora_request, len(batch) if isinstance(batch, SequenceABC) else None)
        if not self.is_finished():
            raise RuntimeError("beam_search() called while step-wise requests are still pending")

        def one_step(batch: list[dict], step_params: SamplingParams) -> list[RequestOutput]:
            return self.generate(batch, step_params, use_tqdm=False)

        return beam_search(self, one_step, prompts, params, use_tqdm, concurrency_limit)

    @one_call_at_a_time
    def chat(
        self,
        messages: SequenceABC,
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: object = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        tokenization_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat, with its arguments in its order: `messages` is one conversation (a list
        of {"role", "content"} dicts) or a list of them; each is rendered with the chat template (the
        tokenizer's, or `chat_template`, seeing contents as `chat_template_content_format` says:
        engine/chat.py; `tools` and `chat_template_kwargs` such as {"enable_thinking": False} reach
        it, the latter over the named options), tokenized without special tokens, and generated like
        generate() does. Returns one RequestOutput per conversation, in input order ([] for an empty list).
        `tokenization_kwargs`: as generate's; `mm_processor_kwargs`: None (text models only)."""
        self._check_open()
        check_use_tqdm(use_tqdm)
        check_no_lora(lora_request)
        tokenization_truncation(tokenization_kwargs, ": the rendered conversation is tokenized without special "
                                "tokens, as vLLM does, and nothing else")
        if not is_unset(mm_processor_kwargs):
            raise ValueError(f"mm_processor_kwargs={mm_processor_kwargs!r}: nanovllm serves text models only")
        options = ChatOptions(chat_template, add_generation_prompt, continue_final_message,
                              {} if chat_template_kwargs is None else chat_template_kwargs, tools,
                              chat_template_content_format)
        prompts = render_chat(self.tokenizer, self.config.tokenizer, messages, options)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request, tokenization_kwargs=tokenization_kwargs)
