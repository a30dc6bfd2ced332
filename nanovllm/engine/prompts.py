"""Checks and tokenizes one request before it reaches the scheduler.

Accepted prompts: a string (needs a tokenizer), a list of token ids, or vLLM's
{"prompt_token_ids": [...]} / {"prompt": "..."} dicts (nanovllm.inputs' TokensPrompt / TextPrompt;
one that sets multimodal data or prompt_embeds is refused). A dict's "cache_salt" (a non-empty str) isolates its
prefix-cache hits as vLLM V1's does: only requests with the same salt (or all without one) share
cached KV blocks (engine/block_manager.py seeds the first block's hash with it).
Anything else (a text that is not valid Unicode too: a lone surrogate), or a request the engine could
never serve, raises TypeError/ValueError naming the bad value.
A text prompt is tokenized as the tokenizer does by default (with its special tokens, e.g. a BOS).
truncate_prompt_tokens keeps a prompt's last tokens (a text prompt's as vLLM's left-truncating
tokenizer keeps them: the special tokens it adds, e.g. a BOS, stay); max_tokens=None is resolved
here to the room left under max_model_len. As in vLLM, a prompt may fill max_model_len: it then
generates one token (its KV is never computed), which ends it by length.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from nanovllm.sampling_params import TRUNCATE_TO_MODEL_LEN, SamplingParams
from nanovllm.utils.validation import check_text, is_unset

# Keys of vLLM's prompt dicts that carry images, audio and their processing: refused when set (text
# models only); "cache_salt" is kept (PreparedPrompt), the other keys change nothing here and are ignored.
MEDIA_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")


@dataclass(frozen=True)
class PreparedPrompt:
    """A checked prompt: its token ids (truncated as asked), the most tokens its request may
    generate, its text when it was given as text, and its dict's cache_salt (None: none)."""

    token_ids: list[int]
    max_tokens: int
    text: str | None
    cache_salt: str | None = None


def prompt_text(prompt: object) -> str | None:
    """The text of a prompt given as text (a str, or a dict's "prompt", which a dict with token ids
    may carry too: chat's rendered prompts), else None."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def tokenized_text(prompt: object) -> str | None:
    """The text a prompt's token ids are tokenized from (a str, or a dict's "prompt" when it gives
    no "prompt_token_ids"), else None."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return None
    return prompt_text(prompt)


