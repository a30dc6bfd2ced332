"""Logprobs, prompt logprobs and n samples on a CUDA device: bf16 logprobs against transformers'
float32 log_softmax, and a seeded request's tokens on CUDA (float32) equal to the CPU's."""

from __future__ import annotations

import pytest
import torch

from checkpoints import BF16_TOLERANCE, GPU_SHAPE, checkpoint_fixture, cpu_llm, make_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.layers.kernel_path import KernelRoutes
from nanovllm.sampling.row_logprobs import token_logprobs

pytestmark = pytest.mark.gpu

ENGINE = dict(kvcache_block_size=16, max_model_len=1024, num_kvcache_blocks=512, max_num_seqs=16,
              max_num_batched_tokens=256)


ckpt = checkpoint_fixture("lpgpu", GPU_SHAPE)


@torch.no_grad()
def reference_logprobs(path, ids):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").cuda().eval()
    logits = model(torch.tensor([ids], device="cuda")).logits[0].float()  # [len, vocab]
    return torch.log_softmax(logits, dim=-1).cpu(), (logits.amax(-1) - logits.amin(-1)).cpu()


@pytest.mark.parametrize("enforce_eager, logprobs_kernel", [(False, True), (True, True), (False, False)])
def test_bf16_logprobs_and_prompt_logprobs_match_transformers(ckpt, enforce_eager, logprobs_kernel):
    """The Triton logprobs pass, and torch's where KernelRoutes turns it off (bench.py's A/B)."""
    prompt = make_prompts(8, 1, 300, 301)[0]  # longer than the 256-token budget: chunked prompt logprobs
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=4, prompt_logprobs=3, n=2)
    llm = LLM(ckpt, dtype="bfloat16", enforce_eager=enforce_eager,
              kernel_routes=KernelRoutes(logprobs_kernel=logprobs_kernel), **ENGINE)
    try:
        assert (llm.model_runner.sampler.token_logprobs is token_logprobs) != logprobs_kernel
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
    finally:
        llm.exit()
    assert [o["token_ids"] for o in out["outputs"]] == [out["token_ids"]] * 2  # greedy n=2: identical
    tokens = out["token_ids"]
    ref, span = reference_logprobs(ckpt, prompt + tokens)
    for i, (token, entry) in enumerate(zip(tokens, out["logprobs"])):
        row = len(prompt) - 1 + i
        assert token in entry and len(entry) <= 5
        for t, lp in entry.items():
            assert abs(lp - ref[row, t].item()) <= BF16_TOLERANCE * span[row].item(), (i, t)
    plp = out["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        assert prompt[i] in plp[i]
        for t, lp in plp[i].items():
            assert abs(lp - ref[i - 1, t].item()) <= BF16_TOLERANCE * span[i - 1].item(), (i, t)


def test_prompt_logprobs_in_mixed_graph_steps_match_transformers(ckpt):
    """Scoring requests (prompt_logprobs 0 and 5, one token) queued behind generating ones: their
    chunks share prefill graphs' steps with decode rows; every entry within bf16 tolerance of
    transformers' float32 log_softmax, k = 0 entries the scored token alone."""
    from transformers import Qwen3ForCausalLM

    prompts = make_prompts(10, 6, 100, 300)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for _ in range(2)]
    params += [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k) for k in (0, 5, 0, 5)]
    llm = LLM(ckpt, dtype="bfloat16", **ENGINE)
    try:
        assert llm.model_runner.varlen_graphs is not None
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.exit()
    model = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa").cuda().eval()
    for prompt, out, sp in zip(prompts[2:], outs[2:], params[2:]):
        with torch.no_grad():
            logits = model(torch.tensor([prompt], device="cuda")).logits[0].float()  # [len, vocab]
        ref, span = torch.log_softmax(logits, dim=-1).cpu(), (logits.amax(-1) - logits.amin(-1)).cpu()
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for i in range(1, len(prompt)):
            entry = plp[i]
            assert next(iter(entry)) == prompt[i] and len(entry) <= 1 + sp.prompt_logprobs
            for t, lp in entry.items():
                assert abs(lp.logprob - ref[i - 1, t].item()) <= BF16_TOLERANCE * span[i - 1].item(), (i, t)


def test_counts_past_the_kernels_k_and_the_whole_vocabulary_match_transformers(ckpt):
    """LLM(max_logprobs=-1): logprobs 40 / prompt_logprobs 30 (past the Triton pass's MAX_K: torch's
    path on CUDA) and -1 (every token) beside a k = 5 request (the Triton pass) in one batch, with
    graphs; each entry within bf16 tolerance of transformers' float32 log_softmax."""
    from nanovllm.sampling.logprobs_kernel import MAX_K

    prompt = make_prompts(11, 1, 40, 41)[0]
    ks = [(5, 5), (MAX_K + 20, MAX_K + 10), (-1, -1)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=k, prompt_logprobs=p)
              for k, p in ks]
    llm = LLM(ckpt, dtype="bfloat16", max_logprobs=-1, **ENGINE)
    try:
        assert llm.model_runner.sampler.token_logprobs_max_k == MAX_K
        vocab = llm.config.model_config.vocab_size
        outs = llm.generate([prompt] * 3, params, use_tqdm=False)
    finally:
        llm.exit()
    tokens = outs[0]["token_ids"]
    ref, span = reference_logprobs(ckpt, prompt + tokens)
    for out, (k, p) in zip(outs, ks):
        assert out["token_ids"] == tokens
        k, p = (vocab, vocab) if k == -1 else (k, p)
        for i, (token, entry) in enumerate(zip(tokens, out["logprobs"])):
            row = len(prompt) - 1 + i
            assert token in entry and len(entry) in (k, k + 1)
            for t, lp in entry.items():
                assert abs(lp - ref[row, t].item()) <= BF16_TOLERANCE * span[row].item(), (i, t)
        for i in range(1, len(prompt)):
            entry = out["prompt_logprobs"][i]
            assert prompt[i] in entry and len(entry) in (p, p + 1)
            for t, lp in entry.items():
                assert abs(lp - ref[i - 1, t].item()) <= BF16_TOLERANCE * span[i - 1].item(), (i, t)


def test_seeded_request_gives_the_same_tokens_on_cuda_float32_as_on_cpu(ckpt):
    prompts = make_prompts(9, 4, 20, 80)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in range(3)]
    params.append(SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True))
    llm = LLM(ckpt, dtype="float32", **ENGINE)
    try:
        on_cuda = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.exit()
    llm = cpu_llm(ckpt, dtype="float32", **ENGINE)
    try:
        on_cpu = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.exit()
    assert on_cuda == on_cpu
