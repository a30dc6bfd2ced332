"""Llama (LlamaForCausalLM; Llama 3.x): no q/k norm; biases on the q/k/v and o projections as
config.json's `attention_bias` says, on the MLP as `mlp_bias` says (published Llama 3: none).
Llama 3's RoPE scaling (`rope_type: "llama3"`) is read by ModelConfig into the RoPE table.
Mistral (MistralForCausalLM) is this decoder under its own name; its sliding window is served
where it masks nothing (ModelConfig.sliding_window)."""

from __future__ import annotations

from nanovllm.models.decoder import DecoderForCausalLM, DecoderTraits
from nanovllm.models.model_config import ModelConfig


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, DecoderTraits(qk_norm=False, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                                            mlp_bias=cfg.mlp_bias))


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral 7B and kin: Llama's layers and checkpoint names."""
