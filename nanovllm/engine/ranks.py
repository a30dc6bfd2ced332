"""The model's ranks as one: rank 0's ModelRunner (this process) and, under tensor parallelism,
the WorkerGroup running ranks 1..N-1 (engine/tp_workers.py). The engine's calls that every rank
must make go through here:

    ranks.call(call, name, timeout)    # a function with a result per rank (engine/rank_calls.py)
    ranks.run_method(method, *args)    # ModelRunner.<method>(*args) on the workers, then rank 0
    ranks.update_weights(weights, on_loaded)  # a chunk at a time: rank 0 checks and loads it, then the workers
    ranks.close()                      # rank 0's model and cache, then the workers

Invariants: every rank runs the same calls in the same order, so rank 0 sends the workers their
part inside `worker_errors` (a worker's death is named; rank 0 failing after the send marks the
group out of step) and holds interrupts back until its own part is done (`deferred_signals`),
except for a call with a result, whose interrupt is raised at once (the group is then out of
step). `workers` is None without tensor parallelism, and None again once closed; a Ranks
collected without close() still stops its workers (WorkerGroup.close is idempotent).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.rank_calls import RankCall, Worker, pickled_call, results, run_call
from nanovllm.engine.sleep import WEIGHTS
from nanovllm.engine.tp_workers import CALL, PackedTensors, WorkerGroup, worker_errors
from nanovllm.utils.deferred_signals import deferred_signals
from nanovllm.utils.loader import weight_chunks


class Ranks:
    def __init__(self, config: Config):
        # Ranks 1..N-1 run in spawned processes; this process is rank 0.
        self.workers: WorkerGroup | None = WorkerGroup(config) if config.tensor_parallel_size > 1 else None
        if self.workers is not None:
            weakref.finalize(self, self.workers.close)
        try:
            with worker_errors(self.workers):  # a worker dying while rank 0 waits in a collective is named
                self.model_runner = ModelRunner(config)
            self.worker = Worker(self.model_runner, 0, self.model_runner.device)  # rank 0's, for `call`
            if self.workers is not None:
                self.workers.wait_ready()
        except BaseException:
            self._close_workers()
            raise

    def sleep_state(self) -> str:
        """The sleeping parts, e.g. "weights asleep, kv_cache asleep" (for error messages)."""
        return ", ".join(f"{tag} asleep" for tag in self.model_runner.sleeping)

    def check_weights_awake(self, call: str) -> None:
        """RuntimeError naming `call` while the weights sleep (their storage is gone)."""
        if WEIGHTS in self.model_runner.sleeping:
            raise RuntimeError(f"{call} called while the weights sleep ({self.sleep_state()}): "
                               "call wake_up(tags=['weights']) first")

    def call(self, call: RankCall, name: str, timeout: float | None) -> list:
        """`call(worker)` on every rank (its Worker: engine/rank_calls.py), the workers' first; each rank's
        result, rank 0 first. Refused while the weights sleep (their storage is gone). An
        interrupt (or the workers' `timeout`) while the ranks run it is raised at once and leaves
        the group out of step: their answers would come after it."""
        self.check_weights_awake(name)
        if self.workers is None:
            return results([run_call(call, self.worker)])
        payload = pickled_call(call, name)
        with worker_errors(self.workers):  # a rank's own error is an outcome, raised once all answered
            with deferred_signals():
                self.workers.send(CALL, payload)
            try:
                outcomes = [run_call(call, self.worker), *self.workers.collect(timeout)]
            except KeyboardInterrupt:
                self.workers.out_of_step = f"{name} was interrupted while the workers ran it"
                raise
        return results(outcomes)

    def run_method(self, method: str, *args) -> None:
        """ModelRunner.<method>(*args) on the workers, then here (on CUDA, capturing graphs runs
        collectives every rank joins); an interrupt waits for every rank to finish it."""
        with worker_errors(self.workers), deferred_signals():
            if self.workers is not None:
                self.workers.send(method, *args)
            getattr(self.model_runner, method)(*args)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], on_loaded: Callable[[], None]) -> None:
        """`weights` into every rank's model a chunk (~1 GiB) at a time (loader.weight_chunks),
        rank 0's first: it checks the chunk before any rank changes (LLMEngine.update_weights says
        what is refused). A chunk refused after earlier ones were loaded says so. `on_loaded()`
        runs at the end once a chunk reached the model, also when a later chunk is refused or
        interrupted: the earlier ones changed the weights."""
        copied = 0  # tensors loaded by earlier chunks
        # A chunk reached the model (an empty one too: FP8 KV scales computed from the data are set
        # anew, so the cached KV, quantized under the old ones, is stale as under old weights).
        loaded = False
        try:
            for chunk in weight_chunks(weights):  # a generator runs here, where an interrupt lands at once
                # An interrupt waits for the chunk's copy to end on every rank: no half-copied chunk.
                try:
                    with worker_errors(self.workers), deferred_signals():
                        self.model_runner.update_weights(chunk)  # checks the chunk before changing anything
                        loaded = True  # set before an interrupt held over the copy is raised
                        if self.workers is not None:
                            self.workers.send("update_weights", PackedTensors.pack(chunk))
                except (TypeError, ValueError) as e:
                    if copied:
                        raise type(e)(f"{e} (but the {copied} weight(s) of this generator's earlier chunks "
                                      "were loaded: the model holds part of the new weights)") from None
                    raise
                copied += len(chunk)
        finally:
            if loaded:
                on_loaded()

    def close(self) -> None:
        """Release rank 0's model and cache, then stop the workers (once: the engine's exit)."""
        self.model_runner.exit()
        self._close_workers()

    def _close_workers(self) -> None:
        workers = self.workers
        if workers is not None:
            self.workers = None
            workers.close()
