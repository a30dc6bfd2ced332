"""SamplingParams' vLLM fields checked: every bad value refused with a clear error naming it, at
construction and again when a request is added (fields may be edited afterwards, as verl does), with
the engine serving on; max_tokens=None, truncate_prompt_tokens, lora_request; and client code
reading outputs as lm-evaluation-harness's and verl's vLLM backends do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkpoints import (
    TinyShape, build_checkpoint, checkpoint_fixture, cpu_llm, cpu_llm_fixture, load_reference, make_prompts,
)
from nanovllm import SamplingParams
from nanovllm.sampling_params import BeamSearchParams

BAD = [
    ({"presence_penalty": 2.5}, ValueError, r"presence_penalty must be in \[-2.0, 2.0\], got 2.5"),
    ({"frequency_penalty": -3}, ValueError, "frequency_penalty must be in"),
    ({"frequency_penalty": "high"}, TypeError, "frequency_penalty must be a number"),
    ({"presence_penalty": float("nan")}, ValueError, "presence_penalty must not be NaN"),
    ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty must be > 0 and within float32's range"),
    ({"repetition_penalty": 1e-50}, ValueError, r"repetition_penalty .* got 1e-50"),
    ({"repetition_penalty": 1e39}, ValueError, r"repetition_penalty .* got 1e\+39"),
    ({"logit_bias": {3: 1e39}}, ValueError, r"logit_bias\[3\] must be finite in float32"),
    ({"repetition_penalty": float("inf")}, ValueError, r"repetition_penalty must be > 0 .* got inf"),
    ({"repetition_penalty": None}, TypeError, "repetition_penalty must be a number"),
    ({"min_tokens": -1}, ValueError, "min_tokens must be >= 0"),
    ({"min_tokens": 1.5}, TypeError, "min_tokens must be an int"),
    ({"min_tokens": 9, "max_tokens": 8}, ValueError, r"min_tokens \(9\) must be <= max_tokens \(8\)"),
    ({"logit_bias": [(1, 2.0)]}, TypeError, "logit_bias must be a dict"),
    ({"logit_bias": {"5": 1.0}}, TypeError, "logit_bias token id must be an int, got '5'"),
    ({"logit_bias": {-2: 1.0}}, ValueError, "logit_bias token id must be >= 0, got -2"),
    ({"logit_bias": {5: float("inf")}}, ValueError, r"logit_bias\[5\] must be finite"),
    ({"logit_bias": {5: "up"}}, TypeError, r"logit_bias\[5\] must be a number"),
    ({"allowed_token_ids": []}, ValueError, "allowed_token_ids is empty"),
    ({"allowed_token_ids": 5}, TypeError, "allowed_token_ids must be a list of token ids, got 5"),
    ({"allowed_token_ids": [1, -1]}, ValueError, "allowed_token_ids must be >= 0, got -1"),
    ({"bad_words": "word"}, TypeError, "bad_words must be a list of strings, got 'word'"),
    ({"bad_words": ["ok", 3]}, TypeError, "bad_words must be a list of strings"),
    ({"bad_words": ["ok", "  "]}, ValueError, "bad_words must not hold blank strings"),
    ({"include_stop_str_in_output": 1}, TypeError, "include_stop_str_in_output must be a bool, got 1"),
    ({"skip_special_tokens": None}, TypeError, "skip_special_tokens must be a bool"),
    ({"spaces_between_special_tokens": "no"}, TypeError, "spaces_between_special_tokens must be a bool"),
    ({"detokenize": 0}, TypeError, "detokenize must be a bool, got 0"),
    ({"detokenize": False, "stop": ["x"]}, ValueError, "stop strings need detokenize=True"),
    ({"truncate_prompt_tokens": 0}, ValueError, r"truncate_prompt_tokens must be >= 1 or -1 \(max_model_len\), got 0"),
    ({"truncate_prompt_tokens": -2}, ValueError, "truncate_prompt_tokens must be >= 1 or -1"),
    ({"truncate_prompt_tokens": 2.0}, TypeError, "truncate_prompt_tokens must be an int"),
    ({"max_tokens": -1}, ValueError, "max_tokens must be >= 1"),
    ({"stop_token_ids": 7}, TypeError, "stop_token_ids must be a list of token ids, got 7"),
    # vLLM's cap (VLLM_MAX_N_SEQUENCES' default): n=10**9 used to build 10**9 sequences (the process was OOM-killed)
    ({"n": 16385}, ValueError, "n must be <= 16384, got 16385"),
    # past float32's largest value the sampler's temperature was inf (a RuntimeWarning from the step's packing)
    ({"temperature": 1e39}, ValueError, r"temperature must be finite in float32 .* got 1e\+39"),
    # an array seed was compared with -1 (vLLM's no-seed) first: NumPy's / torch's 'truth value of an array
    # ... is ambiguous' (a RuntimeError from torch), naming neither the field nor the value
    ({"seed": np.array([1, 2])}, TypeError, r"seed must be an int, got array\(\[1, 2\]\)"),
    ({"seed": torch.tensor([1, 2])}, TypeError, r"seed must be an int, got tensor\(\[1, 2\]\)"),
]


ckpt = checkpoint_fixture("params", seed=8)
llm = cpu_llm_fixture(kvcache_block_size=16, max_model_len=64)


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("kwargs,exc,words", BAD, ids=[str(k) for k, _, _ in BAD])
def test_bad_values_are_refused_at_construction_and_when_edited_in(llm, kwargs, exc, words):
    with pytest.raises(exc, match=words):
        SamplingParams(**kwargs)
    # the same value set on a valid object afterwards is refused when the request is added
    params = SamplingParams(temperature=0, max_tokens=4)
    for name, value in kwargs.items():
        setattr(params, name, value)
    for call in (lambda: llm.generate([[1, 2, 3]], params, use_tqdm=False), lambda: llm.add_request([1, 2, 3], params)):
        with pytest.raises(exc, match=words):
            call()
        assert llm.is_finished()  # nothing was queued
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4  # still serving


MODEL_CHECKS = [
    ({"stop_token_ids": [384]}, "stop_token_ids holds token id 384, outside the vocabulary \\[0, 384\\)"),
    ({"logit_bias": {400: 1.0}}, "logit_bias holds token id 400"),
    ({"allowed_token_ids": [3, 1000]}, "allowed_token_ids holds token id 1000"),
]


@pytest.mark.parametrize("kwargs,words", MODEL_CHECKS, ids=[str(k) for k, _ in MODEL_CHECKS])
def test_token_ids_outside_the_vocabulary_are_refused_when_added(llm, kwargs, words):
    with pytest.raises(ValueError, match=words):
        llm.generate([[1, 2, 3]], SamplingParams(**kwargs), use_tqdm=False)
    assert llm.is_finished()


def test_bad_words_and_stop_strings_need_a_tokenizer(tmp_path):
    import os
    import shutil

    path = tmp_path / "no-tokenizer"
    src = build_checkpoint(str(tmp_path / "src"), TinyShape())
    path.mkdir()
    shutil.copy(os.path.join(src, "config.json"), path / "config.json")
    llm = cpu_llm(str(path), load_format="dummy", kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=8)
    try:
        with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
            llm.generate([[1, 2]], SamplingParams(bad_words=["x"]), use_tqdm=False)
        # stop strings too (they were ignored: nothing decodes the text they are matched on)
        with pytest.raises(ValueError, match=r"SamplingParams.stop \['x'\] needs a tokenizers-backed tokenizer"):
            llm.generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
        assert llm.generate([[1, 2]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    finally:
        llm.exit()


def test_logprobs_true_means_one_as_in_vllm():
    assert (SamplingParams(logprobs=True).logprobs, SamplingParams(prompt_logprobs=True).prompt_logprobs) == (1, 1)
    with pytest.raises(TypeError, match="logprobs must be an int, got False"):
        SamplingParams(logprobs=False)


def test_a_queued_request_keeps_the_params_it_was_added_with(llm):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    rid = llm.add_request([5, 6, 7], params)
    params.max_tokens = 10  # edited after add_request: the queued request is not affected
    params.temperature = -5.0  # not even by a bad value
    done = {}
    while not llm.is_finished():
        done.update({o.request_id: o for o in llm.step().finished})
    assert len(done[rid].outputs[0].token_ids) == 3


def test_verl_style_edits_between_batches(llm):
    """verl edits one SamplingParams object per batch (update_sampling_params) and reads ids and
    logprobs; each generate call sees the values of that moment."""
    params = SamplingParams(n=1, logprobs=0, max_tokens=5, detokenize=False, temperature=1.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(4, 3, 5, 12)]
    first = llm.generate(prompts=prompts, sampling_params=params, lora_request=None, use_tqdm=False)
    params.n, params.max_tokens, params.temperature = 2, 3, 0.0
    second = llm.generate(prompts=prompts, sampling_params=params, lora_request=None, use_tqdm=False)
    assert [len(o.outputs) for o in first] == [1] * 3 and [len(o.outputs) for o in second] == [2] * 3
    for output in first + second:
        for sample in output.outputs:
            response_ids = sample.token_ids
            log_probs = [sample.logprobs[i][response_ids[i]].logprob for i in range(len(response_ids))]
            assert len(log_probs) == len(response_ids) and all(lp <= 0 for lp in log_probs) and sample.text == ""
    assert all(len(o.outputs[1].token_ids) == 3 for o in second)


@torch.no_grad()
def test_lm_eval_style_loglikelihood(ckpt, llm):
    """lm-evaluation-harness's vLLM loglikelihood: prompt logprobs of context + continuation,
    max_tokens=1, detokenize=False; the continuation's logprob sum and greediness read from
    prompt_logprobs[i][token].logprob match transformers'."""
    reference = load_reference(ckpt)
    context, continuation = make_prompts(5, 2, 6, 12)
    tokens = context + continuation
    params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
    [out] = llm.generate(prompts=[{"prompt_token_ids": tokens}], sampling_params=params, use_tqdm=False,
                         lora_request=None)
    dicts = [None if d is None else {t: getattr(lp, "logprob", lp) for t, lp in d.items()} for d in out.prompt_logprobs]
    got = sum(d[t] for t, d in zip(tokens[len(context):], dicts[len(context):]))
    greedy = all(max(d, key=d.get) == t for t, d in zip(tokens[len(context):], dicts[len(context):]))
    ref = torch.log_softmax(reference(torch.tensor([tokens])).logits[0].double(), dim=-1)
    want = sum(ref[i - 1, tokens[i]].item() for i in range(len(context), len(tokens)))
    want_greedy = all(ref[i - 1].argmax().item() == tokens[i] for i in range(len(context), len(tokens)))
    assert got == pytest.approx(want, abs=1e-2) and greedy == want_greedy


