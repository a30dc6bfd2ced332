"""An engine's tensor-parallel layout: this process's rank and the engine's rank count.

It is the engine's own (Config.tensor_parallel_size, the rank WorkerGroup gave the process), never
read from torch.distributed: a process may hold a default process group of its own (torchrun, an RL
trainer building one engine per rank), and a 1-rank engine there is still a whole engine, with no
collectives. Layers read it at construction, inside `tensor_parallel(...)` (ModelRunner builds the
model there); outside the block it is the 1-rank layout. With more than one rank, the collectives
run on the default process group, which tp_workers.WorkerGroup sets up for the engine alone.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass

from nanovllm.utils.scoped import scoped
from nanovllm.utils.validation import check_int


@dataclass(frozen=True)
class TensorParallel:
    rank: int  # 0 .. size - 1; rank 0 is the process that schedules
    size: int  # the engine's tensor_parallel_size

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.size, 1)
        check_int("rank", self.rank, 0)
        if self.rank >= self.size:
            raise ValueError(f"rank must be below tensor_parallel_size {self.size}, got {self.rank}")


_LAYOUT: ContextVar[TensorParallel] = ContextVar("tensor_parallel", default=TensorParallel(0, 1))


def tensor_parallel(layout: TensorParallel) -> AbstractContextManager[TensorParallel]:
    """Layers constructed inside this block hold `layout`'s part (reset on exit, also on exceptions)."""
    return scoped(_LAYOUT, layout)


def tp_rank() -> int:
    """The rank of layers constructed now."""
    return _LAYOUT.get().rank


def tp_size() -> int:
    """The rank count of layers constructed now."""
    return _LAYOUT.get().size


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """The KV heads each of `size` ranks holds: its share, or 1 where the ranks outnumber the heads
    (each head replicated on size / num_kv_heads ranks, as vLLM serves them; ModelConfig.check_tensor_parallel
    admits only a size that divides the heads or is a multiple of them)."""
    return max(1, num_kv_heads // size)
