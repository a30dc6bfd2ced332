"""Functions run on every rank with a result back: vLLM's `LLM.apply_model(func)` and
`LLM.collective_rpc(callable)`.

    llm.apply_model(func)                        -> [func(model) on rank 0, on rank 1, ...]
    llm.collective_rpc(func, args=(a,), kwargs)  -> [func(worker, a, **kwargs) on each rank]

`model` is the rank's nn.Module (its shard of the weights under tensor parallelism); `worker` the
rank's Worker: its `model_runner` (whose `.model` and `.get_model()` are that module, as is the
worker's own `get_model()`), `rank`, `device` and `model_config` (the engine's
llm_engine.model_config: dtype, max_model_len, ...), the parts of vLLM's worker such functions read.
Each rank has one Worker for the engine's life, as vLLM's worker persists: what a function sets on
it (a weight-sync process group) is there at the rank's next call.

Under tensor parallelism rank 0 sends the call to the workers as pickled bytes, runs its own
part, then reads every worker's RankOutcome, also as bytes (plain pickle: tensors travel as
data, not as one shared-memory file each, which thousands of tensors would run out of). Every
failure a worker meets (the call cannot be unpickled there, the function raises, its result
does not pickle) comes back as an outcome, so the pipes never hold a stale reply, and the
first rank's error is raised once all have answered: the engine keeps serving. The function
must pickle by plain pickle, which names a function by its module: a top-level function of an
importable module, or of the script being run, not a lambda, a local function or one from
`python -c` / a notebook (vLLM sends callables with cloudpickle, behind its
VLLM_ALLOW_INSECURE_SERIALIZATION setting).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanovllm.config import ServedModel
    from nanovllm.engine.model_runner import ModelRunner

# What a rank runs: a function of its Worker (apply_to_model / call_with_worker bound to the user's).
RankCall = Callable[["Worker"], object]


@dataclass(eq=False)
class Worker:
    """What a collective_rpc function gets as `self`: vLLM's worker, as far as such functions reach.
    One per rank, made with its ModelRunner and kept with it (Ranks, tp_workers): attributes a
    function sets here stay for the rank's later calls, as on vLLM's worker."""

    model_runner: ModelRunner
    rank: int
    device: torch.device

    @property
    def local_rank(self) -> int:
        return self.rank  # every rank runs on this host

    def get_model(self) -> torch.nn.Module:
        """The rank's model (vLLM's Worker.get_model): model_runner.get_model()."""
        return self.model_runner.get_model()

    @property
    def model_config(self) -> ServedModel:
        """vLLM's Worker.model_config (weight-sync functions check a tensor's dtype against its dtype):
        the engine's llm_engine.model_config."""
        return self.model_runner.config.served_model


@dataclass(frozen=True)
class RankOutcome:
    """One rank's answer: its function's value, or the exception it raised."""

    value: object = None
    error: BaseException | None = None


def apply_to_model(func: Callable, worker: Worker) -> object:
    return func(worker.model_runner.model)


def call_with_worker(func: Callable, args: tuple, kwargs: dict, worker: Worker) -> object:
    return func(worker, *args, **kwargs)


def model_call(func: object) -> RankCall:
    """apply_model's `func` as the call each rank runs; TypeError unless it is callable."""
    if not callable(func):
        raise TypeError(f"apply_model takes a function of the model, got {func!r}")
    return functools.partial(apply_to_model, func)


def worker_call(func: Callable, args: object, kwargs: object, timeout: object) -> RankCall:
    """collective_rpc's `func` bound to `args` (a tuple) and `kwargs` (a dict or None) as the call
    each rank runs; TypeError for other args or kwargs, ValueError unless `timeout` is None or a
    number of seconds > 0."""
    if not isinstance(args, tuple) or not isinstance(kwargs, (dict, type(None))):
        raise TypeError(f"collective_rpc args must be a tuple and kwargs a dict or None, got {args!r}, "
                        f"{kwargs!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ValueError(f"collective_rpc timeout must be None or a number of seconds > 0, got {timeout!r}")
    return functools.partial(call_with_worker, func, args, kwargs or {})


def run_call(call: RankCall, worker: Worker) -> RankOutcome:
    """Rank 0's part: `call(worker)`, its exception caught (an interrupt is not)."""
    try:
        return RankOutcome(call(worker))
    except Exception as e:  # noqa: BLE001 - raised once every rank answered
        return RankOutcome(error=e)


def pickled_call(call: RankCall, name: str) -> bytes:
    """`call` as the bytes the workers get; a TypeError naming `name` if it does not pickle."""
    try:
        return pickle.dumps(call)
    except Exception as e:  # noqa: BLE001 - any pickling failure
        raise TypeError(f"{name}: the function runs on the tensor-parallel workers too, so it must pickle (a "
                        f"top-level function of a module, not a lambda or a local one): {e}") from None


def answer(payload: bytes, worker: Worker) -> bytes:
    """A worker's part: the call in `payload` run on `worker`, its RankOutcome as bytes. Whatever
    fails (unpickling the call, the function, pickling its result) is the outcome's error; a
    worker ignores SIGINT, so no interrupt is taken for the function's own."""
    rank = worker.rank
    try:
        outcome = RankOutcome(pickle.loads(payload)(worker))
    except BaseException as e:  # noqa: BLE001 - SystemExit too: the worker must live on to answer
        outcome = RankOutcome(error=e)
    try:
        return pickle.dumps(outcome)
    except Exception as e:  # noqa: BLE001 - any pickling failure
        what = "result" if outcome.error is None else f"error ({type(outcome.error).__name__}: {outcome.error})"
        return pickle.dumps(RankOutcome(error=TypeError(
            f"tensor-parallel rank {rank}'s {what} cannot be sent to rank 0: {e}")))


def outcome_of(data: bytes, rank: int) -> RankOutcome:
    """A worker's answer read back on rank 0 (an exception that pickles but cannot be rebuilt
    here, such as one whose __init__ takes other arguments, becomes a TypeError saying so)."""
    try:
        return pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - any unpickling failure
        return RankOutcome(error=TypeError(f"tensor-parallel rank {rank}'s answer cannot be read on rank 0: {e}"))


def results(outcomes: list[RankOutcome]) -> list:
    """Each rank's value, rank 0 first; the first rank's error is raised instead."""
    for outcome in outcomes:
        if outcome.error is not None:
            raise outcome.error
    return [outcome.value for outcome in outcomes]
