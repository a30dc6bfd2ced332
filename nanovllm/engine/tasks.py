"""The tasks a model serves, under vLLM's names and types (vllm/tasks.py): nanovllm runs generative
models only, so every engine supports SUPPORTED_TASKS = ("generate",), what vLLM's
`llm_engine.get_supported_tasks()` returns for a text-generation model (its `llm.supported_tasks`)."""

from __future__ import annotations

from typing import Literal

GenerationTask = Literal["generate", "transcription"]
PoolingTask = Literal["encode", "embed", "classify", "score", "token_embed", "token_classify"]
SupportedTask = Literal[GenerationTask, PoolingTask]

SUPPORTED_TASKS: tuple[SupportedTask, ...] = ("generate",)
