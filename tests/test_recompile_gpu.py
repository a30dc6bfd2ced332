"""Once every kind of request has run once, steps of new sizes compile no Triton kernel.

Triton compiles a kernel variant per 16-byte alignment of each pointer argument and per
specialised integer (== 1, divisible by 16), so a value first met mid-run costs a compile:
~0.4 s on an empty Triton cache, as a fresh machine has (the Gumbel kernel did, through
step-dependent offsets of the sampling values in the step's input copy). Sizes change
per step: batch sizes (decode graphs, sampling rows), prompt lengths and sequence counts (graph
buckets), prompt-logprob steps (eager at their exact size)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch

from checkpoints import GPU_KV_TOKENS, GPU_MAX_NUM_SEQS, GPU_MAX_STEP_TOKENS, GPU_SHAPE, checkpoint_fixture, make_prompts
from nanovllm import SamplingParams

pytestmark = pytest.mark.gpu

SHAPE = dataclasses.replace(GPU_SHAPE, num_hidden_layers=2)
# One of each sampling path: greedy, plain, top-p, top-k with min-p, logprobs, prompt logprobs.
PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=20, min_p=0.05, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.8, logprobs=3, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0, prompt_logprobs=2, max_tokens=4, ignore_eos=True)]


@contextlib.contextmanager
def compiles() -> Iterator[list[str]]:
    """The kernels Triton compiles (or loads from its disk cache) in this process meanwhile."""
    import triton

    seen: list[str] = []
    previous = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["repr"][:300])
    try:
        yield seen
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous


ckpt = checkpoint_fixture("recompile", SHAPE)


def test_steps_of_new_sizes_compile_nothing(ckpt):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from nanovllm import LLM

    llm = LLM(ckpt, kvcache_block_size=16, max_model_len=2048, dtype="bfloat16", max_num_seqs=GPU_MAX_NUM_SEQS,
              max_num_batched_tokens=GPU_MAX_STEP_TOKENS, num_kvcache_blocks=GPU_KV_TOKENS // 16)
    try:
        # one request of each kind together, then batches of other sizes (odd and even: the
        # alignments that used to differ) and prompt lengths
        llm.generate(make_prompts(0, len(PARAMS), 30, 31), PARAMS, use_tqdm=False)
        with compiles() as seen:
            for seed, (n, lo, hi) in enumerate([(1, 5, 6), (3, 17, 90), (7, 100, 300), (12, 1, 40), (5, 333, 334)]):
                params = [PARAMS[(seed + i) % len(PARAMS)] for i in range(n)]
                outs = llm.generate(make_prompts(seed + 1, n, lo, hi), params, use_tqdm=False)
                assert [len(o["token_ids"]) for o in outs] == [p.max_tokens for p in params]
    finally:
        llm.exit()
    assert seen == [], f"{len(seen)} kernels compiled after every kind of request ran once: {seen}"
