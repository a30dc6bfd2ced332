"""Argument checks of the fused MoE entry points (grouped_gemm.fused_moe, decode.moe_gemv): stacked
experts that fit hidden, and a top-k routing that fits hidden and the experts. One definition, so both
paths refuse the same input with the same words."""

from __future__ import annotations

import torch

from nanovllm.kernels.checks import check_matrix
from .align import check_ids


def check_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """hidden [T, H]; w13 [E, 2I, H] (gate | up) and w2 [E, H, I], 3-D with a contiguous last dim, on
    hidden's device. Returns (E, H, I); a ValueError / TypeError naming the argument otherwise."""
    check_matrix("hidden", hidden)
    h = hidden.shape[1]
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [E, N, K], got {getattr(w, 'shape', type(w))}")
        if w.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {w.stride()}")
        if w.device != hidden.device:
            raise ValueError(f"{name} is on {w.device}, hidden on {hidden.device}")
    e, two_i, wh = w13.shape
    if wh != h or two_i < 2 or two_i % 2:
        raise ValueError(f"w13 shape {tuple(w13.shape)} must be [E, 2 * I, H={h}] (gate | up)")
    if tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"w2 shape {tuple(w2.shape)} must be [E={e}, H={h}, I={two_i // 2}]")
    return e, h, two_i // 2


def check_routing(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> None:
    """topk_ids [T, K] int32/int64 in [0, num_experts) (range read on the CPU only) and topk_weights
    [T, K] float32, both contiguous, on hidden's device, T = hidden's rows."""
    check_ids(topk_ids, num_experts)
    if topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows, hidden {hidden.shape[0]}")
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32:
        got = getattr(topk_weights, "dtype", type(topk_weights))
        raise TypeError(f"topk_weights must be a float32 tensor, got {got}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights must be contiguous of topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)} strides {topk_weights.stride()}")
    for name, x in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if x.device != hidden.device:
            raise ValueError(f"{name} is on {x.device}, hidden on {hidden.device}")
