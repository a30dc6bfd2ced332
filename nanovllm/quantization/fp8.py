"""FP8 weights in PyTorch: quantized and dequantized at load (and by update_weights), and the
CUDA matmul of a layer that holds them.

    quantize_weight(w [N, K], BLOCK)    -> (q [N, K] e4m3, s [ceil(N/128), ceil(K/128)])  s = amax(block) / 448
    quantize_weight(w [N, K], CHANNEL)  -> (q, s [N, 1])                                  s = amax(row) / 448
        q = e4m3(clamp(w / s, -448, 448)), s floored at FP8_MIN_SCALE (an all-zero block)
    dequantize_weight(q, s, scales)     -> float32 q * s, s spread over its block, row or tensor

    fp8_linear(x [M, K], Fp8Weights)    -> [M, N]: x quantized per token (per 1 x 128 group for
        block weights, with the static input scale where the checkpoint has one) by
        kernels/fp8_quant.py, then torch._scaled_mm (rowwise scales with fast accumulation, or
        blockwise scales), or the skinny GEMM's e4m3 MMAs where the layer's LinearPath says
        (33-192 rows: kernels/skinny_gemm.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nanovllm.kernels.checks import FP8_BLOCK, FP8_MAX, FP8_MIN_SCALE
from nanovllm.quantization.config import BLOCK, CHANNEL, FP8_DTYPE, TENSOR
from nanovllm.utils.ints import cdiv

if TYPE_CHECKING:  # the kernels import Triton, which config-only imports must not pull in
    from nanovllm.kernels.fp8_quant import QuantizedRows, RowQuant

# torch._scaled_mm's blockwise scaling (cuBLAS) refused row counts that are not multiples of
# this (H200, torch 2.11: 1-3, 5 and 17 rows refused, 4-32 in steps of 4 taken); the
# activations are padded with zero rows.
BLOCKWISE_ROW_MULTIPLE = 4


def expand_blocks(s: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A block grid [ceil(n/128), ceil(k/128)] spread over its [n, k] weight."""
    return s.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 rounded once to float32, on every device (CUDA divides a tensor by a number as a
    product with its reciprocal), floored at FP8_MIN_SCALE."""
    return (amax.double() / FP8_MAX).float().clamp(min=FP8_MIN_SCALE)


def quantize_weight(w: torch.Tensor, scales: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q float8_e4m3fn [N, K], s float32): BLOCK scales
    [ceil(N/128), ceil(K/128)] or CHANNEL scales [N, 1], each amax / 448."""
    if w.dim() != 2:
        raise ValueError(f"a weight to quantize must be 2-D, got shape {tuple(w.shape)}")
    w = w.float()
    n, k = w.shape
    if scales == BLOCK:
        gn, gk = cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK)
        padded = F.pad(w, (0, gk * FP8_BLOCK - k, 0, gn * FP8_BLOCK - n)).view(gn, FP8_BLOCK, gk, FP8_BLOCK)
        s = _scale(padded.abs().amax(dim=(1, 3)))  # [gn, gk]
        return _to_fp8(w / expand_blocks(s, n, k)), s
    if scales == CHANNEL:
        s = _scale(w.abs().amax(dim=1, keepdim=True))  # [N, 1]
        return _to_fp8(w / s), s
    raise ValueError(f"weights are quantized with {BLOCK!r} or {CHANNEL!r} scales, got {scales!r}")


def scale_shapes(n: int, k: int, scales: str) -> tuple[tuple[int, ...], ...]:
    """The shapes a checkpoint's `scales` scale of an [n, k] weight may have: the block grid
    [ceil(n/128), ceil(k/128)], [n, 1] or [n] per channel, [1] or [] per tensor."""
    if scales == BLOCK:
        return ((cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK)),)
    if scales == CHANNEL:
        return (n, 1), (n,)
    return (1,), ()


def scale_shape_ok(s: torch.Tensor, n: int, k: int, scales: str) -> bool:
    """Whether `s` is a checkpoint's `scales` scale of an [n, k] weight (`scale_shapes`)."""
    return tuple(s.shape) in scale_shapes(n, k, scales)


