"""Penalties, min_tokens, logit_bias, allowed_token_ids and bad_words through the whole engine (CPU):
every greedy token is an argmax of transformers' logits with vLLM's rules applied by hand
(tests/logits_refs.py), in each scheduling regime (overlap on and off, chunked prefill, preemption,
forked samples), and seeded sampling gives the same tokens in each."""

from __future__ import annotations

import random

import pytest

from checkpoints import checkpoint_fixture, cpu_llm, make_prompts, reference_fixture
from logits_refs import assert_rules_argmax, bad_word_token_sequences
from nanovllm import SamplingParams

EOS = {0}
MAX_TOKENS = 12
PENALIZED = [
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=2.0,
                   frequency_penalty=1.0, presence_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=1.5),
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=0.6),
    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),  # a plain row in the batch
]
REGIMES = {"overlap": {}, "no-overlap": {"overlap_scheduling": False}, "chunked": {"max_num_batched_tokens": 16},
           "preempt": {"num_kvcache_blocks": 6}}


ckpt = checkpoint_fixture("rules", seed=5)
reference = reference_fixture()


def run(ckpt, prompts, params, **kwargs):
    llm = cpu_llm(ckpt, **{"kvcache_block_size": 16, "max_model_len": 256, **kwargs})
    try:
        return llm.generate(prompts, params, use_tqdm=False), llm.scheduler.num_preemptions
    finally:
        llm.exit()


@pytest.mark.parametrize("regime", list(REGIMES))
def test_penalties_give_argmaxes_of_penalized_transformers_logits(ckpt, reference, regime):
    prompts = make_prompts(7, len(PENALIZED), 12, 30)
    outs, preemptions = run(ckpt, prompts, PENALIZED, **REGIMES[regime])
    assert preemptions > 0 or regime != "preempt"
    for prompt, out, sp in zip(prompts, outs, PENALIZED):
        assert len(out.outputs[0].token_ids) == MAX_TOKENS
        assert_rules_argmax(reference, prompt, out.outputs[0].token_ids, sp, EOS, [])
    # the penalties matter here: without them the same prompts give other tokens
    plain, _ = run(ckpt, prompts[:3], PENALIZED[3])
    assert all(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(outs, plain))


def test_bias_allowed_bad_words_and_min_tokens(ckpt, reference):
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256)
    tok = llm.tokenizer
    prompts = make_prompts(8, 5, 10, 25)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    # bad words: a two-token word the plain run generates (it tokenizes back to those two tokens)
    word = next(text for ids in plain for a, b in zip(ids, ids[1:])
                if (text := tok.decode([a, b])).strip() and tok.encode(text.lstrip(), add_special_tokens=False) == [a, b])
    sequences = bad_word_token_sequences(tok, [word, "the"])
    biased_token = plain[1][0]
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, bad_words=[word, "the"]),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={biased_token: -50.0, 7: 3.0}),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=[5, 9, 40, 41, 300]),
        # EOS made the argmax everywhere, held back for 5 tokens; a stop id the same way
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logit_bias={0: 100.0}, min_tokens=5),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logit_bias={17: 100.0}, min_tokens=3, stop_token_ids=[17]),
    ]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.exit()
    for prompt, out, sp in zip(prompts, outs, params):
        bad = sequences if sp.bad_words else []
        assert_rules_argmax(reference, prompt, out.token_ids, sp, EOS | set(sp.stop_token_ids), bad)
    ids = outs[0].token_ids
    assert all(ids[i:i + len(s)] != s for s in sequences for i in range(len(ids)))
    assert biased_token not in outs[1].token_ids
    assert set(outs[2].token_ids) <= {5, 9, 40, 41, 300}
    assert (outs[3].token_ids[-1], len(outs[3].token_ids), outs[3].finish_reason) == (0, 6, "stop")
    assert (outs[4].token_ids, outs[4].finish_reason, outs[4].stop_reason) == (outs[4].token_ids[:3] + [17], "stop", 17)


