"""The one way host data reaches the device: a pinned, asynchronous copy on CUDA.

Pinned (page-locked) memory lets the copy run as a DMA that does not block the host, so
step inputs and sampling tensors go up while the host keeps planning. PyTorch's pinned
allocator keeps the host buffer alive until the copy has run.
"""

from __future__ import annotations

import numpy as np
import torch

from nanovllm.utils.ints import cdiv

# Sampling words start 16 bytes (4 int32) into their copy, and each of their parts at a 16-byte
# boundary (sampling/batch.py): Triton specializes a kernel on whether each pointer is
# 16-byte aligned, so pointers whose alignment varied from step to step would compile new variants
# of the sampler's kernels in the middle of a run (~0.4 s each on an empty Triton cache).
ALIGN_BYTES = 16


def aligned_count(n: int, item_bytes: int) -> int:
    """n items of item_bytes each, rounded up to fill whole ALIGN_BYTES units."""
    per = ALIGN_BYTES // item_bytes
    return cdiv(n, per) * per


def words_offset(num_ints: int) -> int:
    """The index of the int32 array where `with_words` puts words after `num_ints` int32s."""
    return aligned_count(num_ints, 4)


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
    `words` (e.g. a step's sampling values) starting 16-byte aligned (`words_offset`), so that
    they can be viewed as int64 on the device with the same alignment every step (the copy's
    device buffer starts aligned). Returns (array, index of the words).

        | ints ............ | pad (0-3) | words as int32 pairs ... |
    """
    ints = ints.reshape(-1)
    if words is None:
        return ints, ints.shape[0]
    offset = words_offset(ints.shape[0])
    out = np.zeros(offset + 2 * words.shape[0], dtype=np.int32)
    out[: ints.shape[0]] = ints
    out[offset:].view(np.int64)[:] = words
    return out, offset


def words_view(flat: torch.Tensor, offset: int, num_words: int) -> torch.Tensor:
    """The int64 words that `with_words` put at `offset` of a copied int32 array `flat`."""
    return flat[offset : offset + 2 * num_words].view(torch.int64)
