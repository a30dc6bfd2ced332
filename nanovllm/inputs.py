"""vLLM's prompt dicts (`vllm.inputs`), which `LLM.generate` takes beside strings and token-id lists:
code written as `from vllm.inputs import TokensPrompt` runs as `from nanovllm.inputs import TokensPrompt`.
engine/prompts.py checks and tokenizes them."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import TypedDict


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """vLLM's prompt given as token ids: {"prompt_token_ids": [...]} (a "prompt" text may ride along;
    "cache_salt": only prompts of the same salt share prefix-cache hits, engine/prompts.py)."""

    prompt: str
    cache_salt: str


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, total=False):
    """vLLM's prompt given as text: {"prompt": "..."} (and its "cache_salt", as TokensPrompt's)."""

    cache_salt: str


# What one prompt may be (vLLM's PromptType, less its multimodal and encoder-decoder forms).
PromptType = str | list[int] | TokensPrompt | TextPrompt


def tokens_prompt(token_ids: list[int], cache_salt: str | None = None) -> TokensPrompt:
    """A TokensPrompt of `token_ids`, under `cache_salt` when one is given (None: the key is left out)."""
    prompt = TokensPrompt(prompt_token_ids=token_ids)
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def prompt_batch(prompts: object) -> object:
    """`prompts` as a batch, by vLLM's rule (prompt_to_seq): a str, a dict or a non-empty list whose
    first item is an int (a list of token ids) is one prompt, wrapped in a list; anything else is
    returned as given (a sequence of prompts, checked by the caller). Bytes (undecoded text, else a
    sequence of ints, one "prompt" per byte) are a TypeError."""
    if isinstance(prompts, (bytes, bytearray)):
        raise TypeError(f"prompts must be a str, a list of token ids, a prompt dict or a list of them, got "
                        f"{type(prompts).__name__}: decode it to a str first")
    one_id_list = (isinstance(prompts, list) and len(prompts) > 0 and isinstance(prompts[0], Integral))
    return [prompts] if isinstance(prompts, (str, dict)) or one_id_list else prompts


def legacy_token_prompts(prompts: object, prompt_token_ids: object) -> list:
    """vLLM's older `generate(prompt_token_ids=...)` (deprecated there in 0.4, gone in 0.11; lm-eval,
    lighteval and OpenRLHF still pass it): a list of token ids is one prompt, a list of such lists
    one each (their ids checked as any prompt's, by the engine); with `prompts` (texts) too, the two
    must be as many and the texts are what is generated, as vLLM did (the ids then checked here, as
    it parsed them). Returns the prompts to generate."""
    if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
        raise TypeError(f"prompt_token_ids must be a list of token ids or a list of such lists, got "
                        f"{type(prompt_token_ids).__name__}")
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids is empty")
    one = isinstance(prompt_token_ids[0], Integral)
    batch = [prompt_token_ids] if one else list(prompt_token_ids)
    if not all(isinstance(ids, Sequence) and not isinstance(ids, (str, bytes)) for ids in batch):
        raise TypeError(f"prompt_token_ids must be a list of token ids or a list of such lists, got "
                        f"{prompt_token_ids!r:.200}")
    if prompts is None:  # the engine's prompt checks take the ids from here (one pass, fast for plain ints)
        return [TokensPrompt(prompt_token_ids=list(ids)) for ids in batch]
    if not all(ids and all(isinstance(t, Integral) and not isinstance(t, bool) for t in ids) for ids in batch):
        raise TypeError(f"prompt_token_ids must be a list of token ids or a list of such (non-empty) lists, got "
                        f"{prompt_token_ids!r:.200}")
    texts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"with prompt_token_ids, prompts must be text (a str or a list of them), got {prompts!r:.200}")
    if len(texts) != len(batch):
        raise ValueError(f"got {len(texts)} prompts and {len(batch)} prompt_token_ids lists: they must be as many")
    return texts
