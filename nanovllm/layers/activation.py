"""SiLU-and-multiply, the gate of the SwiGLU MLP: [*, 2 * I] = gate | up -> [*, I].

A layer built on CUDA runs the fused Triton kernel (nanovllm/kernels/fused_activation.py,
same arithmetic); on other devices the plain PyTorch code in `forward_native`. The choice is
made once, at construction (layers/kernel_path.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.kernel_path import construction_device, uses_triton


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.use_triton = uses_triton(construction_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x[..., :I]) * x[..., I:]."""
        if self.use_triton:
            return self.forward_triton(x)
        return self.forward_native(x)

    @staticmethod
    def forward_triton(x: torch.Tensor) -> torch.Tensor:
        from nanovllm.kernels.checks import as_rows
        from nanovllm.kernels.fused_activation import silu_and_mul

        return silu_and_mul(as_rows(x)).view(*x.shape[:-1], x.shape[-1] // 2)

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