def test_lora_request_is_refused(llm):
    # vLLM's per-prompt list, of no adapters: accepted
    assert len(llm.generate([[1, 2], [3]], GREEDY, use_tqdm=False, lora_request=[None, None])) == 2
    with pytest.raises(ValueError, match="LoRA adapters are not supported: lora_request must be None"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match="lora_request must be None"):
        llm.generate([[1, 2], [3]], GREEDY, use_tqdm=False, lora_request=[None, "adapter"])
    with pytest.raises(ValueError, match="lora_request must be None"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, lora_request="adapter")
    # vLLM's rule: a per-prompt list is one per prompt (it was taken whatever its length)
    with pytest.raises(ValueError, match="lora_request is a list of 1 for 2 prompts"):
        llm.generate([[1, 2], [3]], GREEDY, use_tqdm=False, lora_request=[None])
    with pytest.raises(ValueError, match="lora_request is a list of 3 for 2 prompts"):
        llm.beam_search([[1, 2], [3]], BeamSearchParams(beam_width=1, max_tokens=1), lora_request=[None] * 3)
    assert llm.is_finished()


def test_priority_is_vllms_argument_of_zeros(llm):
    assert len(llm.generate([[1, 2], [3]], GREEDY, use_tqdm=False, priority=[0, 0])) == 2
    with pytest.raises(ValueError, match=r"priority=\[0, 3\]: requests are served in arrival order"):
        llm.generate([[1, 2], [3]], GREEDY, use_tqdm=False, priority=[0, 3])
    with pytest.raises(ValueError, match=r"priority must be a list of one int per prompt \(2\), got \[0\]"):
        llm.generate([[1, 2], [3]], GREEDY, use_tqdm=False, priority=[0])
    assert len(llm.generate([[1, 2], [3]], GREEDY, use_tqdm=False, priority=[np.int64(0), 0.0])) == 2
    # an array was compared with 0 and read for its truth: NumPy's 'truth value ... is ambiguous', unnamed
    with pytest.raises(ValueError, match=r"priority=\[array\(\[0, 1\]\), 0\]: requests are served in arrival"):
        llm.generate([[1, 2], [3]], GREEDY, use_tqdm=False, priority=[np.array([0, 1]), 0])
    with pytest.raises(ValueError, match=r"tokenization_kwargs=array\(\[1, 2\]\) are not supported"):
        llm.generate([[1, 2], [3]], GREEDY, use_tqdm=False, tokenization_kwargs=np.array([1, 2]))
    assert llm.is_finished()


