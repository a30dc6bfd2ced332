"""Triton per-head q/k RMSNorm (optional) fused with neox rotary embedding: the attention input.

Replicates the torch sequence `RMSNorm` (q_norm / k_norm over head_dim, cast to dtype)
then `RotaryEmbedding` (upcast, rotate, cast back), including the intermediate rounding::

    n   = round_to_dtype(x * rsqrt(mean(x^2) + eps) * weight)     # per head, over D
    c, s = cos_sin_cache[pos, i], cos_sin_cache[pos, D/2 + i]      # pair i < D/2, float32
    out[i]       = round_to_dtype(n[i] * c - n[i + D/2] * s)
    out[i + D/2] = round_to_dtype(n[i + D/2] * c + n[i] * s)

All math is float32. The only difference from the torch path is that the compiler may
fuse `a * b - c * d` into an FMA (and sums reduce in another order), which moves a
bf16/fp16 result by at most one ulp, rarely.

Grid (N, q_head_blocks + k_head_blocks): a program handles HEADS heads of one token of
either q or k as two [HEADS, D/2] half tiles (so the pair partners sit at the same index).
q/k may be strided views into the fused qkv projection output (last dim contiguous,
arbitrary token/head strides); outputs are contiguous. N is only the grid size and the
launch parameters depend on shapes only, so the call is CUDA-graph capturable.
Positions are not range-checked (that would need a host sync): they must lie in
[0, cos_sin_cache.shape[0]).

With `kv_write`, the k programs also write their rotated heads, and the same heads of v, into
the paged KV cache at the token's slot (what torch_attention.store_kvcache does on the CPU path).
A padding row (slot < 0) masks the write rather than branching around it (0.6B / 8B batch-1
decode ~1% faster on an H100, BENCHMARKS.md, thirty-eighth session).
An FP8 cache (given with its `k_scale` / `v_scale`) is written quantized: a constexpr branch
(the scale pointers are None for a 16-bit cache, which leaves that code as it was) stores
e4m3(clamp(x / scale, -448, 448)) as kernels/fp8_kv.py defines it.

`rope` is the same kernel without the norm (APPLY_NORM off: Llama, Qwen2), with the same
optional `kv_write`.

Measured end to end (H200): this kernel, fused_norm and fused_activation together took the default
workload from 12,112 to 20,773 tok/s and 0.6B batch-1 decode from 4.51 to 1.65 ms per token
(740201d); writing the KV cache here is part of the 1.333 -> 1.081 ms change of 2c43c71
(BENCHMARKS.md, "Throughput and latency history"). Alone: 54.2 -> 1.4 us at one token, graphed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.utils.ints import next_pow2

from .checks import (MAX_GRID_YZ, check_cache, check_eps, check_float_dtype, check_kv_scales, check_on_device,
                     check_vector, kv_cache_dtype)
from .fp8_kv import quantize_fp8
from .fused_norm import round_to
from .pdl import pdl_launch_options, wait_for_prior

# Largest supported head_dim: one [HEADS, D/2] tile pair must stay in registers.
MAX_HEAD_DIM = 1024
# Target elements per program (both halves): 8 heads at D=128, ~2 KB of bf16 moved each way.
TILE_ELEMS = 1024
NUM_WARPS = 4


@triton.jit
def _norm_rope_heads(
    src_ptr, dst_ptr, w_ptr, cos, sin, tok, head0, n_heads, stride_t, stride_h, eps,
    HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, APPLY_NORM: tl.constexpr,
):
    """Normalise (optionally) and rotate heads [head0, head0 + HEADS) of token `tok`; returns the
    two rounded [HEADS, BLOCK_HALF] halves and their mask."""
    HALF: tl.constexpr = HEAD_DIM // 2
    heads = head0 + tl.arange(0, HEADS)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    mask = (heads < n_heads)[:, None] & col_mask[None, :]
    src = src_ptr + tok * stride_t + heads[:, None].to(tl.int64) * stride_h + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if APPLY_NORM:
        mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
        rstd = tl.math.rsqrt(mean_sq + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        # RMSNorm's output is rounded to dtype before the rotary embedding upcasts it again.
        x1 = round_to((x1 * rstd) * w1, dst_ptr.dtype.element_ty).to(tl.float32)
        x2 = round_to((x2 * rstd) * w2, dst_ptr.dtype.element_ty).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    o1 = round_to(o1, dst_ptr.dtype.element_ty)
    o2 = round_to(o2, dst_ptr.dtype.element_ty)
    dst = dst_ptr + (tok * n_heads + heads[:, None].to(tl.int64)) * HEAD_DIM + cols[None, :]
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)
    return o1, o2, mask


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    n_q_heads, n_k_heads, q_blocks, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_pos, stride_cache, stride_vt, stride_vh, stride_cb, stride_co, stride_ch, eps,
    HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, APPLY_NORM: tl.constexpr,
    STORE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(pos_ptr + tok * stride_pos).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    cs_row = cache_ptr + pos * stride_cache
    cos = tl.load(cs_row + cols, mask=col_mask, other=0.0)[None, :]
    sin = tl.load(cs_row + HALF + cols, mask=col_mask, other=0.0)[None, :]
    if hb < q_blocks:
        _norm_rope_heads(q_ptr, q_out_ptr, qw_ptr, cos, sin, tok, hb * HEADS, n_q_heads,
                         stride_qt, stride_qh, eps, HEAD_DIM, HEADS, BLOCK_HALF, APPLY_NORM)
    else:
        head0 = (hb - q_blocks) * HEADS
        k1, k2, mask = _norm_rope_heads(k_ptr, k_out_ptr, kw_ptr, cos, sin, tok, head0, n_k_heads,
                                        stride_kt, stride_kh, eps, HEAD_DIM, HEADS, BLOCK_HALF, APPLY_NORM)
        if STORE_KV:  # the rotated k and the untouched v of these heads go to cache slot slot_ptr[tok]
            # slot < 0 (a padding row) masks every store instead of branching: without the branch the
            # v loads need not wait for the slot's
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            heads = (head0 + tl.arange(0, HEADS)).to(tl.int64)[:, None]
            mask = mask & ((tl.zeros_like(heads) + slot) >= 0)  # [HEADS, 1] (the interpreter wants a tensor)
            row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + heads * stride_ch
            dst = row + cols[None, :]
            src = v_ptr + tok * stride_vt + heads * stride_vh + cols[None, :]
            v1 = tl.load(src, mask=mask)
            v2 = tl.load(src + HALF, mask=mask)
            if k_scale_ptr is None:  # a cache of q's dtype: the values as they are
                tl.store(k_cache_ptr + dst, k1, mask=mask)
                tl.store(k_cache_ptr + dst + HALF, k2, mask=mask)
                tl.store(v_cache_ptr + dst, v1, mask=mask)
                tl.store(v_cache_ptr + dst + HALF, v2, mask=mask)
            else:  # FP8 cache: k (rounded to q's dtype above) and v quantized with the layer's scales
                k_scale, v_scale = tl.load(k_scale_ptr), tl.load(v_scale_ptr)
                fp8 = k_cache_ptr.dtype.element_ty
                tl.store(k_cache_ptr + dst, quantize_fp8(k1, k_scale, fp8), mask=mask)
                tl.store(k_cache_ptr + dst + HALF, quantize_fp8(k2, k_scale, fp8), mask=mask)
                tl.store(v_cache_ptr + dst, quantize_fp8(v1, v_scale, fp8), mask=mask)
                tl.store(v_cache_ptr + dst + HALF, quantize_fp8(v2, v_scale, fp8), mask=mask)


def _check_heads(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        raise ValueError(f"{name} must be a 3-D tensor [N, heads, head_dim], got {getattr(t, 'shape', type(t))}")
    check_float_dtype(name, t)
    if t.stride(2) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
    if t.shape[1] < 1:
        raise ValueError(f"{name} must have at least one head, got shape {tuple(t.shape)}")


def _check_args(q, k, positions, cos_sin_cache) -> None:
    _check_heads("q", q)
    _check_heads("k", k)
    n, _, d = q.shape
    if k.shape[0] != n or k.shape[2] != d:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} (N and head_dim)")
    if k.dtype != q.dtype:
        raise TypeError(f"k dtype {k.dtype} != q dtype {q.dtype}")
    if d < 2 or d % 2 or d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be even and in [2, {MAX_HEAD_DIM}], got {d}")
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions must be an int32/int64 tensor, got {getattr(positions, 'dtype', type(positions))}")
    if positions.shape != (n,):
        raise ValueError(f"positions shape {tuple(positions.shape)} != ({n},)")
    if not isinstance(cos_sin_cache, torch.Tensor) or cos_sin_cache.dtype != torch.float32:
        raise TypeError(f"cos_sin_cache must be a float32 tensor, got {getattr(cos_sin_cache, 'dtype', type(cos_sin_cache))}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != d or cos_sin_cache.shape[0] < 1:
        raise ValueError(f"cos_sin_cache must be [max_position, {d}], got {tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must have a contiguous last dim, got strides {cos_sin_cache.stride()}")
    check_on_device(q.device, (("k", k), ("positions", positions), ("cos_sin_cache", cos_sin_cache)))


def _check_kv_write(kv_write) -> None:
    """kv_write is None or (v, k_cache, v_cache, slot_mapping); the tensors are checked at launch."""
    if kv_write is not None and (not isinstance(kv_write, tuple) or len(kv_write) != 4):
        got = f"a tuple of {len(kv_write)}" if isinstance(kv_write, tuple) else type(kv_write).__name__
        raise ValueError(f"kv_write must be a tuple (v, k_cache, v_cache, slot_mapping), got {got}")


def check_kv_store(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale=None, v_scale=None) -> int:
    """Validate a K/V cache write (key / value [N, Hkv, D] into the paged caches at slot_mapping
    [N]); return the cache block size. With k_scale / v_scale (checks.check_kv_scales) the caches
    are FP8, else of key's dtype."""
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


