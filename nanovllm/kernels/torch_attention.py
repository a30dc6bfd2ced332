"""Plain-PyTorch implementation of the attention contract (the CPU path).

Same names, shapes and semantics as flash-attn's functions (see prefill_attention.py / decode_attention.py);
it loops over sequences in Python, so it is for CPU runs and tests, not for speed.
Computes in float32 (or float64 when given float64).
"""

from __future__ import annotations

import torch


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value [N, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping [N]; slots < 0 skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[valid]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[valid]


def _gather_paged(cache: torch.Tensor, block_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """First num_tokens tokens of one sequence from a paged cache: [num_tokens, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    return cache[block_row[:num_blocks].long()].flatten(0, 1)[:num_tokens]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D]; causal is bottom-right aligned."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
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
) -> torch.Tensor:
    """q [total_q, Hq, D]; k/v packed [total_k, Hkv, D] or paged caches with block_table."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        qs, qe = cu_q[i], cu_q[i + 1]
        if block_table is None:
            ks, vs = k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
        else:
            lk = cu_k[i + 1] - cu_k[i]
            ks, vs = _gather_paged(k, block_table[i], lk), _gather_paged(v, block_table[i], lk)
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
) -> torch.Tensor:
    """q [batch, 1, Hq, D] against each sequence's first cache_seqlens[i] cached tokens."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    for i, lk in enumerate(cache_seqlens.tolist()):
        if lk > 0:
            ks = _gather_paged(k_cache, block_table[i], lk)
            vs = _gather_paged(v_cache, block_table[i], lk)
            out[i] = _attend(q[i], ks, vs, scale, causal)
    return out
