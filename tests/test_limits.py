"""Lengths and limits at the call: truncate_prompt_tokens against max_model_len, and beam searches
whose beams would outgrow a KV cache smaller than max_model_len (refused before any step runs)."""

from __future__ import annotations

import pytest

from checkpoints import checkpoint_fixture, cpu_llm_fixture
from nanovllm import SamplingParams
from nanovllm.beam_search import beam_search
from nanovllm.sampling_params import BeamSearchParams

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


def test_beam_search_whose_beams_outgrow_the_cache_is_refused_before_any_step(llm):
    """A beam grows a token a step: one that would need more KV than the whole cache holds is refused
    at the call, naming the prompt and max_tokens (it used to fail after 5 of its 10 steps,
    naming a prompt of 65 tokens the caller never passed). The search's steps go through the
    `generate` it is given (LLM.beam_search passes LLM.generate): a counting one sees none."""
    steps = []

    def counted_step(batch, step_params):
        steps.append(len(batch))
        return llm.generate(batch, step_params, use_tqdm=False)

    too_long = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prompt 60 \+ max_tokens 10\) but the whole KV cache holds 64"):
        beam_search(llm, counted_step, [{"prompt_token_ids": [5] * 60}], too_long)
    with pytest.raises(ValueError, match=r"prompt 60 \+ max_tokens 10\) but the whole KV cache holds 64"):
        llm.beam_search([{"prompt_token_ids": [5] * 60}], too_long)
    assert steps == [] and llm.is_finished()
    beam_search(llm, counted_step, [{"prompt_token_ids": [5] * 60}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert steps  # the counter does see the steps of a search that runs
    # beams that fit (60 + 5 tokens, the last one's KV never computed) are served to their full length
    [out] = llm.beam_search([{"prompt_token_ids": [5] * 60}], BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
    assert [len(beam.tokens) for beam in out.sequences] == [65, 65]
    assert llm.block_manager.num_free_blocks == 4
