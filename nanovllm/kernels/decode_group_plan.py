"""Which decode rows attend as a group sharing a prompt prefix (kernels/decode_groups.py), decided on
the host each decode step, without Triton (the engine imports it where Triton may be absent).

`group_rows`: consecutive rows whose block tables start with the same full blocks form a group, led by
its first row (block size 256, two samples of a 600-token prompt at 650 tokens):

    row b:    [ blk 7 ][ blk 2 ][ blk 9: 88 prompt + 50 own tokens ]     shared[b] = 512, members[b] = 2
    row b+1:  [ blk 7 ][ blk 2 ][ blk 4: its own copy, 138 tokens  ]     members[b+1] = 0

In general:

    members[b] = k > 0, shared[b] = s:  rows b .. b+k-1 hold the same blocks for keys [0, s), s a multiple
                                        of block_size below every member's length; rows b+1 .. b+k-1 have
                                        members 0, shared 0 (their leader attends for them)
    members[b] = 1, shared[b] = 0:      a row on its own

A group holds at most `max_group_rows` rows (the tile's rows over the query heads a program takes per
row: the GQA group times the kv heads it reads side by side), and fewer when the
step's groups alone would leave SMs idle (`GroupLimits.cap`). Groups are a hint: a call that splits its
sequences (small batches) ignores them and attends each row by itself, with the same result.
"""

from dataclasses import dataclass

import numpy as np

from nanovllm.utils.ints import next_pow2

from .checks import MIN_DOT_DIM
from .decode_plan import NO_SPLIT_PROGRAMS_PER_SM


def query_tile_height(gqa_group: int) -> int:
    """Rows of a decode program's query tile (kernels/decode_attention.py): the GQA group's query heads,
    padded to a power of two and to at least MIN_DOT_DIM (tl.dot's least size; Qwen3's groups are 2-8)."""
    return max(MIN_DOT_DIM, next_pow2(gqa_group))


def max_group_rows(gqa_group: int) -> int:
    """Rows one program attends for: its query tile's rows over the query heads a row puts in it."""
    return query_tile_height(gqa_group) // gqa_group


@dataclass(frozen=True)
class GroupLimits:
    """What bounds a step's groups: the model's GQA group and kv heads (this rank's), the GPU's SMs, and
    the kv heads one decode program reads side by side (decode_plan.heads_per_program)."""

    gqa_group: int
    num_kv_heads: int
    sm_count: int
    heads_per_program: int = 1

    def __post_init__(self) -> None:
        for name in ("gqa_group", "num_kv_heads", "sm_count", "heads_per_program"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GroupLimits.{name} must be an int >= 1, got {value!r}")

    def cap(self, num_rows: int) -> int:
        """Most rows in a group this step: max_group_rows, and few enough that the step keeps
        NO_SPLIT_PROGRAMS_PER_SM programs per SM, as an unsplit call asks (at least 1)."""
        fill = (num_rows * self.num_kv_heads // self.heads_per_program) // (NO_SPLIT_PROGRAMS_PER_SM * self.sm_count)
        return max(1, min(max_group_rows(self.gqa_group * self.heads_per_program), fill))


def group_rows(tables: np.ndarray, context_lens: np.ndarray, block_size: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """(members, shared), int32 [n] each (the module docstring), for n decode rows: tables [n, width]
    their block tables, context_lens [n] their lengths (the current token included, > 0), cap the most
    rows in a group. Only full blocks before each row's last are shared: the current token's block is
    the row's own."""
    n = tables.shape[0]
    members = np.ones(n, dtype=np.int32)
    shared = np.zeros(n, dtype=np.int32)
    if n < 2 or cap < 2:
        return members, shared
    full = (np.asarray(context_lens, dtype=np.int64) - 1) // block_size  # blocks before the current token's
    reach = np.minimum(full[1:], full[:-1])  # [n - 1]: blocks rows i and i+1 could share
    width = int(reach.max())
    if width == 0:
        return members, shared
    same = (tables[1:, :width] == tables[:-1, :width]) & (np.arange(width) < reach[:, None])
    link = np.logical_and.accumulate(same, axis=1).sum(axis=1)  # leading blocks rows i, i+1 share
    if not link.any():
        return members, shared
    link = link.tolist()
    leader = 0
    for i, blocks in enumerate(link):  # row i + 1 joins row i's group if they share as many blocks
        size = i + 1 - leader
        if blocks and size < cap and (size == 1 or blocks == link[leader]):
            continue
        _close(members, shared, leader, size, link[leader] * block_size)
        leader = i + 1
    _close(members, shared, leader, n - leader, link[leader] * block_size if leader < n - 1 else 0)
    return members, shared


def _close(members: np.ndarray, shared: np.ndarray, leader: int, size: int, tokens: int) -> None:
    """Record rows [leader, leader + size) as one group sharing `tokens` keys (a lone row shares none)."""
    if size > 1:
        members[leader] = size
        members[leader + 1 : leader + size] = 0
        shared[leader] = tokens
