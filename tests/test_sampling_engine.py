"""Sampling through the whole engine: greedy equivalences, seeds, filters, stop strings and ids."""

from __future__ import annotations

import logging

import pytest
import torch

from checkpoints import (
    assert_greedy_matches_reference, checkpoint_fixture, complete_tokens, cpu_llm, cpu_llm_fixture, load_reference,
)
from nanovllm import SamplingParams
from nanovllm.sampling_params import MIN_TEMPERATURE
from nanovllm.sampling.gumbel_torch import torch_gumbel_sample
from nanovllm.sampling.batch import row_key


ckpt = checkpoint_fixture("sampling")
llm = cpu_llm_fixture(kvcache_block_size=16, max_model_len=256)


PROMPT = [11, 12, 13, 14, 15, 16]


def tokens(llm, prompts, params):
    return complete_tokens(llm, prompts, params)


def test_temperature_zero_and_top_k_one_are_greedy(llm, ckpt):
    greedy = tokens(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert_greedy_matches_reference(load_reference(ckpt), PROMPT, greedy)
    topk1 = tokens(llm, [PROMPT], SamplingParams(temperature=0.9, top_k=1, max_tokens=12, ignore_eos=True))[0]
    assert topk1 == greedy
    # in a mixed batch with sampled rows, the greedy row is unchanged
    mixed = tokens(llm, [PROMPT, PROMPT, [3, 4]], [
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.8, max_tokens=5, ignore_eos=True),
    ])
    assert mixed[1] == greedy


def test_seed_reproduces_across_batch_compositions(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = tokens(llm, [PROMPT], seeded)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 20)]
    crowd = tokens(llm, [[9, 9, 9], PROMPT, [40] * 30], [others[0], seeded, others[1]])[1]
    assert crowd == alone
    other_seed = tokens(llm, [PROMPT], SamplingParams(temperature=1.0, seed=4321, max_tokens=16, ignore_eos=True))[0]
    assert other_seed != alone


@torch.no_grad()
def test_seeded_tokens_are_the_keyed_noise_of_the_logits(llm, ckpt):
    """A seeded request's first token is Gumbel-max of its logits with the noise of
    row_key(seed, position): the one noise of every device (the CUDA kernel draws it too)."""
    logits = load_reference(ckpt)(torch.tensor([PROMPT])).logits[0, -1].float()  # [V]
    seeds = list(range(100, 116))
    temperature = 1.3
    firsts = [t[0] for t in tokens(llm, [PROMPT] * len(seeds),
                                   [SamplingParams(temperature=temperature, seed=s, max_tokens=1) for s in seeds])]
    keys = torch.tensor([row_key(s, len(PROMPT)) for s in seeds])
    expected = torch_gumbel_sample(logits.expand(len(seeds), -1), keys, torch.full((len(seeds),), temperature))
    assert firsts == expected.tolist()
    assert len(set(firsts)) > 1


@torch.no_grad()
def allowed_first_tokens(ckpt, temperature, top_k=0, top_p=1.0, min_p=0.0) -> set[int]:
    logits = load_reference(ckpt)(torch.tensor([PROMPT])).logits[0, -1].double()
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    kept = probs * keep
    sorted_kept = kept[order]
    mass_before = torch.cumsum(sorted_kept, 0) - sorted_kept
    keep_p = torch.zeros_like(keep)
    keep_p[order] = mass_before < top_p * kept.sum()
    keep &= keep_p
    keep &= probs >= min_p * probs.max()
    return set(torch.nonzero(keep).flatten().tolist())


@pytest.mark.parametrize("filt", [{"top_p": 0.6}, {"top_k": 5}, {"min_p": 0.3}, {"top_k": 8, "top_p": 0.7, "min_p": 0.05}])
def test_filters_never_sample_outside_allowed_set(llm, ckpt, filt):
    allowed = allowed_first_tokens(ckpt, 1.5, **filt)
    n = 300
    params = [SamplingParams(temperature=1.5, max_tokens=1, seed=s, **filt) for s in range(n)]
    firsts = {t[0] for t in tokens(llm, [PROMPT] * n, params)}
    assert firsts <= allowed
    assert len(firsts) >= min(2, len(allowed))  # it does sample, not just the argmax


def test_stop_token_ids_end_with_the_stop_token(llm):
    free = tokens(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    stop = free[5]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out["token_ids"] == free[: free.index(stop) + 1]
    assert out["finish_reason"] == "stop"


def test_stop_string_spanning_tokens(llm):
    prompt = "the quick brown"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.tokenizer
    pieces = [tok.decode(free["token_ids"][:i], skip_special_tokens=True) for i in range(len(free["token_ids"]) + 1)]
    text = free["text"]
    # a stop string made of the last char of token k's text and the first char of token k+1's text
    for k in range(2, len(pieces) - 2):
        a, b = pieces[k], pieces[k + 1]
        if len(a) > len(pieces[k - 1]) and len(b) > len(a) and a[-1:].strip() and b[len(a)].strip():
            stop = a[-1] + b[len(a)]
            break
    else:
        pytest.skip("no printable token boundary in this sample")
    start = text.find(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "zzzz"]),
                       use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[:start]
    # token_ids cover the tokens up to the one that completed the stop string, no more
    n = len(out["token_ids"])
    assert out["token_ids"] == free["token_ids"][:n]
    assert stop in tok.decode(out["token_ids"], skip_special_tokens=True)
    assert stop not in tok.decode(out["token_ids"][:-1], skip_special_tokens=True)