def _launch(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, apply_norm, kv_write=None,
            k_scale=None, v_scale=None):
    n, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, hkv, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return q_out, k_out
    block_half = next_pow2(d // 2)
    heads = max(1, min(next_pow2(max(hq, hkv)), TILE_ELEMS // (2 * block_half)))
    q_blocks, k_blocks = triton.cdiv(hq, heads), triton.cdiv(hkv, heads)
    if q_blocks + k_blocks > MAX_GRID_YZ:
        raise ValueError(f"too many heads ({hq} q + {hkv} k): {q_blocks + k_blocks} > {MAX_GRID_YZ} head blocks")
    if kv_write is not None:
        v, k_cache, v_cache, slot_mapping = kv_write
        block_size = check_kv_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        cache_args = (v, k_cache, v_cache, slot_mapping, k_scale, v_scale)  # scales None: constexpr, no code
        cache_strides = (v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    else:  # never read without STORE_KV; q stands in for the pointers
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale / v_scale are the FP8 cache's scales: they need kv_write")
        block_size, cache_args, cache_strides = 1, (q, q, q, positions, None, None), (0,) * 5
    _qk_norm_rope_kernel[(n, q_blocks + k_blocks)](
        q, k, q_weight, k_weight, q_out, k_out, positions, cos_sin_cache, *cache_args,
        hq, hkv, q_blocks, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        positions.stride(0), cos_sin_cache.stride(0), *cache_strides, float(eps),
        HEAD_DIM=d, HEADS=heads, BLOCK_HALF=block_half, APPLY_NORM=apply_norm,
        STORE_KV=kv_write is not None, BLOCK_SIZE=block_size, num_warps=NUM_WARPS, **pdl_launch_options(q),
    )
    return q_out, k_out


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 positions: torch.Tensor, cos_sin_cache: torch.Tensor, eps: float,
                 kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None, *,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k [N, Hkv, D] (strided views allowed) -> contiguous (q_out, k_out) in q's dtype.

    Per-head RMSNorm over D with q_weight / k_weight [D], then neox RoPE at `positions` [N]
    (int32/int64) from `cos_sin_cache` [max_position, D] float32 = [cos | sin].
    kv_write = (v, k_cache, v_cache, slot_mapping) also writes k_out and v into the paged cache,
    exactly as torch_attention.store_kvcache(k_out, v, k_cache, v_cache, slot_mapping) would (slots < 0 skipped).
    k_scale / v_scale (float32 [1] on q's device, with kv_write only): the caches are FP8
    (checks.FP8_KV_DTYPE) and receive e4m3(clamp(x / scale, -448, 448)) (kernels/fp8_kv.py).
    """
    _check_args(q, k, positions, cos_sin_cache)
    d = q.shape[2]
    check_vector("q_weight", q_weight, d, "q", q)
    check_vector("k_weight", k_weight, d, "q", q)
    check_eps(eps)
    _check_kv_write(kv_write)
    return _launch(q, k, q_weight, k_weight, positions, cos_sin_cache, eps, True, kv_write, k_scale, v_scale)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
         kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None, *,
         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE only (no norm): same shapes, rules, `kv_write` and scales as `qk_norm_rope`."""
    _check_args(q, k, positions, cos_sin_cache)
    _check_kv_write(kv_write)
    # The weight pointers are never read without the norm; q stands in for them.
    return _launch(q, k, q, k, positions, cos_sin_cache, 0.0, False, kv_write, k_scale, v_scale)
