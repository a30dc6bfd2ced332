"""Seeded randomized stress of what test_scheduling_fuzz.py leaves out: cache_salt, stop strings,
sample and prompt logprobs, penalties, min_tokens, bad words, structured outputs, 48- and 64-token
blocks, reset_prefix_cache() between steps, and phases of requests separated by update_weights (to
another checkpoint's weights or back), sleep / wake_up (level 1, tags in either order; level 2 then
update_weights), reset_prefix_cache() or a generate() call.

Checked after every step: each block's ref count is the number of block tables holding it, the free
list is exactly the unheld blocks, every hash the prefix cache maps names its block. Checked per
finished request: its samples (tokens, finish and stop reasons, text) equal a reference engine's
(no prefix cache, no overlap, a large budget, one request at a time, on the weights the engine holds
then), its logprobs are within 2e-3 of the reference's, and its num_cached_tokens is a multiple of
the block size, 0 without prefix caching or with prompt logprobs, and never more than the longest
block-aligned prefix it shares with a request of the same salt added since the cache was last
emptied. After each phase every block is free and nothing is pending. A shortened copy of a stress
that ran ~340 such cases, and ~280 of a harder variant (prompts of max_model_len tokens, n=4, up to
16 requests, caches of exactly the largest request, more aborts), all passing.
"""

from __future__ import annotations

import random

import pytest

from checkpoints import TinyShape, cpu_llm, lazy_checkpoints_fixture, load_reference
from nanovllm import SamplingParams
from nanovllm.sampling_params import StructuredOutputsParams
from random_workloads import abort_one, assert_block_accounting, random_prompts, record_finished, tokens

SEEDS = range(6)
STRUCTURED = [StructuredOutputsParams(regex=r"[a-z]{1,6}-[0-9]{2,4}"),
              StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"])]
checkpoints = lazy_checkpoints_fixture({"stress": TinyShape()})


@pytest.fixture(scope="module")
def states(checkpoints):
    """states(weights_seed) -> the transformers state dict of the checkpoint built with that seed."""
    cache: dict[int, dict] = {}

    def get(seed: int) -> dict:
        if seed not in cache:
            cache[seed] = load_reference(checkpoints("stress", seed)).state_dict()
        return cache[seed]

    return get


@pytest.fixture(scope="module")
def reference(checkpoints):
    """reference(weights_seed, prompt, kwargs, max_model_len) -> ([(token ids, finish reason, stop
    reason, text)] of each sample, [logprobs of each sample], prompt logprobs), cached."""
    engines, results = {}, {}

    def run(wseed: int, prompt: list[int], kw: dict, mml: int):
        key = (wseed, tuple(prompt), tuple(sorted((k, str(v)) for k, v in kw.items())), mml)
        if key not in results:
            if (wseed, mml) not in engines:
                engines[wseed, mml] = cpu_llm(checkpoints("stress", wseed), kvcache_block_size=16, max_model_len=mml,
                                              num_kvcache_blocks=64, max_num_batched_tokens=4096,
                                              enable_prefix_caching=False, overlap_scheduling=False)
            out = engines[wseed, mml].generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]
            results[key] = (summarize(out), *logprobs_of(out))
        return results[key]

    yield run
    for engine in engines.values():
        engine.exit()


def summarize(out) -> list[tuple]:
    return [(list(c.token_ids), c.finish_reason, c.stop_reason, c.text) for c in out.outputs]


def logprobs_of(out) -> tuple[list, list | None]:
    def flat(entries):
        return None if entries is None else [None if d is None else {k: v.logprob for k, v in d.items()}
                                             for d in entries]

    return [flat(c.logprobs) for c in out.outputs], flat(out.prompt_logprobs)


