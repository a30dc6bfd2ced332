"""Per-request sampling settings, with vLLM's field names and meanings.

Every field is validated at construction: a bad value raises ValueError/TypeError
naming it, so the engine never sees a request it cannot serve.
"""

from __future__ import annotations

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

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature below GREEDY_TEMPERATURE, or top_k
        1). The one place this is decided: SamplingPack stores such rows as greedy (T = 0), so
        every sampling path (PyTorch or Triton) takes their argmax."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
