"""config.json's `architectures` -> the model class that builds it: the one list of what loads.

Each entry names the module that defines a class of the architecture's own name. Modules are
imported when a model is built, so ModelConfig can check a checkpoint's architecture at
`LLM(...)` without importing the model code (which imports ModelConfig).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from nanovllm.models.model_config import ModelConfig

# architecture name (= class name) -> module defining it
_MODEL_MODULES = {
    "Qwen3ForCausalLM": "nanovllm.models.qwen3",
    "LlamaForCausalLM": "nanovllm.models.llama",
    "Qwen2ForCausalLM": "nanovllm.models.qwen2",
    "Qwen3MoeForCausalLM": "nanovllm.models.qwen3_moe",
}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_MODULES)
# Architectures whose config.json carries a mixture-of-experts section (ModelConfig.moe).
MOE_ARCHITECTURES = frozenset({"Qwen3MoeForCausalLM"})


def resolve_architecture(architectures: object, source: str) -> str:
    """The first of config.json's `architectures` that is supported; ValueError naming them and
    listing the supported ones otherwise (`source` names the file in the message)."""
    names = architectures if isinstance(architectures, list) else []
    for name in names:
        if name in _MODEL_MODULES:
            return name
    raise ValueError(
        f"{source}: unsupported architecture {architectures!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def model_class(architecture: str) -> type[nn.Module]:
    """The class that builds `architecture` (a name from SUPPORTED_ARCHITECTURES)."""
    if architecture not in _MODEL_MODULES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return getattr(importlib.import_module(_MODEL_MODULES[architecture]), architecture)


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model of `cfg.architecture`, its parameters allocated (not loaded) on the current
    default device and dtype."""
    return model_class(cfg.architecture)(cfg)
