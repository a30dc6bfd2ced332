"""Which implementation a layer runs, fused Triton kernels or plain PyTorch: the one rule.

A layer applies it once, in its constructor, to the device it is built on (the model runner
builds the model under `with torch.device(...)`), and keeps the answer: a layer runs the path
of the device it was built on for its whole life (moving it afterwards does not change it).

    CUDA          -> the Triton kernels (compiled)
    other devices -> PyTorch (the CPU path; Triton's interpreter serves the kernel tests only)
"""

from __future__ import annotations

import torch


def uses_triton(device: torch.device) -> bool:
    """Whether a layer built on `device` runs the Triton kernels."""
    return device.type == "cuda"


def construction_device() -> torch.device:
    """The device new tensors go to here (the `with torch.device(...)` in effect), for layers
    that have no parameter to ask."""
    return torch.empty(0).device
