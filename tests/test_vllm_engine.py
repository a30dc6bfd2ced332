"""`llm.llm_engine`: vLLM's LLMEngine step API as scripts written for vLLM drive it (the caller's
string ids, has_unfinished_requests / step / abort_request), against LLM.generate's outputs of the
same prompts; and what clients read on it being the LLM's own."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from checkpoints import checkpoint_fixture, cpu_llm_fixture, make_prompts

from nanovllm import SamplingParams
from nanovllm.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

ckpt = checkpoint_fixture("vllm_engine", seed=2)
llm = cpu_llm_fixture(kvcache_block_size=16, max_model_len=128)


def run_to_completion(engine) -> dict:
    """vLLM's script loop: final outputs by request id, each seen once (after its running ones)."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in done
            if out.finished:
                done[out.request_id] = out
    return done


def run_streaming(engine) -> dict[str, list]:
    """Every output of each request, in order; the last one (only) finished."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not seen.get(out.request_id) or not seen[out.request_id][-1].finished
            seen.setdefault(out.request_id, []).append(out)
    assert all(outs[-1].finished for outs in seen.values())
    return seen


def test_a_vllm_engine_script_gets_generates_outputs_under_its_ids(llm):
    prompts = make_prompts(4, 3, 10, 30)
    params = [GREEDY, SamplingParams(temperature=0.9, seed=4, max_tokens=5, n=2), GREEDY]
    expected = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        assert engine.add_request(f"req-{i}", {"prompt_token_ids": prompt}, sp) == f"req-{i}"
    assert engine.get_num_unfinished_requests() == 4  # vLLM V1 counts req-1's n=2 samples as two requests
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
        # an array was compared with 0 and read for its truth: NumPy's 'truth value ... is ambiguous', unnamed
        with pytest.raises(ValueError, match=r"priority=array\(\[0, 0\]\): requests are served in arrival order"):
            engine.add_request("b", [4, 5], GREEDY, priority=np.array([0, 0]))
        with pytest.raises(ValueError, match="lora_request"):
            engine.add_request("b", [4, 5], GREEDY, lora_request="adapter")
        # not ids of this API: refused naming them (an int raised "'int' object is not iterable"; an int
        # in a list was skipped, so the caller's abort silently dropped nothing)
        with pytest.raises(TypeError, match=r"abort_request takes a request id \(a str\) or an iterable .* got 7"):
            engine.abort_request(7)
        with pytest.raises(TypeError, match="got 0"):
            engine.abort_request(["a", 0])
        assert engine.get_num_unfinished_requests() == 1  # refused before anything was aborted
    finally:
        engine.abort_request("a")
    assert not engine.has_unfinished_requests()


def test_unfinished_requests_count_each_sample_as_vllm_v1_does(llm):
    """vLLM V1 fans a request of n > 1 out into n child requests, each counted by
    get_num_unfinished_requests until it ends (its output processor's request states)."""
    engine = llm.llm_engine
    prompts = make_prompts(7, 3, 10, 20)
    three = SamplingParams(temperature=0.8, seed=1, max_tokens=3, n=3, ignore_eos=True)
    engine.add_request("three", {"prompt_token_ids": prompts[0]}, three)
    engine.add_request("one", {"prompt_token_ids": prompts[1]}, GREEDY)  # 6 tokens: it ends last
    assert engine.get_num_unfinished_requests() == 4
    counts = []
    while engine.has_unfinished_requests():
        engine.step()
        counts.append(engine.get_num_unfinished_requests())
    assert 1 in counts and counts[-1] == 0  # "three"'s samples ended before "one"
    engine.add_request("aborted", {"prompt_token_ids": prompts[2]}, SamplingParams(max_tokens=4, n=2))
    assert engine.get_num_unfinished_requests() == 2
    engine.abort_request("aborted")
    assert engine.get_num_unfinished_requests() == 0


def test_what_clients_read_on_the_engine_is_the_llms(llm):
    engine = llm.llm_engine
    assert engine is llm.llm_engine  # one per LLM: its ids persist
    assert engine.model_config is llm.model_config and engine.get_tokenizer() is llm.tokenizer
    assert engine.get_model_config() is llm.model_config  # vLLM's LLMEngine.get_model_config()
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


def test_the_driver_workers_model_reads_as_the_serving_module(llm):
    """verl takes the synced weights' device from `next(model.parameters())` of vLLM's driver
    worker's model, scripts walk its named_parameters() to check a sync: the end of the path reads
    as rank 0's module (the same parameter objects), and its load_weights is still update_weights."""
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    module = llm.model_runner.model
    assert next(model.parameters()).device == torch.device("cpu")
    served = dict(module.named_parameters())
    assert {name: p for name, p in model.named_parameters()}.keys() == served.keys()
    assert all(p is served[name] for name, p in model.named_parameters())
    assert model.model.embed_tokens is module.model.embed_tokens  # submodules as vLLM's model holds them
    assert model.load_weights([]) == set()
    with pytest.raises(AttributeError, match="no_such_part"):
        _ = model.no_such_part
    model.sync_step = 3  # set on the module, as on vLLM's model (the path's objects are made at each access)
    try:
        assert llm.llm_engine.model_executor.driver_worker.model_runner.model.sync_step == module.sync_step == 3
    finally:
        del module.sync_step


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


def test_abort_request_takes_vllms_internal_flag(llm):
    """vLLM's LLMEngine.abort_request(request_ids, internal=False) (its LLM aborts the requests it added
    with internal=True): the ids add_request returned, either way (a TypeError before); anything but
    a bool is refused naming it, before any request is dropped."""
    engine = llm.llm_engine
    for name in ("a", "b", "c"):
        assert engine.add_request(name, [1, 2, 3], GREEDY) == name
    with pytest.raises(TypeError, match="internal must be a bool, got 'yes'"):
        engine.abort_request(["a"], internal="yes")
    assert engine.get_num_unfinished_requests() == 3
    engine.abort_request(["a"], internal=False)
    engine.abort_request(["b"], internal=True)
    assert list(run_to_completion(engine)) == ["c"]


STREAMED = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1),
            SamplingParams(temperature=0.9, seed=5, max_tokens=9, n=2, ignore_eos=True)]


