"""Mixed steps on CPU: decode rows and prefill chunks share one token budget per step.

Requests arrive while others decode (through the step API), under a token budget that
chunks prompts, a cache small enough to preempt, and shared prefixes the cache hits;
the tokens must be transformers' greedy tokens, and the same with mixed steps off.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import TinyShape, assert_greedy_matches_reference, build_checkpoint, cpu_llm, load_reference
from nanovllm import SamplingParams
from nanovllm.engine.scheduler import StepKind

BUDGET = 24
MAX_SEQS = 4
# Arrival schedule: (step index, number of requests added before that step).
ARRIVALS = [(0, 2), (3, 3), (7, 2), (12, 3)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(str(tmp_path_factory.mktemp("mixed")), TinyShape())


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(5)
    shared = list(range(200, 232))  # two full blocks of 16: later requests hit the prefix cache
    prompts = []
    for i in range(sum(n for _, n in ARRIVALS)):
        tail = torch.randint(1, 384, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist()
        prompts.append(shared + tail if i % 2 else tail)
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * (i % 4), ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


def run_staggered(ckpt: str, **kwargs) -> tuple[dict[int, list[int]], list, object]:
    """Drive the step API with staggered arrivals; returns outputs by prompt index, the steps, the engine."""
    prompts, params = workload()
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256, max_num_batched_tokens=BUDGET,
                  max_num_seqs=MAX_SEQS, **kwargs)
    arrivals = dict(ARRIVALS)
    ids: dict[int, int] = {}  # request id -> prompt index
    outs: dict[int, list[int]] = {}
    steps = []
    step = 0
    while len(ids) < len(prompts) or not llm.is_finished():
        for _ in range(arrivals.get(step, 0)):
            i = len(ids)
            ids[llm.add_request(prompts[i], params[i])] = i
        if not llm.is_finished():
            result = llm.step()
            steps.append(result)
            for out in result.finished:
                outs[ids[out.request_id]] = out.token_ids
        step += 1
    return outs, steps, llm


def test_staggered_arrivals_give_transformers_tokens_with_and_without_mixing(ckpt):
    prompts, params = workload()
    outs, steps, llm = run_staggered(ckpt, num_kvcache_blocks=10)
    kinds = {s.kind for s in steps}
    assert StepKind.MIXED in kinds  # arrivals were prefilled beside running decodes
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_prefix_hit_blocks > 0
    assert all(s.num_tokens <= BUDGET and s.num_seqs <= MAX_SEQS for s in steps)
    assert llm.block_manager.num_free_blocks == 10
    llm.exit()
    reference = load_reference(ckpt)
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        assert len(outs[i]) == sp.max_tokens
        assert_greedy_matches_reference(reference, prompt, outs[i])

    for kwargs in ({"mixed_steps": False}, {"overlap_scheduling": False}, {"mixed_steps": False, "num_kvcache_blocks": 64}):
        other, other_steps, llm = run_staggered(ckpt, **{"num_kvcache_blocks": 10, **kwargs})
        llm.exit()
        assert other == outs, kwargs
        if kwargs.get("mixed_steps") is False:
            assert StepKind.MIXED not in {s.kind for s in other_steps}


def test_each_step_reports_the_requests_that_got_a_token(ckpt):
    _, steps, llm = run_staggered(ckpt)
    llm.exit()
    prompts, params = workload()
    got: dict[int, int] = {}
    for s in steps:
        assert len(set(s.sampled)) == len(s.sampled)
        for rid in s.sampled:
            got[rid] = got.get(rid, 0) + 1
    assert sorted(got.values()) == sorted(sp.max_tokens for sp in params)
