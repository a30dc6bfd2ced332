"""LLM(logprobs_mode=...): vLLM's four modes against transformers' float64 logits with vLLM's rules
applied by hand (logits_refs.py), then the temperature and min-p / top-k / top-p (test_sampler's
float64 reference), for greedy, penalized and filtered rows in one batch."""

from __future__ import annotations

import math

import pytest
import torch

from checkpoints import checkpoint_fixture, cpu_llm, load_reference, make_prompts
from logits_refs import reference_row
from nanovllm import SamplingParams
from test_sampler import reference as filtered_distribution

ATOL = 1e-4  # a float32 engine against float64
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, repetition_penalty=1.4),
    SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=3, top_k=5, presence_penalty=0.5),
    SamplingParams(temperature=1.3, seed=4, max_tokens=6, logprobs=3, top_p=0.6, min_p=0.07),
    SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=2, logit_bias={7: 2.0}),
]

ckpt = checkpoint_fixture("logprobs_mode", seed=3)


@pytest.fixture(scope="module")
def reference(ckpt):
    return load_reference(ckpt)


def expected_row(raw: torch.Tensor, prompt: list[int], before: list[int], params: SamplingParams,
                 mode: str) -> torch.Tensor:
    """[V] float64: the values `mode` reports at one position whose raw logits are `raw`."""
    if mode == "raw_logits":
        return raw
    if mode == "raw_logprobs":
        return torch.log_softmax(raw, dim=-1)
    ruled = reference_row(raw, prompt, before, params, set(), [])
    if params.temperature == 0.0:
        scaled = ruled
    else:
        scaled = ruled / params.temperature
        kept = filtered_distribution(ruled, params) > 0  # temperature, min-p, top-k, top-p (float64)
        scaled = scaled.masked_fill(~kept, -math.inf)
    return torch.log_softmax(scaled, dim=-1) if mode == "processed_logprobs" else scaled


def close(a: float, b: float) -> bool:
    return (a == b == -math.inf) or abs(a - b) < ATOL


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_reports_vllms_values(ckpt, reference, mode):
    prompts = make_prompts(11, len(PARAMS), 12, 20)
    llm = cpu_llm(ckpt, logprobs_mode=mode, kvcache_block_size=16, max_model_len=128)
    try:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    finally:
        llm.exit()
    filtered_out = 0
    for prompt, params, out in zip(prompts, PARAMS, outs):
        sample = out.outputs[0]
        with torch.no_grad():
            raw_rows = reference(torch.tensor([prompt + sample.token_ids])).logits[0].double()  # [len, V]
        for j, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            row = expected_row(raw_rows[len(prompt) - 1 + j], prompt, sample.token_ids[:j], params, mode)
            assert next(iter(entry)) == token and close(entry[token].logprob, row[token].item()), (mode, j, token)
            assert math.isfinite(entry[token].logprob)
            assert entry[token].rank == 1 + int((row > row[token] + ATOL).sum())  # no near-ties at this seed
            for place, t in enumerate(row.topk(params.logprobs).indices.tolist(), start=1):
                if math.isfinite(row[t].item()):
                    assert entry[t].rank == place and close(entry[t].logprob, row[t].item())
            filtered_out += int((row == -math.inf).sum())
    if mode.startswith("processed"):
        assert filtered_out > 0  # the filters did drop tokens: -inf was checked, not only finite values


def test_a_mode_vllm_lacks_is_refused_naming_it(ckpt):
    with pytest.raises(ValueError, match=r"logprobs_mode must be one of .*'processed_logprobs'.*got 'processed'"):
        cpu_llm(ckpt, logprobs_mode="processed")
