"""Overlap scheduling: the decode step after a running one is planned before its tokens exist."""

from __future__ import annotations

import torch

from checkpoints import checkpoint_fixture, cpu_llm, make_prompts, make_sequence
from nanovllm import SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.request import Request
from nanovllm.engine.scheduled_batch import StepKind
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import FinishReason, Sequence
from nanovllm.engine.step_inputs import COL_CONTEXT, COL_INPUT, COL_POSITION, COL_SLOT, StepInputBuilder
from nanovllm.engine.step_plan import StepPlan

BS = 4
EOS = 99


def make_scheduler(num_blocks: int = 8, max_model_len: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=max_model_len, eos_token_ids=frozenset({EOS}))


def add(sched: Scheduler, seq_id: int, prompt_len: int, max_tokens: int) -> Sequence:
    s = make_sequence(seq_id, list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_tokens=max_tokens))
    sched.add(Request(s.request_id, [s]))
    return s


def prefill_then_decode(sched: Scheduler, seqs: list[Sequence]):
    prefill = sched.schedule()
    assert prefill.kind is StepKind.PREFILL
    sched.postprocess(prefill, {s.seq_id: 50 + s.seq_id for s in seqs})
    decode = sched.schedule()
    assert decode.kind is StepKind.DECODE
    assert StepPlan.from_batch(decode).carried_rows == []  # every input is on the host
    return decode


def test_ahead_step_leaves_out_sequences_that_end_by_length():
    sched = make_scheduler()
    a = add(sched, 0, prompt_len=3, max_tokens=10)
    b = add(sched, 1, prompt_len=5, max_tokens=2)  # 1 token after prefill, its 2nd comes from `decode`
    decode = prefill_then_decode(sched, [a, b])
    # a: 4 tokens (3 prompt + 1), one block; `decode` computes position 3, the next step position 4.
    assert len(a.block_table) == 1
    following = sched.schedule(ahead=True)
    assert following is not None and following.kind is StepKind.DECODE and following.seqs == [a]
    assert len(a.block_table) == 2  # room for position 4
    plan = StepPlan.from_batch(following, previous_sampled=decode.seqs)
    assert decode.seqs == [b, a]  # decode batches run longest first
    assert plan.carried_rows == [1] and plan.starts == [4] and plan.token_ids == [0]
    rows = StepInputBuilder(BS, torch.device("cpu"), decode_table_width=16).decode_rows(plan, num_rows=2)
    assert rows[0, COL_INPUT] == 1 and rows[0, COL_POSITION] == 4
    assert rows[0, COL_SLOT] == a.block_table[1] * BS and rows[0, COL_CONTEXT] == 5
    assert rows[1, COL_SLOT] == -1 and rows[1, COL_CONTEXT] == 0  # padding row

    # `decode` ends a by EOS: the carried step's result for a is dropped.
    finished = sched.postprocess(decode, {a.seq_id: EOS, b.seq_id: 7})
    assert {r.request_id for r in finished} == {0, 1}
    assert a.finish_reason is FinishReason.STOP and b.finish_reason is FinishReason.LENGTH
    tokens = list(a.token_ids)
    assert sched.postprocess(following, {a.seq_id: 5}) == []
    assert a.token_ids == tokens
    assert sched.is_finished() and sched.block_manager.num_free_blocks == 8


def test_ahead_step_defers_to_schedule_when_blocks_run_short():
    sched = make_scheduler(num_blocks=3)
    a = add(sched, 0, prompt_len=4, max_tokens=10)
    b = add(sched, 1, prompt_len=3, max_tokens=10)
    prefill_then_decode(sched, [a, b])
    # a (5 tokens) holds 2 blocks, b (4 tokens) 1: the next step needs a new block for b, none free.
    assert sched.block_manager.num_free_blocks == 0
    assert sched.schedule(ahead=True) is None


def test_ahead_step_admits_waiting_requests_beside_carried_rows():
    sched = make_scheduler()
    a = add(sched, 0, prompt_len=4, max_tokens=10)
    decode = prefill_then_decode(sched, [a])
    c = add(sched, 1, prompt_len=6, max_tokens=3)  # arrives while `decode` runs
    following = sched.schedule(ahead=True)
    assert following is not None and following.kind is StepKind.MIXED
    # c's first block holds the same 4 ids as a's: a prefix-cache hit, 2 tokens left to compute
    assert following.seqs == [a, c] and following.num_new_tokens == [1, 2] and following.num_decode == 1
    plan = StepPlan.from_batch(following, previous_sampled=decode.seqs)
    assert plan.carried_rows == [0] and plan.token_ids == [0, 5, 6] and plan.sampled == [True, True]
    assert plan.starts == [5, 4]


