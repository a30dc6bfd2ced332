"""A decoder layer's self-attention on a flat token batch: `[N, hidden] -> [N, hidden]`.

    qkv projection (optional bias) -> [per-head q/k RMSNorm] -> RoPE -> this step's K/V into the
    paged cache -> paged attention (GQA) -> o projection (optional bias)

Parameter names are the checkpoints' (`q_proj`/`k_proj`/`v_proj` packed into `qkv_proj`,
`q_norm`, `k_norm`, `o_proj`). The RoPE step's implementation is chosen once, at construction,
from the device the layer is built on (layers/kernel_path.py):

    CUDA:   one Triton kernel does the optional norm, the rotation and the K/V cache write
            (kernels/fused_rope.py: `qk_norm_rope` with the norm, `rope` without; both given
            the attention layer's `kv_write`)
    others: RMSNorm and RotaryEmbedding in PyTorch, then the attention layer's `store`

Either way the cache holds this step's K/V before `Attention` runs (its invariant). An FP8
cache is written quantized with the layer's scales; in the step that calibrates them
(`Attention.calibrating`) the rotated K is computed once without the write, the scales are set
from it and V, and then the step runs as any other.
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.attention import Attention
from nanovllm.layers.kernel_path import uses_triton
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding


class SelfAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary_emb: RotaryEmbedding, qk_norm: bool, rms_norm_eps: float, qkv_bias: bool, o_bias: bool,
                 prefix: str | None = None):
        """`num_heads` / `num_kv_heads` are the model's (split over tensor-parallel ranks here);
        `rotary_emb` is the model's one RoPE table; `qk_norm`: per-head RMSNorm of q and k
        (eps `rms_norm_eps`) before RoPE; `prefix`: the module's checkpoint name (its
        projections ask their weight format by it)."""
        super().__init__()
        names = (None, None) if prefix is None else (f"{prefix}.qkv_proj", f"{prefix}.o_proj")
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias=qkv_bias,
                                          prefix=names[0])
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=o_bias, prefix=names[1])
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(head_dim**-0.5)
        self.use_triton = uses_triton(self.qkv_proj.weight.device)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden))

    def forward_normed(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                       norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(positions, norm(s)), s) with s = hidden + residual (hidden when residual is None):
        the layer's input norm, inside the qkv projection's GEMV where it can be."""
        qkv, residual = self.qkv_proj.forward_normed(hidden, residual, norm)
        return self.attend(positions, qkv), residual

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The rest after the qkv projection: qkv [N, (Hq + 2 Hkv) * D] -> [N, hidden]."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)  # [N, Hq, D]
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.use_triton:
            q, k = self.rope_and_store_triton(positions, q, k, v)
        else:
            q, k = self.rope_and_store_native(positions, q, k, v)
        out = self.attn(q, k, v)  # [N, Hq, D]
        return self.o_proj(out.flatten(1))

    def rope_and_store_triton(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N]; q [N, Hq, D], k / v [N, Hkv, D] -> (q, k) normalised (optional) and
        rotated, with k and v written into the cache, in one kernel."""
        from nanovllm.kernels.fused_rope import qk_norm_rope, rope

        def norm_rope(kv_write, scale_args):
            if self.qk_norm:
                return qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, positions,
                                    self.rotary_emb.cos_sin_cache, self.q_norm.eps, kv_write=kv_write, **scale_args)
            return rope(q, k, positions, self.rotary_emb.cos_sin_cache, kv_write=kv_write, **scale_args)

        if self.attn.calibrating():
            self.attn.calibrate(norm_rope(None, {})[1], v)
        return norm_rope(self.attn.kv_write(v), self.attn.scale_args)

    def rope_and_store_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_and_store_triton` in PyTorch: norm, rotate, then store k and v."""
        if self.qk_norm:
            q, k = self.q_norm.forward_native(q), self.k_norm.forward_native(k)
        q, k = self.rotary_emb(positions, q, k)
        if self.attn.calibrating():
            self.attn.calibrate(k, v)
        self.attn.store(k, v)
        return q, k
