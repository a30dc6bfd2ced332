"""sleep / wake_up (vLLM's LLM.sleep / LLM.wake_up) on CPU: a level-1 round trip gives the tokens of an
engine that never slept (greedy, seeded and unseeded rows), whatever order the tags wake in; level 2
discards the weights and update_weights from the checkpoint's state gives them back; the prefix cache
is emptied by sleep; bad calls are refused with the state named and the engine keeps serving; tensor
parallelism (gloo) carries sleep and wake_up to every rank. The engine that never slept is itself
checked against transformers' greedy tokens (tests/checkpoints.py)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from checkpoints import assert_greedy_matches_reference, checkpoint_fixture, cpu_llm, load_reference, make_prompts
from nanovllm import SamplingParams

PROMPTS = make_prompts(11, 3, 20, 60)
# A greedy row, a seeded one and an unseeded one (its noise keys come from the engine's RNG, so
# its tokens repeat only if sleeping draws nothing from it).
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8), SamplingParams(temperature=0.8, seed=7, max_tokens=8),
          SamplingParams(temperature=1.0, max_tokens=8)]
GENERATE_CALLS = 3  # generate() calls of the engine that never slept: the sleeping engines' calls compare to them


ckpt = checkpoint_fixture("sleep", seed=5)


@pytest.fixture(scope="module")
def hf_state(ckpt):
    return load_reference(ckpt).state_dict()


def engine(path: str, **kwargs):
    return cpu_llm(path, kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=64, **kwargs)


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def awake_tokens(ckpt):
    """The tokens of each of GENERATE_CALLS generate() calls of an engine that never slept; its
    greedy rows are transformers' argmaxes."""
    llm = engine(ckpt)
    try:
        calls = [tokens(llm) for _ in range(GENERATE_CALLS)]
    finally:
        llm.exit()
    reference = load_reference(ckpt)
    for call in calls:
        assert_greedy_matches_reference(reference, PROMPTS[0], call[0])
    return calls


def weights(llm) -> dict[str, torch.Tensor]:
    return dict(llm.model_runner.model.named_parameters())


def freed(tensors) -> bool:
    return all(t.untyped_storage().nbytes() == 0 for t in tensors)


@pytest.mark.parametrize("wake", [[None], [["weights"], ["kv_cache"]], [["kv_cache"], ["weights"]],
                                  [["kv_cache", "weights"]]])
def test_level1_round_trip_gives_the_tokens_of_an_engine_that_never_slept(ckpt, awake_tokens, wake):
    llm = engine(ckpt)
    try:
        first = tokens(llm)
        before = {n: p.detach().clone() for n, p in weights(llm).items()}
        llm.sleep(level=1)
        assert llm.is_sleeping()
        assert freed(weights(llm).values()) and freed([llm.model_runner.kv_cache])
        for tags in wake[:-1]:  # part of the engine awake: still asleep, no generating
            llm.wake_up(tags=tags)
            assert llm.is_sleeping()
            with pytest.raises(RuntimeError, match="asleep"):
                llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        llm.wake_up(tags=wake[-1])
        assert not llm.is_sleeping()
        assert all(torch.equal(p, before[n]) for n, p in weights(llm).items())
        assert [first, tokens(llm)] == awake_tokens[:2]
    finally:
        llm.exit()


class FailsOnce:
    """A sleeping part whose first restore fails (as one out of device memory does), then restores."""

    def __init__(self, part):
        self.part, self.calls = part, 0

    def restore(self) -> None:
        self.calls += 1
        if self.calls == 1:
            raise torch.OutOfMemoryError("no memory for the weights yet")
        self.part.restore()


def test_a_failed_wake_up_keeps_the_part_asleep_and_can_be_retried(ckpt, awake_tokens):
    llm = engine(ckpt)
    try:
        first = tokens(llm)
        llm.sleep(level=1)
        llm.model_runner.sleeping["weights"] = FailsOnce(llm.model_runner.sleeping["weights"])
        with pytest.raises(torch.OutOfMemoryError):
            llm.wake_up()
        assert llm.is_sleeping() and "weights" in llm.model_runner.sleeping  # its host copy is kept
        llm.wake_up()
        assert not llm.is_sleeping()
        assert [first, tokens(llm)] == awake_tokens[:2]
    finally:
        llm.exit()


