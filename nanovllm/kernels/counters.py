"""Arrival counters for kernels whose last program to finish a piece of work combines the others'
partial results (decode attention's folded merge, the skinny GEMM's split-K sum).

One zeroed int32 buffer per (kernel, device), allocated once and left at zero by every call:
the program that arrives last on a counter resets it.
"""

from __future__ import annotations

import torch


def arrival_counters(cache: dict[torch.device, torch.Tensor], device: torch.device, needed: int,
                     size: int) -> torch.Tensor | None:
    """`cache`'s zeroed counters for `device` (`size` of them, allocated on first use), or None
    when they cannot serve: more than `size` needed, or a first allocation inside a CUDA-graph
    capture (its zero fill would only run on replay). Calls on one device must not run concurrently."""
    counters = cache.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = cache.setdefault(device, torch.zeros(size, dtype=torch.int32, device=device))
    return counters if needed <= counters.numel() else None
