"""Per-request sampling settings, with vLLM's field names and meanings.

Every field is validated at construction: a bad value raises ValueError/TypeError
naming it, so the engine never sees a request it cannot serve.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from nanovllm.utils.validation import check_int

# top_k values that switch top-k filtering off (vLLM accepts both spellings).
TOP_K_OFF = (0, -1)
# Most alternatives `logprobs` / `prompt_logprobs` may ask for: vLLM's default max_logprobs.
MAX_LOGPROBS = 20
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): logits / T overflows float32 near 0.
GREEDY_TEMPERATURE = 1e-5


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"SamplingParams.{name} must be a number, got {value!r}")
    if math.isnan(value):
        raise ValueError(f"SamplingParams.{name} must not be NaN")


@dataclass
class StructuredOutputsParams:
    """Constrains a completion to a formal language (vLLM's structured outputs). Exactly one of:

    json: a JSON schema (a dict, or its JSON text): the completion is JSON valid against it.
    regex: the whole completion matches this regular expression.
    choice: the completion is one of these strings.
    grammar: an EBNF grammar (xgrammar's GBNF-style syntax, start rule `root`).
    json_object: True: the completion is a JSON object.

    disable_any_whitespace: JSON (json / json_object) without optional whitespace; by default any
        whitespace JSON allows may come between its tokens.
    EOS ends a constrained completion only where the language allows the text to end. The shape
    is checked here; the contents (a bad regex, schema or grammar) when the request is added,
    where the grammar is compiled (engine/structured_outputs.py)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams takes exactly one of json, regex, choice, grammar, "
                             f"json_object; got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"StructuredOutputsParams.json is not JSON text ({e}): {self.json!r:.200}") from e
            else:
                schema = self.json
            if isinstance(schema, bool) or not isinstance(schema, dict):
                raise TypeError(f"StructuredOutputsParams.json must be a JSON schema object (a dict or its "
                                f"JSON text), got {self.json!r:.200}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"StructuredOutputsParams.{name} must be a non-empty string, got {value!r:.200}")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise TypeError(f"StructuredOutputsParams.choice must be a non-empty list of strings, "
                                f"got {self.choice!r:.200}")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"StructuredOutputsParams.json_object must be True (or None: not asked), "
                             f"got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise TypeError(f"StructuredOutputsParams.disable_any_whitespace must be a bool, "
                            f"got {self.disable_any_whitespace!r}")


@dataclass
class SamplingParams:
    """How to pick each next token of one request.

    temperature: 0 is greedy (argmax), and so is any value below GREEDY_TEMPERATURE; above it,
        samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 or -1: off).
    top_p: keep the smallest set of tokens whose probability sums to >= top_p (1.0: off).
    min_p: drop tokens with probability < min_p * max probability (0.0: off).
    seed: None draws from the engine's RNG; an int makes this request's tokens
        reproducible whatever else is in the batch.
    max_tokens: most tokens to generate.
    ignore_eos: keep generating past EOS tokens.
    stop: strings; generation stops once the decoded completion contains one, and
        the returned text ends before it.
    stop_token_ids: extra token ids that end generation like EOS (kept in token_ids).
    logprobs: None, or k in [0, MAX_LOGPROBS]: each generated token gets a dict
        {token_id: logprob} with the sampled token and the k most likely ones; logprobs are
        log_softmax of the raw logits (before temperature and top-k/top-p/min-p), as vLLM's.
    prompt_logprobs: None, or k in [0, MAX_LOGPROBS]: the same for every prompt token
        (given the tokens before it; the first prompt token has None).
    n: samples per prompt; they share the prompt's KV blocks and are returned in "outputs".
    structured_outputs: None, or a StructuredOutputsParams the completion must follow.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 64
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_float("temperature", self.temperature)
        if self.temperature < 0 or math.isinf(self.temperature):
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {self.temperature!r}")
        check_int("SamplingParams.top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1, 0 (off) or >= 1, got {self.top_k!r}")
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            check_int("SamplingParams.seed", self.seed, 0)
        check_int("SamplingParams.max_tokens", self.max_tokens, 1)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise TypeError(f"SamplingParams.stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"SamplingParams.stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            check_int("SamplingParams.stop_token_ids", token_id, 0)
        self.stop_token_ids = list(self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                check_int(f"SamplingParams.{name}", value, 0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"SamplingParams.{name} must be at most {MAX_LOGPROBS}, got {value!r}")
        check_int("SamplingParams.n", self.n, 1)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"SamplingParams.structured_outputs must be StructuredOutputsParams or None, "
                            f"got {self.structured_outputs!r:.200}")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature below GREEDY_TEMPERATURE, or top_k
        1). The one place this is decided: SamplingPack stores such rows as greedy (T = 0), so
        every sampling path (PyTorch or Triton) takes their argmax."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
