"""An architecture name -> the model class that builds it (models/model_config.MODEL_MODULES).

Model modules are imported here, when a model is built; ModelConfig checks a checkpoint's
architecture at `LLM(...)` from the table alone, so it never imports the model code (which
imports ModelConfig).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from nanovllm.models.model_config import MODEL_MODULES, SUPPORTED_ARCHITECTURES, ModelConfig

if TYPE_CHECKING:
    from torch import nn


def model_class(architecture: str) -> type[nn.Module]:
    """The class that builds `architecture` (a name from SUPPORTED_ARCHITECTURES)."""
    if architecture not in MODEL_MODULES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return getattr(importlib.import_module(MODEL_MODULES[architecture]), architecture)


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model of `cfg.architecture`, its parameters allocated (not loaded) on the current
    default device and dtype."""
    return model_class(cfg.architecture)(cfg)
