"""Loading a model directory as users' checkpoints come: load formats, tokenizer directories,
tensors in several files, unreadable files."""

from __future__ import annotations

import pytest

from checkpoints import checkpoint_fixture, cpu_llm, generate_tokens, make_prompts
from nanovllm import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

ckpt = checkpoint_fixture("loading")


def test_load_format_safetensors_reads_the_checkpoint(ckpt):
    """vLLM's load_format="safetensors" (the checkpoint's *.safetensors files, as "auto" reads them here)
    loads the checkpoint; a format nanovllm cannot read (vLLM's "pt": *.pt files) is refused naming it."""
    prompts = make_prompts(0, 2, 5, 20)
    assert generate_tokens(ckpt, prompts, GREEDY, load_format="safetensors")[0] == generate_tokens(ckpt, prompts, GREEDY)[0]
    with pytest.raises(ValueError, match="load_format must be one of .*got 'pt'"):
        cpu_llm(ckpt, load_format="pt")
