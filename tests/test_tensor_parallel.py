"""Tensor parallelism on CPU (gloo): same tokens as one rank, clean exit, worker death detected."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from checkpoints import TinyShape, checkpoint_fixture, checkpoint_params_fixture, cpu_llm
from nanovllm import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SHAPES = {
    "tied": TinyShape(),
    "untied": TinyShape(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=128, intermediate_size=160, tie_word_embeddings=False, vocab_size=383),
}
PROMPTS = [list(range(100, 140)) + [i] * (5 + 7 * i) for i in range(6)]


# Both shapes: the sharded weights (tied or not, head_dim apart from hidden / heads) must give
# one rank's tokens.
shaped_ckpt = checkpoint_params_fixture(SHAPES)
# The worker life-cycle tests do not depend on the shape: one is enough (each costs 2-20 s of
# process start-up, twice that on the H200 host).
ckpt = checkpoint_fixture("tied", SHAPES["tied"])
# A vocabulary 2 ranks do not divide (383): the last rank's shards end in a padding row.
odd_vocab_ckpt = checkpoint_fixture("untied", SHAPES["untied"])


def generate(path, tp, **kw):
    llm = cpu_llm(path, tensor_parallel_size=tp, **{"kvcache_block_size": 16, "max_model_len": 256, **kw})
    try:
        return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)], llm
    finally:
        llm.exit()


def test_tp2_matches_tp1_in_every_regime(shaped_ckpt):
    single, _ = generate(shaped_ckpt, 1, enable_prefix_caching=False)
    # prefix cache + chunked prefill + preemption (10 blocks of 16 for ~150 tokens of work at once)
    tp2, llm = generate(shaped_ckpt, 2, max_num_batched_tokens=32, num_kvcache_blocks=10)
    assert tp2 == single
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_prefix_hit_blocks > 0


def test_workers_exit_cleanly_and_engine_can_restart(ckpt):
    import torch

    threads = torch.get_num_threads()
    llm = cpu_llm(ckpt, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256)
    assert torch.get_num_threads() == max(1, threads // 2)  # rank 0's half of the cores
    pids = [p.pid for p in llm.workers.procs]
    group = llm.workers
    llm.exit()
    assert group.store is None  # its listening socket and thread are released, even while `llm` is held
    assert torch.get_num_threads() == threads
    llm.exit()  # harmless twice
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not mp.active_children()
    again, _ = generate(ckpt, 2)
    assert len(again) == len(PROMPTS)
    # the exited engine, collected while a new one runs (its finalizer closes its workers once
    # more), leaves the new engine's process group alone
    new = cpu_llm(ckpt, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256)
    try:
        del llm
        gc.collect()
        assert [o["token_ids"] for o in new.generate(PROMPTS, GREEDY, use_tqdm=False)] == again
    finally:
        new.exit()


def test_killed_worker_raises_instead_of_hanging(ckpt):
    llm = cpu_llm(ckpt, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256)
    os.kill(llm.workers.procs[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.exit()
    assert not mp.active_children()


def test_killed_worker_is_named_once(ckpt):
    """The error of a call after a worker died names it once (it was wrapped twice: 'died ...: died ...')."""
    llm = cpu_llm(ckpt, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256)
    os.kill(llm.workers.procs[0].pid, signal.SIGKILL)
    llm.workers.procs[0].join()
    with pytest.raises(RuntimeError) as caught:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert str(caught.value).count("died") == 1, str(caught.value)
    llm.exit()


def test_an_error_on_rank_0_after_the_workers_were_sent_a_call_is_never_served_past(ckpt):
    """rank 0 failing inside its part of a call the workers were sent (an out-of-memory error in
    its forward, say) leaves the workers inside that call's collectives: the next call's would pair
    with them and give wrong tokens without an error. The group is marked out of step instead:
    every later call refuses, naming the error, and exit() does not wait for the stuck workers."""
    from nanovllm.engine.tp_workers import EXIT_JOIN_SECONDS, PackedTensors, worker_errors

    llm = cpu_llm(ckpt, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256)
    with pytest.raises(ValueError, match="rank 0's part failed"), worker_errors(llm.workers):
        llm.workers.send("update_weights", PackedTensors.pack([]))  # a real call, then rank 0 fails
        raise ValueError("rank 0's part failed")
    message = r"ranks are out of step \(rank 0 failed after the workers were sent their part: ValueError: rank 0"
    with pytest.raises(RuntimeError, match=message):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match=message):
        llm.sleep()
    start = time.monotonic()
    llm.exit()
    # short of EXIT_JOIN_SECONDS (what waiting for the stuck workers would take), with room for a loaded CI machine
    assert time.monotonic() - start < EXIT_JOIN_SECONDS - 2 and not mp.active_children()
    # an error raised before anything was sent leaves the group in step
    llm = cpu_llm(ckpt, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256)
    with pytest.raises(ValueError), worker_errors(llm.workers):
        raise ValueError("refused before the send")
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.exit()


_SIDE_SCRIPT = """
import sys
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256, device="cpu")
out = llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
llm.exit()
print("TOKENS", out[0]["token_ids"])
"""


def test_two_engines_side_by_side(ckpt):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    other = subprocess.Popen([sys.executable, "-c", _SIDE_SCRIPT, ckpt], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    here, _ = generate(ckpt, 2)
    out, err = other.communicate(timeout=300)
    assert other.returncode == 0, err[-2000:]
    single = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256)
    expected = single.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                               use_tqdm=False)[0]["token_ids"]
    single.exit()
    assert f"TOKENS {expected}" in out
    assert len(here) == len(PROMPTS)


_CALLER_GROUP_SCRIPT = """
import sys
import torch.distributed as dist
from nanovllm import LLM, SamplingParams
path, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
# the caller's own group (torchrun, an RL trainer): two ranks, each building its own one-rank engine
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
llm = LLM(path, kvcache_block_size=16, max_model_len=256, device="cpu")
out = llm.generate([[5 + rank, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
llm.exit()
print("TOKENS", out[0].outputs[0].token_ids)
try:
    LLM(path, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256, device="cpu")
except RuntimeError as e:
    print("REFUSED", e)
print("GROUP", dist.is_initialized(), dist.get_world_size())
dist.destroy_process_group()
"""


def test_one_rank_engines_inside_a_callers_process_group(ckpt):
    """A one-rank engine is whole whatever torch.distributed group its process holds (it used to
    take the caller's group for its own, split its layers over it and fail in a collective); a
    tensor-parallel one is refused there, naming the caller's group, which stays as it was."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, "-c", _CALLER_GROUP_SCRIPT, ckpt, str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    single = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256)
    try:
        expected = [o.outputs[0].token_ids for o in single.generate(
            [[5 + r, 6, 7, 8] for r in range(2)], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
    finally:
        single.exit()
    for rank, proc in enumerate(ranks):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        assert f"TOKENS {expected[rank]}" in out
        assert "REFUSED this process already has a torch.distributed default process group" in out
        assert "GROUP True 2" in out


def test_a_one_rank_engine_beside_a_tensor_parallel_one(ckpt):
    """The tensor-parallel engine's process group is its own: a one-rank engine built beside it
    runs no collectives (it used to join that group's and hang)."""
    expected, _ = generate(ckpt, 1)
    tp2 = cpu_llm(ckpt, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256)
    try:
        alone, _ = generate(ckpt, 1)
        assert alone == expected
        assert [o["token_ids"] for o in tp2.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    finally:
        tp2.exit()


def test_a_worker_dying_at_start_up_is_named_at_once(ckpt, tmp_path):
    """A script without the `if __name__ == "__main__":` guard: the spawned worker imports it, tries
    to start processes of its own and dies. Rank 0 says so within seconds (it used to wait out the
    store's 120 s and report a timeout)."""
    script = tmp_path / "unguarded.py"
    script.write_text("from nanovllm import LLM\n"
                      f"LLM({ckpt!r}, tensor_parallel_size=2, device='cpu', max_model_len=128)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=110)
    assert done.returncode != 0
    assert "tensor-parallel worker rank 1 died" in done.stderr and "__main__" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - start < 60


_WORKER_OUT_OF_MEMORY_SCRIPT = """
import sys
if __name__ == "__mp_main__":  # the spawned worker only: 1 GiB of address space above what it holds now
    import os, resource
    import torch
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (held + 2**30, resource.RLIM_INFINITY))
if __name__ == "__main__":
    from nanovllm import LLM
    # 2 GiB of float32 KV cache a rank (twice what the worker has left): rank 0 holds its own, pages untouched
    LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256, device="cpu",
        num_kvcache_blocks=2**17)
    print("BUILT")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="caps the worker's memory with RLIMIT_AS, /proc")
def test_a_worker_failing_to_start_is_named_at_llm(ckpt, tmp_path):
    """A worker that fails building its model or KV cache (out of memory on its device) while rank
    0 built its own: LLM(...) raises, naming the rank and its error. It returned, and the first call
    named only a dead worker (or rank 0 waiting in a collective got gloo's 'Connection closed by peer')."""
    script = tmp_path / "worker_out_of_memory.py"
    script.write_text(_WORKER_OUT_OF_MEMORY_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), ckpt], capture_output=True, text=True, env=env, timeout=110)
    assert done.returncode != 0 and "BUILT" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert "WorkerDied: tensor-parallel worker rank 1 died" in last, last  # raised by LLM(...)
    assert "its start-up raised RuntimeError" in last and "allocate" in last, last


def test_invalid_tp_sizes_fail_before_any_process_starts(ckpt):
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        cpu_llm(ckpt, tensor_parallel_size=3)
    assert not mp.active_children()


def test_settings_the_workers_cannot_get_are_refused_before_any_process_starts(ckpt):
    """The workers get the engine's settings by pickle: a setting that does not pickle (a local
    function among hf_overrides' values) was an AttributeError from multiprocessing's spawn, and it
    left rank 0's torch threads cut to its share of the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a share to cut (max(1, threads // 2) is threads itself on one core)
    try:
        with pytest.raises(TypeError, match="tensor-parallel workers.*pickle"):
            cpu_llm(ckpt, tensor_parallel_size=2, max_model_len=256, hf_overrides={"unread_key": lambda: 0})
        assert torch.get_num_threads() == 2
        assert not mp.active_children()
        assert not torch.distributed.is_initialized()
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def interrupt_after(seconds: float):
    """A KeyboardInterrupt raised in this (the main) process after `seconds`, as Ctrl-C would."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_interrupted_generate_leaves_the_ranks_in_step(ckpt):
    """An interrupt lands anywhere in rank 0's step (also between sending the plan and the end
    of its forward); the ranks must still agree on the next step."""
    llm = cpu_llm(ckpt, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256)
    try:
        expected = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        # Ctrl-C at a terminal reaches every process of the group: rank 0 alone decides what it does.
        os.kill(llm.workers.procs[0].pid, signal.SIGINT)
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        for delay in (0.05, 0.13, 0.22, 0.4, 0.7):
            with interrupt_after(delay), pytest.raises(KeyboardInterrupt):
                llm.generate(PROMPTS * 4, long, use_tqdm=False)
            assert llm.is_finished()
            assert llm.generate(PROMPTS, GREEDY, use_tqdm=False) == expected, delay
    finally:
        llm.exit()
    assert not mp.active_children()


def test_a_dropped_tp_engine_stops_its_workers(ckpt):
    """`del llm; gc.collect()` on a tensor-parallel engine stops its workers and leaves the process
    group, so the next tensor-parallel engine starts (no exit() needed)."""
    llm = cpu_llm(ckpt, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256)
    pids = [p.pid for p in llm.workers.procs]
    del llm
    gc.collect()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    again, _ = generate(ckpt, 2)
    assert len(again) == len(PROMPTS)


class _FrameworkTensor(torch.Tensor):
    """A tensor subclass, as a training framework's state dict may hold (torch.load's weights_only
    unpickler, which a worker reads its chunk with, refuses every class it has not allowed)."""


def test_update_weights_takes_tensor_subclasses_on_every_rank(ckpt):
    """A weight handed over as a tensor subclass reaches every rank as its plain values (rank 0
    loaded it, then the worker died unpickling it: the ranks held different weights, and the next
    call failed naming only a dead worker)."""
    from checkpoints import load_reference

    state = load_reference(ckpt).state_dict()
    new = [(name, -state[name]) for name in ("model.layers.0.mlp.down_proj.weight", "model.norm.weight")]
    single = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256)
    try:
        single.update_weights(new)
        expected = [o["token_ids"] for o in single.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        single.exit()
    llm = cpu_llm(ckpt, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256)
    try:
        llm.update_weights([(name, tensor.as_subclass(_FrameworkTensor)) for name, tensor in new])
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    finally:
        llm.exit()
    assert not mp.active_children()



def padding_rows(model) -> list[torch.Tensor]:
    """The rows of this rank's vocabulary shards past the vocabulary (embedding, then LM head)."""
    rows = []
    for layer in (model.model.embed_tokens, model.lm_head):
        real = max(0, min(layer.shard_size, layer.vocab_size - layer.vocab_start))
        rows.append(layer.weight[real:].clone())
    return rows


def test_vocab_shard_padding_is_zero_on_every_rank(odd_vocab_ckpt):
    """A vocabulary tp does not divide (383 over 2 ranks) pads the last rank's shards with rows no
    token has: zeros, as vLLM fills them (they were uninitialized memory, NaN at times, which
    apply_model / collective_rpc functions summing or checking the weights saw)."""
    llm = cpu_llm(odd_vocab_ckpt, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256)
    try:
        for _ in range(2):  # at start-up, and after update_weights fills the shards again
            shards = llm.apply_model(padding_rows)
            assert [[tuple(t.shape) for t in rank] for rank in shards] == [[(0, 96)] * 2, [(1, 96)] * 2]
            assert all(torch.equal(t, torch.zeros_like(t)) for rank in shards for t in rank)
            llm.update_weights([(name, torch.full((383, 96), 0.5)) for name in
                                ("model.embed_tokens.weight", "lm_head.weight")])
    finally:
        llm.exit()


def test_a_worker_failing_a_call_names_its_error_on_rank_0(ckpt):
    """A worker whose part of a call raises (rank 0 sends most calls without waiting for an answer)
    dies; rank 0's next call names that error, not only the exit code and gloo's closed connection."""
    llm = cpu_llm(ckpt, tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256)
    try:
        llm.workers.send("no_such_method")  # a call the worker cannot make
        llm.workers.procs[0].join(30)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 died \(exit code 1\).*AttributeError.*no_such_method"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
        with pytest.raises(RuntimeError, match="AttributeError.*no_such_method"):  # every later call too
            llm.sleep()
    finally:
        llm.exit()
    assert not mp.active_children()
