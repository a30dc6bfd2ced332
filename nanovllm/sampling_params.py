"""Per-request sampling settings, with vLLM's field names and meanings.

Every field is validated at construction, and again when a request is added (fields may be edited
afterwards, as RL frameworks do): a bad value raises ValueError/TypeError naming it, so the engine
never sees a request it cannot serve. Checks that need the model (token ids within the vocabulary,
bad words that need a tokenizer) are the engine's (engine/request_intake.py, engine/request_rules.py).

Here: SamplingParams, RequestOutputKind, their limits, field_types. vLLM's module holds
StructuredOutputsParams and BeamSearchParams too, so they are importable from here as from
vllm.sampling_params, though each lives in its own module (structured_outputs_params.py,
beam_search_params.py). Value checks live in utils/validation.py.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import typing
from dataclasses import dataclass, field

from nanovllm.beam_search_params import BeamSearchParams  # noqa: F401 - vLLM's import path
from nanovllm.structured_outputs_params import StructuredOutputsParams
from nanovllm.utils.validation import (check_bool, check_float, check_int, check_seed, check_text, plain_number,
                                       token_id_list)

logger = logging.getLogger(__name__)

# top_k values that switch top-k filtering off (vLLM accepts both spellings).
TOP_K_OFF = (0, -1)
# `logprobs` / `prompt_logprobs` value asking for every token of the vocabulary (vLLM's spelling; the engine
# resolves it to the vocabulary's size and checks it against LLM(max_logprobs=...), as any other count).
ALL_LOGPROBS = -1
# The smallest temperature that samples (vLLM's _MAX_TEMP): a positive one below it is raised to it, as
# vLLM does (logits / T overflows float32 near 0); only temperature 0 is greedy.
MIN_TEMPERATURE = 1e-2
# presence_penalty and frequency_penalty lie in [-PENALTY_LIMIT, PENALTY_LIMIT] (vLLM's and OpenAI's range).
PENALTY_LIMIT = 2.0
# truncate_prompt_tokens value meaning "keep at most max_model_len tokens" (vLLM's spelling).
TRUNCATE_TO_MODEL_LEN = -1
# The seed vLLM reads as None (no seed).
NO_SEED = -1
# The rules work on float32 logits: a bias beyond float32's largest value would be inf there.
FLOAT32_MAX = 3.4028234663852886e38
# The most samples a request may ask for (vLLM's VLLM_MAX_N_SEQUENCES default): each is a sequence the
# engine builds when the request is added, so an unbounded n exhausts host memory there.
MAX_N = 16384
# repetition_penalty's smallest value, float32's smallest normal one: the rules divide float32 logits by
# it, and a smaller one is 0 (a division by zero) or subnormal there.
MIN_REPETITION_PENALTY = 2.0**-126


class RequestOutputKind(enum.Enum):
    """What `llm.llm_engine.step()` returns for a request while it runs (vLLM's names; LLM.generate
    returns finished requests whatever the kind): CUMULATIVE each step its outputs so far, DELTA only
    what is new since the last, FINAL_ONLY nothing until it finishes (engine/output_streams.py)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to pick each next token of one request.

    temperature: 0 is greedy (argmax; top_k, top_p and min_p are then set off, as vLLM sets them);
        above it, samples from softmax(logits / temperature), a temperature below MIN_TEMPERATURE
        being raised to it (with a warning), as vLLM does.
    top_k: keep the k most likely tokens (0 or -1: off).
    top_p: keep the smallest set of tokens whose probability sums to >= top_p (1.0: off).
    min_p: drop tokens with probability < min_p * max probability (0.0: off).
    seed: None draws from the engine's RNG; an int >= 0 makes this request's tokens
        reproducible whatever else is in the batch (-1: None, as in vLLM).
    max_tokens: most tokens to generate.
    ignore_eos: keep generating past EOS tokens.
    stop: strings; generation stops once the decoded completion contains one, and
        the returned text ends before it (after it with include_stop_str_in_output).
    stop_token_ids: extra token ids that end generation like EOS (kept in token_ids).
    logprobs: None, k >= 0 or -1 (the whole vocabulary): each generated token gets a dict
        {token_id: Logprob} with the sampled token and the k most likely ones; logprobs are
        log_softmax of the raw logits (before penalties, temperature and top-k/top-p/min-p), as
        vLLM's, with ranks over the whole vocabulary (nanovllm/outputs.py). The engine refuses a k
        above LLM(max_logprobs=...) (20 unless set; -1: no cap), as vLLM's does.
    prompt_logprobs: None, k >= 0 or -1: the same for every prompt token
        (given the tokens before it; the first prompt token has None).
    n: samples per prompt (at most MAX_N, vLLM's 16384); they share the prompt's KV blocks and are returned
        in "outputs".
    presence_penalty / frequency_penalty: in [-2, 2]; subtracted from the logit of every token
        generated so far, once / once per occurrence (0: off).
    repetition_penalty: > 0; the logit of every token of the prompt or generated so far is divided
        by it where positive and multiplied by it where not (1: off). Penalties apply before greedy
        or sampling, after logit_bias (vLLM's order); logprobs stay those of the raw logits.
    min_tokens: EOS and stop_token_ids cannot be sampled before this many tokens exist (0: off).
    logit_bias: {token_id: bias} added to those logits (finite biases).
    allowed_token_ids: only these tokens can be sampled (None: all).
    bad_words: words never generated: the last token of each of the word's token sequences (with
        and without a leading space) is masked where the tokens before it were just generated.
    include_stop_str_in_output: keep the stop string that ended the text at its end.
    skip_special_tokens: whether the text leaves special tokens out (engine/text_stream.py).
    spaces_between_special_tokens: accepted and not applied (vLLM applies it between two kept
        special tokens).
    detokenize: False leaves every text empty (token ids only; stop strings are then refused).
    truncate_prompt_tokens: keep only the prompt's last k tokens (-1: the last max_model_len); a text
        prompt keeps the special tokens its tokenizer adds (a BOS) among them, as vLLM's does.
    max_tokens: None generates up to max_model_len.
    structured_outputs: None, or a StructuredOutputsParams the completion must follow.
    output_kind: a RequestOutputKind, what llm.llm_engine.step() returns while the request runs.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 64
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Anything for custom samplers and plugins (vLLM's; its own samplers read none either): kept, not read.
    extra_args: dict[str, object] | None = None
    # vLLM's older name of structured_outputs (TRL passes guided_decoding=None): None only, not kept.
    guided_decoding: dataclasses.InitVar[None] = None
    # vLLM's per-request logits callbacks (distilabel passes []): None or empty only (vLLM V1 refuses others too).
    logits_processors: dataclasses.InitVar[list | None] = None
    # vLLM's older best_of (lighteval passes it): None or n only (V1 dropped sampling more to keep the best).
    best_of: dataclasses.InitVar[int | None] = None
    # vLLM's choice of FlatLogprobs over a list of dicts (scoring scripts pass True): a bool, not kept;
    # logprobs are kept flat here either way (outputs.FlatLogprobs, read as the list).
    flat_logprobs: dataclasses.InitVar[bool] = False

    def __post_init__(self, guided_decoding: object, logits_processors: object, best_of: object,
                      flat_logprobs: object) -> None:
        if guided_decoding is not None:
            raise TypeError(f"SamplingParams.guided_decoding is vLLM's older name of structured_outputs: pass "
                            f"structured_outputs=StructuredOutputsParams(...) (nanovllm.sampling_params), got "
                            f"{guided_decoding!r:.200}")
        if logits_processors is not None and (not isinstance(logits_processors, (list, tuple)) or logits_processors):
            raise ValueError(f"SamplingParams.logits_processors={logits_processors!r:.200}: per-request logits "
                             "processors are not supported (vLLM V1 refuses them too); logit_bias, allowed_token_ids, "
                             "bad_words, min_tokens and structured_outputs cover the usual ones")
        check_bool("SamplingParams.flat_logprobs", flat_logprobs)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise TypeError(f"SamplingParams.extra_args must be a dict or None, got {self.extra_args!r:.200}")
        for f in dataclasses.fields(self):
            setattr(self, f.name, plain_number(getattr(self, f.name)))
        if isinstance(self.seed, int) and self.seed == NO_SEED:  # (an array compared with -1 has no truth value)
            self.seed = None
        check_float("SamplingParams.temperature", self.temperature)
        if not 0 <= self.temperature <= FLOAT32_MAX:  # the sampler divides float32 logits by it
            raise ValueError(f"SamplingParams.temperature must be finite in float32 and >= 0 (<= {FLOAT32_MAX:.3g}), "
                             f"got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("SamplingParams.temperature %r is below %r, where logits / temperature overflow: "
                           "raised to %r (vLLM's rule; 0 is greedy)", self.temperature, MIN_TEMPERATURE,
                           MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        check_int("SamplingParams.top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1, 0 (off) or >= 1, got {self.top_k!r}")
        check_float("SamplingParams.top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        check_float("SamplingParams.min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p!r}")
        if self.temperature == 0:  # greedy: the filters off, as vLLM sets them (a later temperature samples unfiltered)
            self.top_k, self.top_p, self.min_p = 0, 1.0, 0.0
        if self.seed is not None:
            check_seed("SamplingParams.seed", self.seed)
        if self.max_tokens is not None:
            check_int("SamplingParams.max_tokens", self.max_tokens, 1)
        check_bool("SamplingParams.ignore_eos", self.ignore_eos)
        check_bool("SamplingParams.include_stop_str_in_output", self.include_stop_str_in_output)
        check_bool("SamplingParams.skip_special_tokens", self.skip_special_tokens)
        check_bool("SamplingParams.spaces_between_special_tokens", self.spaces_between_special_tokens)
        check_bool("SamplingParams.detokenize", self.detokenize)
        if self.stop is None:
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise TypeError(f"SamplingParams.stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(self.stop):
            raise ValueError(f"SamplingParams.stop must not hold an empty string, got {self.stop!r}")
        self.stop = list(self.stop)
        if self.stop and not self.detokenize:
            raise ValueError("SamplingParams.stop strings need detokenize=True (the text is matched): "
                             f"got stop={self.stop!r} with detokenize=False")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.stop_token_ids = token_id_list("SamplingParams.stop_token_ids", self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # vLLM's spelling of 1 (the top token besides the scored one)
                setattr(self, name, 1)
            value = getattr(self, name)
            if value is not None:
                check_int(f"SamplingParams.{name}", value)
                if value < 0 and value != ALL_LOGPROBS:
                    raise ValueError(f"SamplingParams.{name} must be >= 0, or {ALL_LOGPROBS} for the whole vocabulary, "
                                     f"got {value!r}")
        check_int("SamplingParams.n", self.n, 1)
        if self.n > MAX_N:
            raise ValueError(f"SamplingParams.n must be <= {MAX_N}, got {self.n!r} (vLLM's limit)")
        best_of = plain_number(best_of)
        if best_of is not None and (not isinstance(best_of, int) or best_of != self.n):
            raise ValueError(f"SamplingParams.best_of={best_of!r}: only best_of=None or n (={self.n}) is supported "
                             "(vLLM V1 dropped sampling more than n to return the best)")
        self._check_logits_settings()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"SamplingParams.structured_outputs must be StructuredOutputsParams or None, "
                            f"got {self.structured_outputs!r:.200}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"SamplingParams.output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.truncate_prompt_tokens is not None:
            check_int("SamplingParams.truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != TRUNCATE_TO_MODEL_LEN:
                raise ValueError(f"SamplingParams.truncate_prompt_tokens must be >= 1 or "
                                 f"{TRUNCATE_TO_MODEL_LEN} (max_model_len), got {self.truncate_prompt_tokens!r}")

    def _check_logits_settings(self) -> None:
        """Penalties, min_tokens, logit_bias, allowed_token_ids and bad_words (vLLM's ranges);
        containers are copied, so later edits of the caller's lists do not reach a queued request."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check_float(f"SamplingParams.{name}", value)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"SamplingParams.{name} must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}], "
                                 f"got {value!r}")
        check_float("SamplingParams.repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0 and within float32's range "
                             f"[{MIN_REPETITION_PENALTY:.3g}, {FLOAT32_MAX:.3g}], got {self.repetition_penalty!r}")
        check_int("SamplingParams.min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must be <= "
                             f"max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"SamplingParams.logit_bias must be a dict {{token_id: bias}}, "
                                f"got {self.logit_bias!r}")
            self.logit_bias = {plain_number(t): plain_number(b) for t, b in self.logit_bias.items()}
            for token_id, bias in self.logit_bias.items():
                check_int("SamplingParams.logit_bias token id", token_id, 0)
                check_float(f"SamplingParams.logit_bias[{token_id}]", bias)
                if not -FLOAT32_MAX <= bias <= FLOAT32_MAX:
                    raise ValueError(f"SamplingParams.logit_bias[{token_id}] must be finite in float32 (|bias| <= "
                                     f"{FLOAT32_MAX:.3g}: the logits' type), got {bias!r}")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = token_id_list("SamplingParams.allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("SamplingParams.allowed_token_ids is empty: no token could be sampled "
                                 "(None allows all)")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
                raise TypeError(f"SamplingParams.bad_words must be a list of strings, got {self.bad_words!r}")
            if not all(w.strip() for w in self.bad_words):
                raise ValueError(f"SamplingParams.bad_words must not hold blank strings, got {self.bad_words!r}")
            for word in self.bad_words:  # they are tokenized when the request is added
                check_text("SamplingParams.bad_words entry", word)
            self.bad_words = list(dict.fromkeys(self.bad_words))

    def clone(self) -> SamplingParams:
        """vLLM's clone: a deep copy."""
        return copy.deepcopy(self)

    def validated(self) -> SamplingParams:
        """A checked copy of these settings as they are now (the engine keeps one per request, so
        later edits of this object do not change a queued request); raises as construction does."""
        structured = self.structured_outputs
        if isinstance(structured, StructuredOutputsParams):  # re-checked and copied too (it may have been edited)
            structured = dataclasses.replace(structured)
        return dataclasses.replace(self, structured_outputs=structured)

    @property
    def uses_logits_rules(self) -> bool:
        """Whether the logits are changed before sampling (penalties, min_tokens, logit_bias,
        allowed_token_ids, bad_words): rows of requests that use none pay nothing for them."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0 or bool(self.logit_bias) or self.allowed_token_ids is not None
                or bool(self.bad_words))

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0, or top_k 1). The one place this is
        decided: SamplingPack stores such rows as greedy (T = 0), so
        every sampling path (PyTorch or Triton) takes their argmax."""
        return self.temperature == 0 or self.top_k == 1


def field_types() -> dict[str, object]:
    """SamplingParams' fields and their annotations, in order (guided_decoding, an InitVar, is not one)."""
    hints = typing.get_type_hints(SamplingParams)
    return {f.name: hints[f.name] for f in dataclasses.fields(SamplingParams)}
