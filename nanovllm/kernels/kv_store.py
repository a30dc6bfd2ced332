"""Triton kernel that scatters new K/V rows into the paged KV cache.

Slot arithmetic (one program per new token i)::

    slot = slot_mapping[i]            # -1 for padding rows: nothing is written
    block, offset = slot // block_size, slot % block_size
    k_cache[block, offset, :, :] = key[i, :, :]      # [num_kv_heads, head_dim]

All offsets are computed in int64: ``block * stride_block`` exceeds 2**31 for
caches over 2 GiB elements.
"""

import torch
import triton
import triton.language as tl

from .checks import check_cache, check_float_dtype, check_kv_scales, kv_cache_dtype, next_pow2


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding row
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < num_kv_heads)[:, None]
    # [BLOCK_H, HEAD_DIM] tiles
    k = tl.load(key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = blk * stride_cb + off * stride_co + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def check_kv_store(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale=None, v_scale=None) -> int:
    """Validate the arguments of a K/V cache write (see store_kvcache); return the cache block size.
    With k_scale / v_scale (checks.check_kv_scales) the caches are FP8, else of key's dtype."""
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [N, num_kv_heads, head_dim], got "
                             f"{getattr(t, 'shape', type(t))}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if key.shape != value.shape:
        raise ValueError(f"key shape {tuple(key.shape)} != value shape {tuple(value.shape)}")
    check_float_dtype("key", key)
    n, hkv, d = key.shape
    fp8 = check_kv_scales(k_scale, v_scale, key.device)
    block_size = check_cache(k_cache, v_cache, hkv, d, kv_cache_dtype(key.dtype, fp8))
    if value.dtype != key.dtype:
        raise TypeError(f"value dtype {value.dtype} != key dtype {key.dtype}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be an int32/int64 tensor, got "
                        f"{getattr(slot_mapping, 'dtype', type(slot_mapping))}")
    if slot_mapping.shape != (n,):
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} != ({n},)")
    if slot_mapping.stride(0) != 1 and n > 1:
        raise ValueError("slot_mapping must be contiguous")
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device}, key on {key.device}")
    return block_size


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key[i]``/``value[i]`` to cache slot ``slot_mapping[i]``; slots < 0 are skipped.

    key, value: [N, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim]; slot_mapping: [N] int32/int64 with slot = block_id * block_size + offset.
    """
    block_size = check_kv_store(key, value, k_cache, v_cache, slot_mapping)
    n, hkv, d = key.shape
    if n == 0:
        return
    _store_kvcache_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        hkv,
        BLOCK_SIZE=block_size, HEAD_DIM=d, BLOCK_H=next_pow2(hkv),
        num_warps=4,
    )