def test_a_prompt_is_chunked_across_steps_while_others_decode():
    sched = Scheduler(BlockManager(16, BS), max_num_seqs=8, max_num_batched_tokens=4, max_model_len=64,
                      eos_token_ids=frozenset({EOS}))
    a = add(sched, 0, prompt_len=3, max_tokens=10)
    sched.postprocess(sched.schedule(), {a.seq_id: 7})
    c = add(sched, 1, prompt_len=7, max_tokens=3)
    steps = []
    for _ in range(3):
        batch = sched.schedule()
        steps.append((batch.kind, [s.seq_id for s in batch.seqs], batch.num_new_tokens))
        sched.postprocess(batch, {s.seq_id: 7 for s in batch.seqs if s.num_computed_tokens == len(s)})
    assert steps == [(StepKind.MIXED, [0, 1], [1, 3]), (StepKind.MIXED, [0, 1], [1, 3]),
                     (StepKind.MIXED, [0, 1], [1, 1])]
    assert len(c.completion_token_ids) == 1 and len(a.completion_token_ids) == 4


def test_max_model_len_is_never_overrun_by_an_ahead_step():
    sched = make_scheduler(max_model_len=6)
    a = add(sched, 0, prompt_len=4, max_tokens=100)
    prefill_then_decode(sched, [a])  # a holds 5 tokens; `decode` makes it 6 = max_model_len
    assert sched.schedule(ahead=True) is None


ckpt = checkpoint_fixture("overlap")


def first_new_token_after(tokens: list[int], index: int) -> list[int]:
    """[a token whose first occurrence is at position >= index], or [] if there is none."""
    return next(([t] for i, t in enumerate(tokens) if i >= index and t not in tokens[:i]), [])


def test_overlap_gives_the_same_outputs_with_early_stops(ckpt):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 384, (20 + 7 * i,), generator=g).tolist() for i in range(6)]
    free = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=128, overlap_scheduling=False)
    runs = free.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    free.exit()
    # Stop requests at tokens they really produce, at different steps.
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             stop_token_ids=first_new_token_after(r["token_ids"], 6 + 5 * i))
              for i, r in enumerate(runs)]
    assert sum(bool(sp.stop_token_ids) for sp in params) >= 3
    outs = {}
    for overlap in (False, True):
        llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=128, overlap_scheduling=overlap, num_kvcache_blocks=6)
        outs[overlap] = llm.generate(prompts, params, use_tqdm=False)
        assert llm.scheduler.num_preemptions > 0  # 6 blocks of 16 cannot hold all six at once
        assert llm.block_manager.num_free_blocks == 6
        assert all(b.ref_count == 0 for b in llm.block_manager.blocks)
        llm.exit()
    assert outs[True] == outs[False]
    for r, o, sp in zip(runs, outs[True], params):
        end = r["token_ids"].index(sp.stop_token_ids[0]) + 1 if sp.stop_token_ids else len(r["token_ids"])
        assert o["token_ids"] == r["token_ids"][:end]
        assert o["finish_reason"] == ("stop" if sp.stop_token_ids else "length")


def test_step_wise_api_reports_each_step_once(ckpt):
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=128)
    llm.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    kinds, done = [], []
    while not llm.is_finished():
        r = llm.step()
        kinds.append(r.kind)
        done += r.finished
    # 1 prefill (samples token 1) + 5 decodes, each reported once though they were queued early
    assert kinds == [StepKind.PREFILL] + [StepKind.DECODE] * 5
    assert len(done) == 1 and len(done[0].token_ids) == 6
    llm.exit()


def test_each_steps_preparation_is_reported_once(ckpt):
    """Under overlap a step is prepared (and its time counted) in the call that queues it ahead; the call
    that completes it reports only what it prepared itself: the next step's preparation."""
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=128)
    llm.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    queued_ahead = []
    results = []
    while not llm.is_finished():
        results.append(llm.step())
        ahead = llm.pipeline._in_flight  # the step this call queued ahead (white-box: its own prepare_s)
        queued_ahead.append(ahead.launched.prepare_s if ahead is not None else 0.0)
    llm.exit()
    assert len(results) == 6 and all(r.prepare_s <= r.launch_s for r in results)
    for i, r in enumerate(results[1:], start=1):  # calls 2.. only complete steps queued by the call before
        assert r.prepare_s == queued_ahead[i], i
    assert results[0].prepare_s > queued_ahead[0] > 0.0  # the first call prepares its own step too


def test_sampled_lists_only_the_tokens_that_were_kept(ckpt):
    """A request ended by a stop token at step k was queued for step k + 1 already (overlap): that
    step's token is dropped, and the request is not among its `sampled`."""
    prompts = make_prompts(7, 6, 10, 40)
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=128)
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                             stop_token_ids=first_new_token_after(r["token_ids"], 3 + 4 * i))
              for i, r in enumerate(free)]
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    seen = {i: 0 for i in ids}
    ended: set[int] = set()
    while not llm.is_finished():
        result = llm.step()
        assert not ended & set(result.sampled)
        for i in result.sampled:
            seen[i] += 1
        ended |= {out.request_id for out in result.finished}
    llm.exit()
    assert ended == set(ids)
    stops = [sp.stop_token_ids for sp in params]
    assert sum(map(bool, stops)) >= 3
    # each request is listed once per token it holds
    lengths = [r["token_ids"].index(s[0]) + 1 if s else len(r["token_ids"]) for r, s in zip(free, stops)]
    assert [seen[i] for i in ids] == lengths
