"""Triton mixture-of-experts for decode steps of 1-2 tokens: two GEMV-style launches, no
alignment, no [T*K, H] intermediate, no separate sum over the top k (kernels/moe.py needs
seven launches; at one token those launches, not the weight reads, dominate).

    gate_up  grid (T*K pairs, I / BLOCK_N):  pair p = t*K + k, e = ids[t, k]
             act[p, n] = silu_mul(w13[e, n] . hidden[t], w13[e, I + n] . hidden[t])       act [T*K, I]
    down     grid (T, H / BLOCK_N):
             out[t, n] = sum_k weights[t, k] * (w2[ids[t, k], n] . act[t*K + k])            out [T, H]

Each program streams BLOCK_N weight rows over the whole reduction in BLOCK_K steps
(accumulator [BLOCK_N, BLOCK_K] in float32, as kernels/gemv.py). g, u and act are rounded to
the input dtype as the unfused MLP does; the sum over k stays float32 until the output.
Offsets are int64. Shapes only set the launch: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_matrix, next_pow2
from .fused_activation import silu_mul
from .fused_norm import round_to

# Most tokens this path serves: past 2 the grouped GEMMs of kernels/moe.py read each picked
# expert once for all its tokens, where this path reads it once per (token, slot).
MAX_TOKENS = 2
# Weight rows per program and columns per step: a [16, 256] float32 accumulator is 32 registers a
# thread at 4 warps; 16 rows keep 384 gate/up programs (8 pairs x 768 / 16) over 132 SMs at one token.
GATE_UP_BLOCK_N = 16
# The down projection has T programs per row tile only: 8 rows doubles the grid (256 at H = 2048).
DOWN_BLOCK_N = 8
BLOCK_K = 256
NUM_WARPS = 4


@triton.jit
def _gate_up_gemv(hidden_ptr, w13_ptr, ids_ptr, act_ptr, hidden_size, inter, stride_h, stride_we, stride_wn,
                  TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    token = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < inter
    rows = tl.minimum(rn, inter - 1).to(tl.int64)  # columns past I repeat row I - 1, never stored
    rk = tl.arange(0, BLOCK_K)
    w = w13_ptr + expert * stride_we + rk[None, :]
    g_ptrs = w + rows[:, None] * stride_wn  # [BLOCK_N, BLOCK_K]
    u_ptrs = w + (rows + inter)[:, None] * stride_wn
    x_ptrs = hidden_ptr + token.to(tl.int64) * stride_h + rk  # [BLOCK_K]
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k_ok = k0 + rk < hidden_size
        x = tl.load(x_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(g_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32) * x
        acc_u += tl.load(u_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32) * x
    dtype = act_ptr.dtype.element_ty
    g = round_to(tl.sum(acc_g, axis=1), dtype).to(tl.float32)
    u = round_to(tl.sum(acc_u, axis=1), dtype).to(tl.float32)
    tl.store(act_ptr + pair.to(tl.int64) * inter + rn, silu_mul(g, u, dtype), mask=n_ok)


@triton.jit
def _down_gemv(act_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr, hidden_size, inter, stride_we, stride_wn, stride_o,
               TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < hidden_size
    rows = tl.minimum(rn, hidden_size - 1).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        w_ptrs = w2_ptr + expert * stride_we + rows[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K]
        a_ptrs = act_ptr + pair.to(tl.int64) * inter + rk
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = k0 + rk < inter
            a = tl.load(a_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32) * a
        total += tl.load(weights_ptr + pair) * tl.sum(acc, axis=1)
    out = out_ptr + token.to(tl.int64) * stride_o + rn
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def moe_gemv(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor) -> torch.Tensor:
    """Same contract as kernels/moe.fused_moe for 1..MAX_TOKENS tokens: hidden [T, H] -> [T, H]
    in hidden's dtype; w13 [E, 2I, H] (gate | up), w2 [E, H, I], topk_weights [T, K] float32,
    topk_ids [T, K] int32/int64 (contiguous)."""
    check_matrix("hidden", hidden)
    t, h = hidden.shape
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"moe_gemv serves 1..{MAX_TOKENS} tokens, got {t}")
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.stride(-1) != 1 or w.dtype != hidden.dtype:
            raise ValueError(f"{name} must be a 3-D {hidden.dtype} tensor with a contiguous last dim")
    e, two_i, wh = w13.shape
    inter = two_i // 2
    if wh != h or two_i % 2 or tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden {tuple(hidden.shape)}")
    if (not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64)
            or topk_ids.dim() != 2 or topk_ids.shape[0] != t or not topk_ids.is_contiguous()):
        raise TypeError(f"topk_ids must be a contiguous int32/int64 [{t}, K] tensor")
    k = topk_ids.shape[1]
    if (not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32
            or topk_weights.shape != topk_ids.shape or not topk_weights.is_contiguous()):
        raise TypeError(f"topk_weights must be a contiguous float32 [{t}, {k}] tensor")
    for name, x in (("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if x.device != hidden.device:
            raise ValueError(f"{name} is on {x.device}, hidden on {hidden.device}")
    act = torch.empty((t * k, inter), dtype=hidden.dtype, device=hidden.device)  # [T * K, I]
    block_k = max(16, min(BLOCK_K, next_pow2(h)))
    _gate_up_gemv[(t * k, triton.cdiv(inter, GATE_UP_BLOCK_N))](
        hidden, w13, topk_ids, act, h, inter, hidden.stride(0), w13.stride(0), w13.stride(1),
        TOP_K=k, BLOCK_N=GATE_UP_BLOCK_N, BLOCK_K=block_k, num_warps=NUM_WARPS)
    out = torch.empty((t, h), dtype=hidden.dtype, device=hidden.device)  # [T, H]
    _down_gemv[(t, triton.cdiv(h, DOWN_BLOCK_N))](
        act, w2, topk_ids, topk_weights, out, h, inter, w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=k, BLOCK_N=DOWN_BLOCK_N, BLOCK_K=max(16, min(BLOCK_K, next_pow2(inter))), num_warps=NUM_WARPS)
    return out
