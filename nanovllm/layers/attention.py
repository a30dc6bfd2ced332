"""Paged attention layer: attends over the KV cache that this step's K/V were written into.

Reads the step's metadata from `nanovllm.utils.context`. Writing this step's K/V is the
caller's part, before `forward` (layers/self_attention.py does it in its RoPE step): either a
kernel that writes the cache itself, given `kv_write(v)`, or `store(k, v)`. Prefill attends over
this step's tokens (or, with a block table, over the cached prefix plus them); decode attends
one query per sequence over its cached keys.
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.kernels.torch_attention import store_kvcache
from nanovllm.layers.attention_backend import AttentionBackend
from nanovllm.utils.context import AttentionMetadata, get_attention_metadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Set by the model runner once the cache is allocated: [num_blocks, block_size, Hkv, D].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def _require_cache(self) -> AttentionBackend:
        if self.backend is None or self.k_cache is None:
            raise RuntimeError("Attention used before the model runner attached a KV cache and backend")
        return self.backend

    def kv_write(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(v, k_cache, v_cache, slot_mapping): where this step's K/V go, for a kernel that
        writes the cache itself (kernels/fused_rope.py's `kv_write`)."""
        self._require_cache()
        return v, self.k_cache, self.v_cache, get_attention_metadata().slot_mapping

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's k/v [N, Hkv, D] into the cache at the step's slots (slots < 0 skipped),
        in PyTorch: the path of layers built off CUDA (on CUDA the RoPE kernel writes the cache)."""
        self._require_cache()
        store_kvcache(k, v, self.k_cache, self.v_cache, get_attention_metadata().slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] (already in the cache) -> [N, Hq, D]."""
        meta = get_attention_metadata()
        backend = self._require_cache()
        if meta.is_prefill:
            return self._varlen(q, k, v, meta, backend)
        out = backend.flash_attn_with_kvcache(
            q.unsqueeze(1), self.k_cache, self.v_cache,
            cache_seqlens=meta.context_lens, block_table=meta.block_tables,
            softmax_scale=self.scale, causal=True,
        )  # [batch, 1, Hq, D]
        return out.squeeze(1)

    def _varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """A prefill / mixed step. With leading decode rows (Triton backend) those go to the
        decode kernel and the prefill chunks to the prefill kernel, both writing one output;
        otherwise every row is a varlen chunk."""
        if meta.block_tables is not None:
            k, v = self.k_cache, self.v_cache
        extra = {}
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            cap = rows.context_lens.shape[0]
            out = torch.empty_like(q)  # [N, Hq, D]
            backend.flash_attn_with_kvcache(
                q[:cap].unsqueeze(1), self.k_cache, self.v_cache, cache_seqlens=rows.context_lens,
                block_table=meta.block_tables[:cap], softmax_scale=self.scale, causal=True,
                num_seqs=rows.num_rows, out=out[:cap].unsqueeze(1),
            )
            tiles = meta.query_tiles
            extra = {"tile_seq": tiles.tile_seq, "tile_block": tiles.tile_block, "num_tiles": tiles.num_tiles,
                     "out": out}
        return backend.flash_attn_varlen_func(
            q, k, v,
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=self.scale, causal=True, block_table=meta.block_tables, **extra,
        )