def test_max_tokens_none_fills_max_model_len(llm):
    [out] = llm.generate([[1] * 10], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 64 - 10 and out.outputs[0].finish_reason == "length"


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    prompt = list(range(1, 41))
    cut, whole = llm.generate([prompt, prompt[-8:]], [
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=8), GREEDY],
        use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-8:] and cut.outputs[0].token_ids == whole.outputs[0].token_ids
    # -1: the last max_model_len tokens, which fill it: one token, as vLLM serves them
    [full] = llm.generate([list(range(1, 100))], SamplingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    assert full.prompt_token_ids == list(range(36, 100)) and len(full.outputs[0].token_ids) == 1


def test_numpy_scalars_and_seed_minus_one_as_vllm_takes_them():
    """NumPy scalars (as data-synthesis scripts draw them) become Python ints / floats, also inside the
    token lists and logit_bias; seed -1 is no seed."""
    drawn = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(20), top_p=np.float64(0.9), seed=np.int32(3),
                           max_tokens=np.int64(7), n=np.int16(2), min_tokens=np.uint8(1),
                           stop_token_ids=[np.int64(5)], allowed_token_ids=np.arange(3).tolist() + [np.int32(9)],
                           logit_bias={np.int64(4): np.float32(1.5)})
    plain = SamplingParams(temperature=0.5, top_k=20, top_p=0.9, seed=3, max_tokens=7, n=2, min_tokens=1,
                           stop_token_ids=[5], allowed_token_ids=[0, 1, 2, 9], logit_bias={4: 1.5})
    assert drawn == plain
    assert all(type(getattr(drawn, name)) is type(getattr(plain, name))
               for name in ("temperature", "top_k", "top_p", "seed", "max_tokens", "n", "min_tokens"))
    assert [type(t) for t in drawn.stop_token_ids + drawn.allowed_token_ids + list(drawn.logit_bias)] == [int] * 6
    assert SamplingParams(seed=-1).seed is None