def test_rules_that_leave_no_token_allowed_end_the_sample(ckpt, caplog):
    """allowed_token_ids=[x] with the bad word "x x": after the first x no token is allowed (every
    logit -inf), and the sample ends there with a warning, as a constrained row's does. Before, the
    sampler's fallback for a row of all -inf (token 0) came out unnoticed, a token the rules ban, and
    the row went on (x, 0, x, 0, ...)."""
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256)
    try:
        tok = llm.tokenizer
        x = next(i for i in range(5, 384) if (word := tok.decode([i, i])).strip()
                 and tok.encode(word.lstrip(), add_special_tokens=False) == [i, i])
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[x],
                                bad_words=[tok.decode([x, x])])
        plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        prompts = make_prompts(12, 2, 10, 20)
        with caplog.at_level("WARNING", logger="nanovllm.engine.scheduler"):
            ended, served = [o.outputs[0] for o in llm.generate(prompts, [params, plain], use_tqdm=False)]
    finally:
        llm.exit()
    assert (ended.token_ids, ended.finish_reason) == ([x], "stop")
    assert "leave no token allowed" in caplog.text
    assert len(served.token_ids) == 6  # the other request is served on


def test_seeded_sampling_with_penalties_repeats_in_every_regime(ckpt):
    prompts = make_prompts(9, 3, 10, 30)
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.8, top_k=40) for s in (1, 2, 3)]
    results = {name: [o.outputs[0].token_ids for o in run(ckpt, prompts, params, **kw)[0]]
               for name, kw in REGIMES.items()}
    assert all(r == results["overlap"] for r in results.values()), results


def test_forked_samples_keep_their_own_counts(ckpt, reference):
    """n = 3 greedy samples fork from one prompt: each counts its own tokens (all equal here)."""
    prompt = make_prompts(10, 1, 20, 21)[0]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3, frequency_penalty=2.0)
    [out], _ = run(ckpt, [prompt], sp, enable_prefix_caching=False)
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert completion.token_ids == out.outputs[0].token_ids
        assert_rules_argmax(reference, prompt, completion.token_ids, sp, EOS, [])


WORDS = ["the", "fox jumps", " lazy dog", "blocks", "scheduler batches"]


def random_params(rng: random.Random) -> SamplingParams:
    p = dict(temperature=0, max_tokens=rng.randint(3, 16), ignore_eos=rng.random() < 0.7)
    if rng.random() < 0.5:
        p.update(repetition_penalty=rng.uniform(0.5, 2), frequency_penalty=rng.uniform(-2, 2),
                 presence_penalty=rng.uniform(-2, 2))
    if rng.random() < 0.3:
        p.update(logit_bias={rng.randrange(384): rng.uniform(-5, 5) for _ in range(3)})
    if rng.random() < 0.2:
        p.update(allowed_token_ids=rng.sample(range(384), 20))
    if rng.random() < 0.4:
        p.update(bad_words=rng.sample(WORDS, 2))
    if rng.random() < 0.3:
        p.update(min_tokens=rng.randint(0, p["max_tokens"]), stop_token_ids=[rng.randrange(384)])
    if rng.random() < 0.2:
        p.update(n=2)
    return SamplingParams(**p)


@pytest.mark.parametrize("trial", range(3))
def test_random_rule_mixes_in_random_regimes(ckpt, reference, trial):
    """Random mixes of every rule (and n = 2) in one batch, under random overlap / chunk budget /
    KV size (preemptions): every sample's tokens are the rules' argmaxes."""
    rng = random.Random(trial)
    regime = dict(overlap_scheduling=rng.random() < 0.5, max_num_batched_tokens=rng.choice([16, 64, 512]),
                  num_kvcache_blocks=rng.choice([8, 64]))
    prompts = make_prompts(20 + trial, 8, 5, 40)
    params = [random_params(rng) for _ in prompts]
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256, **regime)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        tok = llm.tokenizer
    finally:
        llm.exit()
    for prompt, out, sp in zip(prompts, outs, params):
        bad = bad_word_token_sequences(tok, sp.bad_words or [])
        for completion in out.outputs:
            assert_rules_argmax(reference, prompt, completion.token_ids, sp, EOS | set(sp.stop_token_ids), bad)