def test_finish_reasons(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 3


def stop_ending_at(tok, token_ids: list[int], k: int) -> str | None:
    """A stop string that the first k tokens' text contains and the first k - 1 tokens' does not:
    the last characters of token k's text, up to 3 (None when token k adds no printable text)."""
    before = tok.decode(token_ids[: k - 1], skip_special_tokens=True)
    text = tok.decode(token_ids[:k], skip_special_tokens=True)
    for size in (3, 2, 1):
        stop = text[-size:]
        if len(text) > len(before) and stop.strip() and stop not in before and text.find(stop) == len(text) - size:
            return stop
    return None


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm, ckpt):
    """vLLM's order: a stop string ends the request before the length limit does (max_tokens, or
    max_model_len), and the text is cut at it."""
    prompt = "the quick brown"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    ids = free["token_ids"]
    k, stop = next((k, s) for k in range(4, 30) if (s := stop_ending_at(llm.tokenizer, ids, k)) is not None)
    text = llm.tokenizer.decode(ids[:k], skip_special_tokens=True)
    # the last allowed token by max_tokens
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert (out["finish_reason"], out["token_ids"], out["text"]) == ("stop", ids[:k], text[: -len(stop)])
    # the last allowed token by max_model_len
    prompt_ids = llm.tokenizer.encode(prompt)
    short = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=len(prompt_ids) + k)
    try:
        out = short.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                             use_tqdm=False)[0]
    finally:
        short.exit()
    assert (out["finish_reason"], out["token_ids"], out["text"]) == ("stop", ids[:k], text[: -len(stop)])


@pytest.mark.parametrize("temperature", [1e-38, 1e-6, 5e-3])
def test_tiny_temperatures_are_raised_to_vllms_floor(temperature, caplog):
    """vLLM's rule: a positive temperature below MIN_TEMPERATURE (0.01; logits / 1e-38 overflows
    float32) is raised to it, with a warning; only temperature 0 is greedy. (nanovllm used to take
    temperatures below 1e-5 as greedy and sample at the tiny value between 1e-5 and 0.01.)"""
    with caplog.at_level(logging.WARNING, logger="nanovllm.sampling_params"):
        tiny = [SamplingParams(temperature=temperature, seed=5, max_tokens=12, ignore_eos=True),
                SamplingParams(temperature=temperature, top_p=0.5, min_p=0.1, seed=7, max_tokens=12, ignore_eos=True)]
    assert [p.temperature for p in tiny] == [MIN_TEMPERATURE] * 2 and not any(p.greedy for p in tiny)
    assert "raised to 0.01" in caplog.text
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0).temperature == 0
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE


def test_a_stop_token_that_completes_a_stop_string_kept_in_the_output(llm):
    """With include_stop_str_in_output the stop token's text is the output's: a stop string it
    completes ends the request as that string (vLLM: stop_reason the string, the text cut after it;
    the token stays in token_ids), for EOS and for a stop_token_ids entry alike."""
    tok = llm.tokenizer
    eos = tok.eos_token_id
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=5, logit_bias={eos: 100.0}, stop=["endoftext"],
                                                  include_stop_str_in_output=True, skip_special_tokens=False),
                         use_tqdm=False)
    c = out.outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([eos], "stop", "endoftext")
    assert c.text == tok.decode([eos])[: tok.decode([eos]).index("endoftext") + len("endoftext")]
    [the] = tok.encode(" the", add_special_tokens=False)
    stopped = SamplingParams(max_tokens=5, logit_bias={the: 100.0}, stop_token_ids=[the], stop=["he"],
                             include_stop_str_in_output=True)
    c = llm.generate([PROMPT], stopped, use_tqdm=False)[0].outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason, c.text) == ([the], "stop", "he", " the")
    # without include_stop_str_in_output the stop token ends it as before: its id the reason, no text
    plain = SamplingParams(max_tokens=5, logit_bias={the: 100.0}, stop_token_ids=[the], stop=["he"])
    c = llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0]
    assert (c.token_ids, c.stop_reason, c.text) == ([the], the, "")


@pytest.mark.parametrize("include", [False, True])
def test_stops_completed_by_one_token_the_first_listed_wins(llm, include):
    """vLLM's check_stop_strings: of the stop strings found in a step's new text, the first one in
    `stop`'s order ends the request (stop_reason) and cuts the text, wherever the others start.
    (nanovllm took the one starting earliest: " quick" with stop=["ck", "qu"] gave " ", "qu".)"""
    [quick] = llm.tokenizer.encode(" quick", add_special_tokens=False)
    for stop, cut in ((["ck", "qu"], " qui"), (["qu", "ck"], " ")):
        params = SamplingParams(max_tokens=3, logit_bias={quick: 100.0}, stop=stop, include_stop_str_in_output=include)
        c = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        text = cut + stop[0] if include else cut
        assert (c.token_ids, c.finish_reason, c.stop_reason, c.text) == ([quick], "stop", stop[0], text), stop
