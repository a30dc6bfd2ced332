"""LLM(generation_config=...): generate / chat without sampling params use the checkpoint's
generation_config.json sampling keys (vLLM's "auto"), none with "vllm", another directory's when
given one; explicit SamplingParams are used as given; bad values are clear errors at LLM()."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from checkpoints import TinyShape, build_checkpoint, cpu_llm, make_prompts
from nanovllm import LLM, SamplingParams

# top_k 1: greedy, so "the defaults applied" shows as equal tokens
FILE = {"temperature": 0.6, "top_k": 1, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.8,
        "max_new_tokens": 5, "do_sample": True, "eos_token_id": 0}
APPLIED = dict(temperature=0.6, top_k=1, top_p=0.95, min_p=0.05, repetition_penalty=1.8, max_tokens=5)
ENGINE = dict(kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=32)


def write_generation_config(directory, values) -> None:
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(values, f)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = build_checkpoint(str(tmp_path_factory.mktemp("genconfig") / "model"), TinyShape(), seed=2)
    write_generation_config(path, FILE)
    return path


def test_auto_applies_the_checkpoints_sampling_keys(ckpt):
    llm = cpu_llm(ckpt, **ENGINE)
    try:
        defaults = llm.get_default_sampling_params()
        assert {k: getattr(defaults, k) for k in APPLIED} == APPLIED
        assert defaults.ignore_eos is False and defaults.n == 1  # keys the file does not set keep their defaults
        defaults.max_tokens = 50  # a copy: the engine's defaults stay
        assert llm.get_default_sampling_params().max_tokens == 5
        prompts = make_prompts(1, 3, 8, 20)
        implicit = llm.generate(prompts, use_tqdm=False)
        explicit = llm.generate(prompts, SamplingParams(**APPLIED), use_tqdm=False)
        assert implicit == explicit and all(len(o.outputs[0].token_ids) <= 5 for o in implicit)
        # explicit params are used as given, not merged with the file's
        longer = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 9 for o in longer)
    finally:
        llm.exit()


def test_vllm_ignores_the_file_and_a_directory_gives_its_own(ckpt, tmp_path):
    llm = cpu_llm(ckpt, generation_config="vllm", **ENGINE)
    try:
        assert llm.get_default_sampling_params() == SamplingParams()
    finally:
        llm.exit()
    other = tmp_path / "other"
    other.mkdir()
    write_generation_config(other, {"temperature": 0.3, "max_new_tokens": 11})
    llm = cpu_llm(ckpt, generation_config=str(other), **ENGINE)
    try:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.3, max_tokens=11)
    finally:
        llm.exit()


def test_eos_ids_come_from_the_directory_generation_config_names(ckpt, tmp_path):
    """vLLM reads the EOS ids of generation_config.json where the defaults come from: another
    directory's file adds its ids (here 7, forced by a logit bias) as stop token ids."""
    forced = SamplingParams(temperature=0, max_tokens=4, logit_bias={7: 100.0})
    other = tmp_path / "eos"
    other.mkdir()
    write_generation_config(other, {"eos_token_id": [0, 7]})
    for source, stops in (("auto", False), (str(other), True)):
        llm = cpu_llm(ckpt, generation_config=source, **ENGINE)
        try:
            out = llm.generate([[3, 4, 5]], forced, use_tqdm=False)[0].outputs[0]
            assert (7 in llm.eos_token_ids) is stops
            if stops:
                assert (out.token_ids, out.finish_reason, out.stop_reason) == ([7], "stop", 7)
            else:
                assert out.token_ids == [7] * 4 and out.finish_reason == "length"
        finally:
            llm.exit()


def test_config_json_eos_ids_count_only_without_a_generation_config_file(tmp_path):
    """vLLM's rule (try_get_generation_config): the EOS ids beside the tokenizer's come from
    generation_config.json, and from config.json only when there is no such file
    (GenerationConfig.from_model_config). config.json's 7, absent from the file, does not end a request."""
    forced = SamplingParams(temperature=0, max_tokens=4, logit_bias={7: 100.0})
    path = build_checkpoint(str(tmp_path / "config_eos"), TinyShape(), eos_token_id=[0, 7])
    saved = os.path.join(path, "generation_config.json")
    for file in ({"eos_token_id": 0}, {"temperature": 0.5}, None):
        if file is None:
            os.remove(saved)
        else:
            write_generation_config(path, file)
        llm = cpu_llm(path, **ENGINE)
        try:
            out = llm.generate([[3, 4, 5]], forced, use_tqdm=False)[0].outputs[0]
            if file is None:  # config.json's ids stand in for the missing file's
                assert 7 in llm.eos_token_ids and (out.token_ids, out.stop_reason) == ([7], 7)
            else:
                assert llm.eos_token_ids == {0} and (out.token_ids, out.finish_reason) == ([7] * 4, "length")
        finally:
            llm.exit()


