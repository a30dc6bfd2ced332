"""BlockManager and Scheduler bookkeeping: exact block ids, ref counts, hash reuse."""

from __future__ import annotations

import random

from checkpoints import make_sequence
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.engine.block_manager import BlockManager, chain_hash
from nanovllm.engine.request import Request
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

BS = 16


def seq(seq_id: int, tokens: list[int], max_tokens: int = 8) -> Sequence:
    return make_sequence(seq_id, tokens, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def test_allocate_takes_lowest_free_ids_and_free_returns_them():
    bm = BlockManager(8, BS)
    a = seq(0, list(range(40)))  # 3 blocks
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert a.block_table == [0, 1, 2]
    assert a.num_computed_tokens == 0
    assert [bm.blocks[i].ref_count for i in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 5
    bm.free(a)
    assert bm.num_free_blocks == 8 and a.block_table == []
    # freed blocks go to the back of the free list, last block first
    b = seq(1, list(range(1000, 1080)))  # 5 blocks
    bm.allocate(b)
    assert b.block_table == [3, 4, 5, 6, 7]


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(10, BS)
    prefix = list(range(32))
    a = seq(0, prefix + [900, 901])
    bm.allocate(a)
    bm.publish_full_blocks(a, len(a))  # the prefill of a is scheduled
    h0 = chain_hash(None, prefix[:16])
    assert bm.blocks[0].hash == h0 and bm.blocks[1].hash == chain_hash(h0, prefix[16:])
    b = seq(1, prefix + [902])
    bm.allocate(b)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 32
    assert bm.blocks[0].ref_count == 2 and bm.blocks[1].ref_count == 2
    assert bm.num_prefix_hit_blocks == 2
    bm.free(a)
    bm.free(b)
    assert all(blk.ref_count == 0 for blk in bm.blocks)
    # cached blocks stay reusable after free: a third request hits them
    c = seq(2, prefix + [903, 904])
    bm.allocate(c)
    assert c.block_table[:2] == [0, 1] and c.num_computed_tokens == 32
    assert 0 not in bm.free_block_ids and 1 not in bm.free_block_ids


def test_hash_collision_is_caught_by_token_comparison():
    bm = BlockManager(4, BS)
    a = seq(0, list(range(16)) + [1])
    bm.allocate(a)
    bm.publish_full_blocks(a, len(a))
    # forge: point a different prefix's hash at a's block
    other = list(range(100, 116))
    bm.hash_to_block_id[chain_hash(None, other)] = a.block_table[0]
    b = seq(1, other + [2])
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and b.block_table[0] != a.block_table[0]


def test_fully_cached_prompt_recomputes_its_last_block_in_a_block_of_its_own():
    """vLLM's rule: the block holding the last token (recomputed for its logits) is never a hit,
    so the step never writes K/V into a cached block that another sequence may be reading."""
    bm = BlockManager(4, BS)
    a = seq(0, list(range(32)))
    bm.allocate(a)
    bm.publish_full_blocks(a, 32)
    b = seq(1, list(range(32)))
    bm.allocate(b)
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] not in a.block_table
    assert b.num_computed_tokens == BS
    assert bm.blocks[a.block_table[1]].ref_count == 1


def test_unpublished_blocks_are_not_hit_and_reallocation_drops_hash():
    bm = BlockManager(4, BS)
    a = seq(0, list(range(20)))
    bm.allocate(a)
    bm.publish_full_blocks(a, 10)  # only a partial chunk scheduled: no full block yet

    def computed_on_allocation(seq_id: int) -> int:
        """Tokens a fresh sequence of a's prompt finds cached (its blocks are freed again)."""
        b = seq(seq_id, list(range(20)))
        bm.allocate(b)
        computed = b.num_computed_tokens
        bm.free(b)
        return computed

    assert computed_on_allocation(1) == 0
    bm.publish_full_blocks(a, 20)
    bm.free(a)
    assert computed_on_allocation(2) == BS
    c = seq(3, list(range(500, 564)))  # takes all four blocks, evicting the cached one
    bm.allocate(c)
    assert bm.hash_to_block_id == {}
    bm.free(c)
    assert computed_on_allocation(4) == 0


def test_prefix_caching_off_never_hits():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    a = seq(0, list(range(20)))
    bm.allocate(a)
    bm.publish_full_blocks(a, 20)
    b = seq(1, list(range(20)))
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)


def test_decode_needs_a_new_block_only_at_block_boundaries():
    bm = BlockManager(3, BS)
    a = seq(0, list(range(16)))
    bm.allocate(a)
    assert len(a.block_table) == 1
    a.token_ids.append(7)  # 17 tokens: the 17th needs block 2
    assert bm.needs_new_block(a, len(a)) and bm.can_append(a, len(a))
    bm.may_append(a, len(a))
    assert len(a.block_table) == 2
    a.token_ids.append(8)
    bm.may_append(a, len(a))
    assert len(a.block_table) == 2


def simulate(prompts, max_tokens, num_blocks, max_num_seqs, budget, prefix_caching, rng_seed):
    """Drive the scheduler with fake tokens until every request finishes."""
    bm = BlockManager(num_blocks, BS, prefix_caching)
    sched = Scheduler(bm, max_num_seqs, budget, max_model_len=10_000, eos_token_ids=frozenset())
    seqs = [seq(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    for s in seqs:
        sched.add(Request(s.request_id, [s]))
    rng = random.Random(rng_seed)
    steps = 0
    while not sched.is_finished():
        batch = sched.schedule()
        assert batch.seqs, "a step scheduled nothing while work remained"
        assert batch.num_tokens <= budget
        assert len(batch.seqs) <= max_num_seqs and len({s.seq_id for s in batch.seqs}) == len(batch.seqs)
        assert all(n == 1 for n in batch.num_new_tokens[: batch.num_decode])
        for s, a, n in zip(batch.seqs, batch.starts, batch.num_new_tokens):
            # work is booked at scheduling, and every scheduled token has a slot in the block table
            assert s.num_computed_tokens == a + n and len(s.block_table) * BS >= a + n
        sampled = {s.seq_id: rng.randrange(50) for s in batch.seqs if s.num_computed_tokens == len(s)}
        sched.postprocess(batch, sampled)
        steps += 1
        assert steps < 100_000
    return bm, seqs


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 12),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 200),
    prefix_caching=st.booleans(),
)
def test_random_workloads_free_everything(data, n, max_num_seqs, budget, prefix_caching):
    shared = data.draw(st.lists(st.integers(0, 49), min_size=0, max_size=40))
    prompts = [shared + data.draw(st.lists(st.integers(0, 49), min_size=1, max_size=60)) for _ in range(n)]
    max_tokens = [data.draw(st.integers(1, 40)) for _ in range(n)]
    longest = max(-(-(len(p) + m - 1) // BS) for p, m in zip(prompts, max_tokens))
    num_blocks = data.draw(st.integers(longest, longest + 12))
    bm, seqs = simulate(prompts, max_tokens, num_blocks, max_num_seqs, budget, prefix_caching, 0)
    assert all(s.is_finished and len(s.completion_token_ids) == s.params.max_tokens for s in seqs)
    assert bm.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
