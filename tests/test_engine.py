"""End-to-end engine tests on CPU against transformers' Qwen3."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import (
    TinyShape, assert_greedy_matches_reference, build_checkpoint, check_greedy_tokens, check_scheduling_regimes,
    checkpoint_fixture, checkpoint_params_fixture, cpu_llm, generate_tokens, load_reference, make_prompts,
    rewrite_config, whole_text,
)
from nanovllm import SamplingParams

SHAPES = {
    "tied-hd64": TinyShape(),
    "untied-hd128-sharded": TinyShape(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                                      head_dim=128, intermediate_size=160, tie_word_embeddings=False),
    "mha-hd64": TinyShape(hidden_size=128, num_attention_heads=2, num_key_value_heads=2),
}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


checkpoint = checkpoint_params_fixture(SHAPES, max_shard_sizes={"untied-hd128-sharded": "200KB"})
tied_checkpoint = checkpoint_fixture("tied")


def run(path, prompts, params=GREEDY, **kwargs):
    return generate_tokens(path, prompts, params, **kwargs)


def test_greedy_matches_transformers(checkpoint):
    check_greedy_tokens(checkpoint, make_prompts(0, 5, 1, 70), GREEDY)


def test_identical_under_every_scheduling_regime(tied_checkpoint):
    # shared prefixes (2 full blocks of 16) so the prefix cache has something to hit
    shared = list(range(100, 132))
    prompts = [shared + p for p in make_prompts(1, 6, 1, 40)] + make_prompts(2, 4, 20, 90)
    # 12 blocks of 16 tokens: the longest request (~113 tokens) fits, all ten together do not.
    baseline = check_scheduling_regimes(tied_checkpoint, prompts, GREEDY, preempt_blocks=12)

    big_blocks, _ = run(tied_checkpoint, prompts, kvcache_block_size=256)
    assert big_blocks == baseline

    few_seqs, _ = run(tied_checkpoint, prompts, max_num_seqs=3)
    assert few_seqs == baseline

    one_step_at_a_time, _ = run(tied_checkpoint, prompts, overlap_scheduling=False, num_kvcache_blocks=12)
    assert one_step_at_a_time == baseline


def test_second_run_is_served_from_prefix_cache(tied_checkpoint):
    prompts = make_prompts(3, 4, 40, 80)
    llm = cpu_llm(tied_checkpoint, kvcache_block_size=16, max_model_len=512)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    hits_after_first = llm.block_manager.num_prefix_hit_blocks
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    # every full block before the one of the last token (that one is recomputed: block_manager._prefix_hits)
    assert llm.block_manager.num_prefix_hit_blocks - hits_after_first >= sum((len(p) - 1) // 16 for p in prompts)
    assert first == second and all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in first)
    # vLLM's RequestOutput.num_cached_tokens: the prompt tokens the cache served
    assert [o.num_cached_tokens for o in first] == [0] * len(prompts)
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert all(o.metrics is None and o.lora_request is None for o in second)
    # everything is free again, with zero ref counts
    assert llm.block_manager.num_free_blocks == llm.num_kvcache_blocks
    assert all(b.ref_count == 0 for b in llm.block_manager.blocks)
    llm.exit()


def test_fully_cached_prompt_multiple_of_block_size(tied_checkpoint):
    prompt = list(range(1, 33))  # exactly two blocks
    outs, llm = run(tied_checkpoint, [prompt, prompt])
    assert outs[0] == outs[1]
    llm = cpu_llm(tied_checkpoint, kvcache_block_size=16, max_model_len=512)
    a = llm.generate([prompt], GREEDY, use_tqdm=False)
    b = llm.generate([prompt], GREEDY, use_tqdm=False)  # every block cached: last token recomputed
    assert a == b and len(b[0]["token_ids"]) == GREEDY.max_tokens
    assert_greedy_matches_reference(load_reference(tied_checkpoint), prompt, b[0]["token_ids"])
    llm.exit()


def test_outputs_in_input_order_with_mixed_inputs(tied_checkpoint):
    llm = cpu_llm(tied_checkpoint, kvcache_block_size=16, max_model_len=512)
    prompts = ["the quick brown fox", {"prompt_token_ids": [5, 6, 7]}, [9] * 50, {"prompt": "lazy dog"}]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 1, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [3, 9, 1, 5]
    assert all(o["finish_reason"] == "length" for o in outs)
    ids0 = llm.tokenizer.encode("the quick brown fox")
    assert outs[0]["text"] == whole_text(llm.tokenizer, outs[0]["token_ids"], skip_special_tokens=True)
    assert_greedy_matches_reference(load_reference(tied_checkpoint), ids0, outs[0]["token_ids"])
    llm.exit()


def test_eos_from_generation_config_list(tmp_path):
    path = build_checkpoint(str(tmp_path / "eos"), TinyShape(), eos_token_id=0)
    prompt = [7, 8, 9, 10]
    free_run, _ = run(path, [prompt])
    stop_at = free_run[0][4]
    first_hit = free_run[0].index(stop_at)
    with open(os.path.join(path, "generation_config.json")) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [383, stop_at]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    llm = cpu_llm(path, kvcache_block_size=16, max_model_len=512)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert out["token_ids"] == free_run[0][: first_hit + 1]
    assert out["finish_reason"] == "stop"
    ignored = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert ignored["token_ids"] == free_run[0]
    llm.exit()


def test_stops_at_max_model_len(tied_checkpoint):
    llm = cpu_llm(tied_checkpoint, kvcache_block_size=16, max_model_len=40)
    outs = llm.generate([[3] * 30, [4] * 5], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [10, 35]
    assert all(o["finish_reason"] == "length" for o in outs)
    llm.exit()


def test_prompt_filling_max_model_len_gets_one_token(tied_checkpoint):
    """vLLM's rule: a prompt may be max_model_len tokens long (lm-eval cuts its contexts to exactly
    that); it generates one token, never stored, which ends it by length. The token and the prompt
    logprobs are transformers' (argmax, log_softmax), whatever max_tokens asks."""
    prompt = [(7 * i) % 300 + 3 for i in range(40)]
    reference = load_reference(tied_checkpoint)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0].double()  # [40, vocab]
    want = torch.log_softmax(logits, -1)[torch.arange(39), torch.tensor(prompt[1:])]
    llm = cpu_llm(tied_checkpoint, kvcache_block_size=16, max_model_len=40)
    try:
        for max_tokens in (1, 5, None):
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
            out = llm.generate([prompt], sp, use_tqdm=False)[0]
            assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
            assert_greedy_matches_reference(reference, prompt, out.outputs[0].token_ids)
            got = torch.tensor([next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]], dtype=torch.float64)
            assert torch.allclose(got, want, atol=1e-4)
        with pytest.raises(ValueError, match="41 tokens, more than max_model_len"):
            llm.generate([prompt + [3]], SamplingParams(max_tokens=1), use_tqdm=False)
        # truncate_prompt_tokens=-1 keeps max_model_len tokens, which now fit
        kept = llm.generate([[5] * 7 + prompt], SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1),
                            use_tqdm=False)[0]
        assert kept.prompt_token_ids == prompt
    finally:
        llm.exit()


