"""RoPE scalings (config.json `rope_scaling`, transformers 5's `rope_parameters`): how each one
rewrites the plain inverse frequencies inv_freq[i] = theta^(-2i/D), i < D/2, what it multiplies
cos and sin by, and how many positions it serves (vLLM's derived maximum length).

    "llama3"   Llama 3.x: by wavelength w = 2 pi / inv_freq against L = original_max_position_embeddings
                 w > L / low_freq_factor    ->  inv_freq / factor          (long wavelengths)
                 w < L / high_freq_factor   ->  inv_freq                   (short wavelengths)
                 otherwise                  ->  (1 - s) inv_freq / factor + s inv_freq,
                                                s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)
    "linear"   every inv_freq / factor (position interpolation)
    "yarn"     YaRN (Qwen's long-context setting): pair i keeps its frequency below dimension `low`,
               is divided by factor above `high`, and is interpolated linearly in between,

                 pair:   0 ....... low ........... high ........ D/2 - 1
                 kept:   |---------|  ramp 1 -> 0  |---- / factor ---|

               where d(r) = D ln(L / (2 pi r)) / (2 ln theta) is the dimension that turns r times over
               the original context, low = d(beta_fast), high = d(beta_slow) (floor / ceil unless
               truncate is false); cos and sin are multiplied by attention_factor (default
               0.1 ln(factor) + 1).

Positions served: max_position_embeddings, except "linear" (max_position_embeddings x factor) and
"yarn" (original_max_position_embeddings x factor), as vLLM derives them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Rope types that are plain neox RoPE with a theta (no scaling of positions).
PLAIN_ROPE_TYPES = (None, "default")
# YaRN's defaults (the paper's, transformers' and vLLM's): the ramp's ends in rotations over the original context.
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


def _check_factor(kind: str, factor: float) -> None:
    if not factor > 0:
        raise ValueError(f"{kind} rope factor must be > 0, got {factor!r}")


def _check_original(kind: str, original: int) -> None:
    if not original > 0:
        raise ValueError(f"{kind} rope original_max_position_embeddings must be > 0, got {original!r}")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x's frequency-dependent RoPE scaling (`rope_type: "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    attention_factor = 1.0

    def __post_init__(self) -> None:
        _check_factor("llama3", self.factor)
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"llama3 rope needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor!r}, high_freq_factor={self.high_freq_factor!r}"
            )
        _check_original("llama3", self.original_max_position_embeddings)

    def scale(self, inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
        """inv_freq [D/2] -> the scaled inverse frequencies (same dtype)."""
        old_len = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        interpolated = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        long_wave = wavelen > old_len / self.low_freq_factor
        short_wave = wavelen < old_len / self.high_freq_factor
        return torch.where(long_wave, inv_freq / self.factor, torch.where(short_wave, inv_freq, interpolated))

    def max_positions(self, max_position_embeddings: int) -> int:
        return max_position_embeddings


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (`rope_type: "linear"`): positions divided by `factor`."""

    factor: float
    attention_factor = 1.0

    def __post_init__(self) -> None:
        _check_factor("linear", self.factor)

    def scale(self, inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
        return inv_freq / self.factor

    def max_positions(self, max_position_embeddings: int) -> int:
        return int(max_position_embeddings * self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times longer (1 when not longer)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (`rope_type: "yarn"`; module docstring). `attention_factor` is the config's, or derived
    from factor (and mscale / mscale_all_dim where both are set) by transformers' rule."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW
    truncate: bool = True

    def __post_init__(self) -> None:
        _check_factor("yarn", self.factor)
        _check_original("yarn", self.original_max_position_embeddings)
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(f"yarn rope needs beta_fast > beta_slow > 0, got beta_fast={self.beta_fast!r}, "
                             f"beta_slow={self.beta_slow!r}")
        if not self.attention_factor > 0:
            raise ValueError(f"yarn rope attention_factor must be > 0, got {self.attention_factor!r}")

    @classmethod
    def of(cls, factor: float, original: int, attention_factor: float | None = None, mscale: float | None = None,
           mscale_all_dim: float | None = None, **ramp) -> YarnRopeScaling:
        """The scaling, its attention factor derived where the config gives none (transformers' rule)."""
        if attention_factor is None:
            attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                                if mscale and mscale_all_dim else yarn_mscale(factor))
        return cls(factor, original, float(attention_factor), **ramp)

    def _dimension(self, rotations: float, dim: int, theta: float) -> float:
        """The (fractional) dimension whose wavelength fits `rotations` times in the original context."""
        return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    def scale(self, inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
        dim = 2 * inv_freq.numel()
        low, high = self._dimension(self.beta_fast, dim, theta), self._dimension(self.beta_slow, dim, theta)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard: a ramp of zero width would divide by zero
        ramp = ((torch.arange(dim // 2, dtype=inv_freq.dtype) - low) / (high - low)).clamp(0, 1)
        return inv_freq / self.factor * ramp + inv_freq * (1 - ramp)

    def max_positions(self, max_position_embeddings: int) -> int:
        return int(self.original_max_position_embeddings * self.factor)


RopeScaling = Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling
ROPE_TYPES = ("llama3", "linear", "yarn")


def parse_rope_scaling(rope: dict, max_position_embeddings: int, source: str) -> RopeScaling | None:
    """The scaling a rope_scaling / rope_parameters dict names (None for plain RoPE);
    original_max_position_embeddings defaults to max_position_embeddings. A type not supported,
    or a key missing or out of range, is a ValueError naming it and `source`."""
    rope_type = rope.get("rope_type", rope.get("type"))  # "type": configs before transformers 4.45
    if rope_type in PLAIN_ROPE_TYPES:
        return None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported (plain RoPE or one of {ROPE_TYPES})")
    original = rope.get("original_max_position_embeddings") or max_position_embeddings
    factor = rope.get("factor")
    if factor is None and rope_type == "yarn":  # transformers' rule (DeepSeek-V3's configs)
        factor = max_position_embeddings / original
    needed = {"llama3": ("factor", "low_freq_factor", "high_freq_factor"), "linear": ("factor",), "yarn": ()}
    missing = [k for k in needed[rope_type] if rope.get(k) is None]
    if missing:
        raise ValueError(f"{source}: {rope_type} rope scaling is missing {', '.join(missing)}")
    try:
        if rope_type == "llama3":
            return Llama3RopeScaling(float(factor), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                                     int(original))
        if rope_type == "linear":
            return LinearRopeScaling(float(factor))
        ramp = {"beta_fast": float(rope.get("beta_fast") or YARN_BETA_FAST),
                "beta_slow": float(rope.get("beta_slow") or YARN_BETA_SLOW),
                "truncate": bool(rope.get("truncate", True))}
        return YarnRopeScaling.of(float(factor), int(original), rope.get("attention_factor"), rope.get("mscale"),
                                  rope.get("mscale_all_dim"), **ramp)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None
