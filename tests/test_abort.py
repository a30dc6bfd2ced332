"""abort_request: pending requests dropped mid-run. Their KV blocks are freed at once, they are never
returned (nor listed in `sampled`) afterwards, and the other requests' tokens are those of a run
without the aborts; under overlap scheduling (a step in flight holding the request), chunked prefill
in mixed steps, preemption and prefix caching."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from checkpoints import checkpoint_fixture, cpu_llm, cpu_llm_fixture, make_prompts
from nanovllm import SamplingParams
from nanovllm.engine.scheduled_batch import StepKind
from nanovllm.engine.sequence import SequenceStatus


ckpt = checkpoint_fixture("abort")
baseline = cpu_llm_fixture(kvcache_block_size=16, max_model_len=256, enable_prefix_caching=False,
                           overlap_scheduling=False)


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


def assert_blocks_match_live_sequences(llm) -> None:
    """Every block's ref count is the number of live (waiting or running) sequences holding it, and
    the free list holds exactly the others: no block leaked, none freed twice."""
    sched, bm = llm.scheduler, llm.block_manager
    holders = Counter(b for s in [*sched.running, *sched.waiting] for b in s.block_table)
    assert [b.ref_count for b in bm.blocks] == [holders[i] for i in range(len(bm.blocks))]
    assert set(bm.free_block_ids) == {i for i in range(len(bm.blocks)) if not holders[i]}


class Run:
    """Drives an engine step by step, recording what each request got and checking that an aborted
    request never shows up again."""

    def __init__(self, llm):
        self.llm = llm
        self.outputs: dict[int, list[int]] = {}
        self.sampled: Counter = Counter()
        self.aborted: set[int] = set()  # requests aborted while pending
        self.aborted_seqs: set[int] = set()  # their samples' sequence ids

    def step(self):
        result = self.llm.step()
        assert not self.aborted & {o.request_id for o in result.finished}
        assert not self.aborted_seqs & set(result.sampled)
        self.outputs.update((o.request_id, o.token_ids) for o in result.finished)
        self.sampled.update(result.sampled)
        assert_blocks_match_live_sequences(self.llm)
        return result

    def abort(self, ids: int | list[int]) -> None:
        requests = self.llm.scheduler.requests  # the pending ones
        pending = {i for i in ([ids] if isinstance(ids, int) else ids) if i in requests}
        self.aborted_seqs |= {s.seq_id for i in pending for s in requests[i].samples}
        self.llm.abort_request(ids)
        self.aborted |= pending
        assert_blocks_match_live_sequences(self.llm)  # freed at once

    def finish(self) -> None:
        while not self.llm.is_finished():
            self.step()
        bm = self.llm.block_manager
        assert bm.num_free_blocks == len(bm.blocks) and all(b.ref_count == 0 for b in bm.blocks)


def test_abort_request_takes_one_id_or_many_and_ignores_unknown_ones(ckpt):
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=128)
    try:
        a, b, c, d = (llm.add_request(p, greedy(6)) for p in make_prompts(0, 4, 5, 30))
        for bad in ("7", 2.5, True, None, [c, "x"]):
            with pytest.raises(TypeError, match=repr(bad if not isinstance(bad, list) else "x")):
                llm.abort_request(bad)
        run = Run(llm)
        llm.abort_request(iter([]))
        run.abort(a)
        run.step()
        run.abort([b, 12345])  # an unknown id is ignored ...
        run.abort(a)  # ... as is one already aborted
        run.step()
        llm.abort_request(np.int64(x) for x in (d,))  # NumPy ids (an id array's items): they were a TypeError
        run.aborted.add(d)
        run.aborted_seqs.add(d)
        run.finish()
        assert run.outputs.keys() == {c} and run.sampled.keys() == {b, c, d}
        llm.abort_request(c)  # finished: ignored
        assert llm.is_finished() and llm.step().finished == []
    finally:
        llm.exit()


def test_abort_in_mixed_steps_while_a_step_holding_the_request_is_in_flight(ckpt, baseline):
    """Overlap scheduling: each step() has queued the next step already. Abort a decoding request
    and one whose prompt is half prefilled (holding blocks), both in that queued step."""
    prompts = make_prompts(1, 3, 20, 30) + make_prompts(2, 2, 90, 100)
    expected = [o["token_ids"] for o in baseline.generate(prompts, greedy(12), use_tqdm=False)]
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256, max_num_batched_tokens=32)
    try:
        ids = [llm.add_request(p, greedy(12)) for p in prompts]
        run = Run(llm)
        chunked = False  # a mixed step ran, and a prompt is half prefilled
        while not chunked:
            assert not llm.is_finished(), "no mixed step left a prompt half prefilled"
            waiting = llm.scheduler.waiting
            chunked = run.step().kind is StepKind.MIXED and bool(waiting) and bool(waiting[0].block_table)
        queued = llm.pipeline.in_flight_batch.seqs
        decoding, prefilling = ids[0], llm.scheduler.waiting[0].request_id
        assert {decoding, prefilling} <= {s.request_id for s in queued}
        free = llm.block_manager.num_free_blocks
        run.abort([decoding, prefilling])
        assert llm.block_manager.num_free_blocks > free
        run.finish()
        kept = [i for i in ids if i not in run.aborted]
        assert run.outputs == {i: expected[ids.index(i)] for i in kept}
        assert all(run.sampled[i] == len(run.outputs[i]) for i in kept)
    finally:
        llm.exit()


def test_abort_a_preempted_request(ckpt, baseline):
    prompts = make_prompts(3, 5, 20, 40)
    expected = [o["token_ids"] for o in baseline.generate(prompts, greedy(40), use_tqdm=False)]
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=9)
    try:
        ids = [llm.add_request(p, greedy(40)) for p in prompts]
        run = Run(llm)
        while not any(len(s.completion_token_ids) for s in llm.scheduler.waiting):
            assert not llm.is_finished(), "nothing was preempted"
            run.step()
        preempted = next(s for s in llm.scheduler.waiting if len(s.completion_token_ids))
        assert preempted.status is SequenceStatus.WAITING and llm.scheduler.num_preemptions > 0
        run.abort([preempted.request_id])
        run.finish()
        kept = [i for i in ids if i != preempted.request_id]
        assert run.outputs == {i: expected[ids.index(i)] for i in kept}
    finally:
        llm.exit()


@settings(max_examples=int(os.environ.get("NANOVLLM_SOAK_EXAMPLES", "8")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), budget=st.sampled_from([16, 48, 300]), slack_blocks=st.integers(0, 2),
       shared_len=st.integers(0, 48), overlap=st.booleans())
def test_random_aborts_leak_no_block(ckpt, baseline, data, budget, slack_blocks, shared_len, overlap):
    """Random aborts (one or several ids, some unknown or finished) at random steps, over shared
    prefixes (prefix-cache hits), n = 1-2 samples, chunked prompts and preemption."""
    num = data.draw(st.integers(2, 5))
    shared = make_prompts(shared_len, 1, shared_len, shared_len + 1)[0]  # a prefix of every prompt
    prompts = [shared + p for p in make_prompts(data.draw(st.integers(0, 2**16)), num, 1, 31)]
    params = [greedy(data.draw(st.integers(1, 12)), n=data.draw(st.integers(1, 2))) for _ in range(num)]
    expected = baseline.generate(prompts, params, use_tqdm=False)
    need = max(-(-(len(p) + sp.max_tokens - 1) // 16) for p, sp in zip(prompts, params))
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256, max_num_batched_tokens=budget,
                  num_kvcache_blocks=need + slack_blocks, max_num_seqs=6, overlap_scheduling=overlap)
    try:
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        # before which steps to abort which ids (one unknown id among the choices)
        aborts = data.draw(st.dictionaries(st.integers(0, 12), st.lists(st.sampled_from(ids + [max(ids) + 1]),
                                                                         min_size=1, max_size=3), max_size=4))
        run = Run(llm)
        step = 0
        while not llm.is_finished():
            if step in aborts:
                in_flight = llm.pipeline.in_flight_batch
                queued = in_flight.seqs if in_flight is not None else []
                if any(s.request_id in aborts[step] for s in queued):
                    event("aborted a request of the step in flight")
                run.abort(aborts[step])
            run.step()
            step += 1
        run.finish()
        # `--hypothesis-show-statistics` shows how often the examples reach each regime
        event(f"preempted: {llm.scheduler.num_preemptions > 0}")
        event(f"prefix-cache hits: {llm.block_manager.num_prefix_hit_blocks > 0}")
        assert run.outputs == {i: expected[k]["token_ids"] for k, i in enumerate(ids) if i not in run.aborted}
    finally:
        llm.exit()


def test_nothing_pending_once_the_last_request_ends_under_overlap(ckpt):
    """Overlap scheduling queues the next step before this one's tokens are read. Once the last
    request is aborted, or finished by a stop token, that queued step holds no request: the engine
    is finished at once, so sleep / update_weights / generate are not refused, and outputs after
    it are a fresh engine's."""
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256)
    try:
        prompt = make_prompts(3, 1, 20, 30)[0]
        free = llm.generate([prompt], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
        request = llm.add_request(prompt, greedy(6))
        llm.step()
        assert llm.pipeline.in_flight_batch is not None  # the next step is queued
        llm.abort_request(request)
        assert llm.is_finished() and llm.pipeline.idle
        llm.sleep(1)
        llm.wake_up()
        # a stop token ends the request at its third token while the fourth step is queued
        stop = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[free[2]])
        request = llm.add_request(prompt, stop)
        finished = []
        while not finished:
            finished = llm.step().finished
        assert finished[0].outputs[0].token_ids == free[: free.index(free[2]) + 1] and llm.is_finished()
        llm.update_weights([])
        assert llm.generate([prompt], greedy(6), use_tqdm=False)[0].outputs[0].token_ids == free
        assert_blocks_match_live_sequences(llm)
    finally:
        llm.exit()