def prompt_cache_salt(prompt: object) -> str | None:
    """The "cache_salt" of a prompt dict (vLLM's: a non-empty str), None when it sets none."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise TypeError(f"prompt dict's cache_salt must be a str, got {salt!r}")
    if not salt:
        raise ValueError("prompt dict's cache_salt is an empty string: pass a non-empty salt, or none")
    return salt


class PromptValidator:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, kv_capacity_tokens: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens

    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("no tokenizer is loaded (the model directory has none, or skip_tokenizer_init=True): "
                             "pass prompts as lists of token ids")
        check_text("prompt", text)
        return self.tokenizer.encode(text)

    def _truncate_text(self, text: str, ids: list[int], keep: int) -> list[int]:
        """`ids` (the tokens of `text`) cut to at most `keep` as vLLM's tokenizer cuts them (its
        truncation_side="left"): the special tokens it adds (a BOS) stay, the text keeps its last tokens."""
        if len(ids) <= keep:
            return ids
        plain = self.tokenizer.encode(text, add_special_tokens=False)
        added = len(ids) - len(plain)
        start = next((i for i in range(added + 1) if ids[i:i + len(plain)] == plain), None) if added >= 0 else None
        if start is None:  # the special tokens are not around the text's tokens: its last tokens only
            return ids[-keep:]
        room = max(0, keep - added)
        return (ids[:start] + plain[len(plain) - room:] + ids[start + len(plain):])[-keep:]

    def token_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, dict):
            media = [key for key in MEDIA_KEYS if not is_unset(prompt.get(key))]
            if media:
                raise ValueError(f"prompt dict sets {', '.join(map(repr, media))}: nanovllm serves text models "
                                 f"only (give the prompt's text or token ids alone)")
            if prompt.get("prompt_embeds") is not None:  # (a tensor: no truth value)
                raise ValueError("prompt dict sets 'prompt_embeds': nanovllm takes prompts as text or token ids, "
                                 "not embeddings (vLLM's EmbedsPrompt is not supported)")
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, (list, tuple)):  # vLLM's TokensPrompt: token ids only, never text
                    raise TypeError(f"prompt_token_ids must be a list of token ids, got {type(prompt).__name__}")
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):  # vLLM's TextPrompt: text only (token ids: prompt_token_ids)
                    raise TypeError(f"a prompt dict's 'prompt' must be a str (token ids go under 'prompt_token_ids'), "
                                    f"got {type(prompt).__name__}")
            else:
                raise ValueError(f"prompt dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            # vLLM refuses a prompt of no tokens, not an empty text: "" is [BOS] where the tokenizer adds one
            ids = self._tokenize(prompt)
            if not ids and not prompt:
                raise ValueError("prompt is an empty string, which tokenizes to no tokens (the tokenizer adds no BOS)")
            if not ids:  # e.g. whitespace under a WordPiece tokenizer without a [CLS] template
                raise ValueError(f"prompt {prompt[:80]!r} tokenizes to no tokens")
            source = f"prompt {prompt[:80]!r} tokenizes to token id"  # a tokenizer larger than the model's vocabulary
        else:
            if not isinstance(prompt, (list, tuple)):
                raise TypeError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError("prompt is an empty list of token ids")
            ids = list(prompt)
            # Plain ints pass at C speed (an isinstance(t, Integral) a token cost ~0.7 ms per 1,000 tokens
            # on a CI core: time to first token); other integers (numpy's) are checked one by one.
            if set(map(type, ids)) != {int}:
                for t in ids:
                    if isinstance(t, bool) or not isinstance(t, Integral):
                        raise TypeError(f"prompt token ids must be ints, got {t!r}")
                ids = [int(t) for t in ids]
            source = "prompt token id"
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"{source} {bad}, outside the model's vocabulary [0, {self.vocab_size})")
        return ids

    def validate(self, prompt: object, params: SamplingParams) -> PreparedPrompt:
        """`prompt` checked for a request with (checked) `params`."""
        ids = self.token_ids(prompt)
        salt = prompt_cache_salt(prompt)
        if params.truncate_prompt_tokens is not None:
            keep = (self.max_model_len if params.truncate_prompt_tokens == TRUNCATE_TO_MODEL_LEN
                    else params.truncate_prompt_tokens)
            text = tokenized_text(prompt)
            ids = ids[-keep:] if text is None else self._truncate_text(text, ids, keep)
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len})")
        room = max(1, self.max_model_len - len(ids))  # tokens it can generate: one past a full prompt
        max_tokens = room if params.max_tokens is None else params.max_tokens
        # The last sampled token's KV is never computed, hence the -1.
        kv_tokens = len(ids) + min(max_tokens, room) - 1
        if kv_tokens > self.kv_capacity_tokens:
            if params.max_tokens is None:
                asked = f"max_tokens None: up to max_model_len {self.max_model_len}, {room} tokens"
            elif max_tokens > room:
                asked = f"max_tokens {max_tokens}, of which max_model_len {self.max_model_len} leaves {room}"
            else:
                asked = f"max_tokens {max_tokens}"
            fits = self.kv_capacity_tokens - len(ids) + 1  # the most tokens it could generate
            hint = (f"pass max_tokens <= {fits}" if fits >= 1 else "the prompt alone is longer than the cache")
            raise ValueError(
                f"request needs KV for {kv_tokens} tokens (prompt {len(ids)} + {asked}) "
                f"but the whole KV cache holds {self.kv_capacity_tokens}: {hint}, or give the engine more KV "
                f"cache (num_kvcache_blocks / kv_cache_memory_bytes / gpu_memory_utilization)"
            )
        return PreparedPrompt(ids, max_tokens, prompt_text(prompt), salt)
