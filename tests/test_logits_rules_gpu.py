"""Penalties and the other logits rules on a CUDA device (bf16), under CUDA graphs and overlap
scheduling: every regime gives the same tokens as eager steps one at a time, greedy tokens are
argmaxes of transformers' logits with vLLM's rules by hand (within bf16 rounding), and seeded
sampling repeats. Many rows at once: the penalties' count slab grows while steps are in flight."""

from __future__ import annotations

import pytest

from checkpoints import BF16_TOLERANCE, GPU_SHAPE, checkpoint_fixture, load_reference, make_prompts
from logits_refs import assert_rules_argmax
from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

ENGINE = dict(kvcache_block_size=16, max_model_len=1024, num_kvcache_blocks=1024, max_num_seqs=64,
              max_num_batched_tokens=512, dtype="bfloat16")
REGIMES = {"graphs+overlap": {}, "graphs": {"overlap_scheduling": False}, "eager+overlap": {"enforce_eager": True},
           "eager": {"enforce_eager": True, "overlap_scheduling": False}}
EOS = {0}
MAX_TOKENS = 24


def greedy(**rules) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **rules)


# 40 rows: penalized ones (more than the slab's first 8 slots), rows with the other rules, plain rows
PARAMS = [greedy(repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4),
          greedy(frequency_penalty=1.5), greedy(repetition_penalty=0.7), greedy(),
          greedy(logit_bias={5: 4.0, 9: -20.0}), greedy(allowed_token_ids=list(range(30, 200))),
          greedy(presence_penalty=2.0, min_tokens=4), greedy()] * 5


ckpt = checkpoint_fixture("rulesgpu", GPU_SHAPE, seed=1)


def run(path, prompts, params, **kwargs):
    llm = LLM(path, **ENGINE, **kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.exit()


def test_greedy_rules_match_transformers_and_agree_in_every_regime(ckpt):
    prompts = make_prompts(1, len(PARAMS), 20, 200)
    outs = {name: run(ckpt, prompts, PARAMS, **kw) for name, kw in REGIMES.items()}
    for name, got in outs.items():
        assert got == outs["eager"], name
    reference = load_reference(ckpt).cuda()
    for prompt, tokens, sp in zip(prompts, outs["graphs+overlap"], PARAMS):
        assert_rules_argmax(reference, prompt, tokens, sp, EOS, [], range_fraction=BF16_TOLERANCE)
    plain = run(ckpt, prompts[:3], greedy())
    assert all(a != b for a, b in zip(outs["graphs+overlap"][:3], plain))  # the penalties mattered


def test_seeded_sampling_with_penalties_repeats_in_every_regime(ckpt):
    prompts = make_prompts(2, 24, 20, 120)
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True,
                             repetition_penalty=1.3, presence_penalty=0.5 * (i % 3)) for i in range(24)]
    outs = {name: run(ckpt, prompts, params, **kw) for name, kw in REGIMES.items()}
    for name, got in outs.items():
        assert got == outs["eager"], name
