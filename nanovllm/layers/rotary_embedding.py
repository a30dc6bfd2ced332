"""Rotary position embedding, neox style (the head's two halves rotate as pairs): its table and
its plain PyTorch rotation.

For position p and pair i < D/2: angle = p * inv_freq[i];
    out[i]       = x[i] * cos - x[i + D/2] * sin
    out[i + D/2] = x[i + D/2] * cos + x[i] * sin

Plain RoPE: inv_freq[i] = theta^(-2i/D). Llama 3 scaling (config `rope_type: "llama3"`) rewrites
each inv_freq by its wavelength w = 2 pi / inv_freq, with L = original_max_position_embeddings:

    w > L / low_freq_factor    ->  inv_freq / factor                   (long wavelengths)
    w < L / high_freq_factor   ->  inv_freq                            (short wavelengths)
    otherwise                  ->  (1 - s) * inv_freq / factor + s * inv_freq,
                                   s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)

The table `cos_sin_cache` [max_position, D] float32 = [cos | sin] is computed once, at
construction, in float64. One table serves every layer of a model. The fused Triton kernels
(kernels/fused_rope.py) read the same table; `forward` is the PyTorch rotation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x's frequency-dependent RoPE scaling (config.json `rope_type: "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"llama3 rope factor must be > 0, got {self.factor!r}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"llama3 rope needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor!r}, high_freq_factor={self.high_freq_factor!r}"
            )
        if not self.original_max_position_embeddings > 0:
            raise ValueError(
                f"llama3 rope original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings!r}"
            )

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """inv_freq [D/2] -> the scaled inverse frequencies (same dtype)."""
        old_len = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        interpolated = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        long_wave = wavelen > old_len / self.low_freq_factor
        short_wave = wavelen < old_len / self.high_freq_factor
        return torch.where(long_wave, inv_freq / self.factor, torch.where(short_wave, inv_freq, interpolated))


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> torch.Tensor:
    """[head_dim / 2] float64 inverse frequencies, scaled when `scaling` is given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    return inv_freq if scaling is None else scaling.scale(inv_freq)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: Llama3RopeScaling | None = None):
        super().__init__()
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"rotary head_dim must be even and >= 2, got {head_dim}")
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
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
        """positions [N]; q [N, Hq, D]; k [N, Hkv, D] -> rotated q, k (PyTorch)."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [N, 1, D/2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
