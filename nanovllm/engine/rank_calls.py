"""Functions run on every rank with a result back: vLLM's `LLM.apply_model(func)` and
`LLM.collective_rpc(callable)`.

    llm.apply_model(func)                        -> [func(model) on rank 0, on rank 1, ...]
    llm.collective_rpc(func, args=(a,), kwargs)  -> [func(worker, a, **kwargs) on each rank]

`model` is the rank's nn.Module (its shard of the weights under tensor parallelism); `worker` a
Worker: the rank's `model_runner` (whose `.model` is that module), `rank` and `device`, the
parts of vLLM's worker such functions read. Rank 0 sends the call to the workers, runs its own
part, then collects every worker's RankOutcome, so the pipes never hold a stale reply, even when
a rank's function raises (the first rank's error is raised, after all have answered). Functions
travel to the workers pickled: a lambda or a function defined in a notebook cannot, at
tensor_parallel_size > 1 (vLLM asks the same of them: it pickles callables too).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanovllm.engine.model_runner import ModelRunner

# What a rank runs: a function of its ModelRunner (apply_to_model / call_with_worker bound to the user's).
RankCall = Callable[["ModelRunner"], object]


@dataclass(frozen=True)
class Worker:
    """What a collective_rpc function gets as `self`: vLLM's worker, as far as such functions reach."""

    model_runner: ModelRunner
    rank: int
    device: torch.device

    @property
    def local_rank(self) -> int:
        return self.rank  # every rank runs on this host


@dataclass(frozen=True)
class RankOutcome:
    """One rank's answer: its function's value, or the exception it raised."""

    value: object = None
    error: BaseException | None = None


def apply_to_model(func: Callable, runner: ModelRunner) -> object:
    return func(runner.model)


def call_with_worker(func: Callable, args: tuple, kwargs: dict, runner: ModelRunner) -> object:
    return func(Worker(runner, runner.rank, runner.device), *args, **kwargs)


def run_call(call: RankCall, runner: ModelRunner) -> RankOutcome:
    """`call(runner)`, its exception caught (an interrupt is not: the caller holds signals back)."""
    try:
        return RankOutcome(call(runner))
    except Exception as e:  # noqa: BLE001 - handed to rank 0, which raises it
        return RankOutcome(error=e)


def sendable(outcome: RankOutcome, rank: int) -> RankOutcome:
    """`outcome` if it pickles (a worker's reply crosses a pipe); else an error saying why."""
    try:
        pickle.dumps(outcome)
        return outcome
    except Exception as e:  # noqa: BLE001 - any pickling failure
        what = "result" if outcome.error is None else f"error ({type(outcome.error).__name__}: {outcome.error})"
        return RankOutcome(error=TypeError(f"tensor-parallel rank {rank}'s {what} cannot be sent to rank 0: {e}"))


def check_picklable(func: Callable, call: str) -> None:
    """TypeError naming `call` unless `func` pickles (it must reach the tensor-parallel workers)."""
    try:
        pickle.dumps(func)
    except Exception as e:  # noqa: BLE001 - any pickling failure
        raise TypeError(f"{call}: the function runs on the tensor-parallel workers too, so it must pickle (a "
                        f"function defined at a module's top level, not a lambda or a local one), got {func!r}: "
                        f"{e}") from None


def results(outcomes: list[RankOutcome]) -> list:
    """Each rank's value, rank 0 first; the first rank's error is raised instead."""
    for outcome in outcomes:
        if outcome.error is not None:
            raise outcome.error
    return [outcome.value for outcome in outcomes]
