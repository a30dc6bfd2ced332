"""vLLM's prompt dicts (`vllm.inputs`), which `LLM.generate` takes beside strings and token-id lists:
code written as `from vllm.inputs import TokensPrompt` runs as `from nanovllm.inputs import TokensPrompt`.
engine/prompts.py checks and tokenizes them."""

from __future__ import annotations

from typing import TypedDict


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """vLLM's prompt given as token ids: {"prompt_token_ids": [...]} (a "prompt" text may ride along)."""

    prompt: str


class TextPrompt(TypedDict):
    """vLLM's prompt given as text: {"prompt": "..."}."""

    prompt: str


# What one prompt may be (vLLM's PromptType, less its multimodal and encoder-decoder forms).
PromptType = str | list[int] | TokensPrompt | TextPrompt
