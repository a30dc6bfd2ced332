"""Seeded random workloads for the scheduling tests (test_scheduling_fuzz.py, test_scheduling_stress.py):
prompt lengths near block boundaries, prompts sharing prefixes with each other, and the block-accounting
invariants checked after every step."""

from __future__ import annotations

import random
from collections import Counter

from checkpoints import TEST_VOCAB_SIZE


def tokens(rng: random.Random, n: int) -> list[int]:
    """n random token ids in [1, TEST_VOCAB_SIZE)."""
    return [rng.randint(1, TEST_VOCAB_SIZE - 1) for _ in range(n)]


def near_boundary(rng: random.Random, bs: int, lo: int, hi: int) -> int:
    """A length in [lo, hi], mostly a multiple of the block size or one off it."""
    k = rng.randint(0, max(1, hi // bs))
    return max(lo, min(hi, k * bs + rng.choice([-1, 0, 1, rng.randint(1 - bs, bs - 1)])))


def random_prompts(rng: random.Random, bs: int, mml: int, base: list[int], count: int) -> list[list[int]]:
    """`count` prompts shorter than `mml`: copies and prefixes of earlier ones, prefixes of `base`
    with random tails, and random ones, their lengths near multiples of the block size `bs`."""
    prompts: list[list[int]] = []
    for _ in range(count):
        kind = rng.random()
        if prompts and kind < 0.2:
            p = list(rng.choice(prompts))  # identical to an earlier prompt
        elif prompts and kind < 0.4:
            src = rng.choice(prompts)  # a prefix of an earlier prompt
            p = src[:near_boundary(rng, bs, 1, len(src))]
        elif kind < 0.8:  # a shared prefix, then a random tail
            p = base[:near_boundary(rng, bs, 1, mml - 8)] + tokens(rng, rng.randint(0, bs))
        else:
            p = tokens(rng, near_boundary(rng, bs, 1, mml - 1))
        prompts.append(p[:mml - 1])
    return prompts


def assert_block_accounting(llm) -> None:
    """Each block's ref count is the number of block tables holding it; the free list is the rest;
    no table holds a block twice; every hash the prefix cache maps names its block; no more
    sequences run than max_num_seqs."""
    sched, bm = llm.scheduler, llm.block_manager
    held = Counter(b for s in [*sched.running, *sched.waiting] for b in s.block_table)
    assert [b.ref_count for b in bm.blocks] == [held[i] for i in range(len(bm.blocks))]
    assert set(bm.free_block_ids) == {i for i in range(len(bm.blocks)) if not held[i]}
    assert all(len(set(s.block_table)) == len(s.block_table) for s in [*sched.running, *sched.waiting])
    assert all(bm.blocks[b].hash == h for h, b in bm.hash_to_block_id.items())
    assert len(sched.running) <= llm.config.max_num_seqs


def abort_one(llm, rng: random.Random, ids: dict, got: dict, aborted: set) -> object | None:
    """Abort a random request of `ids` neither reported (`got`) nor aborted yet, if any (one rng.choice);
    it joins `aborted` unless it finished in the step just read (then a later step reports it).
    Returns the request id aborted, None when none was live."""
    live = [r for r in ids if r not in got and r not in aborted]
    if not live:
        return None
    victim = rng.choice(live)
    if victim in llm.scheduler.requests:  # else it finished in the step just read
        aborted.add(victim)
    llm.abort_request(victim)
    return victim


def record_finished(result, got: dict, aborted: set) -> None:
    """Each request a step finished into `got`, checking none was aborted or reported before."""
    for out in result.finished:
        assert out.request_id not in aborted, "an aborted request was reported"
        assert out.request_id not in got, "a request was reported twice"
        got[out.request_id] = out
