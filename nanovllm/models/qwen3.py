"""Qwen3 dense (Qwen3ForCausalLM): per-head q/k RMSNorm before RoPE; biases on the q/k/v and
o projections as config.json's `attention_bias` says (published checkpoints: none)."""

from __future__ import annotations

from nanovllm.models.decoder import DecoderForCausalLM, DecoderTraits
from nanovllm.models.model_config import ModelConfig


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, DecoderTraits(qk_norm=True, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                                            mlp_bias=False))
