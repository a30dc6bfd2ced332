"""Plain-PyTorch implementation of the attention contract (the CPU path).

Same names, shapes and semantics as flash-attn's functions (see prefill_attention.py / decode_attention.py);
it loops over sequences in Python, so it is for CPU runs and tests, not for speed.
Computes in float32 (or float64 when given float64).

FP8 caches come with their `k_scale` / `v_scale` (float32 [1]): a store writes
e4m3(clamp(x / scale, -448, 448)), as the Triton cache writers do (kernels/fp8_kv.py), and
attention reads fp8 * scale.
"""

from __future__ import annotations

import torch

from nanovllm.utils.ints import cdiv

from .checks import FP8_KV_DTYPE, FP8_MAX, softmax_scale_of


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (a float32 IEEE division) saturated to +-FP8_MAX, as FP8_KV_DTYPE (round to nearest even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """key/value [N, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping [N]; slots < 0 skipped.
    With k_scale / v_scale the caches are FP8 and receive the quantized values."""
    if k_scale is not None:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[valid]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[valid]


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _gather_paged(cache: torch.Tensor, block_row: torch.Tensor, num_tokens: int, scale: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """First num_tokens tokens of one sequence from a paged cache: [num_tokens, Hkv, D] in `dtype`
    (an FP8 cache's values times its scale)."""
    block_size = cache.shape[1]
    num_blocks = cdiv(num_tokens, block_size)
    tokens = cache[block_row[:num_blocks].long()].flatten(0, 1)[:num_tokens].to(dtype)
    return tokens if scale is None else tokens * scale.to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D]; causal is bottom-right aligned."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    compute = _compute_dtype(q)
    group = hq // hkv
    qf = q.to(compute).transpose(0, 1)  # [Hq, Lq, D]
    kf = k.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Lk, D]
    vf = v.to(compute).repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Lq, Lk]
    if causal:
        # query j sees keys 0 .. j + (lk - lq)
        allowed = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [Hq, Lq, D]
    return out.transpose(0, 1).to(q.dtype)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_table: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [total_q, Hq, D]; k/v packed [total_k, Hkv, D] or paged caches with block_table (FP8 ones
    with k_scale / v_scale)."""
    scale = softmax_scale_of(softmax_scale, q.shape[-1])
    out = torch.empty_like(q)
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    dtype = _compute_dtype(q)
    for i in range(len(cu_q) - 1):
        qs, qe = cu_q[i], cu_q[i + 1]
        if block_table is None:
            ks, vs = k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
        else:
            lk = cu_k[i + 1] - cu_k[i]
            ks = _gather_paged(k, block_table[i], lk, k_scale, dtype)
            vs = _gather_paged(v, block_table[i], lk, v_scale, dtype)
        out[qs:qe] = _attend(q[qs:qe], ks, vs, scale, causal)
    return out


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [batch, 1, Hq, D] against each sequence's first cache_seqlens[i] cached tokens (FP8 caches
    with k_scale / v_scale)."""
    scale = softmax_scale_of(softmax_scale, q.shape[-1])
    out = torch.zeros_like(q)
    dtype = _compute_dtype(q)
    for i, lk in enumerate(cache_seqlens.tolist()):
        if lk > 0:
            ks = _gather_paged(k_cache, block_table[i], lk, k_scale, dtype)
            vs = _gather_paged(v_cache, block_table[i], lk, v_scale, dtype)
            out[i] = _attend(q[i], ks, vs, scale, causal)
    return out