def test_step_wise_api(tied_checkpoint):
    # The reference run comes first: on CUDA each engine takes most of the card's memory,
    # so two engines cannot be alive at once.
    expected, _ = run(tied_checkpoint, [[1, 2, 3] * 20], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm = cpu_llm(tied_checkpoint, kvcache_block_size=16, max_model_len=512, max_num_batched_tokens=32)
    a = llm.add_request([1, 2, 3] * 20, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    b = llm.add_request([4, 5], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    kinds, finished = [], {}
    while not llm.is_finished():
        result = llm.step()
        kinds.append(result.kind.value)
        finished.update({o.request_id: o for o in result.finished})
    assert kinds[:2] == ["prefill", "prefill"]  # 60 prompt tokens over a 32-token budget: chunked
    assert "decode" in kinds
    assert len(finished[a].token_ids) == 4 and len(finished[b].token_ids) == 2
    assert finished[a].token_ids == expected[0]
    llm.exit()


def test_both_config_formats_give_the_same_tokens(tmp_path):
    path = build_checkpoint(str(tmp_path / "fmt"), TinyShape())
    prompts = make_prompts(4, 3, 5, 30)
    new_format, _ = run(path, prompts)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    rewrite_config(path, rope_parameters=None, dtype=None,
                   rope_theta=cfg["rope_parameters"]["rope_theta"], torch_dtype=cfg["dtype"])
    old_format, _ = run(path, prompts)
    assert old_format == new_format
    # theta is really read: another theta changes the tokens
    rewrite_config(path, rope_theta=3.0)
    other, _ = run(path, prompts)
    assert other != new_format


def test_a_directory_name_with_glob_characters_loads(tied_checkpoint, tmp_path):
    """A checkpoint in "run[1]/" (a sweep's directory) loads: its files are not found by a pattern."""
    path = str(tmp_path / "run[1]*")
    shutil.copytree(tied_checkpoint, path)
    prompts = make_prompts(5, 2, 5, 20)
    assert generate_tokens(path, prompts, GREEDY)[0] == generate_tokens(tied_checkpoint, prompts, GREEDY)[0]


def test_load_errors_name_the_problem(tmp_path):
    path = build_checkpoint(str(tmp_path / "bad"), TinyShape())
    with pytest.raises(TypeError, match="bogus"):
        cpu_llm(path, bogus=1)
    with pytest.raises(ValueError, match="config.json"):
        cpu_llm(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        cpu_llm(str(tmp_path / "nope"))
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight$"):
        cpu_llm(path)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 64)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="shape"):
        cpu_llm(path)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    weights["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unknown weight 'model\.layers\.1\.mlp\.extra_proj\.weight'"):
        cpu_llm(path)
    rewrite_config(path, architectures=["MixtralForCausalLM"], model_type="mixtral")
    with pytest.raises(ValueError, match="unsupported architecture"):
        cpu_llm(path)


def test_request_that_never_fits_is_refused_before_work(tied_checkpoint):
    llm = cpu_llm(tied_checkpoint, kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=4)
    ok = [1, 2, 3]
    with pytest.raises(ValueError, match="whole KV cache"):
        llm.generate([ok, [5] * 60], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert llm.is_finished()  # nothing was queued
    assert len(llm.generate([ok], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)) == 1
    llm.exit()


def test_dummy_load_format_runs_from_config_alone(tmp_path, tied_checkpoint):
    path = tmp_path / "cfg-only"
    path.mkdir()
    shutil.copy(os.path.join(tied_checkpoint, "config.json"), path / "config.json")
    outs, llm = run(str(path), [[1, 2, 3]], load_format="dummy")
    assert len(outs[0]) == GREEDY.max_tokens
    assert llm.tokenizer is None
    llm = cpu_llm(str(path), load_format="dummy")
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text"], GREEDY)
    llm.exit()


def test_a_sharded_checkpoint_loads_the_files_its_index_lists(tmp_path):
    """As transformers and vLLM: with model.safetensors.index.json, only its files are read; a stale
    or consolidated copy beside the shards (same tensor names) used to overwrite the real weights."""
    path = build_checkpoint(str(tmp_path / "sharded"), TinyShape(), max_shard_size="100KB")
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    prompts = make_prompts(5, 3, 5, 20)
    expected, _ = run(path, prompts)
    stale = {name: torch.zeros_like(t) for name, t in load_reference(path).state_dict().items()
             if name != "lm_head.weight"}
    save_file(stale, os.path.join(path, "model-stale.safetensors"), metadata={"format": "pt"})
    served, _ = run(path, prompts)
    assert served == expected
    with open(index) as f:
        listed = json.load(f)
    listed["weight_map"]["model.norm.weight"] = "model-99999-of-99999.safetensors"
    with open(index, "w") as f:
        json.dump(listed, f)
    with pytest.raises(ValueError, match="lists files that are not in .*model-99999-of-99999.safetensors"):
        cpu_llm(path)
