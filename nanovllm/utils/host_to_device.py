"""The one way host data reaches the device: a pinned, asynchronous copy on CUDA.

Pinned (page-locked) memory lets the copy run as a DMA that does not block the host, so
step inputs and sampling tensors go up while the host keeps planning. PyTorch's pinned
allocator keeps the host buffer alive until the copy has run.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from nanovllm.utils.ints import cdiv

# Sampling words start 16 bytes (4 int32) into their copy, and each of their parts at a 16-byte
# boundary (sampling/batch.py): Triton specializes a kernel on whether each pointer is
# 16-byte aligned, so pointers whose alignment varied from step to step would compile new variants
# of the sampler's kernels in the middle of a run (~0.4 s each on an empty Triton cache).
ALIGN_BYTES = 16


# Pack layouts remembered (a step's part sizes mostly repeat the previous step's).
LAYOUT_CACHE_SIZE = 1024


def aligned_count(n: int, item_bytes: int) -> int:
    """n items of item_bytes each, rounded up to fill whole ALIGN_BYTES units."""
    per = ALIGN_BYTES // item_bytes
    return cdiv(n, per) * per


@dataclass(frozen=True)
class PackLayout:
    """Where the parts of one int64 host array (one host-to-device copy) lie: the int64 parts, then
    float32 parts two a word, each part starting ALIGN_BYTES aligned (lengths padded), so a kernel
    reading a part sees the same pointer alignment every step.

        | int part 0 | pad | int part 1 | pad | ... | float part 0 | pad | float part 1 | pad | ... |
        ^ int_starts (words)                        ^ floats_word; float_starts count float32s from it
    """

    int_sizes: tuple[int, ...]
    float_sizes: tuple[int, ...]
    int_starts: tuple[int, ...]  # int64 word index of each int part
    floats_word: int  # word index where the float32 region starts
    float_starts: tuple[int, ...]  # float32 index of each float part within that region
    num_words: int

    @staticmethod
    @functools.lru_cache(maxsize=LAYOUT_CACHE_SIZE)
    def of(int_sizes: tuple[int, ...], float_sizes: tuple[int, ...]) -> PackLayout:
        int_ends = [0, *accumulate(aligned_count(n, 8) for n in int_sizes)]
        float_ends = [0, *accumulate(aligned_count(n, 4) for n in float_sizes)]
        # at least one float word: torch cannot view an empty int64 slice as float32
        return PackLayout(int_sizes, float_sizes, tuple(int_ends[:-1]), int_ends[-1], tuple(float_ends[:-1]),
                          int_ends[-1] + max(float_ends[-1] // 2, 1))

    def pack(self, int_parts: Sequence, float_parts: Sequence) -> np.ndarray:
        """The [num_words] int64 array holding the parts (of this layout's sizes), padding zeroed."""
        words = np.zeros(self.num_words, dtype=np.int64)
        floats = words[self.floats_word :].view(np.float32)
        for start, part in zip(self.int_starts, int_parts):
            words[start : start + len(part)] = part
        for start, part in zip(self.float_starts, float_parts):
            floats[start : start + len(part)] = part
        return words

    def split(self, words: torch.Tensor) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """(int parts, float parts) as views of `words` (the packed array, copied to any device);
        None for an empty part (each view costs host time every step: only the parts in use)."""
        ints = [words[a : a + n] if n else None for a, n in zip(self.int_starts, self.int_sizes)]
        if not any(self.float_sizes):
            return ints, [None] * len(self.float_sizes)
        floats = words[self.floats_word :].view(torch.float32)
        return ints, [floats[a : a + n] if n else None for a, n in zip(self.float_starts, self.float_sizes)]


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