def test_vllm_clone_and_guided_decoding_none():
    """vLLM's SamplingParams.clone() (a deep copy), and TRL's guided_decoding=None (vLLM's older name
    of structured_outputs): None is accepted and kept nowhere, anything else points to the new name."""
    params = SamplingParams(temperature=0.5, stop=["x"], guided_decoding=None)
    copy = params.clone()
    assert copy == params and copy is not params and copy.stop is not params.stop
    with pytest.raises(TypeError, match="guided_decoding is vLLM's older name of structured_outputs"):
        SamplingParams(guided_decoding={"regex": "a+"})


def test_flat_logprobs_as_scoring_scripts_pass_it(llm):
    """vLLM's flat_logprobs (scoring scripts pass True to spare the garbage collector): logprobs are
    kept flat here either way (outputs.FlatLogprobs, read as vLLM's list), so both values are
    accepted and give the same entries; anything but a bool is refused (a TypeError before)."""
    prompt = [[5, 6, 7, 8, 9]]
    outs = [llm.generate(prompt, SamplingParams(temperature=0, prompt_logprobs=1, logprobs=1, max_tokens=2,
                                                detokenize=False, **flag), use_tqdm=False)[0]
            for flag in ({}, {"flat_logprobs": True}, {"flat_logprobs": False})]
    for out in outs[1:]:
        assert list(out.prompt_logprobs) == list(outs[0].prompt_logprobs)
        assert list(out.outputs[0].logprobs) == list(outs[0].outputs[0].logprobs)
    with pytest.raises(TypeError, match="flat_logprobs must be a bool, got 'yes'"):
        SamplingParams(flat_logprobs="yes")