def test_level2_then_update_weights_gives_the_checkpoints_tokens(ckpt, awake_tokens, hf_state):
    """verl's order: sleep(level=2), wake_up(["weights"]), update_weights, wake_up(["kv_cache"])."""
    llm = engine(ckpt)
    try:
        first = tokens(llm)
        rope_tables = [b.clone() for b in llm.model_runner.model.buffers()]
        llm.sleep(level=2)
        assert freed(weights(llm).values())
        with pytest.raises(RuntimeError, match="weights asleep"):
            llm.update_weights(hf_state.items())
        llm.wake_up(tags=["weights"])
        assert all(not p.any() for p in weights(llm).values())  # discarded: zeros until refilled
        assert all(torch.equal(a, b) for a, b in zip(rope_tables, llm.model_runner.model.buffers()))  # kept
        llm.update_weights(hf_state.items())
        with pytest.raises(RuntimeError, match="kv_cache asleep"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        llm.wake_up(tags=["kv_cache"])
        assert [first, tokens(llm)] == awake_tokens[:2]
    finally:
        llm.exit()


def test_level2_then_reload_weights_gives_the_checkpoints_tokens(ckpt, awake_tokens, hf_state):
    """vLLM's documented level-2 order: sleep(level=2), wake_up(["weights"]),
    collective_rpc("reload_weights"), wake_up(["kv_cache"]); reload_weights also undoes an
    update_weights (the checkpoint's weights again, as in vLLM). Other method names: NotImplementedError."""
    llm = engine(ckpt)
    try:
        first = tokens(llm)
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        assert llm.collective_rpc("reload_weights") == [None]
        llm.wake_up(tags=["kv_cache"])
        assert [first, tokens(llm)] == awake_tokens[:2]
        llm.update_weights((name, torch.randn_like(t)) for name, t in hf_state.items())
        assert tokens(llm)[:2] != awake_tokens[2][:2]
        llm.collective_rpc("reload_weights")
        assert tokens(llm)[:2] == awake_tokens[2][:2]  # greedy and seeded rows (the unseeded one drew more noise)
        with pytest.raises(NotImplementedError, match="is not implemented"):
            llm.collective_rpc("init_process_group")
        assert llm.collective_rpc(lambda worker: worker.rank) == [0]  # a function of the worker runs
        with pytest.raises(ValueError, match="takes no arguments"):
            llm.collective_rpc("reload_weights", args=("/elsewhere",))
        llm.sleep(level=2)
        with pytest.raises(RuntimeError, match="weights asleep"):
            llm.collective_rpc("reload_weights")
    finally:
        llm.exit()


def test_sleep_empties_the_prefix_cache_and_it_fills_again_after_wake(ckpt):
    prompt = make_prompts(12, 1, 70, 71)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    llm = engine(ckpt)
    try:
        first = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        hits = llm.block_manager.num_prefix_hit_blocks
        llm.sleep(level=1)
        llm.wake_up()
        # the blocks' KV went with the cache: no hit on them (the woken cache holds zeros)
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == first
        assert llm.block_manager.num_prefix_hit_blocks == hits
        # ... and the cache serves hits again
        assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == first
        assert llm.block_manager.num_prefix_hit_blocks > hits
        llm.sleep(level=1)  # exit() while asleep: as harmless as awake
    finally:
        llm.exit()
    assert llm.model_runner.sleeping == {}  # the host copies went with the engine


def test_bad_calls_are_refused_with_the_state_named_and_the_engine_keeps_serving(ckpt, awake_tokens, caplog):
    llm = engine(ckpt)
    try:
        with pytest.raises(ValueError, match="got 3"):
            llm.sleep(level=3)
        with pytest.raises(TypeError, match="True"):
            llm.sleep(level=True)
        with pytest.raises(TypeError, match="'1'"):
            llm.sleep(level="1")
        with pytest.raises(ValueError, match="'bogus'.*'weights', 'kv_cache'"):
            llm.wake_up(tags=["bogus"])
        with pytest.raises(TypeError, match="'weights'"):
            llm.wake_up(tags="weights")  # a bare string, not a list of tags
        with pytest.raises(ValueError, match="empty"):
            llm.wake_up(tags=[])
        llm.wake_up()  # awake already: nothing to do
        assert not llm.is_sleeping()
        request = llm.add_request(PROMPTS[0], PARAMS[0])
        with pytest.raises(RuntimeError, match="pending"):
            llm.sleep()
        llm.abort_request(request)
        llm.sleep(level=1)
        with caplog.at_level(logging.WARNING, logger="nanovllm.engine.llm_engine"):
            llm.sleep(level=2)  # as vLLM: a warning, nothing done (the level-1 host copy is kept: see below)
        assert "already asleep" in caplog.text
        with pytest.raises(RuntimeError, match="weights asleep, kv_cache asleep"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        with pytest.raises(RuntimeError, match="asleep"):
            llm.add_request(PROMPTS[0], PARAMS[0])
        with pytest.raises(ValueError, match="bogus"):
            llm.wake_up(tags=["weights", "bogus"])  # checked before anything wakes
        assert freed(weights(llm).values())
        llm.wake_up()
        assert tokens(llm) == awake_tokens[0]
    finally:
        llm.exit()
    with pytest.raises(RuntimeError, match="exit"):
        llm.sleep()
    with pytest.raises(RuntimeError, match="exit"):
        llm.wake_up()


def test_tp2_sleep_and_wake_up_reach_every_rank(ckpt, awake_tokens, hf_state):
    llm = engine(ckpt, tensor_parallel_size=2)
    try:
        calls = [tokens(llm)]
        llm.sleep(level=1)
        llm.wake_up()
        calls.append(tokens(llm))
        llm.sleep(level=2)
        llm.wake_up()
        # every rank's weights are zeros: all-zero logits, whose argmax is token 0 (EOS here)
        zero_model = llm.generate(PROMPTS, PARAMS[0], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in zero_model] == [[0]] * len(PROMPTS)
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.update_weights(hf_state.items())
        llm.wake_up(tags=["kv_cache"])
        calls.append(tokens(llm))
    finally:
        llm.exit()
    assert calls[:2] == awake_tokens[:2]
    # the zero model's step drew one key per row from the unseeded RNG: compare the other rows
    assert [row for i, row in enumerate(calls[2]) if i != 2] == [row for i, row in enumerate(awake_tokens[2]) if i != 2]


def _resident_bytes() -> int:
    """This process's resident memory (Linux /proc; CI runs there)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
def test_waking_the_kv_cache_on_cpu_touches_none_of_it(ckpt, awake_tokens):
    """The KV cache comes back as start-up allocates it, unfilled: its host pages stay unallocated
    until blocks are used (a zero-fill made every page resident: ~2 GiB at the default block count)."""
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=16384)
    kv_bytes = llm.model_runner.kv_cache.nbytes
    assert kv_bytes >= 256 * 2**20  # big enough that a fill would show
    llm.sleep(level=1)
    before = _resident_bytes()
    llm.wake_up()
    assert _resident_bytes() - before < kv_bytes // 4
    assert tokens(llm)[0] == awake_tokens[0][0]  # the greedy row, as an engine that never slept
    llm.exit()
