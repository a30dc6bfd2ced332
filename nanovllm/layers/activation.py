"""SiLU-and-multiply, the gate of Qwen3's MLP: [*, 2 * I] -> [*, I].

CUDA tensors go through the fused Triton kernel (nanovllm/kernels/fused_activation.py,
same arithmetic); other devices run the plain PyTorch code in `forward_native`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:]: the Triton kernel on CUDA, plain PyTorch elsewhere."""
    if x.is_cuda:
        return SiluAndMul.forward_triton(x)
    return SiluAndMul.forward_native(x)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    @staticmethod
    def forward_triton(x: torch.Tensor) -> torch.Tensor:
        from nanovllm.kernels.checks import as_rows
        from nanovllm.kernels.fused_activation import silu_and_mul

        return silu_and_mul(as_rows(x)).view(*x.shape[:-1], x.shape[-1] // 2)

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
