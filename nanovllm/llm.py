"""The public entry point: `LLM(model, **config)` is the engine."""

from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    pass