def assert_logprobs_close(got, want, tol: float = 2e-3) -> None:
    """Equal up to float noise; a near-tie may swap which ids a top-k holds, so only shared ids compare."""
    assert (got is None) == (want is None)
    if got is None:
        return
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            shared = set(a) & set(b)
            assert shared and all(abs(a[k] - b[k]) <= tol for k in shared), (a, b)


def workload(rng: random.Random, bs: int, mml: int, wseed: int, base: list[int], reference) -> list[tuple]:
    """[(prompt, cache salt, SamplingParams kwargs)]."""
    prompts = random_prompts(rng, bs, mml, base, rng.randint(3, 10))
    reqs = []
    for p in prompts:
        if rng.random() < 0.5:
            kw = {"temperature": 0, "n": rng.choice([1, 1, 2, 3])}
        else:
            kw = {"temperature": rng.choice([0.7, 1.3]), "seed": rng.randint(0, 10**6), "n": rng.randint(1, 3)}
        kw["max_tokens"] = rng.choice([1, mml - len(p), rng.randint(1, min(mml - len(p), 20))])
        if rng.random() < 0.5:
            kw["ignore_eos"] = True
        if rng.random() < 0.15:
            kw["logprobs"] = rng.choice([0, 2])
        if rng.random() < 0.15:
            kw["prompt_logprobs"] = rng.choice([0, 1])
        if rng.random() < 0.15:
            kw[rng.choice(["repetition_penalty", "presence_penalty", "frequency_penalty"])] = rng.choice([0.5, 1.5])
        if rng.random() < 0.1:
            kw["min_tokens"] = min(rng.randint(1, 4), kw["max_tokens"])
        if rng.random() < 0.1:
            kw["bad_words"] = [" the", "fox jumps"]
        if rng.random() < 0.08:
            kw["structured_outputs"] = rng.choice(STRUCTURED)
            kw.pop("ignore_eos", None)
        toks, _, _, text = reference(wseed, p, kw, mml)[0][0]
        r = rng.random()
        if r < 0.2 and len(toks) > 1:
            kw["stop_token_ids"] = [rng.choice(toks)]  # a token the request does produce
        elif r < 0.4 and len(text) > 3:
            start = rng.randint(0, len(text) - 2)
            kw["stop"] = [text[start:start + rng.randint(1, 3)]]  # a string it does produce
            kw["include_stop_str_in_output"] = rng.random() < 0.3
        reqs.append((p, rng.choice([None, None, None, "a", "b"]), kw))
    return reqs


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def between_phases(llm, rng: random.Random, states, wseed: int) -> tuple[str, int]:
    """One of the calls made between phases; (its name, the weights' seed after it)."""
    action = rng.choice(["none", "update", "sleep1", "sleep2", "reset", "generate"])
    if action == "update":
        wseed = rng.choice([0, 1])
        llm.update_weights(states(wseed).items())
    elif action == "sleep1":
        llm.sleep(1)
        for tags in rng.choice([[None], [["weights"], ["kv_cache"]], [["kv_cache"], ["weights"]]]):
            llm.wake_up(tags)
    elif action == "sleep2":
        llm.sleep(2)
        llm.wake_up()
        wseed = rng.choice([0, 1])
        llm.update_weights(states(wseed).items())
    elif action == "reset":
        assert llm.reset_prefix_cache() is True
    return action, wseed


