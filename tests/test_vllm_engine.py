"""`llm.llm_engine`: vLLM's LLMEngine step API as scripts written for vLLM drive it (the caller's
string ids, has_unfinished_requests / step / abort_request), against LLM.generate's outputs of the
same prompts; and what clients read on it being the LLM's own."""

from __future__ import annotations

import pytest

from checkpoints import checkpoint_fixture, cpu_llm_fixture, make_prompts
from nanovllm import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

ckpt = checkpoint_fixture("vllm_engine", seed=2)
llm = cpu_llm_fixture(kvcache_block_size=16, max_model_len=128)


def run_to_completion(engine) -> dict:
    """vLLM's script loop: outputs by request id, each seen once and finished."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finished and out.request_id not in done
            done[out.request_id] = out
    return done


def test_a_vllm_engine_script_gets_generates_outputs_under_its_ids(llm):
    prompts = make_prompts(4, 3, 10, 30)
    params = [GREEDY, SamplingParams(temperature=0.9, seed=4, max_tokens=5, n=2), GREEDY]
    expected = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        assert engine.add_request(f"req-{i}", {"prompt_token_ids": prompt}, sp) == f"req-{i}"
    assert engine.get_num_unfinished_requests() == 3
    done = run_to_completion(engine)
    assert sorted(done) == ["req-0", "req-1", "req-2"] and engine.get_num_unfinished_requests() == 0
    for i, want in enumerate(expected):
        assert [c.token_ids for c in done[f"req-{i}"].outputs] == [c.token_ids for c in want.outputs]
    # ids are free again once finished; an aborted request is never returned
    engine.add_request("req-0", {"prompt_token_ids": prompts[0]}, GREEDY)
    engine.add_request("gone", {"prompt_token_ids": prompts[1]}, GREEDY)
    engine.abort_request(["gone", "never-added"])
    assert list(run_to_completion(engine)) == ["req-0"]
    # a request added through nano-vllm's own step API comes back under its int id
    ours = llm.add_request(prompts[2], GREEDY)
    assert list(run_to_completion(engine)) == [ours]


def test_bad_engine_requests_are_refused(llm):
    engine = llm.llm_engine
    engine.add_request("a", [1, 2, 3], GREEDY)
    try:
        with pytest.raises(ValueError, match="request_id 'a' is already pending"):
            engine.add_request("a", [4, 5], GREEDY)
        with pytest.raises(TypeError, match="request_id must be a str"):
            engine.add_request(7, [4, 5], GREEDY)
        with pytest.raises(ValueError, match="priority"):
            engine.add_request("b", [4, 5], GREEDY, priority=1)
        with pytest.raises(ValueError, match="lora_request"):
            engine.add_request("b", [4, 5], GREEDY, lora_request="adapter")
    finally:
        engine.abort_request("a")
    assert not engine.has_unfinished_requests()


def test_what_clients_read_on_the_engine_is_the_llms(llm):
    engine = llm.llm_engine
    assert engine is llm.llm_engine  # one per LLM: its ids persist
    assert engine.model_config is llm.model_config and engine.get_tokenizer() is llm.tokenizer
    assert engine.reset_prefix_cache() is True and engine.is_sleeping() is False
    assert engine.model_executor.driver_worker.model_runner.model.load_weights([]) == set()
    prompt = make_prompts(6, 1, 10, 20)
    before = llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
    engine.sleep(level=2)
    assert engine.is_sleeping()
    engine.wake_up(tags=["weights"])
    assert engine.collective_rpc("reload_weights") == [None]
    engine.wake_up()
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids == before


def test_requests_ended_through_the_llms_own_api_leave_no_ids_behind(llm):
    """abort_all (what generate's interrupt handler calls) ends requests the engine API never sees
    end: their ids are forgotten once nothing is pending, and may be given again."""
    engine = llm.llm_engine
    for name in ("x", "y"):
        engine.add_request(name, [1, 2, 3], GREEDY)
    llm.abort_all()
    assert not engine.has_unfinished_requests()
    engine.add_request("x", [4, 5], GREEDY)
    assert (engine._ids, engine._names) == ({max(engine._ids): "x"}, {"x": max(engine._ids)})
    assert list(run_to_completion(engine)) == ["x"] and engine._ids == {} and engine._names == {}
