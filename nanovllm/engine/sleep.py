"""Sleep mode (vLLM's `LLM.sleep` / `LLM.wake_up`): give the device memory back between generate
calls, for RL training colocated with the engine on the same GPUs.

    sleep(level=1)   weights copied to host memory (pinned on CUDA), KV cache freed
    sleep(level=2)   weights discarded (the next update_weights refills them), KV cache freed
    wake_up(tags)    "weights" and / or "kv_cache" get their device memory back (None: both)

How the memory goes and comes back (`FreedStorages`): each distinct storage under the tensors is
resized to zero bytes and later back to its size. Every tensor object, parameter, module and view
on a storage (tied weights, the attention layers' per-layer KV views) stays as it is and sees the
storage again after waking, but at a new device address: CUDA graphs, which hold addresses, are
dropped at sleep and captured again once nothing sleeps (ModelRunner). Woken contents: level 1's
weights are the bytes they had; level 2's parameters are zeros (its buffers, such as RoPE tables,
and a checkpoint's static activation scales, which update_weights does not refill, wait on the host
as level 1's weights do); the KV cache's
contents are undefined (the prefix cache is emptied at sleep). `free_for_sleep` decides what a level
gives back, `wake` restores it; ModelRunner holds the result (`sleeping`, empty while awake).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable

import torch

from nanovllm.quantization.config import INPUT_SCALE

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
# What wake_up's `tags` may name (vLLM's), in the order wake_up(None) restores them.
WAKE_TAGS = (WEIGHTS, KV_CACHE)


class SleepLevel(enum.IntEnum):
    OFFLOAD_WEIGHTS = 1  # weights kept in host memory; outputs after waking are as before
    DISCARD_WEIGHTS = 2  # weights dropped; update_weights after waking gives the model back


def sleep_level(level: object) -> SleepLevel:
    """`level` checked: 1 or 2 (an int, not a bool); TypeError / ValueError naming it otherwise."""
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(f"sleep level must be an int (1 or 2), got {level!r}")
    if level not in (SleepLevel.OFFLOAD_WEIGHTS, SleepLevel.DISCARD_WEIGHTS):
        raise ValueError(f"sleep level must be 1 (offload the weights) or 2 (discard them), got {level}")
    return SleepLevel(level)


def wake_tags(tags: object) -> tuple[str, ...]:
    """`tags` checked, in WAKE_TAGS order: None means all; otherwise a non-empty list of tag names.
    A bare string, an unknown tag or an empty list raises, naming the value and the valid tags."""
    if tags is None:
        return WAKE_TAGS
    if isinstance(tags, (str, bytes)) or not isinstance(tags, Iterable):
        raise TypeError(f"wake_up tags must be None or a list of tags from {list(WAKE_TAGS)}, got {tags!r}")
    names = list(tags)
    unknown = [t for t in names if t not in WAKE_TAGS]
    if unknown:
        raise ValueError(f"unknown wake_up tag(s) {unknown!r}: valid tags are {list(WAKE_TAGS)}")
    if not names:
        raise ValueError(f"wake_up tags is empty: pass None (everything) or tags from {list(WAKE_TAGS)}")
    return tuple(t for t in WAKE_TAGS if t in names)


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`: [nbytes]."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The non-empty storages under `tensors`, once each (keyed by address: tied weights and
    views share one)."""
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            storages.setdefault(s.data_ptr(), s)
    return storages


class FreedStorages:
    """Device storages given back by sleep, and what `restore` puts into them again.

    Invariants: while asleep each storage holds zero bytes and the device memory is the
    allocator's (the caller empties its cache); after `restore` each holds its former size at
    a new address, with its former bytes (`kept` tensors) or zeros (`dropped` ones; undefined bytes
    with zero_dropped=False, as a fresh torch.empty has: the KV cache, which nothing reads before it
    is written, and whose host pages then stay unallocated until used, as at start-up). A storage
    under both a kept and a dropped tensor is kept. `restore` runs once."""

    @torch.no_grad()
    def __init__(self, kept: Iterable[torch.Tensor], dropped: Iterable[torch.Tensor], device: torch.device,
                 zero_dropped: bool = True):
        self.device = device
        self.zero_dropped = zero_dropped
        pinned = device.type == "cuda"
        keep = _distinct_storages(kept)
        drop = {p: s for p, s in _distinct_storages(dropped).items() if p not in keep}
        # (storage, its size in bytes, its bytes in host memory or None: restored as zeros)
        self._entries: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        for s in keep.values():
            host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pinned)
            host.copy_(_storage_bytes(s), non_blocking=pinned)
            self._entries.append((s, s.nbytes(), host))
        self._entries += [(s, s.nbytes(), None) for s in drop.values()]
        if pinned:
            torch.cuda.synchronize(device)  # the host copies are complete before the storages go
        for s, _, _ in self._entries:
            s.resize_(0)

    @property
    def nbytes(self) -> int:
        """Device bytes the storages held (and hold again after restore)."""
        return sum(n for _, n, _ in self._entries)

    @torch.no_grad()
    def restore(self) -> None:
        """Reallocate every storage at its size and fill it (former bytes, or zeros unless zero_dropped=False)."""
        for s, nbytes, host in self._entries:
            s.resize_(nbytes)
            if host is None:
                if self.zero_dropped:
                    _storage_bytes(s).zero_()
            else:
                _storage_bytes(s).copy_(host, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the host copies may go once this returns
        self._entries = []


def free_for_sleep(model: torch.nn.Module, kv_cache: torch.Tensor, level: SleepLevel,
                   device: torch.device) -> dict[str, FreedStorages]:
    """Give back the device memory of `model` and `kv_cache` (the module docstring), by wake_up
    tag, weights first: should their host copies fail (host memory), nothing has changed."""
    named = list(model.named_parameters())
    # a checkpoint's static activation scales are calibration: no weight update_weights takes
    # gives them back, so level 2 keeps them as it keeps the buffers
    calibration = [p for name, p in named if name.endswith(INPUT_SCALE)]
    weights = [p for name, p in named if not name.endswith(INPUT_SCALE)]
    kept = calibration + list(model.buffers())
    if level == SleepLevel.OFFLOAD_WEIGHTS:
        kept, weights = kept + weights, []
    return {WEIGHTS: FreedStorages(kept, weights, device),
            KV_CACHE: FreedStorages([], [kv_cache], device, zero_dropped=False)}


def wake(sleeping: dict[str, FreedStorages], tags: Collection[str]) -> None:
    """Restore the parts of `sleeping` among `tags` (WAKE_TAGS names; others are skipped), in
    WAKE_TAGS order, removing each from `sleeping` once restored: one whose restore raises stays
    (with its host copy), so waking can be tried again."""
    for tag in WAKE_TAGS:
        if tag in tags and tag in sleeping:
            sleeping[tag].restore()
            del sleeping[tag]
