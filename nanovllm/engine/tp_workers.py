"""Tensor-parallel worker processes: ranks 1..N-1 of the model, driven by rank 0.

Rank 0 (the caller's process, which owns the scheduler) spawns the workers, and all
ranks join one torch.distributed group (NCCL on CUDA, gloo on CPU) through a TCPStore
on a port the OS picks, so two engines on one host never collide. Each step, rank 0
sends the step's `StepPlan` to every worker over a multiprocessing Pipe (a local
socket: no fixed names, no size limit; tensors go as bytes, PackedTensors), then all
ranks run the same forward; the collectives inside the model keep them in lock-step.

    rank 0:  schedule -> send(plan) -> prepare, queue, sample (StepPipeline)
    rank k:            recv(plan)  -> run(plan): prepare, queue, sample

On CPU the N ranks share the cores that rank 0's torch had: each rank gets 1/N of its
threads (rank 0's own count is restored on close), since OpenMP threads that outnumber the
cores spin against each other inside every collective.

A worker ignores SIGINT (Ctrl-C at a terminal reaches every process of its group): rank 0
decides what an interrupt does, and finishes the step it has sent before raising it
(StepPipeline._queue, engine/step_pipeline.py), so the ranks always agree on where a step ends.

A worker tells rank 0 it is ready once its model and KV cache are built, and LLM(...) waits for
that (WorkerGroup.wait_ready). A worker exits when told to, or when its pipe closes (rank 0 is
gone), or when its start-up or its part of a call without a reply raises: it sends the error
first, and rank 0 names it. Rank 0
checks the workers are alive before every step, and a worker that dies inside a
collective makes gloo fail on rank 0 (NCCL: after the group's timeout). An error on rank 0
after the workers were sent a call (worker_errors) leaves them inside its collectives, which
the next call's would be paired with (wrong tokens, no error): the group is marked out of step
and every later call refuses, naming the error; exit() stops the workers without waiting.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import multiprocessing as mp
import os
import pickle
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.rank_calls import RankOutcome, Worker, answer, outcome_of

# Address of the rendezvous store: every rank is on this host.
LOCALHOST = "127.0.0.1"
# How long a collective (and the start-up rendezvous) may wait on a silent peer.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
# How often rank 0 looks for started or dead workers while they start (a spawned worker imports torch: seconds).
STARTUP_POLL_SECONDS = 0.05
# The store key prefix under which each worker says it started.
STARTED_KEY = "nanovllm/started"
# How long exit waits for a worker to leave by itself before terminating it.
EXIT_JOIN_SECONDS = 10.0
# A failed collective waits this long for the dead worker's exit to become visible.
DEATH_CONFIRM_SECONDS = 2.0
# ...polling at this interval (short next to the confirm window, cheap for the host).
DEATH_POLL_SECONDS = 0.05
# The message that runs a function on a worker and sends its RankOutcome back (WorkerGroup.collect).
CALL = "call"
# Variables that must reach workers: NVLink multicast stays off on shared hosts.
_INHERITED_ENV = {"NCCL_NVLS_ENABLE": "0"}


@dataclass(frozen=True)
class PackedTensors:
    """Named tensors as one byte string for the pipe (update_weights' chunks): a tensor pickled
    onto a multiprocessing pipe is moved into shared memory, the caller's own storage when it is
    on the CPU already, and passed as an open file descriptor per tensor, which piled up past
    `ulimit -n` while a worker lagged. Bytes also make rank 0 wait for a worker reading them.
    Tensors go as plain torch.Tensors: a worker reads them with torch.load's weights_only
    unpickler, which refuses a tensor subclass (a training framework's) and killed the worker
    after rank 0 had loaded the chunk."""

    data: bytes

    @classmethod
    def pack(cls, named: list[tuple[str, torch.Tensor]]) -> PackedTensors:
        buffer = io.BytesIO()
        torch.save([(name, tensor.detach().cpu().as_subclass(torch.Tensor)) for name, tensor in named], buffer)
        return cls(buffer.getvalue())

    def unpack(self) -> list[tuple[str, torch.Tensor]]:
        return torch.load(io.BytesIO(self.data), weights_only=True)


def _backend(config: Config) -> str:
    return "nccl" if config.device == "cuda" else "gloo"


def _worker_main(config: Config, rank: int, port: int, conn: Connection, cpu_threads: int | None) -> None:
    from nanovllm.engine.model_runner import ModelRunner

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 handles interrupts (module docstring)
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)

    store = dist.TCPStore(LOCALHOST, port, config.tensor_parallel_size, is_master=False,
                          timeout=COLLECTIVE_TIMEOUT)
    store.set(f"{STARTED_KEY}/{rank}", "1")  # rank 0 waits for every rank's, watching for deaths
    dist.init_process_group(_backend(config), store=store, rank=rank,
                            world_size=config.tensor_parallel_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        runner = ModelRunner(config, rank)
    except Exception as e:  # rank 0 names it (WorkerGroup.wait_ready, or worker_errors around its own start-up)
        _last_words(conn, f"its start-up raised {type(e).__name__}: {e}")
        raise
    worker = Worker(runner, rank, runner.device)  # the rank's one, for every call (engine/rank_calls.py)
    conn.send_bytes(pickle.dumps(RankOutcome()))  # ready: rank 0 waits for it (WorkerGroup.wait_ready)
    try:
        while True:
            try:
                method, args = conn.recv()
            except EOFError:
                break  # rank 0 went away
            if method == "exit":
                break
            if method == CALL:  # a function with a result (engine/rank_calls.py): rank 0 waits for the reply
                conn.send_bytes(answer(args[0], worker))
                continue
            try:
                getattr(runner, method)(*(a.unpack() if isinstance(a, PackedTensors) else a for a in args))
            except Exception as e:  # the worker dies of it
                _last_words(conn, f"its {method}() raised {type(e).__name__}: {e}")
                raise
    finally:
        runner.exit()
        dist.destroy_process_group()


def _last_words(conn: Connection, message: str) -> None:
    """Tell rank 0 what the worker dies of (WorkerGroup._death reads it)."""
    with contextlib.suppress(OSError):  # rank 0 gone: nobody to tell
        conn.send_bytes(pickle.dumps(RankOutcome(error=RuntimeError(message))))


class WorkerDied(RuntimeError):
    """A worker process is gone, or the group is out of step (WorkerGroup.check_alive)."""


class WorkerGroup:
    def __init__(self, config: Config):
        if dist.is_initialized():
            raise RuntimeError(
                "this process already has a torch.distributed default process group (another tensor-parallel "
                "engine's, or the caller's own, e.g. under torchrun): a tensor-parallel engine sets up that group "
                "for its ranks alone. exit() the other engine, or build this one with tensor_parallel_size=1")
        try:  # what each worker's spawn pickles (the rest are ints, a port and a pipe end)
            pickle.dumps(config)
        except Exception as e:  # noqa: BLE001 - any pickling failure
            raise TypeError(f"the engine's settings do not pickle, and the tensor-parallel workers get them by "
                            f"pickle (a setting holds a local function or another unpicklable value): {e}") from None
        n = config.tensor_parallel_size
        # close() ran: a second call (exit(), then the engine's finalizer when it is collected) must
        # not destroy the process group of an engine built since.
        self.closed = False
        self.sends = 0  # calls sent to the workers (worker_errors: did a failed block send one?)
        # Why the ranks no longer run the same call (set by worker_errors); None while they do.
        self.out_of_step: str | None = None
        self.causes: dict[int, str] = {}  # rank -> ": the error it died of" (_death), once read
        for key, value in _INHERITED_ENV.items():
            os.environ.setdefault(key, value)
        ctx = mp.get_context("spawn")
        # CPU ranks split rank 0's threads (module docstring); None: CUDA ranks leave theirs alone.
        self.saved_threads: int | None = None
        cpu_threads: int | None = None
        if config.device == "cpu":
            self.saved_threads = torch.get_num_threads()
            cpu_threads = max(1, self.saved_threads // n)
            torch.set_num_threads(cpu_threads)
        self.store: dist.TCPStore | None = dist.TCPStore(LOCALHOST, 0, n, is_master=True, wait_for_workers=False,
                                                         timeout=COLLECTIVE_TIMEOUT)
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        try:  # a failure stops the workers started so far and gives rank 0 its threads back
            for rank in range(1, n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(config, rank, self.store.port, child, cpu_threads),
                                   name=f"nanovllm-tp{rank}", daemon=True)
                self.conns.append(parent)
                try:
                    proc.start()
                finally:
                    child.close()
                self.procs.append(proc)
            self._wait_for_workers(n)
            dist.init_process_group(_backend(config), store=self.store, rank=0, world_size=n,
                                    timeout=COLLECTIVE_TIMEOUT)
        except BaseException:
            self._stop_processes()
            raise

    def _wait_for_workers(self, n: int) -> None:
        """Wait until ranks 1..n-1 have reached the store; a worker that died on the way (an import
        error, a script without the `if __name__ == "__main__":` guard that spawned processes need)
        is a RuntimeError at once, not a store timeout COLLECTIVE_TIMEOUT later."""
        keys = [f"{STARTED_KEY}/{rank}" for rank in range(1, n)]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while not self.store.check(keys):  # non-blocking: a timed-out wait would log a warning a poll
            death = self._death()
            if death is not None:
                raise RuntimeError(f"{death} while starting; a script that builds a tensor-parallel LLM "
                                   "must do so under `if __name__ == \"__main__\":` (its workers are spawned "
                                   "processes that import the script)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {COLLECTIVE_TIMEOUT}")
            time.sleep(STARTUP_POLL_SECONDS)

    def wait_ready(self) -> None:
        """Wait (rank 0's model and KV cache built) until every worker has built its own (its ready
        message); a worker that died building them is a WorkerDied naming its error (LLM(...)
        returned, and the death was found at the first call, naming no cause)."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(STARTUP_POLL_SECONDS) and proc.is_alive():
                pass
            try:
                outcome = outcome_of(conn.recv_bytes(), rank)
            except (EOFError, OSError) as e:
                raise self._gone(rank, e) from None
            if outcome.error is not None:  # its last words: it is exiting
                self.causes[rank] = f": {outcome.error}"
                raise self._gone(rank, outcome.error)

    def _death(self) -> str | None:
        """'tensor-parallel worker rank R died (exit code C)' for the first dead worker, if any,
        with the error it died of when it sent one (_worker_main)."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if not proc.is_alive():
                with contextlib.suppress(EOFError, OSError):
                    if rank not in self.causes and conn.poll(0):
                        error = outcome_of(conn.recv_bytes(), rank).error  # None: its ready message, unread
                        if error is not None:
                            self.causes[rank] = f": {error}"
                return f"tensor-parallel worker rank {rank} died (exit code {proc.exitcode}){self.causes.get(rank, '')}"
        return None

    def check_alive(self) -> None:
        """WorkerDied unless every worker is alive and in step with rank 0."""
        if self.out_of_step is not None:
            raise WorkerDied(f"the tensor-parallel ranks are out of step ({self.out_of_step}): exit() this LLM and "
                             "create a new one")
        death = self._death()
        if death is not None:
            raise WorkerDied(death)

    def dead_worker_error(self, cause: BaseException) -> RuntimeError | None:
        """After a failed collective: a clear error naming a worker that died, if one did."""
        deadline = time.monotonic() + DEATH_CONFIRM_SECONDS
        while time.monotonic() < deadline:
            death = self._death()
            if death is not None:
                return WorkerDied(f"{death}: {cause}")
            time.sleep(DEATH_POLL_SECONDS)
        return None

    def _gone(self, rank: int, cause: BaseException) -> WorkerDied:
        """The error for worker `rank`'s pipe found closed: a process's pipe closes before its exit
        can be seen, so wait for the exit (DEATH_CONFIRM_SECONDS) and name it, exit code and last words."""
        self.procs[rank - 1].join(DEATH_CONFIRM_SECONDS)
        return WorkerDied(self._death() or f"tensor-parallel worker rank {rank} is gone: {cause!r}")

    def send(self, method: str, *args) -> None:
        """Ask every worker to call ModelRunner.<method>(*args)."""
        self.check_alive()
        self.sends += 1
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((method, args))
            except (BrokenPipeError, ConnectionResetError, EOFError) as e:
                raise self._gone(rank, e) from None

    def collect(self, timeout: float | None = None) -> list[RankOutcome]:
        """Each worker's answer to the CALL sent last (ranks 1..N-1, in order); TimeoutError if
        they have not all answered `timeout` seconds from now (None: wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        outcomes = []
        for rank, conn in enumerate(self.conns, start=1):
            if deadline is not None and not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"tensor-parallel worker rank {rank} did not answer within {timeout} s")
            try:
                data = conn.recv_bytes()
            except (EOFError, ConnectionResetError, OSError) as e:
                raise self._gone(rank, e) from None
            outcomes.append(outcome_of(data, rank))
        return outcomes

    def _stop_processes(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("exit", ()))
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                pass
        for proc in self.procs:
            proc.join(0 if self.out_of_step is not None else EXIT_JOIN_SECONDS)  # out of step: stuck in a collective
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        self.store = None  # its listening socket and thread go with it (an exited engine may stay referenced)
        if self.saved_threads is not None:
            torch.set_num_threads(self.saved_threads)
            self.saved_threads = None

    def close(self) -> None:
        """Stop the workers and leave the process group, once (later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        self._stop_processes()
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def worker_errors(workers: WorkerGroup | None) -> Iterator[None]:
    """Around a block that sends the workers a call and runs rank 0's part of it: a collective
    that fails because a worker died names that worker; any other error after the send (rank 0's
    part cut short) marks the group out of step. An interrupt is no such error: the blocks hold
    signals back until rank 0's part is done (deferred_signals)."""
    if workers is None:
        yield
        return
    sends = workers.sends
    try:
        yield
    except WorkerDied:
        raise
    except BaseException as e:
        death = workers.dead_worker_error(e) if isinstance(e, RuntimeError) else None
        if death is not None:
            raise death from e
        if workers.sends != sends and not isinstance(e, KeyboardInterrupt):
            workers.out_of_step = f"rank 0 failed after the workers were sent their part: {type(e).__name__}: {e}"
        raise
