"""Triton MoE routing: softmax over the experts, top k, optional renormalisation, in one launch
(the PyTorch route in moe/layer.py takes four: softmax, topk, sum, divide).

    program t:  p = softmax(logits[t, :E]) in float32
                K rounds: w_i = max(p), e_i = lowest expert holding it; p[e_i] = -1
                weights[t] = w / sum(w) if RENORMALIZE else w;  ids[t] = e

Among equal probabilities the lower expert id is picked first. One program per token, the
whole expert row in registers (E <= MAX_EXPERTS); offsets are int64. Decode-sized grids (one
wave) launch with PDL: the kernel waits for the router's logits before reading them.

No end-to-end figure of its own: it replaced four PyTorch launches a layer inside the MoE decode
graphs (3.1 us a layer, BENCHMARKS.md "Qwen3-MoE (#16)"); 30B-A3B batch-1 decode runs 48 of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.checks import LOG2E as _LOG2E_VALUE, check_float_dtype
from nanovllm.kernels.pdl import pdl_for_grid, wait_for_prior
from nanovllm.utils.ints import next_pow2

from .align import MAX_EXPERTS  # expert rows live in one register tile: past this they crowd out

# Kernels read module globals only as constexprs (compiled Triton refuses plain floats).
LOG2E = tl.constexpr(_LOG2E_VALUE)

NUM_WARPS = 4


@triton.jit
def route_row(row_ptr, num_experts, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
              RENORMALIZE: tl.constexpr):
    """One token's routing from its logits at row_ptr ([num_experts]): (weights [K_PAD] float32,
    ids [K_PAD] int32), slots past TOP_K holding 0 (moe/decode.py routes with it too)."""
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    x = tl.load(row_ptr + experts, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp2((x - tl.max(x, axis=0)) * LOG2E)  # padding: exp2(-inf) = 0
    p = p / tl.sum(p, axis=0)
    # Padding is never picked; a row with non-finite logits (a padded graph row's garbage) has
    # NaN weights, read as 0 so that its ids still name distinct experts in [0, num_experts).
    p = tl.where(valid, tl.where(p == p, p, 0.0), -1.0)
    slots = tl.arange(0, K_PAD)
    w = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        e = tl.min(tl.where(p == best, experts, BLOCK_E), axis=0)
        w = tl.where(slots == i, best, w)
        ids = tl.where(slots == i, e, ids)
        p = tl.where(experts == e, -1.0, p)
    if RENORMALIZE:
        w = w / tl.sum(w, axis=0)  # slots past TOP_K hold 0
    return w, ids


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_prior(PDL)  # the logits come from the router's projection
    t = tl.program_id(0).to(tl.int64)
    w, ids = route_row(logits_ptr + t * stride_l, num_experts, TOP_K, K_PAD, BLOCK_E, RENORMALIZE)
    slots = tl.arange(0, K_PAD)
    out = t * TOP_K + slots
    keep = slots < TOP_K
    tl.store(weights_ptr + out, w, mask=keep)
    tl.store(ids_ptr + out, ids, mask=keep)


def expert_block(num_experts: int) -> int:
    """BLOCK_E of route_row for num_experts experts: a power of two, at least 16."""
    return max(16, next_pow2(num_experts))


def check_router_logits(logits: torch.Tensor, top_k: int) -> tuple[int, int]:
    """(tokens, experts) of router logits [T, E] that route_row can take with this top_k; else a
    ValueError naming what is wrong."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be 2-D [tokens, experts] with a contiguous last dim, got "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    check_float_dtype("logits", logits)
    tokens, num_experts = logits.shape
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"routing serves 1..{MAX_EXPERTS} experts, got {num_experts}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, {num_experts}], got {top_k!r}")
    return tokens, num_experts


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float16/bfloat16/float32, contiguous last dim) -> (weights [T, K]
    float32, expert ids [T, K] int32): the top-k of the float32 softmax by descending weight,
    divided by their sum when `renormalize` (as moe/layer.route)."""
    tokens, num_experts = check_router_logits(logits, top_k)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)  # [T, K]
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)  # [T, K]
    if tokens:
        _route_kernel[(tokens,)](
            logits, weights, ids, num_experts, logits.stride(0),
            TOP_K=top_k, K_PAD=next_pow2(top_k), BLOCK_E=expert_block(num_experts),
            RENORMALIZE=bool(renormalize), num_warps=NUM_WARPS, **pdl_for_grid(logits, tokens),
        )
    return weights, ids