def final_outputs(llm, prompts, params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_cumulative_outputs_grow_to_the_final_one(llm):
    """vLLM's default kind: each step a running request advanced gives all of it so far."""
    prompts = make_prompts(6, 2, 10, 30)
    expected = final_outputs(llm, prompts, STREAMED)
    engine = llm.llm_engine
    for i, (prompt, sp) in enumerate(zip(prompts, STREAMED)):
        assert sp.output_kind is RequestOutputKind.CUMULATIVE
        engine.add_request(f"c{i}", {"prompt_token_ids": prompt}, sp)
    seen = run_streaming(engine)
    for i, want in enumerate(expected):
        outs = seen[f"c{i}"]
        assert len(outs) > 2 and outs[-1] == want  # the dict views: tokens, texts, logprobs
        for earlier, later in itertools.pairwise(outs):
            for a, b in zip(earlier.outputs, later.outputs):
                assert b.token_ids[: len(a.token_ids)] == a.token_ids and b.text.startswith(a.text)
        for out in outs:  # each output's logprobs as they were when given (Logprobs: values, ranks, texts)
            for c, final in zip(out.outputs, want.outputs):
                if final.logprobs is not None:
                    n = len(c.token_ids)
                    assert len(c.logprobs) == n and list(c.logprobs) == final.logprobs[:n]
        assert all(o.prompt_logprobs == want.prompt_logprobs for o in outs)


def test_delta_outputs_join_into_the_final_one(llm):
    prompts = make_prompts(7, 2, 10, 30)
    expected = final_outputs(llm, prompts, STREAMED)
    engine = llm.llm_engine
    for i, (prompt, sp) in enumerate(zip(prompts, STREAMED)):
        engine.add_request(f"d{i}", {"prompt_token_ids": prompt}, SamplingParams(**{
            **{f: getattr(sp, f) for f in ("temperature", "seed", "max_tokens", "n", "ignore_eos", "logprobs",
                                           "prompt_logprobs")}, "output_kind": RequestOutputKind.DELTA}))
    seen = run_streaming(engine)
    for i, want in enumerate(expected):
        outs = seen[f"d{i}"]
        assert len(outs) > 2
        # vLLM pops the prompt's logprobs into the first output: the later ones hold [] when they were asked for
        assert outs[0].prompt_logprobs == want.prompt_logprobs
        if want.prompt_logprobs is None:
            assert all(o.prompt_logprobs is None for o in outs[1:])
        else:
            assert all(o.prompt_logprobs == [] and isinstance(o.prompt_logprobs, list) for o in outs[1:])
        for index, completion in enumerate(want.outputs):
            parts = [c for o in outs for c in o.outputs if c.index == index]
            assert [t for c in parts for t in c.token_ids] == completion.token_ids
            assert "".join(c.text for c in parts) == completion.text
            if completion.logprobs is not None:
                assert [e for c in parts for e in c.logprobs] == completion.logprobs
            assert parts[-1].finish_reason == completion.finish_reason
            assert all(c.finish_reason is None for c in parts[:-1])


def test_a_stop_string_is_never_shown_and_taken_back(llm):
    """The running text holds back len(stop) - 1 characters: joined deltas are the final text, cut
    before the stop string, and no running text passes it."""
    prompt = make_prompts(8, 1, 12, 13)[0]
    free = final_outputs(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    pieces = [llm.get_tokenizer().decode([t]) for t in free.token_ids]
    # a stop string across two tokens (the last 2 characters of one, the first of the next), seen once:
    # its start is in the running text a step before it completes, unless held back
    stop = next(a[-2:] + b[0] for a, b in itertools.pairwise(pieces[2:])
                if len(a) >= 2 and b and (a + b).isascii() and free.text.count(a[-2:] + b[0]) == 1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    want = final_outputs(llm, [prompt], params)[0].outputs[0]
    assert want.finish_reason == "stop" and stop not in want.text
    engine = llm.llm_engine
    engine.add_request("s", {"prompt_token_ids": prompt},
                       SamplingParams(**{**vars(params), "output_kind": RequestOutputKind.DELTA}))
    outs = run_streaming(engine)["s"]
    assert "".join(o.outputs[0].text for o in outs) == want.text
    engine.add_request("s", {"prompt_token_ids": prompt}, params)  # cumulative
    outs = run_streaming(engine)["s"]
    assert all(want.text.startswith(o.outputs[0].text) for o in outs) and outs[-1].outputs[0].text == want.text


def test_final_only_and_the_llms_own_requests_give_the_final_output_alone(llm):
    engine = llm.llm_engine
    engine.add_request("f", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                      output_kind=RequestOutputKind.FINAL_ONLY))
    ours = llm.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    seen = run_streaming(engine)
    assert sorted(map(str, seen)) == sorted(["f", str(ours)]) and all(len(v) == 1 for v in seen.values())
    with pytest.raises(TypeError, match="output_kind must be a RequestOutputKind, got 2"):
        SamplingParams(output_kind=2)


def worker_rank_plus(worker, k: int) -> int:
    return worker.rank + k


def test_the_executors_collective_rpc_is_the_llms(llm):
    """`llm.llm_engine.model_executor.collective_rpc(...)` (vLLM's Executor method: OpenRLHF's weight
    broadcast, scripts reading worker state) runs as llm.collective_rpc: it was an AttributeError on
    the weight-sync path object, naming neither the method nor what is supported."""
    executor = llm.llm_engine.model_executor
    assert executor.collective_rpc(worker_rank_plus, args=(3,)) == [3]
    assert executor.collective_rpc(worker_rank_plus, kwargs={"k": 1}, timeout=30) == [1]
    with pytest.raises(NotImplementedError, match="'update_weight' is not implemented"):
        executor.collective_rpc("update_weight", kwargs={"name": "x"})
    prompt = make_prompts(9, 1, 10, 20)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids  # still serving


def test_validate_outputs_returns_them(llm):
    """vLLM's LLMEngine.validate_outputs(outputs, output_type), a classmethod that returns `outputs`
    (loops copied from vLLM's LLM._run_engine end with it): it was an AttributeError."""
    from nanovllm.engine.vllm_engine import VllmEngine
    from nanovllm.outputs import RequestOutput

    engine = llm.llm_engine
    engine.add_request("v", [1, 2, 3], GREEDY)
    outputs = list(run_to_completion(engine).values())
    assert engine.validate_outputs(outputs, RequestOutput) is outputs
    assert VllmEngine.validate_outputs(outputs, RequestOutput) is outputs


def test_the_engines_cache_config_is_vllm_configs(llm):
    """vLLM V1's LLMEngine keeps `cache_config` beside `model_config` (scripts read
    llm.llm_engine.cache_config.num_gpu_blocks / block_size / cache_dtype): it was an AttributeError."""
    engine = llm.llm_engine
    assert engine.cache_config == engine.vllm_config.cache_config
    assert (engine.cache_config.block_size, engine.cache_config.num_gpu_blocks) == (16, llm.num_kvcache_blocks)
    assert engine.cache_config.cache_dtype == "auto"
