"""vLLM's `LLM.beam_search`: the `beam_width` most likely continuations of each prompt, found by
one-token generate() steps over every live beam (their prompts share KV blocks through the
prefix cache).

    step:  each live beam b  --generate(max_tokens=1, logprobs=2W)-->  its 2W most likely tokens t
           candidates b + t, cumulative logprob b.cum + logprob(t)
             t an EOS (unless ignore_eos)  -> a finished beam, kept aside
             otherwise                     -> a live candidate
           the W best live candidates go on (W = beam_width)
    end:   after max_tokens steps (or no live beam): the W best of finished + live beams

Beams are ranked by cum_logprob / len ** length_penalty, len counting the prompt's tokens and not a
final EOS (vLLM's score), compared in log space (`beam_rank`): len ** length_penalty itself overflows,
or underflows to a division by zero, for a large |length_penalty|. A beam that reaches max_model_len
stops growing (it stays a candidate); a prompt of max_model_len tokens takes one step (generate()
serves it one token).
EOS is any of the engine's EOS ids (the tokenizer's and generation_config.json's, which generate()
stops at too). The logprobs are the raw ones (log_softmax of the model's logits), as vLLM's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from nanovllm.beam_search_params import BeamSearchParams
from nanovllm.inputs import prompt_batch, tokens_prompt
from nanovllm.outputs import Logprob
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.validation import check_int, plain_number

if TYPE_CHECKING:
    from nanovllm.engine.llm_engine import LLMEngine
    from nanovllm.engine.prompts import PreparedPrompt
    from nanovllm.outputs import RequestOutput

# LLM.generate as beam search calls it: (prompts, params) -> one output per prompt.
Generate = Callable[[list[dict], SamplingParams], list["RequestOutput"]]


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` (the prompt's, then the completion's), one logprobs dict per completion
    token (the candidates its step read, the chosen token among them), the cumulative logprob of
    the completion, and its text once returned: all its tokens decoded, prompt and a final EOS
    included, as vLLM's LLM.beam_search returns it. finish_reason: "stop" (EOS) or "length"."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None  # the EOS id that ended it
    lora_request: None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Instance:
    """One prompt's search: its live beams (best first), the finished ones, this step's candidates,
    and its prompt's cache_salt (None: none)."""

    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)
    candidates: list[BeamSearchSequence] = field(default_factory=list)
    salt: str | None = None


def beam_rank(beam: BeamSearchSequence, eos: frozenset[int], length_penalty: float) -> tuple[int, float]:
    """A key that orders beams as vLLM's score does, cumulative logprob over the length (prompt
    included, a final EOS not) ** penalty, without forming len ** length_penalty (which overflows,
    or underflows to zero, for a large |length_penalty|): the score's sign, then the log of its
    magnitude, log|cum_logprob| - length_penalty * log(len), negated for a negative score."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos)
    cum = beam.cum_logprob
    if cum == 0:
        return 0, 0.0
    log_magnitude = math.log(abs(cum)) - length_penalty * math.log(length)
    return (1, log_magnitude) if cum > 0 else (-1, -log_magnitude)


def _full(beam: BeamSearchSequence, max_len: int) -> bool:
    """Whether `beam` grows no more: it holds max_len tokens or more and a completion token. A bare
    prompt of max_len tokens still takes its step, as generate() serves such a prompt one token (so
    its search returns beam_width one-token beams, not the prompt alone with no completion)."""
    return len(beam.tokens) >= max_len and bool(beam.logprobs)


def beam_search(llm: LLMEngine, generate: Generate, prompts: Sequence[object], params: BeamSearchParams,
                use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """The W best beams of each prompt (module docstring), in input order, each step a `generate`
    call (LLM.generate) on `llm`; params and prompts are checked before any step runs. `concurrency_limit`: at
    most this many prompts searched at a time."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
    params = params.validated()  # its fields as they are now (edited ones too), checked
    prompts = prompt_batch(prompts)  # one prompt (a str, a dict, a list of token ids) or a list of them
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    concurrency_limit = plain_number(concurrency_limit)  # a NumPy count, as BeamSearchParams takes them
    if concurrency_limit is not None:
        check_int("concurrency_limit", concurrency_limit, 1)
    if 2 * params.beam_width > llm.config.logprobs_limit:
        raise ValueError(f"BeamSearchParams.beam_width={params.beam_width}: each step reads the 2 x beam_width most "
                         f"likely tokens, more than the {llm.config.logprobs_limit} logprobs this engine allows: "
                         f"raise LLM(max_logprobs=...) to at least {2 * params.beam_width}")
    step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature)
    # checked as one request of max_tokens: a beam that would outgrow the KV cache is refused before any step
    whole = SamplingParams(max_tokens=params.max_tokens)
    checked = [llm.validator.validate(p, whole) for p in prompts]
    chunk = concurrency_limit or max(1, len(checked))
    outputs = []
    for start in range(0, len(checked), chunk):
        outputs += _search(llm, generate, checked[start:start + chunk], params, step_params, use_tqdm)
    return outputs


def _search(llm: LLMEngine, generate: Generate, prompts: list[PreparedPrompt], params: BeamSearchParams,
            step_params: SamplingParams, use_tqdm: bool) -> list[BeamSearchOutput]:
    """The search of `prompts` (checked); a prompt's cache_salt rides on each of its beams' steps."""
    eos = frozenset(llm.eos_token_ids)
    stops = frozenset() if params.ignore_eos else eos  # the tokens that finish a beam
    max_len = llm.config.max_model_len

    def score(beam: BeamSearchSequence) -> tuple[int, float]:
        return beam_rank(beam, eos, params.length_penalty)

    instances = [_Instance([BeamSearchSequence(list(p.token_ids))], salt=p.cache_salt) for p in prompts]
    for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
        for instance in instances:  # a beam at max_model_len cannot grow: it waits for the end
            instance.completed += [b for b in instance.beams if _full(b, max_len)]
            instance.beams = [b for b in instance.beams if not _full(b, max_len)]
        live = [(instance, beam) for instance in instances for beam in instance.beams]
        if not live:
            break
        results = generate([tokens_prompt(beam.tokens, instance.salt) for instance, beam in live], step_params)
        for (instance, beam), result in zip(live, results):
            step_logprobs = result.outputs[0].logprobs[0]
            for token, logprob in step_logprobs.items():
                grown = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [step_logprobs],
                                           beam.cum_logprob + logprob.logprob)
                if token in stops:
                    grown.finish_reason, grown.stop_reason = "stop", token
                    instance.completed.append(grown)
                else:
                    instance.candidates.append(grown)
        for instance in instances:
            instance.beams = sorted(instance.candidates, key=score, reverse=True)[: params.beam_width]
            instance.candidates = []
    outputs = []
    for instance in instances:
        best = sorted(instance.completed + instance.beams, key=score, reverse=True)[: params.beam_width]
        for beam in best:
            beam.finish_reason = beam.finish_reason or "length"
            beam.text = "" if llm.tokenizer is None else llm.tokenizer.decode(beam.tokens)  # vLLM's LLM.beam_search
        outputs.append(BeamSearchOutput(best))
    return outputs
