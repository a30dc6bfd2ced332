"""Mixed steps on CPU: decode rows and prefill chunks share one token budget per step.

Requests arrive while others decode (through the step API), under a token budget that
chunks prompts, a cache small enough to preempt, and shared prefixes the cache hits;
the tokens must be transformers' greedy tokens, and the same with mixed steps off.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import assert_greedy_matches_reference, checkpoint_fixture, cpu_llm, load_reference, make_sequence
from nanovllm import SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.request import Request
from nanovllm.engine.scheduled_batch import StepKind
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence

BUDGET = 24
MAX_SEQS = 4
# Arrival schedule: (step index, number of requests added before that step).
ARRIVALS = [(0, 2), (3, 3), (7, 2), (12, 3)]


ckpt = checkpoint_fixture("mixed")


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(5)
    shared = list(range(200, 232))  # two full blocks of 16: later requests hit the prefix cache
    prompts = []
    for i in range(sum(n for _, n in ARRIVALS)):
        tail = torch.randint(1, 384, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist()
        prompts.append(shared + tail if i % 2 else tail)
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * (i % 4), ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


def run_staggered(ckpt: str, fill_sizes: tuple[int, ...] = (), **kwargs) -> tuple[dict[int, list[int]], list, object]:
    """Drive the step API with staggered arrivals; returns outputs by prompt index, the steps, the engine.
    `fill_sizes`: step sizes the scheduler trims mixed steps down to (as a GPU runner's graph buckets)."""
    prompts, params = workload()
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256, max_num_batched_tokens=BUDGET,
                  max_num_seqs=MAX_SEQS, **kwargs)
    llm.scheduler.fill_sizes = fill_sizes
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

    # mixed steps trimmed down to fill sizes: other chunks, same tokens
    fill = (6, 12, 18, 24)
    trimmed, trimmed_steps, llm = run_staggered(ckpt, fill_sizes=fill, num_kvcache_blocks=10)
    llm.exit()
    assert trimmed == outs
    # the first step the trimming changed is a mixed step landing on a fill size, below its untrimmed size
    first = next(i for i, (a, b) in enumerate(zip(trimmed_steps, steps)) if a.num_tokens != b.num_tokens)
    assert trimmed_steps[first].kind is StepKind.MIXED
    assert trimmed_steps[first].num_tokens in fill and trimmed_steps[first].num_tokens < steps[first].num_tokens
    assert all(s.num_tokens <= BUDGET and s.num_seqs <= MAX_SEQS for s in trimmed_steps)


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


# ----- trimming a mixed step down to a fill size (the runner's compute-bound graph buckets) -----
FILL_SIZES = (256, 320, 384, 448, 512)


def running_rows(num_rows: int, budget: int = 1024) -> Scheduler:
    """A scheduler with `num_rows` one-token prompts prefilled, so each is a decode row next."""
    sched = Scheduler(BlockManager(1024, 16), max_num_seqs=512, max_num_batched_tokens=budget, max_model_len=4096,
                      eos_token_ids=frozenset(), fill_sizes=FILL_SIZES)
    for i in range(num_rows):
        sched.add(Request(i, [make_sequence(i, [7], SamplingParams(max_tokens=100))]))
    first = sched.schedule()
    assert first.kind is StepKind.PREFILL and first.num_tokens == num_rows  # no decode rows: never trimmed
    sched.postprocess(first, sampled_by(first))
    return sched


def sampled_by(step) -> dict[int, int]:
    """A token for each sequence the step samples for (decode rows, completed prompts)."""
    return {s.seq_id: 1 for s in step.seqs if s.num_computed_tokens == len(s)}


def add_prompt(sched: Scheduler, seq_id: int, length: int) -> Sequence:
    """A prompt of `length` tokens no other prompt shares (no prefix-cache hits)."""
    seq = make_sequence(seq_id, [seq_id * 10_000 + j for j in range(length)], SamplingParams(max_tokens=100))
    sched.add(Request(seq.request_id, [seq]))
    return seq


