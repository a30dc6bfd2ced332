"""Sizes and allocates the paged KV cache.

One tensor holds every layer's K and V:
    [2 (K, V), num_layers, num_blocks, block_size, num_kv_heads_per_rank, head_dim]
Layer i reads kv[0, i] and kv[1, i], each [num_blocks, block_size, Hkv, D].

Its element type is `LLM(kv_cache_dtype=...)` (vLLM's names), decided once here:
    "auto"              the model's dtype
    "fp8", "fp8_e4m3"   float8 e4m3 (1 byte: twice the blocks of a 16-bit cache in the same memory),
                        with a float32 k_scale and v_scale per layer (allocate_kv_scales):
                        stored = e4m3(clamp(x / scale, -448, 448)), read = stored * scale.
The scales come from the checkpoint when it has them (utils/kv_scales.py), else from the data: the
first prefill step after start-up (not the warm-up or graph capture) sets each layer's
scale = max(amax|x| of that step's K (V) / 448 * KV_SCALE_HEADROOM, KV_MIN_SCALE) on the device
before writing (layers/attention.py), and they stay fixed until update_weights changes the weights
they were computed under (the next prefill step sets them again: no request is pending then, and
the prefix cache is emptied, so no entry written under the old scales is read again); every entry
written stays decodable. Values past 448 * scale saturate.

On CUDA the cache takes what `gpu_memory_utilization` of the card leaves after this
process's own peak usage in a warm-up at the largest batch (other processes' memory
is not ours to count). On CPU it takes a bounded share of available RAM.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanovllm.config import Config

# CPU runs serve tests and examples: more cache than this only costs RAM.
CPU_KV_CACHE_MAX_BYTES = 2 * 2**30
# Memory held before an engine starts that is worth naming in the error (below this: stray tensors).
OTHER_HOLDER_HINT_BYTES = 2**30


def kv_cache_shape(config: Config, world_size: int, num_blocks: int) -> tuple[int, ...]:
    """[2, layers, num_blocks, block_size, this rank's KV heads, head_dim] (the module docstring)."""
    mc = config.model_config
    return (2, mc.num_hidden_layers, num_blocks, config.kvcache_block_size, mc.num_key_value_heads // world_size,
            mc.head_dim)


def kv_block_bytes(config: Config, world_size: int = 1) -> int:
    """Bytes of one cache block on one of `world_size` tensor-parallel ranks: K and V of every
    layer, this rank's KV heads, in the cache's element type."""
    return math.prod(kv_cache_shape(config, world_size, 1)) * config.kv_cache_torch_dtype.itemsize


def blocks_in_budget(budget_bytes: float, block_bytes: int) -> int:
    """Blocks of `block_bytes` that fit in `budget_bytes` (what num_blocks_from_memory gives for that budget)."""
    return int(budget_bytes // block_bytes)


def available_cpu_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_blocks_from_memory(device: torch.device, utilization: float, block_bytes: int,
                           allocated_before: int = 0) -> int:
    """Blocks that fit in this process's memory budget (call after the warm-up).
    `allocated_before`: bytes this process held on the device before the engine started."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        peak = torch.cuda.max_memory_allocated(device)
        budget = total * utilization - peak
        hint = (f"raise gpu_memory_utilization, or lower max_num_batched_tokens / max_num_seqs "
                f"(peak use of this process: {peak / 2**30:.1f} GiB of {total / 2**30:.1f} GiB)")
        if allocated_before >= OTHER_HOLDER_HINT_BYTES:
            hint += (f"; {allocated_before / 2**30:.1f} GiB was already allocated in this process before "
                     "this engine started: call exit() on any other LLM first")
    else:
        budget = min(available_cpu_bytes() * utilization, CPU_KV_CACHE_MAX_BYTES)
        hint = "free some RAM or pass num_kvcache_blocks"
    num_blocks = blocks_in_budget(budget, block_bytes)
    if num_blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache: budget {budget / 2**30:.2f} GiB, one block needs "
            f"{block_bytes / 2**20:.1f} MiB; {hint}"
        )
    return num_blocks


def num_cache_blocks(config: Config, block_bytes: int, device: torch.device, allocated_before: int = 0) -> int:
    """The cache's blocks (call after the warm-up): num_kvcache_blocks as given, those fitting
    kv_cache_memory_bytes (vLLM's: bytes a GPU), or gpu_memory_utilization's share (num_blocks_from_memory)."""
    if config.num_kvcache_blocks is not None:
        return config.num_kvcache_blocks
    if config.kv_cache_memory_bytes is None:
        return num_blocks_from_memory(device, config.gpu_memory_utilization, block_bytes, allocated_before)
    num_blocks = blocks_in_budget(config.kv_cache_memory_bytes, block_bytes)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no KV cache block: one takes "
                         f"{block_bytes} bytes")
    return num_blocks


def allocate_kv_cache(config: Config, world_size: int, num_blocks: int, device: torch.device) -> torch.Tensor:
    shape = kv_cache_shape(config, world_size, num_blocks)
    try:
        return torch.empty(shape, dtype=config.kv_cache_torch_dtype, device=device)
    except torch.OutOfMemoryError as e:
        raise ValueError(
            f"could not allocate a KV cache of {num_blocks} blocks ({shape}): {e}; "
            "lower num_kvcache_blocks or gpu_memory_utilization"
        ) from None


def allocate_kv_scales(num_layers: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(k_scale, v_scale) of each layer of an FP8 cache: float32 [1] at 1.0 until set, each its own
    allocation (16-byte aligned, as Triton specializes pointers on it: one compiled variant for all)."""
    return [(torch.ones(1, dtype=torch.float32, device=device), torch.ones(1, dtype=torch.float32, device=device))
            for _ in range(num_layers)]
