"""The decoder every supported family shares (Qwen3, Llama 3.x, Qwen2/2.5, Qwen3-MoE), on a
flat token batch.

    embed -> L x [ RMSNorm -> self-attention (GQA, RoPE) -> add -> RMSNorm -> MLP -> add ]
          -> RMSNorm -> LM head (tied to the embedding or not)

All sequences' tokens are stacked on one axis (no batch dimension): hidden states are
`[num_tokens, hidden]`. Module and parameter names match the Hugging Face checkpoints, except
the packed `qkv_proj` and `gate_up_proj` (see `packed_modules_mapping`). The families differ
only in `DecoderTraits`, which each model file states (models/qwen3.py, llama.py, qwen2.py),
in the config values they carry (RoPE scaling, eps, head_dim, tying), read by ModelConfig,
and in each layer's MLP: the dense SwiGLU unless a family's `build_mlp` says otherwise
(models/qwen3_moe.py: mixture-of-experts layers). One RoPE table serves all layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, SiluMulRowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.layers.self_attention import SelfAttention
from nanovllm.models.model_config import ModelConfig
from nanovllm.utils.kv_scales import is_attention_scale_name
from nanovllm.utils.loader import update_weights, weight_chunks


@dataclass(frozen=True)
class DecoderTraits:
    """What sets one family's decoder apart from another's."""

    qk_norm: bool  # per-head RMSNorm of q and k before RoPE
    qkv_bias: bool  # biases on the q, k and v projections
    o_bias: bool  # bias on the attention output projection
    mlp_bias: bool  # biases on the gate, up and down projections


def layer_prefix(layer_idx: int) -> str:
    """Decoder layer `layer_idx`'s checkpoint name: its layers ask their weight format by names
    under it (quantization/config.py)."""
    return f"model.layers.{layer_idx}"


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = SiluMulRowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias,
                                                  prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))  # [N, 2 I / tp] -> down(SiLU(gate) * up) [N, hidden]

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor,
                       norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual), the norm inside gate_up's GEMV where it can be."""
        gate_up, residual = self.gate_up_proj.forward_normed(x, residual, norm)
        return self.down_proj(gate_up), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, traits: DecoderTraits, rotary_emb: RotaryEmbedding, mlp: nn.Module,
                 prefix: str):
        super().__init__()
        self.self_attn = SelfAttention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, rotary_emb,
            qk_norm=traits.qk_norm, rms_norm_eps=cfg.rms_norm_eps, qkv_bias=traits.qkv_bias, o_bias=traits.o_bias,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = mlp  # [N, hidden] -> [N, hidden]; forward_normed(x, residual, norm) -> (out, x + residual)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.self_attn.forward_normed(positions, hidden, residual, self.input_layernorm)
        return self.mlp.forward_normed(hidden, residual, self.post_attention_layernorm)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, traits: DecoderTraits, build_mlp: Callable[[int], nn.Module]):
        """build_mlp(layer index) -> that layer's MLP."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList([DecoderLayer(cfg, traits, rotary_emb, build_mlp(i), layer_prefix(i))
                                     for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [N, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# RoPE buffers a checkpoint may hold (computed here): older checkpoints' frequencies, ColossalAI's tables.
_ROPE_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _nothing() -> None:
    pass


class DecoderForCausalLM(nn.Module):
    """Base of the model classes: a model file subclasses it, stating its family's traits."""

    # checkpoint name -> (packed parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, traits: DecoderTraits):
        super().__init__()
        # Called after load_weights changed the weights: set by the model runner (engine/kv_cache.py's
        # KvScales.weights_changed: FP8 KV scales computed from the data are due again), nothing without one.
        self.on_weights_loaded: Callable[[], None] = _nothing
        self.model = DecoderModel(cfg, traits, lambda layer_idx: self.build_mlp(cfg, traits, layer_idx))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [N] -> hidden [N, hidden]."""
        return self.model(input_ids, positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's model.load_weights, for code that reaches this module (LLM.apply_model):
        checkpoint-named full tensors copied into this rank's parameters, every one checked first
        (utils/loader.update_weights; a generator's a chunk at a time: loader.weight_chunks); the
        names loaded. The engine is not told: the prefix cache's KV stays the old weights'
        (LLM.update_weights empties it; else call llm.reset_prefix_cache())."""
        names: set[str] = set()
        loaded = False  # a chunk reached the weights (an empty one too, as LLM.update_weights counts it)
        try:
            for chunk in weight_chunks(weights):
                update_weights(self, chunk)
                loaded = True
                names.update(name for name, _ in chunk)
        finally:
            if loaded:  # also when a later chunk is refused: the earlier ones changed the weights
                self.on_weights_loaded()
        return names

    def build_mlp(self, cfg: ModelConfig, traits: DecoderTraits, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s MLP: the dense SwiGLU (a family with other MLPs overrides this)."""
        return DecoderMLP(cfg, traits.mlp_bias, f"{layer_prefix(layer_idx)}.mlp")

    def map_checkpoint_name(self, name: str) -> tuple[str, str | int | None]:
        """Checkpoint tensor name -> (parameter name, shard id): `...q_proj.weight` fills shard
        "q" of `...qkv_proj.weight`; unpacked names map onto themselves (shard None)."""
        for ckpt_part, (packed_name, shard_id) in self.packed_modules_mapping.items():
            if f".{ckpt_part}." in name:
                return name.replace(f".{ckpt_part}.", f".{packed_name}."), shard_id
        return name, None

    def checkpoint_name_of(self, param_name: str, shard_id: object) -> str:
        """map_checkpoint_name's inverse: the checkpoint tensor that fills shard `shard_id` of
        `param_name` (`...qkv_proj.weight`, "k" -> `...k_proj.weight`), for error messages."""
        for ckpt_part, (packed_name, packed_shard) in self.packed_modules_mapping.items():
            if packed_shard == shard_id and f".{packed_name}." in param_name:
                return param_name.replace(f".{packed_name}.", f".{ckpt_part}.")
        return param_name

    def ignored_checkpoint_name(self, name: str) -> bool:
        """Names a checkpoint may hold that fill nothing here: the LM head of a tied model (it
        is the embedding), RoPE buffers some checkpoints saved (older ones' inv_freq, ColossalAI's cos / sin
        tables: computed here, as vLLM skips them) and attention scales (an FP8 cache reads the K / V ones
        itself, nothing the query / softmax ones: utils/kv_scales.py)."""
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        return (tied and name == "lm_head.weight") or name.endswith(_ROPE_BUFFERS) or is_attention_scale_name(name)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_seqs, hidden] -> [num_seqs, vocab] (None on tensor-parallel ranks > 0)."""
        return self.lm_head(hidden)