@pytest.mark.parametrize("rows, prompt, expected_chunks", [
    (40, 240, [216, 24]),  # 280 tokens: 24 above 256, 40 below 320 -> trimmed to 256, 24 deferred
    (40, 250, [250]),      # 290: 34 above 256, 30 below 320 -> padded to 320 in one step
    (40, 280, [280]),      # 320: a fill size itself
    (40, 180, [180]),      # 220: below the smallest fill size (memory-bound: padding is free)
    (40, 500, [500]),      # 540: above the largest size (no graph: the step runs at its own size)
    (250, 30, [30]),       # 280: trimming would keep 6 tokens and defer 24 (a crawl): padded
    (40, 248, [248]),      # 288: 32 above 256 and 32 below 320: a tie pads
    (240, 32, [32]),       # 272: keeping 16 and deferring 16: a tie pads
])
def test_mixed_step_trimmed_to_a_fill_size_when_closer_below(rows, prompt, expected_chunks):
    sched = running_rows(rows)
    seq = add_prompt(sched, 1000, prompt)
    chunks = []
    while seq.num_computed_tokens < prompt:
        step = sched.schedule()
        assert step.num_decode == rows and step.num_tokens <= 1024
        chunks.append(step.num_new_tokens[-1])
        sched.postprocess(step, sampled_by(step))
    assert chunks == expected_chunks


def test_trim_spans_prompts_prompt_logprob_steps_included():
    sched = running_rows(40)
    a, b = add_prompt(sched, 1000, 100), add_prompt(sched, 1001, 140)  # 280 tokens: trimmed to 256
    step = sched.schedule()
    assert step.num_tokens == 256 and step.num_new_tokens[40:] == [100, 116]
    sched.postprocess(step, sampled_by(step))
    assert a.num_computed_tokens == 100 and b.num_computed_tokens == 116

    sched = running_rows(40)
    seq = make_sequence(1000, list(range(1, 241)), SamplingParams(max_tokens=100, prompt_logprobs=1),
                        wants_prompt_logprobs=True)
    sched.add(Request(seq.request_id, [seq]))  # a prompt-logprob step replays a graph too: trimmed alike
    step = sched.schedule()
    assert step.num_new_tokens[40:] == [216] and step.prompt_logprob_spans == {40: range(0, 216)}
    sched.postprocess(step, sampled_by(step))
    step = sched.schedule()  # the rest of the prompt scores the rest of its positions, the last one samples
    assert step.num_new_tokens[-1] == 24 and step.prompt_logprob_spans == {len(step.seqs) - 1: range(216, 239)}


def test_fill_sizes_must_be_increasing_and_positive():
    for bad in ((320, 256), (256, 256), (0, 16)):
        with pytest.raises(ValueError, match="fill_sizes"):
            Scheduler(BlockManager(8, 16), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                      eos_token_ids=frozenset(), fill_sizes=bad)


def test_trimmed_prefill_budget_rule():
    """engine/step_trim's rule on its docstring's example and at its edges."""
    from nanovllm.engine.step_trim import trimmed_prefill_budget

    sizes = (256, 320)
    assert trimmed_prefill_budget(40, 1000, sizes, 240) == 216  # 280 -> the 256 bucket, 24 deferred
    assert trimmed_prefill_budget(40, 1000, sizes, 216) == 1000  # exactly 256: nothing to trim
    assert trimmed_prefill_budget(40, 1000, sizes, 270) == 1000  # 310: deferring 54 > padding 10
    assert trimmed_prefill_budget(250, 1000, sizes, 20) == 1000  # would keep 6, defer 14: no crawl
    assert trimmed_prefill_budget(0, 1000, sizes, 240) == 1000  # no decode rows: never trimmed
    assert trimmed_prefill_budget(40, 1000, (), 240) == 1000  # no buckets
    assert trimmed_prefill_budget(40, 1000, sizes, 100) == 1000  # 140: below the smallest bucket
    assert trimmed_prefill_budget(40, 1000, sizes, 400) == 1000  # 440: above the largest
    assert trimmed_prefill_budget(40, 230, sizes, 400) == 216  # the budget caps the tokens first (270)
