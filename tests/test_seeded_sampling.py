"""Seeded sampling repeats whatever else is in the batch (vLLM V1's promise): a request's tokens,
logprobs and cumulative logprob do not depend on the other requests' settings."""

from __future__ import annotations

import glob

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import TinyShape, build_shaped_checkpoint, cpu_llm, rewrite_checkpoint_tensors
from nanovllm import SamplingParams
from nanovllm.sampling.row_logprobs import token_logprobs

# Tokens whose LM-head rows are one row: their logits tie exactly at every step.
TIED = range(100, 140)


@pytest.fixture(scope="module")
def tied_head_ckpt(tmp_path_factory) -> str:
    """A checkpoint whose TIED tokens share one LM-head row, the others' rows scaled down, so the
    tied logit is often the row's largest (and many tokens share it)."""
    path = build_shaped_checkpoint(str(tmp_path_factory.mktemp("tied_head")), TinyShape(tie_word_embeddings=False))
    tensors = load_file(glob.glob(f"{path}/*.safetensors")[0])
    head = tensors["lm_head.weight"].clone()
    shared = head[TIED.start].clone()
    head *= 0.05
    head[TIED.start:TIED.stop] = shared
    tensors["lm_head.weight"] = head
    rewrite_checkpoint_tensors(path, tensors)
    return path


def test_top_logprobs_rank_tied_tokens_lower_id_first_whatever_k() -> None:
    """token_logprobs' k most likely tokens are a stable descending sort's first k (the Triton pass's
    order: the lower id first among equal logits), so a row's list does not depend on the k asked."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 300, generator=g) * 2).round()  # integers: ties everywhere
    logits[1, 50:90] = logits[1].max() + 1  # 40 tied leaders
    tokens = torch.zeros(4, dtype=torch.int64)
    for x in (logits, logits.bfloat16()):
        want = torch.sort(x.float(), dim=1, descending=True, stable=True).indices
        for k in (1, 2, 5, 20, 64, 300):
            assert torch.equal(token_logprobs(x, tokens, k).top_ids, want[:, :k]), k


def test_seeded_logprobs_do_not_depend_on_another_requests_logprobs(tied_head_ckpt) -> None:
    """A seeded request's logprobs (tied alternatives included) are the same alone and beside a
    request that asks for more of them."""
    llm = cpu_llm(tied_head_ckpt, kvcache_block_size=16, max_model_len=128)
    try:
        prompt = list(range(1, 12))
        seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True, logprobs=2)
        other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, logprobs=20)
        alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0]
        beside = llm.generate([prompt, [5, 6, 7]], [seeded, other], use_tqdm=False)[0].outputs[0]
    finally:
        llm.exit()
    # the tied logit led some steps: their top-2 lists hold two tied tokens
    assert sum(len(set(d) & set(TIED)) >= 2 for d in alone.logprobs) >= 3
    assert beside.token_ids == alone.token_ids
    # the same ids and ranks in the same order; the values within float32 sums ordered by the batch
    assert [[(i, lp.rank) for i, lp in d.items()] for d in beside.logprobs] == \
        [[(i, lp.rank) for i, lp in d.items()] for d in alone.logprobs]
    for b, a in zip(beside.logprobs, alone.logprobs):
        assert [lp.logprob for lp in b.values()] == pytest.approx([lp.logprob for lp in a.values()], abs=1e-4)
    assert beside.cumulative_logprob == pytest.approx(alone.cumulative_logprob, abs=1e-4)


def test_sample_i_of_a_seeded_request_is_the_request_seeded_seed_plus_i(tmp_path) -> None:
    """vLLM V1 seeds a request's child i with seed + i: n samples of seed s are the completions of
    n requests of n=1 seeded s, s + 1, ... (each of them distinct), whatever the batch."""
    llm = cpu_llm(build_shaped_checkpoint(str(tmp_path), TinyShape()), kvcache_block_size=16, max_model_len=128)
    try:
        prompt = list(range(1, 12))
        params = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
        grouped = llm.generate([prompt], SamplingParams(seed=41, n=3, **params), use_tqdm=False)[0].outputs
        split = llm.generate([prompt] * 3 + [[5, 6, 7]],
                             [SamplingParams(seed=41 + i, **params) for i in range(3)] + [SamplingParams(**params)],
                             use_tqdm=False)
    finally:
        llm.exit()
    assert [c.index for c in grouped] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in grouped}) == 3
    assert [c.token_ids for c in grouped] == [out.outputs[0].token_ids for out in split[:3]]
