"""Paged attention layer: attends over the KV cache that this step's K/V were written into.

Reads the step's metadata from `nanovllm.utils.context`. Writing this step's K/V is the
caller's part, before `forward` (layers/self_attention.py does it in its RoPE step): either a
kernel that writes the cache itself, given `kv_write(v)`, or `store(k, v)`. Prefill attends over
this step's tokens (or, with a block table, over the cached prefix plus them); decode attends
one query per sequence over its cached keys.

An FP8 cache (engine/kv_cache.py) comes with this layer's k_scale / v_scale (float32 [1] on the
device), passed to every cache writer and attention call (`scale_args`). Unless the checkpoint
gave them, the forward whose metadata says `calibrate_kv_scales` (the first step on an empty cache
after start-up or a weight change: engine/kv_cache.py) sets them from its own K/V before they are written (`calibrate`):

    scale = max(amax(|x|) / FP8_MAX * KV_SCALE_HEADROOM, KV_MIN_SCALE)     x: the step's K (V), all heads

(all of this rank's KV heads: under tensor parallelism each rank calibrates its own, as vLLM does,
so the tokens of a tp=2 engine may differ from one rank's; scales from the checkpoint are shared.)
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.kernels.checks import FP8_MAX
from nanovllm.kernels.torch_attention import store_kvcache
from nanovllm.layers.attention_backend import AttentionBackend
from nanovllm.utils.context import AttentionMetadata, get_attention_metadata

# Later prompts may hold larger K/V than the calibration step: 2x room before they saturate. e4m3's
# relative precision (3 mantissa bits) does not depend on the scale, so the room costs only the tiniest
# values (subnormal below ~1e-4 of the largest instead of ~5e-5). vLLM's amax / 200 (K) is alike.
KV_SCALE_HEADROOM = 2.0
# A layer whose calibration K (V) is all zero still gets a positive scale (x / 0 would be inf or NaN).
KV_MIN_SCALE = 1e-8


class Attention(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        # Set by the model runner once the cache is allocated (`attach`): [num_blocks, block_size, Hkv, D].
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        # {"k_scale", "v_scale"} of an FP8 cache (float32 [1] each), {} for one of the model's dtype:
        # keyword arguments of every cache writer and attention call.
        self.scale_args: dict[str, torch.Tensor] = {}

    def attach(self, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: AttentionBackend,
               scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The model runner's: this layer's caches, the backend, and an FP8 cache's (k_scale, v_scale)
        (None for a cache of the model's dtype), read by the kernels when they run (CUDA graphs too)."""
        self.k_cache, self.v_cache, self.backend = k_cache, v_cache, backend
        self.scale_args = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}

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
        store_kvcache(k, v, self.k_cache, self.v_cache, get_attention_metadata().slot_mapping, **self.scale_args)

    def calibrating(self) -> bool:
        """Whether this forward sets the FP8 scales (`calibrate`) before writing the cache."""
        return get_attention_metadata().calibrate_kv_scales

    def calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set k_scale / v_scale from this step's k / v [N, Hkv, D] (N >= 1), in place on the device
        (no host sync): max(amax(|x|) / FP8_MAX * KV_SCALE_HEADROOM, KV_MIN_SCALE)."""
        if not self.scale_args:
            raise RuntimeError("calibrate: this layer's KV cache is not FP8")
        for name, x in (("k_scale", k), ("v_scale", v)):
            amax = x.detach().abs().amax().float()
            self.scale_args[name].copy_((amax * (KV_SCALE_HEADROOM / FP8_MAX)).clamp_min(KV_MIN_SCALE))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] (already in the cache) -> [N, Hq, D]."""
        meta = get_attention_metadata()
        backend = self._require_cache()
        if meta.is_prefill:
            return self._varlen(q, k, v, meta, backend)
        groups = {} if meta.decode_groups is None else {"groups": meta.decode_groups}  # ours only
        out = backend.flash_attn_with_kvcache(
            q.unsqueeze(1), self.k_cache, self.v_cache,
            cache_seqlens=meta.context_lens, block_table=meta.block_tables,
            softmax_scale=self.scale, causal=True, **self.scale_args, **groups,
        )  # [batch, 1, Hq, D]
        return out.squeeze(1)

    def _varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """A prefill / mixed step. With a query-tile table (Triton backend) the prefill kernel
        walks the chunks' tiles, and leading decode rows, if the step may have them, go to the
        decode kernel, both writing one output; otherwise every row is a varlen chunk."""
        paged = meta.block_tables is not None
        if paged:
            k, v = self.k_cache, self.v_cache
        scales = self.scale_args if paged else {}  # packed k / v are this step's own, in the model's dtype
        extra = {}
        if meta.query_tiles is not None:
            tiles = meta.query_tiles
            out = torch.empty_like(q)  # [N, Hq, D]
            extra = {"tile_seq": tiles.tile_seq, "tile_block": tiles.tile_block, "num_tiles": tiles.num_tiles,
                     "out": out, "long_tiles": tiles.long}
            if meta.decode_rows is not None:
                rows = meta.decode_rows
                cap = rows.context_lens.shape[0]
                backend.flash_attn_with_kvcache(
                    q[:cap].unsqueeze(1), self.k_cache, self.v_cache, cache_seqlens=rows.context_lens,
                    block_table=meta.block_tables[:cap], softmax_scale=self.scale, causal=True,
                    num_seqs=rows.num_rows, out=out[:cap].unsqueeze(1), **self.scale_args,
                )
        return backend.flash_attn_varlen_func(
            q, k, v,
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=self.scale, causal=True, block_table=meta.block_tables, **extra, **scales,
        )
