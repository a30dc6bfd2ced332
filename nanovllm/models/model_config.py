"""The model shape read from a checkpoint's config.json, in both formats on the hub.

Published Qwen3 checkpoints write `rope_theta` and `torch_dtype` at top level;
transformers 5 writes `rope_parameters: {"rope_theta": ...}` and `dtype`. Both are read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
# Rope variants that are plain neox RoPE with a theta (no scaling of positions).
_PLAIN_ROPE_TYPES = (None, "default")
_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"model directory {path!r} has no config.json")
        with open(config_path) as f:
            raw = json.load(f)
        return cls.from_dict(raw, source=config_path)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise ValueError(
                f"{source}: unsupported architecture {architectures!r} "
                f"(model_type {raw.get('model_type')!r}); supported: {SUPPORTED_ARCHITECTURES}"
            )
        if raw.get("use_sliding_window"):
            raise ValueError(f"{source}: sliding-window attention is not supported")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type not in _PLAIN_ROPE_TYPES:
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported (only plain RoPE)")
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
        if dtype_name not in _DTYPE_NAMES:
            raise ValueError(f"{source}: unsupported dtype {dtype_name!r}")
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                architecture=architecture,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                torch_dtype=_DTYPE_NAMES[dtype_name],
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required key {e.args[0]!r}") from None

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ValueError unless `tp` ranks can split heads and the MLP evenly."""
        if tp == 1:
            return
        for name, value in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={value}")
