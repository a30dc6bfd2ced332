"""Paged KV-cache bookkeeping: a free list, ref counts, and a prefix cache.

Token t of a sequence lives in block block_table[t // block_size] at offset
t % block_size (slot = block_id * block_size + offset):

    tokens   : |0 ......... 255|256 ........ 511|512 .. 600|
    blocks   : [   block 7     ][   block 2     ][ block 9  ]   block_size = 256
    hashes   :  h0 = H(0, ids)   h1 = H(h0, ids)   (partial: none)

A full block's hash chains the previous block's hash with its own token ids, so
equal hashes mean equal prefixes (a hit also compares the token ids); a sequence with a cache_salt
(vLLM's prompt key) chains its first block to the salt's hash, so only sequences of the same salt
share blocks (vLLM V1's isolation of tenants). A block's
hash is published when a step that fills it is scheduled: every layer stores the
step's K/V before it attends, so a request later in the same step, or any later
step, may read it; a block that a later prefill chunk will fill is not published
yet. Freed blocks keep their hash and stay reusable until the free list hands them
out again (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence
from nanovllm.utils.ints import cdiv


def chain_hash(prev_hash: int | None, token_ids: list[int]) -> int:
    h = xxhash.xxh64()
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


def salt_hash(cache_salt: str | None) -> int | None:
    """What a sequence's first block hash chains to: None without a salt, else the salt's hash."""
    if cache_salt is None:
        return None
    return xxhash.xxh64_intdigest(b"cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass"))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: list[int] = []


class BlockManager:
    """Allocates KV blocks to sequences. All operations are O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion-ordered set: O(1) pop of the oldest, O(1) removal of a cache hit.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_prefix_hit_blocks = 0  # running total, for tests and stats

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by sequences (ref count above 0)."""
        return len(self.blocks) - self.num_free_blocks

    @property
    def holds_kv(self) -> bool:
        """Some block's KV may be read again: a sequence holds it, or the prefix cache publishes it."""
        return bool(self.num_used_blocks or self.hash_to_block_id)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _take_free_block(self) -> Block:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash = None
        block.token_ids = []
        block.ref_count = 1
        return block

    def _cached_block(self, h: int, token_ids: list[int]) -> Block | None:
        block_id = self.hash_to_block_id.get(h)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return self.blocks[block_id]

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chained hashes of seq's first `num_blocks` full blocks, cached on the sequence
        (its tokens only ever grow, so computed hashes stay valid, also across preemption)."""
        hashes, bs = seq.block_hashes, self.block_size
        for i in range(len(hashes), num_blocks):
            prev = hashes[-1] if hashes else salt_hash(seq.cache_salt)
            hashes.append(chain_hash(prev, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def _prefix_hits(self, seq: Sequence, use_cache: bool = True) -> list[Block]:
        """Leading full blocks of `seq` whose KV is already cached (none when `use_cache` is off),
        never the block of its last token, which is recomputed for its logits (vLLM's rule): a hit
        there would have the step write that token's K/V again into a block others may be reading.

            len 512, bs 256:  [ block 0: hit ][ block 1: new, recomputed ]   (last token 511)
            len 600, bs 256:  [ hit ][ hit ][ new: 512..599 ]
        """
        hits: list[Block] = []
        if not self.enable_prefix_caching or not use_cache:
            return hits
        bs = self.block_size
        num_full = (len(seq) - 1) // bs  # full blocks before the one holding the last token
        for i, h in enumerate(self._block_hashes(seq, num_full)[:num_full]):
            block = self._cached_block(h, seq.token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence, use_cache: bool = True) -> bool:
        hits = self._prefix_hits(seq, use_cache)
        reusable_free = sum(1 for b in hits if b.ref_count == 0)
        new_blocks = self.blocks_needed(len(seq)) - len(hits)
        return new_blocks + reusable_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, use_cache: bool = True) -> None:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks (unless
        `use_cache` is off: all its tokens are then computed, e.g. for their logprobs).

        Sets seq.num_computed_tokens to the cached prefix length, which never reaches the last
        token (`_prefix_hits`): it is always recomputed to produce logits.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already has blocks")
        hits = self._prefix_hits(seq, use_cache)
        self.num_prefix_hit_blocks += len(hits)
        for block in hits:
            if block.ref_count == 0:
                del self.free_block_ids[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        for _ in range(self.blocks_needed(len(seq)) - len(hits)):
            seq.block_table.append(self._take_free_block().block_id)
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_cached_tokens is None:  # the first allocation's, not a resumed preemption's
            seq.num_cached_tokens = seq.num_computed_tokens

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` (a fresh sequence with parent's tokens) parent's blocks: the full ones
        shared (ref counts), the partial last one copied into a block of its own, as the returned
        (source, destination) block ids for the device to copy (None: no partial block).
        Needs one free block when there is a partial block."""
        if child.block_table:
            raise RuntimeError(f"sequence {child.seq_id} already has blocks")
        num_full = len(parent) // self.block_size
        for block_id in parent.block_table[:num_full]:
            self.blocks[block_id].ref_count += 1
        child.block_table = parent.block_table[:num_full]
        child.num_hashed_blocks = min(parent.num_hashed_blocks, num_full)
        child.block_hashes = list(parent.block_hashes[:num_full])
        if len(parent.block_table) == num_full:
            return None
        copy = self._take_free_block().block_id
        child.block_table.append(copy)
        return parent.block_table[num_full], copy

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks (last block first, so a prefix outlives its tail)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def needs_new_block(self, seq: Sequence, num_tokens: int) -> bool:
        """True if holding `num_tokens` tokens takes one block more than seq's table has
        (len(table) < blocks_needed(num_tokens), without the division: called per row per step)."""
        return len(seq.block_table) * self.block_size < num_tokens

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """True if `seq` can grow to hold `num_tokens` tokens (at most one new block)."""
        return not self.needs_new_block(seq, num_tokens) or self.num_free_blocks >= 1

    def may_append(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to hold `num_tokens` tokens (at most one new block)."""
        if self.needs_new_block(seq, num_tokens):
            seq.block_table.append(self._take_free_block().block_id)

    def publish_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the hashes of the full blocks among seq's first `num_tokens` tokens,
        whose KV the step being scheduled writes (or has written)."""
        bs = self.block_size
        num_full = num_tokens // bs
        if not self.enable_prefix_caching or num_full <= seq.num_hashed_blocks:
            return  # nothing new (block_hashes already holds the first num_hashed_blocks hashes)
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            block.hash = hashes[i]
            block.token_ids = seq.token_ids[i * bs : (i + 1) * bs]
            self.hash_to_block_id[hashes[i]] = block.block_id
        seq.num_hashed_blocks = num_full

    def clear_prefix_cache(self) -> None:
        """Forget every published hash (e.g. the weights changed: cached KV is stale). Blocks
        in use stay allocated; later requests find nothing cached."""
        self.hash_to_block_id.clear()
        for block in self.blocks:
            block.hash = None
            block.token_ids = []

    def reset_prefix_cache(self) -> bool:
        """vLLM's KV cache reset (its BlockPool.reset_prefix_cache): clear_prefix_cache only while
        no block is held by a sequence; whether it did."""
        if self.num_used_blocks:
            return False
        self.clear_prefix_cache()
        return True

    def reset(self) -> None:
        """Free every block and forget every hash: after a failed or interrupted step no
        sequence remains, and the step may have published blocks whose KV it never wrote."""
        self.clear_prefix_cache()
        for block in self.blocks:
            block.ref_count = 0
        self.free_block_ids = OrderedDict.fromkeys(range(len(self.blocks)))
