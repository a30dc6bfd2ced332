"""The one way host data reaches the device: a pinned, asynchronous copy on CUDA.

Pinned (page-locked) memory lets the copy run as a DMA that does not block the host, so
step inputs and sampling tensors go up while the host keeps planning. PyTorch's pinned
allocator keeps the host buffer alive until the copy has run.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: list | np.ndarray | torch.Tensor, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """values (a list, a NumPy array or a CPU tensor) as a tensor on `device`, of `dtype` if
    given: pinned and non-blocking on CUDA, a plain copy elsewhere (on the CPU the result may
    share an array's or tensor's memory)."""
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        raise TypeError(f"values must be host data, got a tensor on {values.device}")
    host = torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def copy_into(dst: torch.Tensor, values: np.ndarray) -> None:
    """Copy host values into the device buffer `dst` (same shape, e.g. a CUDA graph's staging
    buffer): pinned and non-blocking, as `to_device`."""
    dst.copy_(torch.from_numpy(values).pin_memory(), non_blocking=True)
