"""RMSNorm, optionally fused with the residual add that precedes it (computed in float32).

A layer built on CUDA runs the fused Triton kernel (nanovllm/kernels/fused_norm.py, same
arithmetic); on other devices the plain PyTorch code in `forward_native`. The choice is made
once, at construction (layers/kernel_path.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from nanovllm.layers.kernel_path import uses_triton

if TYPE_CHECKING:
    from nanovllm.kernels.fp8_quant import QuantizedRows, RowQuant


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.use_triton = uses_triton(self.weight.device)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        if self.use_triton:
            return self.forward_triton(x, residual)
        return self.forward_native(x, residual)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s), s) with s = x + residual, the residual stream after the add (s = x when
        residual is None: a decoder's first layer)."""
        if residual is None:
            return self(x), x
        return self(x, residual)

    def add_norm_and_quantize(self, x: torch.Tensor, residual: torch.Tensor | None,
                              quant: RowQuant) -> tuple[torch.Tensor, QuantizedRows, torch.Tensor]:
        """(norm(s), norm(s) quantized as `quant` says, s), s as add_and_norm's: on CUDA one
        kernel writes both (kernels/fused_norm.rms_norm_both), elsewhere the norm, then the
        quantization (fp8_quant.quantize; Triton's interpreter on CPU)."""
        if self.use_triton:
            from nanovllm.kernels.fused_norm import rms_norm_both

            normed, xq, s = rms_norm_both(x, residual, self.weight, self.eps, quant)
            return normed, xq, x if s is None else s
        from nanovllm.kernels.fp8_quant import quantize

        normed, s = self.add_and_norm(x, residual)
        return normed, quantize(normed, quant), s

    def forward_triton(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`forward` through the fused Triton kernel (leading dims flattened into rows)."""
        from nanovllm.kernels.checks import as_rows
        from nanovllm.kernels.fused_norm import add_rms_norm, rms_norm

        if residual is None:
            return rms_norm(as_rows(x), self.weight, self.eps).view(x.shape)
        out, summed = add_rms_norm(as_rows(x), as_rows(residual), self.weight, self.eps)
        return out.view(x.shape), summed.view(x.shape)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`forward` in plain PyTorch."""
        if residual is None:
            return self._norm(x)
        summed = (x.float() + residual.float()).to(x.dtype)
        return self._norm(summed), summed
