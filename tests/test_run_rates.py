"""The progress bar's rates: averaged over the run (engine/run_rates.py), from each step's counts."""

from __future__ import annotations

import functools
import io

import pytest
from tqdm.auto import tqdm

from checkpoints import TinyShape, build_checkpoint, cpu_llm, make_prompts
from nanovllm import SamplingParams
from nanovllm.engine.run_rates import RunRates


def test_rates_are_run_averages_not_the_last_steps():
    rates = RunRates(start=10.0)
    rates.add(prompt_tokens=900, output_tokens=4)  # a prefill step ending at t = 11
    rates.add(prompt_tokens=0, output_tokens=4)  # two fast decode steps (the last one's rate: 400 tok/s)
    rates.add(prompt_tokens=0, output_tokens=4)
    assert rates.postfix(now=12.0) == {"in tok/s": "450", "out tok/s": "6"}


def test_steps_count_every_prompt_token_and_kept_token(tmp_path):
    path = build_checkpoint(str(tmp_path / "m"), TinyShape())
    prompts = make_prompts(3, 4, 10, 40)
    llm = cpu_llm(path, kvcache_block_size=16, max_model_len=128, max_num_batched_tokens=32,
                  enable_prefix_caching=False)
    try:
        for p in prompts:
            llm.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        results = []
        while not llm.is_finished():
            results.append(llm.step())
    finally:
        llm.exit()
    assert sum(r.num_prompt_tokens for r in results) == sum(map(len, prompts))
    assert sum(len(r.sampled) for r in results) == 6 * len(prompts)


def test_use_tqdm_takes_a_bar_factory_as_vllm(tmp_path):
    """use_tqdm: True / False, or (vLLM's other form) a callable that makes the bar: its bar counts
    the prompts as they finish."""
    path = build_checkpoint(str(tmp_path / "m"), TinyShape())
    made = []

    def factory(**kwargs):
        made.append(tqdm(file=io.StringIO(), **kwargs))
        return made[-1]

    def vllm_style(total, desc, dynamic_ncols):  # vLLM calls its factory without `disable`
        made.append(tqdm(total=total, desc=desc, dynamic_ncols=dynamic_ncols, file=io.StringIO()))
        return made[-1]

    def failing(**kwargs):
        raise OSError("no terminal")

    llm = cpu_llm(path, kvcache_block_size=16, max_model_len=128)
    try:
        outputs = llm.generate(make_prompts(3, 3, 10, 20), SamplingParams(max_tokens=3), use_tqdm=factory)
        assert len(llm.generate(make_prompts(4, 2, 10, 20), SamplingParams(max_tokens=3), use_tqdm=vllm_style)) == 2
        # a factory that raises leaves nothing queued: the engine serves the next call
        with pytest.raises(OSError, match="no terminal"):
            llm.generate(make_prompts(5, 2, 10, 20), SamplingParams(max_tokens=3), use_tqdm=failing)
        assert llm.is_finished()
        assert len(llm.generate(make_prompts(6, 2, 10, 20), SamplingParams(max_tokens=3), use_tqdm=False)) == 2
        # a partial of tqdm keeps its own `disable`
        quiet = functools.partial(tqdm, disable=True, file=io.StringIO())
        assert len(llm.generate(make_prompts(7, 2, 10, 20), SamplingParams(max_tokens=3), use_tqdm=quiet)) == 2
    finally:
        llm.exit()
    assert len(outputs) == 3 and len(made) == 2
    assert (made[0].n, made[0].total, made[0].desc) == (3, 3, "Processed prompts")
    assert (made[1].n, made[1].total) == (2, 2)