def dequantize_weight(q: torch.Tensor, s: torch.Tensor, scales: str) -> torch.Tensor:
    """q [N, K] (float8) and its scale (`scales`: BLOCK, CHANNEL or TENSOR) -> float32 q * s."""
    n, k = q.shape
    if not scale_shape_ok(s, n, k, scales):
        expected = " or ".join(map(str, scale_shapes(n, k, scales)))
        raise ValueError(f"a {scales} scale of a weight {tuple(q.shape)} has the wrong shape {tuple(s.shape)} "
                         f"(expected {expected})")
    s = s.float()
    if scales == BLOCK:
        s = expand_blocks(s, n, k)
    elif scales == CHANNEL:
        s = s.reshape(n, 1)
    elif scales == TENSOR:
        s = s.reshape(())
    return q.float() * s


@dataclass(frozen=True)
class Fp8Weights:
    """A held FP8 layer's tensors (its registered parameters): weight [N, K] float8_e4m3fn;
    scale float32, [N] per output row (channel and tensor checkpoints alike) or the block grid
    [N/128, K/128]; input_scale [parts] float32 per packed part (static activations) or None."""

    weight: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor | None
    amax_ub: float | None = None  # the format's bound on per-token activation amax (Fp8Format.amax_ub)

    @property
    def blocks(self) -> bool:
        return self.scale.dim() == 2

    def row_quant(self) -> RowQuant:
        """How fp8_linear quantizes this layer's activations: per 1 x 128 group for block weights
        (rows padded to BLOCKWISE_ROW_MULTIPLE), else per token, or with the static input scale
        (the largest of the parts' scales, as one packed matmul takes one: the kernels take it)."""
        from nanovllm.kernels.fp8_quant import RowQuant

        if self.blocks:
            return RowQuant(FP8_BLOCK, row_multiple=BLOCKWISE_ROW_MULTIPLE)
        return RowQuant(static_scale=self.input_scale, amax_ub=self.amax_ub)


def fp8_linear(x: torch.Tensor | QuantizedRows, w: Fp8Weights, bias: torch.Tensor | None,
               skinny: bool = False) -> torch.Tensor:
    """x [M, K] (bf16) @ dequant(w)^T (+ bias) -> [M, N] in the compute dtype, through
    torch._scaled_mm on x quantized as `w.row_quant()` says; `x` may come quantized so already
    (kernels/fused_norm.rms_norm_fp8, fused_activation.silu_and_mul_fp8: the same values).
    `skinny`: the skinny GEMM's e4m3 MMAs instead (the layer's LinearPath decides)."""
    from nanovllm.kernels.fp8_quant import quantize

    xq = quantize(x, w.row_quant()) if isinstance(x, torch.Tensor) else x
    if skinny:
        from nanovllm.kernels.skinny_gemm import skinny_gemm_w8a8

        return skinny_gemm_w8a8(xq, w.weight, w.scale, bias)
    if w.blocks:
        y = torch._scaled_mm(xq.q, w.weight.t(), scale_a=xq.scales, scale_b=w.scale.t(), out_dtype=xq.dtype)[:xq.m]
        return y if bias is None else y + bias
    return _rowwise_scaled_mm(xq.q, w.weight.t(), xq.scales, w.scale.view(1, -1), xq.dtype, bias)


def _rowwise_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """torch._scaled_mm with per-row / per-column scales and fast accumulation (the MMAs' own
    accumulator, no periodic fp32 promotion), as the Triton W8A8 kernels run on sm_90 (Triton's
    default there) and vLLM's CUTLASS FP8 schedules do: the 8B / 30B-A3B layers at 384-16,384 rows
    take 0.83-0.99x the promoted time (36 of 38 cases; 1.00 and 1.04x the others), the 8B time to
    first token 0.93x (H200, BENCHMARKS.md, thirtieth session). cuBLAS has no such kernel for some
    shapes (torch 2.11: 3-16 rows x 4096 x 12,288 with a bias; CUBLAS_STATUS_NOT_SUPPORTED from its
    heuristic, before anything is launched): those take the promoted accumulation, and an error of
    another cause raises again from that call. Blockwise scales are refused outright, so
    block-scaled layers (fp8_linear) always promote."""
    try:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, bias=bias,
                                use_fast_accum=True)
    except RuntimeError:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, bias=bias)
