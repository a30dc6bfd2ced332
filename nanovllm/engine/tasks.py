"""The tasks a model serves, under vLLM's names and types (vllm/tasks.py): nanovllm runs generative
models only, so every engine supports SUPPORTED_TASKS = ("generate",), what vLLM's
`llm_engine.get_supported_tasks()` returns for a text-generation model (its `llm.supported_tasks`).
vLLM's pooling methods (encode, embed, classify, score, reward) refuse at the call, as vLLM's refuse
on a generative model (`pooling_method`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NoReturn

GenerationTask = Literal["generate", "transcription"]
PoolingTask = Literal["encode", "embed", "classify", "score", "token_embed", "token_classify"]
SupportedTask = Literal[GenerationTask, PoolingTask]

SUPPORTED_TASKS: tuple[SupportedTask, ...] = ("generate",)

# The first sentence of vLLM's ValueError for each pooling method on a generative model (vLLM 0.10-0.12;
# its reward() goes through encode(), whose sentence names the method here).
POOLING_REFUSALS = {
    "encode": "LLM.encode() is only supported for pooling models.",
    "embed": "Embedding API is not supported by this model.",
    "classify": "Classification API is not supported by this model.",
    "score": "LLM.score() is only supported for pooling models.",
    "reward": "LLM.reward() is only supported for pooling models.",
}


def pooling_method(name: str) -> Callable[..., NoReturn]:
    """LLM.`name`, one of vLLM's pooling methods: whatever its arguments, a ValueError at the call
    with vLLM's sentence, naming the method and the supported task (the engine untouched)."""

    def refuse(self, *args, **kwargs) -> NoReturn:
        self._check_open()
        raise ValueError(f"{POOLING_REFUSALS[name]} LLM.{name}() needs a pooling model, and this model's supported "
                         f"tasks are {SUPPORTED_TASKS} (nanovllm serves generative models only: use LLM.generate() "
                         "or LLM.chat())")

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"vLLM's LLM.{name}: pooling models only, so a ValueError here (engine/tasks.py)."
    return refuse
