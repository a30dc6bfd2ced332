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


def with_words(ints: np.ndarray, words: np.ndarray | None) -> tuple[np.ndarray, int]:
    """One int32 host array for one copy: `ints` (int32, flattened), then, when given, the int64
    `words` (e.g. a step's sampling values) starting at an even index so that they can be
    viewed as int64 on the device. Returns (array, index of the words: len(ints) rounded up
    to even).

        | ints ............ | pad (0-1) | words as int32 pairs ... |
    """
    ints = ints.reshape(-1)
    if words is None:
        return ints, ints.shape[0]
    offset = ints.shape[0] + ints.shape[0] % 2
    out = np.zeros(offset + 2 * words.shape[0], dtype=np.int32)
    out[: ints.shape[0]] = ints
    out[offset:].view(np.int64)[:] = words
    return out, offset


def words_view(flat: torch.Tensor, offset: int, num_words: int) -> torch.Tensor:
    """The int64 words that `with_words` put at `offset` of a copied int32 array `flat`."""
    return flat[offset : offset + 2 * num_words].view(torch.int64)