@pytest.mark.parametrize("seed", SEEDS)
def test_random_phases_give_each_request_its_solo_result(reference, states, checkpoints, seed):
    rng = random.Random(seed)
    bs, mml = rng.choice([16, 16, 32, 48, 64]), rng.choice([64, 96, 128])
    wseed, base = 0, tokens(rng, mml)
    cfg = {"kvcache_block_size": bs, "max_model_len": mml,
           "max_num_batched_tokens": rng.choice([5, 16, 17, 33, 64, 4096]), "max_num_seqs": rng.randint(1, 6),
           "enable_prefix_caching": rng.random() < 0.8, "overlap_scheduling": rng.random() < 0.6,
           "mixed_steps": rng.random() < 0.7}
    first = workload(rng, bs, mml, wseed, base, reference)
    need = max(-(-(len(p) + kw["max_tokens"] - 1) // bs) for p, _, kw in first)
    cfg["num_kvcache_blocks"] = 200 if rng.random() < 0.25 else max(need, -(-mml // bs)) + rng.choice([0, 1, 3])
    llm = cpu_llm(checkpoints("stress", 0), **cfg)
    try:
        pool: list[tuple] = []  # (salt, prompt, token ids of each sample) of requests since the cache was emptied
        for phase in range(rng.randint(1, 3)):
            reqs = first
            if phase:
                action, wseed = between_phases(llm, rng, states, wseed)
                if action != "none":
                    pool = []
                reqs = workload(rng, bs, mml, wseed, base, reference)
                if action == "generate":
                    prompts = [{"prompt_token_ids": p, "cache_salt": s} if s else p for p, s, _ in reqs]
                    outs = llm.generate(prompts, [SamplingParams(**kw) for _, _, kw in reqs], use_tqdm=False)
                    for (p, _, kw), out in zip(reqs, outs):
                        assert summarize(out) == reference(wseed, p, kw, mml)[0], (seed, cfg, p, kw)
                    continue
            reqs = [r for r in reqs if -(-(len(r[0]) + r[2]["max_tokens"] - 1) // bs) <= cfg["num_kvcache_blocks"]]
            pending, ids, got, aborted = list(range(len(reqs))), {}, {}, set()
            abort_p, reset_p = rng.choice([0.0, 0.0, 0.01, 0.03]), rng.choice([0.0, 0.05])
            steps = 0
            while pending or not llm.is_finished():
                if pending and (not ids or rng.random() < 0.4):
                    for i in pending[:rng.randint(1, len(pending))]:
                        p, s, kw = reqs[i]
                        ids[llm.add_request({"prompt_token_ids": p, "cache_salt": s} if s else p,
                                            SamplingParams(**kw))] = i
                        pool.append((s, p, [p + c[0] for c in reference(wseed, p, kw, mml)[0]]))
                        pending.remove(i)
                if rng.random() < abort_p:
                    abort_one(llm, rng, ids, got, aborted)
                if rng.random() < reset_p:
                    used = llm.block_manager.num_used_blocks
                    assert llm.reset_prefix_cache() == (used == 0)
                assert_block_accounting(llm)
                if llm.is_finished():
                    continue
                result = llm.step()
                steps += 1
                assert steps < 3000, "no progress"
                record_finished(result, got, aborted)
                assert_block_accounting(llm)
            assert set(got) | aborted == set(ids), "a request was lost"
            for rid, out in got.items():
                p, s, kw = reqs[ids[rid]]
                want, want_lp, want_plp = reference(wseed, p, kw, mml)
                assert summarize(out) == want, (seed, cfg, phase, p, s, kw)
                got_lp, got_plp = logprobs_of(out)
                for a, b in zip(got_lp, want_lp):
                    assert_logprobs_close(a, b)
                assert_logprobs_close(got_plp, want_plp)
                cached = out.num_cached_tokens
                assert cached % bs == 0 and cached <= (len(p) - 1) // bs * bs
                if not cfg["enable_prefix_caching"] or kw.get("prompt_logprobs") is not None:
                    assert cached == 0
                else:
                    shared = max([common_prefix(p, t) for salt, q, seqs in pool if salt == s and q is not p
                                  for t in seqs], default=0)
                    assert cached <= shared // bs * bs, (cached, shared)
            bm, sched = llm.block_manager, llm.scheduler
            assert bm.num_free_blocks == len(bm.blocks) and all(b.ref_count == 0 for b in bm.blocks)
            assert not sched.requests and not sched.waiting and not sched.running and not sched._unstarted
            assert llm.pipeline.idle
    finally:
        llm.exit()
