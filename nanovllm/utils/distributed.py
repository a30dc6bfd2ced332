"""Tensor-parallel rank and size, read from torch.distributed (1 rank when not initialized)."""

from __future__ import annotations

import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
