"""Chooses the attention implementation once, at start-up.

    "flash_attn": the real flash-attn (CUDA; paged KV needs block_size % 256 == 0)
    "triton":     ours, nanovllm.kernels.prefill_attention / decode_attention (CUDA)
    "torch":      plain PyTorch, nanovllm.kernels.torch_attention (any device; the CPU path)
    "auto":       flash_attn if importable and the block size allows, else triton on CUDA;
                  torch on CPU

An FP8 KV cache (kv_cache_dtype "fp8" / "fp8_e4m3") is read by our kernels only: flash-attn 2
has no FP8 KV. "auto" then takes triton on CUDA (flash-attn installed or not), and an explicit
"flash_attn" is refused with a ValueError, as is a head_dim below the Triton decode kernel's floor
for FP8 (kernels/checks.py, FP8_MIN_HEAD_DIM).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

from nanovllm.kernels.checks import check_fp8_head_dim

# flash-attn's paged-KV path only accepts block sizes that are multiples of this.
FLASH_ATTN_PAGED_BLOCK_MULTIPLE = 256


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    flash_attn_varlen_func: Callable
    flash_attn_with_kvcache: Callable


def _flash_attn_usable(block_size: int) -> bool:
    return importlib.util.find_spec("flash_attn") is not None and block_size % FLASH_ATTN_PAGED_BLOCK_MULTIPLE == 0


def select_attention_backend(requested: str, device: str, block_size: int, fp8_kv: bool,
                             head_dim: int) -> AttentionBackend:
    """The backend for `requested` on `device`; fp8_kv: the KV cache is FP8 (flash-attn cannot read it);
    head_dim: the model's, checked against the Triton kernels' FP8 floor."""
    if requested == "flash_attn" and fp8_kv:
        raise ValueError("attention_backend='flash_attn' cannot read an FP8 KV cache (flash-attn 2 has no FP8 KV): "
                         "use attention_backend='auto' or 'triton', or a 16-bit cache (kv_cache_dtype='bfloat16', "
                         "or 'auto' on a checkpoint without a calibrated FP8 cache)")
    if requested == "auto":
        if device == "cpu":
            requested = "torch"
        else:
            requested = "flash_attn" if _flash_attn_usable(block_size) and not fp8_kv else "triton"
    if requested != "torch" and device == "cpu":
        raise ValueError(f"attention_backend={requested!r} needs CUDA; on CPU use 'torch' or 'auto'")
    if requested == "torch":
        mod = importlib.import_module("nanovllm.kernels.torch_attention")
        return AttentionBackend("torch", mod.flash_attn_varlen_func, mod.flash_attn_with_kvcache)
    if requested == "triton":
        if fp8_kv:
            check_fp8_head_dim(head_dim)
        prefill = importlib.import_module("nanovllm.kernels.prefill_attention")
        decode = importlib.import_module("nanovllm.kernels.decode_attention")
        return AttentionBackend("triton", prefill.flash_attn_varlen_func, decode.flash_attn_with_kvcache)
    # requested == "flash_attn"
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError("attention_backend='flash_attn' but the flash-attn package is not installed")
    if block_size % FLASH_ATTN_PAGED_BLOCK_MULTIPLE:
        raise ValueError(
            f"attention_backend='flash_attn' needs kvcache_block_size to be a multiple of "
            f"{FLASH_ATTN_PAGED_BLOCK_MULTIPLE}, got {block_size}"
        )
    flash_attn = importlib.import_module("flash_attn")
    return AttentionBackend("flash_attn", flash_attn.flash_attn_varlen_func, flash_attn.flash_attn_with_kvcache)
