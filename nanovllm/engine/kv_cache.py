"""Sizes and allocates the paged KV cache, and holds an FP8 cache's scales (`KvScales`).

One tensor holds every layer's K and V:
    [2 (K, V), num_layers, num_blocks, block_size, num_kv_heads_per_rank, head_dim]
(num_kv_heads_per_rank: Hkv / tp, or 1 where tp is a multiple of Hkv: the head is replicated.)
Layer i reads kv[0, i] and kv[1, i], each [num_blocks, block_size, Hkv, D].

Its element type is `LLM(kv_cache_dtype=...)` (vLLM's names), decided once (Config.kv_cache_torch_dtype):
    "auto"              the model's dtype (float8 e4m3 on a ModelOpt checkpoint that calibrated an FP8
                        cache, as vLLM resolves it: quantization/checkpoint_config.calibrated_fp8_kv)
    "bfloat16"          the model's dtype, where that is bfloat16
    "fp8", "fp8_e4m3"   float8 e4m3 (1 byte: twice the blocks of a 16-bit cache in the same memory),
                        with a float32 k_scale and v_scale per layer (KvScales):
                        stored = e4m3(clamp(x / scale, -448, 448)), read = stored * scale.
The scales come from the checkpoint when it has them (utils/kv_scales.py), else from the data: the
first prefill step after start-up (not the warm-up or graph capture) sets each layer's
scale = max(amax|x| of that step's K (V) / 448 * KV_SCALE_HEADROOM, KV_MIN_SCALE) on the device
before writing (layers/attention.py), and they stay fixed until a weight change (update_weights,
load_weights through apply_model / collective_rpc, reload_weights) asks for them again. They are set
only in a step scheduled on an empty cache (StepPlan.fresh_cache: no sequence holds blocks, the prefix
cache publishes none), so no entry written under the old scales is read under the new ones: after
update_weights that is the next step (nothing pending, the prefix cache emptied); a load_weights while
requests run keeps the scales until they end and the prefix cache is reset (reset_prefix_cache).
Every entry written stays decodable. Values past 448 * scale saturate. `KvScales.calibrate` says
whether they are due; the step that sets them runs eagerly (no graph replay), `calibrate_kv_scales`
in its metadata.

On CUDA the cache takes what `gpu_memory_utilization` of the card leaves after this
process's own peak usage in a warm-up at the largest batch (other processes' memory
is not ours to count). On CPU it takes a bounded share of available RAM. Every tensor-parallel
rank takes the least of the ranks' block counts (they share the scheduler's block tables).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from nanovllm.kernels.checks import FP8_KV_DTYPE
from nanovllm.utils.distributed import kv_heads_per_rank
from nanovllm.utils.host_to_device import to_device
from nanovllm.utils.kv_scales import load_kv_scales

if TYPE_CHECKING:
    from nanovllm.config import Config

# CPU runs serve tests and examples: more cache than this only costs RAM.
CPU_KV_CACHE_MAX_BYTES = 2 * 2**30
# Decode inputs travel as int32 (StepInputBuilder.decode_rows): cache slots must fit.
MAX_KV_SLOTS = 2**31 - 1
# Memory held before an engine starts that is worth naming in the error (below this: stray tensors).
OTHER_HOLDER_HINT_BYTES = 2**30


def kv_cache_shape(config: Config, world_size: int, num_blocks: int) -> tuple[int, ...]:
    """[2, layers, num_blocks, block_size, this rank's KV heads, head_dim] (the module docstring)."""
    mc = config.model_config
    return (2, mc.num_hidden_layers, num_blocks, config.kvcache_block_size,
            kv_heads_per_rank(mc.num_key_value_heads, world_size), mc.head_dim)


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


def num_blocks_on_every_rank(config: Config, world_size: int, block_bytes: int, device: torch.device,
                             allocated_before: int = 0) -> int:
    """The cache's blocks (call after the warm-up, on every rank at once: a collective with more
    than one): num_cache_blocks, at most MAX_KV_SLOTS slots, the least over the ranks."""
    num_blocks = min(num_cache_blocks(config, block_bytes, device, allocated_before),
                     MAX_KV_SLOTS // config.kvcache_block_size)
    if world_size == 1:
        return num_blocks
    t = torch.tensor([num_blocks], device=device if device.type == "cuda" else "cpu")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


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


def copy_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]], device: torch.device) -> None:
    """Block `source` -> block `destination` of `kv_cache` for each pair, every layer, K and V."""
    src = to_device([a for a, _ in copies], device, torch.int64)
    dst = to_device([b for _, b in copies], device, torch.int64)
    kv_cache[:, :, dst] = kv_cache[:, :, src]  # [2, layers, copies, block, heads, dim]


class KvScales:
    """A cache's per-layer (k_scale, v_scale) and whether the next prefill step sets them.

    Invariants: `layers` is empty unless the cache is FP8; then layer i's scales are `layers[i]`,
    attached to its attention layer once and written only in place (here, from the checkpoint; by a
    calibrating forward, layers/attention.py), so the CUDA graphs' addresses stay valid.
    `from_data`: no checkpoint scales and config.calculate_kv_scales is not False (True always
    calibrates; False never: 1.0 without the checkpoint's). `calibrate` (the scales are due) is True
    from start-up and from each weight change (`weights_changed`) until a step on an empty cache has
    set them (`calibrated`), and never without `from_data`. Iterating gives `layers`."""

    def __init__(self, config: Config, device: torch.device):
        mc = config.model_config
        fp8 = config.kv_cache_torch_dtype == FP8_KV_DTYPE
        self.layers = allocate_kv_scales(mc.num_hidden_layers, device) if fp8 else []
        checkpoint = (load_kv_scales(config.model, mc.num_hidden_layers, config.checkpoint_quantization)
                      if fp8 and config.load_format != "dummy" and config.calculate_kv_scales is not True
                      else None)
        if checkpoint is not None:
            for (k_scale, v_scale), (k_value, v_value) in zip(self.layers, checkpoint):
                k_scale.fill_(k_value)
                v_scale.fill_(v_value)
        self.from_checkpoint = checkpoint is not None
        self.from_data = fp8 and checkpoint is None and config.calculate_kv_scales is not False
        self.calibrate = self.from_data

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.layers)

    def of_layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer i's (k_scale, v_scale); None for a cache of the model's dtype (Attention.attach's)."""
        return self.layers[i] if self.layers else None

    def weights_changed(self) -> None:
        """The weights the scales were computed under are gone: scales from the data are due again."""
        self.calibrate = self.from_data

    def calibrated(self) -> None:
        """A step on an empty cache has set every layer's scales."""
        self.calibrate = False
