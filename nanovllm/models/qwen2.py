"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): no q/k norm; q/k/v projections always carry biases (the
config has no key for it), the o projection and the MLP none."""

from __future__ import annotations

from nanovllm.models.decoder import DecoderForCausalLM, DecoderTraits
from nanovllm.models.model_config import ModelConfig


class Qwen2ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, DecoderTraits(qk_norm=False, qkv_bias=True, o_bias=False, mlp_bias=False))
