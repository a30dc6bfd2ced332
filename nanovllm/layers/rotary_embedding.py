"""Rotary position embedding, neox style (the head's two halves rotate as pairs): its table and
its plain PyTorch rotation.

For position p and pair i < D/2: angle = p * inv_freq[i];
    out[i]       = x[i] * cos - x[i + D/2] * sin
    out[i + D/2] = x[i + D/2] * cos + x[i] * sin

Plain RoPE: inv_freq[i] = theta^(-2i/D); a config's scaling (layers/rope_scaling.py: llama3,
linear, yarn) rewrites those frequencies and may scale cos and sin (YaRN's attention factor).

The table `cos_sin_cache` [max_position, D] float32 = [cos | sin] is computed once, at
construction, in float64. One table serves every layer of a model. The fused Triton kernels
(kernels/fused_rope.py) read the same table; `forward` is the PyTorch rotation.
"""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.rope_scaling import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """[head_dim / 2] float64 inverse frequencies, scaled when `scaling` is given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    return inv_freq if scaling is None else scaling.scale(inv_freq, theta)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"rotary head_dim must be even and >= 2, got {head_dim}")
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        magnitude = 1.0 if scaling is None else scaling.attention_factor
        # [max_position, head_dim]: cos of each pair | sin of each pair (times the scaling's attention factor)
        cache = (torch.cat([angles.cos(), angles.sin()], dim=-1) * magnitude).float()
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N]; q [N, Hq, D]; k [N, Hkv, D] -> rotated q, k (PyTorch)."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [N, 1, D/2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