def test_older_and_plugin_fields_as_vllm_clients_pass_them(llm):
    """distilabel's logits_processors=[] and lighteval's best_of (None or n) are accepted, anything
    else refused naming what covers it; extra_args is kept with the request and changes nothing."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logits_processors=[], best_of=1,
                            extra_args={"plugin": {"k": 1}})
    assert params.extra_args == {"plugin": {"k": 1}} and SamplingParams(n=3, best_of=3, seed=0).n == 3
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = [[5, 6, 7]]
    assert llm.generate(prompt, params, use_tqdm=False)[0]["token_ids"] == \
        llm.generate(prompt, plain, use_tqdm=False)[0]["token_ids"]
    for kwargs, error, words in [
        (dict(logits_processors=[lambda ids, logits: logits]), ValueError, "per-request logits processors"),
        (dict(best_of=2), ValueError, r"best_of=2: only best_of=None or n \(=1\)"),
        (dict(extra_args=["a"]), TypeError, "extra_args must be a dict or None"),
        # arrays were read for their truth / compared with n: NumPy's and torch's 'ambiguous' errors, unnamed
        (dict(logits_processors=np.array([1, 2])), ValueError, r"logits_processors=array\(\[1, 2\]\)"),
        (dict(logits_processors=torch.tensor([1, 2])), ValueError, r"logits_processors=tensor\(\[1, 2\]\)"),
        (dict(best_of=np.array([1, 2])), ValueError, r"best_of=array\(\[1, 2\]\): only best_of=None or n"),
        (dict(best_of=torch.tensor([1, 1])), ValueError, r"best_of=tensor\(\[1, 1\]\): only best_of=None or n"),
        (dict(n=np.array([1, 2]), best_of=1), TypeError, r"n must be an int, got array\(\[1, 2\]\)"),
    ]:
        with pytest.raises(error, match=words):
            SamplingParams(**kwargs)
    edited = SamplingParams()
    edited.extra_args = "x"  # checked again when a request is added
    with pytest.raises(TypeError, match="extra_args must be a dict"):
        llm.generate(prompt, edited, use_tqdm=False)


def test_temperature_zero_turns_the_filters_off_as_vllm_does(llm):
    """vLLM's SamplingParams: temperature 0 (greedy) sets top_k 0, top_p 1.0 and min_p 0.0 when made
    (after checking them), so a request whose temperature is raised afterwards samples unfiltered.
    (nanovllm kept them: raised to 1.0, such a request sampled among the top 3 tokens.)"""
    greedy = SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.2, seed=3, max_tokens=6, ignore_eos=True)
    assert (greedy.top_k, greedy.top_p, greedy.min_p) == (0, 1.0, 0.0)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(temperature=0, top_p=0.0)
    greedy.temperature = 1.0
    plain = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    filtered = SamplingParams(temperature=1.0, top_k=3, top_p=0.5, min_p=0.2, seed=3, max_tokens=6, ignore_eos=True)
    prompts = make_prompts(12, 3, 5, 12)
    edited, unfiltered, kept = ([o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
                                for p in (greedy, plain, filtered))
    assert edited == unfiltered != kept