def test_a_checkpoint_without_the_file_gets_sampling_params_defaults(tmp_path):
    path = build_checkpoint(str(tmp_path / "plain"), TinyShape())
    saved = os.path.join(path, "generation_config.json")
    if os.path.exists(saved):  # transformers writes one from the model's config
        os.remove(saved)
    llm = cpu_llm(path, **ENGINE)
    try:
        assert llm.get_default_sampling_params() == SamplingParams()
    finally:
        llm.exit()


def test_bad_generation_configs_are_clear_errors(ckpt, tmp_path):
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a directory, got 'nope'"):
        LLM(ckpt, generation_config="nope", device="cpu")
    with pytest.raises(TypeError, match="generation_config must be"):
        LLM(ckpt, generation_config=3, device="cpu")
    bad = tmp_path / "bad"
    bad.mkdir()
    write_generation_config(bad, {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"generation_config.json: SamplingParams.top_p must be in \(0, 1\], got 1.5"):
        cpu_llm(ckpt, generation_config=str(bad), **ENGINE)
    # values transformers' GenerationConfig refuses itself are named with the file too
    write_generation_config(bad, {"max_new_tokens": 0})
    with pytest.raises(ValueError, match=re.escape(str(bad / "generation_config.json")) + ": "):
        cpu_llm(ckpt, generation_config=str(bad), **ENGINE)


def test_override_generation_config_sets_keys_over_the_file_and_under_vllm(ckpt):
    """vLLM's override_generation_config: its keys replace the file's under "auto" (the file's
    others stay) and are the only defaults under "vllm"; max_new_tokens becomes max_tokens."""
    overrides = {"temperature": 0.0, "max_new_tokens": 7}
    expected = {"auto": SamplingParams(**{**APPLIED, "temperature": 0.0, "max_tokens": 7}),
                "vllm": SamplingParams(temperature=0.0, max_tokens=7)}
    for source, want in expected.items():
        llm = cpu_llm(ckpt, generation_config=source, override_generation_config=overrides, **ENGINE)
        try:
            assert llm.get_default_sampling_params() == want
            out = llm.generate([[3, 4, 5]], use_tqdm=False)[0].outputs[0]
            assert out.token_ids == llm.generate([[3, 4, 5]], want, use_tqdm=False)[0].outputs[0].token_ids
            assert len(out.token_ids) <= 7
        finally:
            llm.exit()


def test_bad_override_generation_configs_are_clear_errors(ckpt):
    with pytest.raises(TypeError, match="override_generation_config must be None or a dict, got"):
        LLM(ckpt, override_generation_config=[("temperature", 0.5)], device="cpu")
    with pytest.raises(ValueError, match=r"override_generation_config keys must be among .*got \['temprature'\]"):
        LLM(ckpt, override_generation_config={"temprature": 0.5}, device="cpu")
    with pytest.raises(ValueError, match=r"override_generation_config over .*generation_config.json: "
                                         r"SamplingParams.top_p must be in \(0, 1\], got 2.0"):
        cpu_llm(ckpt, override_generation_config={"top_p": 2.0}, **ENGINE)


@pytest.mark.parametrize("text", ["", "{not json", '{"temperature": 0.6,}', "[]"])
@pytest.mark.parametrize("source", ["dir", "vllm"])
def test_a_generation_config_that_is_not_json_is_a_value_error_naming_it(ckpt, tmp_path, text, source):
    """An empty, cut-short or non-object file (read under "vllm" too, for its EOS ids) is a ValueError
    naming the file, as a bad config.json is; transformers raised an OSError (as for a missing file)
    for text that is not JSON."""
    model = tmp_path / "model"
    shutil.copytree(ckpt, model)
    (model / "generation_config.json").write_text(text)
    generation_config = str(model) if source == "dir" else "vllm"
    with pytest.raises(ValueError, match=re.escape(str(model / "generation_config.json")) + " is not a JSON object"):
        cpu_llm(str(model), generation_config=generation_config, **ENGINE)
