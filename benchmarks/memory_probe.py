"""Checks on CUDA that exit() gives the KV cache, weights and graphs back (memory_allocated)."""

import sys

import torch

sys.path.insert(0, "tests")
from checkpoints import TinyShape, build_checkpoint  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402

path = build_checkpoint("/tmp/probe-ckpt", TinyShape())
for kw in ({"enforce_eager": True}, {}, {"max_model_len": 40}, {"max_num_batched_tokens": 32}):
    llm = LLM(path, kvcache_block_size=16, **kw)
    llm.generate([[3] * 30], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    before = torch.cuda.memory_allocated() / 2**30
    llm.exit()
    print(f"{kw}: allocated before exit {before:.2f} GiB, after {torch.cuda.memory_allocated() / 2**30:.3f} GiB")
