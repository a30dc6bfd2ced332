"""Decode rows that share a prompt prefix, attended as one group: the prefix's keys are read once
for every member's queries (cascade attention), then each member's own keys.

n samples of one prompt (`SamplingParams(n=8)`, RL's group rollouts, pass@k) share the prompt's full
cache blocks (prefix caching) and decode side by side, at equal lengths. Unsplit decode attention
gives each row's GQA group one program, padded to a 16-row MMA tile (Qwen3-0.6B: 2 query heads per
kv head); a group's program fills the tile with its members' query heads instead:

    tile rows:  | row b: heads 0-1 | row b+1: heads 0-1 | ... | row b+7: heads 0-1 |    (GQA group 2)
    keys:       [ shared prefix: block_table[b][0 : shared / block_size], all rows at once ][ row j's own keys, row j only ]

and merges each row's own part into its prefix part with their log-sum-exps.

Measured (H100, 2026-12-05; BENCHMARKS.md, forty-third session): bench.py --workload rollout (Qwen3-0.6B,
64 prompts x 8 samples) 32,197-32,325 -> 34,182-34,553 tok/s (1.063-1.069x, alternating runs in one call),
the default workload (nothing shared) 0.998x. Alone, replayed on one layer's cache, the kernel gains
less (0.94x the time at 512 rows x 1 generated token, 0.99-1.02x at 128-512 tokens, 1.11x at 256 rows
capped at 5): there per-row programs read most of a shared prefix from L2, which may hold much of that
one layer's prompts between replays, while an engine's step reads another cache every layer (a likely
reason for the difference, not measured). Caps from 1 and 6 programs per SM instead of 3: 1.045x, 1.062x.

Which rows form groups is decided on the host each decode step: kernels/decode_group_plan.py.
"""

import triton
import triton.language as tl

from .decode_attend import attend, store_own


@triton.jit
def decode_group(q_ptr, k_ptr, v_ptr, seqlens_ptr, bt_ptr, out_ptr, members_ptr, shared_ptr, v_scale_ptr,
                 qk_scale, pack, b, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ob,
                 stride_oh, FP8: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr, BLOCK_G: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PREC: tl.constexpr,
                 UPCAST: tl.constexpr):
    """The final output of kv heads [pack * PACK, (pack + 1) * PACK) for the group led by row b (int64;
    nothing for a row another leads): the shared prefix once for every member's query heads, then each
    member's own keys, merged per tile row (a member's PACK * GROUP query heads are adjacent rows).
    k_ptr / v_ptr: the first of these kv heads' cache (FP8: int32 words, k_scale already in qk_scale);
    v_scale_ptr: an FP8 cache's value scale, else None. A group of more members than the tile holds
    (PER_TILE; the host's plan caps groups at it, `decode_group_plan.GroupLimits`) is attended a tile's
    worth of members at a time, each pass reading the prefix again."""
    HEADS: tl.constexpr = PACK * GROUP  # a member's query heads in the tile
    PER_TILE: tl.constexpr = BLOCK_G // HEADS  # members a pass attends (a larger group takes several passes)
    members = tl.load(members_ptr + b)
    shared = tl.load(shared_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    row_head = (offs_g % HEADS) // GROUP  # each tile row's kv head among the PACK read
    heads = pack * HEADS + offs_g % HEADS
    for first in range(0, members, PER_TILE):
        member = first + offs_g // HEADS
        valid = (offs_g < PER_TILE * HEADS) & (member < members)
        rows = b + member  # [BLOCK_G]: the sequence of each tile row
        q_rows = q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh  # [BLOCK_G, 1]
        m_i, l_i, acc = attend(q_rows, valid, row_head, k_ptr, v_ptr, bt_ptr + b * stride_bt, 0, shared, qk_scale,
                               stride_kb, stride_kt, stride_kh, FP8, PACK, BLOCK_G, HEAD_DIM, BLOCK_N, BLOCK_SIZE,
                               DOT_PREC, UPCAST)
        for j in range(first, tl.minimum(first + PER_TILE, members)):
            mine = valid & (member == j)
            row = b + j
            m_j, l_j, acc_j = attend(q_rows, mine, row_head, k_ptr, v_ptr, bt_ptr + row * stride_bt, shared,
                                     tl.load(seqlens_ptr + row), qk_scale, stride_kb, stride_kt, stride_kh, FP8, PACK,
                                     BLOCK_G, HEAD_DIM, BLOCK_N, BLOCK_SIZE, DOT_PREC, UPCAST)
            m_new = tl.maximum(m_i, m_j)
            a = tl.exp2(m_i - m_new)
            c = tl.exp2(m_j - m_new)
            m_i = tl.where(mine, m_new, m_i)
            l_i = tl.where(mine, l_i * a + l_j * c, l_i)
            acc = tl.where(mine[:, None], acc * a[:, None] + acc_j * c[:, None], acc)
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        if v_scale_ptr is not None:
            o = o * tl.load(v_scale_ptr)
        store_own(out_ptr + rows[:, None] * stride_ob + heads[:, None] * stride_oh, o, valid, row_head, PACK,
                  HEAD_DIM)
