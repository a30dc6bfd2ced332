"""Seeded randomized scheduling and caching: many requests through the step API must each give
exactly what the same request gives alone, and the engine must end holding nothing.

Each seed draws engine settings (16- or 32-token blocks, a KV cache barely larger than the
longest request so sequences are preempted, a token budget that chunks prefills, few running
sequences, prefix caching, overlap scheduling and mixed steps on or off) and a workload (lengths
near block boundaries, shared prefixes, identical prompts, prompts that are prefixes of others,
greedy and seeded sampling with n up to 3, max_tokens up to max_model_len, stop token ids the
request does produce). Requests arrive between steps and some are aborted. Checked: every
finished request's samples (tokens, finish and stop reasons) equal a reference engine's (no
prefix cache, no overlap, a large budget, one request at a time); no aborted request is reported,
none twice, none lost; between steps each block's ref count is the number of block tables holding
it and the free list is exactly the unheld blocks; at the end every block is free and the
scheduler holds nothing. A shortened copy of the fuzzer that ran ~6,700 such cases.
"""

from __future__ import annotations

import random

import pytest

from checkpoints import assert_greedy_matches_reference, checkpoint_fixture, cpu_llm, load_reference
from nanovllm import SamplingParams
from random_workloads import abort_one, assert_block_accounting, random_prompts, record_finished, tokens

SEEDS = range(40)
ckpt = checkpoint_fixture("fuzz")


@pytest.fixture(scope="module")
def reference(ckpt):
    """reference(prompt, kwargs, max_model_len) -> [(token ids, finish reason, stop reason)] of each
    sample, from engines without prefix cache or overlap that run one request at a time (cached)."""
    engines, results = {}, {}

    def run(prompt: list[int], kw: dict, mml: int) -> list[tuple]:
        key = (tuple(prompt), tuple(sorted((k, str(v)) for k, v in kw.items())), mml)
        if key not in results:
            if mml not in engines:
                engines[mml] = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=mml, num_kvcache_blocks=64,
                                       max_num_batched_tokens=4096, enable_prefix_caching=False,
                                       overlap_scheduling=False)
            out = engines[mml].generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]
            results[key] = summarize(out)
        return results[key]

    yield run
    for engine in engines.values():
        engine.exit()


def summarize(out) -> list[tuple]:
    return [(list(c.token_ids), c.finish_reason, c.stop_reason) for c in out.outputs]


def workload(rng: random.Random, bs: int, mml: int, reference) -> tuple[list[list[int]], list[dict]]:
    base = tokens(rng, mml)
    prompts = random_prompts(rng, bs, mml, base, rng.randint(3, 7))
    params = []
    for p in prompts:
        if rng.random() < 0.5:
            kw = dict(temperature=0, n=rng.choice([1, 1, 2]))
        else:
            kw = dict(temperature=rng.choice([0.7, 1.3]), seed=rng.randint(0, 10**6), n=rng.randint(1, 3))
        room = mml - len(p)
        kw["max_tokens"] = rng.choice([1, room, rng.randint(1, min(room, 20))])  # room: fill max_model_len
        kw["ignore_eos"] = rng.random() < 0.5
        toks = reference(p, kw, mml)[0][0]
        if rng.random() < 0.3 and len(toks) > 1:
            kw["stop_token_ids"] = [rng.choice(toks)]  # a token the request does produce
        params.append(kw)
    return prompts, params


@pytest.mark.parametrize("seed", SEEDS)
def test_random_schedules_give_each_request_its_solo_result(ckpt, reference, seed):
    rng = random.Random(seed)
    bs, mml = rng.choice([16, 32]), rng.choice([64, 96])
    prompts, params = workload(rng, bs, mml, reference)
    need = max(-(-(len(p) + kw["max_tokens"] - 1) // bs) for p, kw in zip(prompts, params))
    cfg = dict(kvcache_block_size=bs, max_model_len=mml, num_kvcache_blocks=need + rng.choice([0, 1, 3]),
               max_num_batched_tokens=rng.choice([5, 16, 17, 33, 4096]), max_num_seqs=rng.randint(1, 4),
               enable_prefix_caching=rng.random() < 0.8, overlap_scheduling=rng.random() < 0.5,
               mixed_steps=rng.random() < 0.7)
    llm = cpu_llm(ckpt, **cfg)
    pending, ids, got, aborted = list(range(len(prompts))), {}, {}, set()
    abort_p = rng.choice([0.0, 0.1])
    steps = 0
    try:
        while pending or not llm.is_finished():
            if pending and (not ids or rng.random() < 0.4):
                for i in pending[:rng.randint(1, len(pending))]:
                    ids[llm.add_request(prompts[i], SamplingParams(**params[i]))] = i
                    pending.remove(i)
            if rng.random() < abort_p:
                victim = abort_one(llm, rng, ids, got, aborted)
                if victim is not None:
                    assert victim not in llm.scheduler.requests
                    assert_block_accounting(llm)
            if llm.is_finished():
                continue
            result = llm.step()
            steps += 1
            assert steps < 2000, "no progress"
            record_finished(result, got, aborted)
            assert_block_accounting(llm)
        assert set(got) | aborted == set(ids), "a request was lost"
        for rid, out in got.items():
            i = ids[rid]
            assert summarize(out) == reference(prompts[i], params[i], mml), (seed, cfg, i, params[i])
        bm, sched = llm.block_manager, llm.scheduler
        assert bm.num_free_blocks == len(bm.blocks) and all(b.ref_count == 0 for b in bm.blocks)
        assert not sched.requests and not sched.waiting and not sched.running and not sched._unstarted
    finally:
        llm.exit()


def test_reference_engine_is_transformers_greedy(ckpt, reference):
    """The reference itself is checked: greedy completions are transformers' argmax tokens."""
    hf = load_reference(ckpt)
    for seed in range(3):
        rng = random.Random(seed)
        prompt = tokens(rng, rng.choice([15, 16, 33]))
        toks = reference(prompt, dict(temperature=0, max_tokens=64 - len(prompt), ignore_eos=True), 64)[0][0]
        assert len(toks) == 64 - len(prompt)
        assert_greedy_matches_reference(hf, prompt, toks)
