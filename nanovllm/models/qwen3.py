"""Qwen3 dense decoder (Qwen3ForCausalLM) on a flat token batch.

All sequences' tokens are stacked on one axis (no batch dimension): hidden states are
`[num_tokens, hidden]`. Module and parameter names match the Hugging Face checkpoint,
except the packed `qkv_proj` and `gate_up_proj` (see `packed_modules_mapping`).
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.models.model_config import ModelConfig


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias=cfg.attention_bias
        )
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [N, (Hq + 2 Hkv) * D]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # [N, Hq, D]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if q.is_cuda:  # one kernel: q/k RMSNorm, rotary, and the K/V write into the paged cache
            from nanovllm.kernels.fused_rope import qk_norm_rope
            import os
            from nanovllm.layers.linear import use_gemv
            from nanovllm.kernels.prefetch import l2_prefetch
            opf = int(os.environ.get("NANOVLLM_EXP_OPF_MB", "0"))
            with l2_prefetch(self.o_proj.weight if opf and use_gemv(hidden) else None, opf * 2**20):
                q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, positions,
                                    self.rotary_emb.cos_sin_cache, self.q_norm.eps, kv_write=self.attn.kv_write(v))
                out = self.attn(q, k, v, kv_stored=True)  # [N, Hq, D]
        else:
            q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k))
            out = self.attn(q, k, v)
        return self.o_proj(out.flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_silu_mul(self.gate_up_proj(x))  # SiLU(gate) * up, then down


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [N, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (packed parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.model = Qwen3Model(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_seqs, hidden] -> [num_seqs, vocab] (None on tensor-parallel ranks > 0)."""
        return self.lm_head(hidden)
