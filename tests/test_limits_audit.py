"""Lengths and limits at the call: truncate_prompt_tokens against max_model_len."""

from __future__ import annotations

import pytest

from checkpoints import checkpoint_fixture, cpu_llm_fixture
from nanovllm import SamplingParams

ckpt = checkpoint_fixture("limits")
# max_model_len 128 over a cache of 4 blocks of 16 tokens (64): requests are checked against both
llm = cpu_llm_fixture(kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=4)


@pytest.mark.parametrize("length", [10, 300])
def test_truncate_prompt_tokens_above_max_model_len_is_refused(llm, length):
    """vLLM's LLM.generate refuses truncate_prompt_tokens > max_model_len, naming both, whatever the
    prompt's length (it used to serve a short prompt, and blame a long one's truncated length)."""
    sp = SamplingParams(max_tokens=2, truncate_prompt_tokens=129)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=129 .*max_model_len \(128\)"):
        llm.generate([[5] * length], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens=129"):
        llm.add_request([5] * length, sp)
    with pytest.raises(ValueError, match="truncate_prompt_tokens=129"):
        llm.check_params(sp)
    assert llm.is_finished()
    # max_model_len itself, and -1 (vLLM's spelling of it), are taken
    for keep in (128, -1):
        [out] = llm.generate([[5] * 10], SamplingParams(max_tokens=2, truncate_prompt_tokens=keep), use_tqdm=False)
        assert out.prompt_token_ids == [5] * 10

