"""Rotary position embedding, neox style (the head's two halves rotate as pairs).

For position p and pair i < D/2: angle = p * theta^(-2i/D);
    out[i]       = x[i] * cos - x[i + D/2] * sin
    out[i + D/2] = x[i + D/2] * cos + x[i] * sin

CUDA tensors go through the Triton kernel (nanovllm/kernels/fused_rope.py, same
arithmetic); other devices run the plain PyTorch code in `forward_native`.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        # [max_position, head_dim]: cos of each pair | sin of each pair
        cache = torch.cat([angles.cos(), angles.sin()], dim=-1).float()
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N]; q [N, Hq, D]; k [N, Hkv, D] -> rotated q, k."""
        if q.is_cuda:
            return self.forward_triton(positions, q, k)
        return self.forward_native(positions, q, k)

    def forward_triton(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from nanovllm.kernels.fused_rope import rope

        return rope(q, k, positions, self.cos_sin_cache)

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [N, 1, D/2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
