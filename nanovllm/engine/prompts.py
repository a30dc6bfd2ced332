"""Checks and tokenizes one request before it reaches the scheduler.

Accepted prompts: a string (needs a tokenizer), a list of token ids, or vLLM's
{"prompt_token_ids": [...]} / {"prompt": "..."} dicts. Anything else, or a request
the engine could never serve, raises TypeError/ValueError naming the bad value.
"""

from __future__ import annotations

from nanovllm.sampling_params import SamplingParams


class PromptValidator:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, kv_capacity_tokens: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens

    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer: pass prompts as lists of token ids")
        return self.tokenizer.encode(text)

    def token_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is an empty string")
            return self._tokenize(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt is an empty list of token ids")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"prompt token ids must be ints, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def validate(self, prompt: object, params: object) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        ids = self.token_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                "no room for a generated token"
            )
        # The last sampled token's KV is never computed, hence the -1.
        kv_tokens = min(len(ids) + params.max_tokens, self.max_model_len) - 1
        if kv_tokens > self.kv_capacity_tokens:
            raise ValueError(
                f"request needs KV for {kv_tokens} tokens (prompt {len(ids)} + max_tokens {params.max_tokens}) "
                f"but the whole KV cache holds {self.kv_capacity_tokens}"
            )
        return ids
