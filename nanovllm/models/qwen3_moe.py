"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k RMSNorm, GQA, biases as
`attention_bias` says) with a mixture-of-experts MLP in the sparse layers.

Layer i is sparse unless it is listed in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step` (ModelConfig's MoeConfig.is_sparse; transformers' rule); a sparse layer's
`mlp` is moe/layer.SparseMoeBlock (router `gate`, stacked `experts`), a dense one the
shared SwiGLU of width intermediate_size. Expert tensors of either checkpoint spelling (one per
expert, or transformers 5's fused 3-D ones) map onto the stacked parameters (map_expert_name).
"""

from __future__ import annotations

from torch import nn

from nanovllm.moe.checkpoint_names import expert_checkpoint_name, map_expert_name
from nanovllm.moe.layer import SparseMoeBlock
from nanovllm.models.decoder import DecoderForCausalLM, DecoderTraits, layer_prefix
from nanovllm.models.model_config import ModelConfig


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig):
        if cfg.moe is None:
            raise ValueError("Qwen3MoeForCausalLM needs a config with num_experts, num_experts_per_tok and "
                             "moe_intermediate_size")
        super().__init__(cfg, DecoderTraits(qk_norm=True, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                                            mlp_bias=False))

    def build_mlp(self, cfg: ModelConfig, traits: DecoderTraits, layer_idx: int) -> nn.Module:
        moe = cfg.moe
        if not moe.is_sparse(layer_idx):
            return super().build_mlp(cfg, traits, layer_idx)
        return SparseMoeBlock(cfg.hidden_size, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size,
                              moe.norm_topk_prob, prefix=f"{layer_prefix(layer_idx)}.mlp")

    def map_checkpoint_name(self, name: str) -> tuple[str, object]:
        """Expert tensors -> the stacked w13 / w2 (moe/checkpoint_names.map_expert_name); the rest as
        the dense decoder maps them (the router `mlp.gate.weight` onto itself)."""
        return map_expert_name(name) or super().map_checkpoint_name(name)

    def checkpoint_name_of(self, param_name: str, shard_id: object) -> str:
        return expert_checkpoint_name(param_name, shard_id) or super().checkpoint_name_of(param_name, shard_id)
