"""The Scheduler's request lifecycle: a request of n samples computes its prompt once (sample
0), the others fork from it (its blocks shared, the partial one copied) or, without room, queue
behind it for the prefix cache; it is reported once all its samples are done; abort_all drops
everything and frees every block. Prompt-logprob positions are booked once."""

from __future__ import annotations

from nanovllm import SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.request import Request, sample_seed
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import SequenceStatus
from nanovllm.engine.step_plan import StepPlan, sampled_positions

BS = 4


def make_scheduler(num_blocks: int = 32, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs=8, max_num_batched_tokens=budget,
                     max_model_len=128, eos_token_ids=frozenset())


def test_samples_fork_from_sample_0_and_the_request_ends_with_its_last_sample():
    sched = make_scheduler()
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + 2 tokens
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=3, stop_token_ids=[8], n=3)
    request = Request.create(0, [0, 1, 2], prompt, params, rules=None, prompt=None, max_tokens=params.max_tokens)
    sched.add(request)
    assert [s.seq_id for s in sched.waiting] == [0]  # sample 0 computes the prompt
    assert [s.seed for s in request.samples] == [5, sample_seed(5, 1), sample_seed(5, 2)]
    assert len({s.seed for s in request.samples}) == 3
    batch = sched.schedule()
    leader, *others = request.samples
    # the others fork as the prompt completes: full blocks shared, the partial one copied
    assert batch.num_new_tokens == [10] and [f.child for f in batch.forks] == others
    assert all(s.block_table[:2] == leader.block_table[:2] for s in others)
    assert all(sched.block_manager.blocks[b].ref_count == 3 for b in leader.block_table[:2])
    copies = [f.block_copy for f in batch.forks]
    assert all(src == leader.block_table[2] for src, _ in copies)
    assert [dst for _, dst in copies] == [s.block_table[2] for s in others] and len({d for _, d in copies}) == 2
    assert all(s.num_computed_tokens == 10 and s.status is SequenceStatus.RUNNING for s in others)
    plan = StepPlan.from_batch(batch)
    assert plan.fork_rows == [0, 0] and plan.block_copies == copies
    assert sampled_positions(plan) == [10, 10, 10]
    done = sched.postprocess(batch, {s.seq_id: 7 for s in request.samples})
    assert done == [] and all(s.completion_token_ids == [7] for s in request.samples)
    batch = sched.schedule()
    # samples 0 and 2 end (stop token 8), sample 1 goes on: the request is not reported yet
    done = sched.postprocess(batch, {0: 8, 1: 7, 2: 8})
    assert done == [] and request.samples[1].status is SequenceStatus.RUNNING
    batch = sched.schedule()
    assert batch.seqs == [request.samples[1]]
    done = sched.postprocess(batch, {1: 9})  # its third token: max_tokens
    assert done == [request] and sched.requests == {} and sched.is_finished()
    assert sched.block_manager.num_free_blocks == 32


def test_samples_queue_behind_sample_0_when_they_cannot_fork():
    sched = Scheduler(BlockManager(32, BS), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
                      eos_token_ids=frozenset())
    request = Request.create(0, [0, 1, 2], list(range(1, 11)), SamplingParams(n=3), rules=None, prompt=None,
                             max_tokens=64)
    sched.add(request)
    batch = sched.schedule()  # 1 running + 2 forks > max_num_seqs 2: sample 1 queues and joins via the cache
    assert batch.forks == [] and [s.seq_id for s in batch.seqs] == [0, 1]
    assert batch.num_new_tokens == [10, 2]  # sample 1 found the 2 full prompt blocks
    assert [s.seq_id for s in sched.waiting] == [2]


def test_abort_all_drops_every_request_and_frees_every_block():
    sched = make_scheduler(budget=6)
    for rid in (0, 3):
        sched.add(Request.create(rid, [rid, rid + 1, rid + 2], list(range(1, 15)), SamplingParams(n=3), rules=None,
                                 prompt=None, max_tokens=64))
    sched.schedule()  # a partial prefill holds blocks
    assert sched.block_manager.num_free_blocks < 32
    sched.abort_all()
    assert sched.requests == {} and sched.is_finished()
    assert sched.block_manager.num_free_blocks == 32
    assert all(b.ref_count == 0 for b in sched.block_manager.blocks)


def test_prompt_logprob_positions_are_booked_once_across_chunks():
    sched = make_scheduler(budget=4)
    request = Request.create(0, [0, 1], list(range(1, 11)), SamplingParams(max_tokens=1, prompt_logprobs=1, n=2),
                             rules=None, prompt=None, max_tokens=1)
    sched.add(request)
    leader, other = request.samples
    assert leader.prompt_logprobs == [None] and other.prompt_logprobs is None  # sample 0 alone scores
    spans, targets = [], []
    while leader.needs_prompt_logprobs or not other.block_table:
        batch = sched.schedule()
        spans += [batch.prompt_logprob_spans.get(i) for i, s in enumerate(batch.seqs) if s is leader]
        targets += StepPlan.from_batch(batch).prompt_logprob_targets
    # chunks of 4 tokens: positions 0-3, 4-7, 8 (position 9's logits sample the first token)
    assert spans == [range(0, 4), range(4, 8), range(8, 9)]
    assert targets == list(range(2, 11))  # each position scores the next prompt token
