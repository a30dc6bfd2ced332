"""How a decode-attention call (kernels/decode_attention.py) is planned on the host, from shapes
only (so a CUDA graph can capture the launch): its key tile (keys per inner step, steps in flight),
its split count, and whether the splits merge inside the kernel. The tuned numbers were measured on
an H200: BENCHMARKS.md, "Tuning notes moved from kernel docstrings" (`kernels/decode_plan.py`).
"""

from dataclasses import dataclass

import torch

from nanovllm.utils.ints import cdiv, next_pow2
from nanovllm.utils.validation import check_pow2

from .checks import MIN_DOT_DIM

# Keys per inner step: 64 x D=128 x 2 bytes = 16 KB per K or V tile, enough bytes in flight.
BLOCK_N = 64
# Aim for this many stage-1 programs per SM: ~2 fit at once (96 KB smem each), so 16
# gives ~8 waves and a small tail (measured: BENCHMARKS.md, "Tuning notes moved from kernel docstrings").
PROGRAMS_PER_SM = 16
# From this many (sequence, kv head) programs per SM, one split is best (measured: same section).
NO_SPLIT_PROGRAMS_PER_SM = 3
# A split shorter than this costs more in partial writes/merging than it saves.
MIN_TOKENS_PER_SPLIT = 256
# Upper bound on splits (also sizes the merge kernel's tile).
MAX_SPLITS = 128
# The last split of a (sequence, kv head) merges its group's partials itself when the
# [group, splits, head_dim] fp32 tile has at most this many elements (64 registers per thread
# at 4 warps); larger merges run as the separate merge kernel.
FOLD_MAX_ELEMS = 8192
# Arrival counters, one int32 per (sequence, kv head), allocated once per device and left at 0
# by every call (the merging program resets its own). Batches needing more use the merge kernel.
NUM_COUNTERS = 4096
# Loads in flight: with the block ids fetched a tile ahead (kernels/paging.py), stages - 1 K/V
# tiles are buffered. The decode kernel's time did not move when they were (sixteenth session): at
# 16-bit it runs near copy bandwidth.
NUM_STAGES = 3
# An unsplit grid of fewer (sequence, kv head) programs per SM than this streams 128-key tiles
# at 2 stages (16-bit caches, head_dim <= 128): engine-like batches of 64 / 96 rows x 8 kv heads
# (3.9 / 5.8 programs per SM) ran at 84-99% of copy bandwidth instead of 65-87%, while 128 rows
# (7.8 per SM) and more lose ~1% (bench_kernels.py --sweep-decode-engine at f1ce559, H200, 2026-12-02).
WIDE_TILE_PROGRAMS_PER_SM = 7
WIDE_BLOCK_N = 128
WIDE_STAGES = 2
# An FP8 cache's tile (kernels/decode_fp8.py): 128 keys are 16 KB of K or V words, as 64 keys of a
# 16-bit cache. At 3 stages it was the fastest of 32-128 keys x 2-4 stages at every engine-like
# batch measured, 80-88% of copy bandwidth at 256 rows (BENCHMARKS.md, seventeenth session).
FP8_BLOCK_N = 128
FP8_STAGES = 3
# An FP8 cache is read in four planes of head_dim / 4 columns (kernels/decode_fp8.py): 16 at head_dim 64,
# tl.dot's least, where the kernel ran at 30% of copy bandwidth on its bytes, slower than a bf16 cache.
# A program then takes adjacent kv heads side by side until its key rows are this many values wide
# (heads_per_program): 1.7-2.4x faster at Qwen2.5-0.5B's and Llama-3.2-1B's heads (14 / 2 and 32 / 8 of 64)
# over 128-256 rows of engine-like lengths; bench.py with an FP8 cache 1.06-1.10x (0.5B) and 1.25x (1B) (H100:
# BENCHMARKS.md, fifty-fifth and fifty-sixth sessions). FP8 at head_dim 128, and 16-bit caches, ran slower
# two heads a program (by 2-57%, fifty-fourth session; a 16-bit cache at 32 / 8 of 64 0.97-1.04x, fifty-sixth):
# one each.
FP8_PACKED_ROW_VALUES = 128


@dataclass(frozen=True)
class DecodeTile:
    """Keys per inner step and pipeline stages (stages - 1 tiles buffered); a call's `tile` argument
    overrides the shape-based choice, `decode_tile` (benchmarks)."""

    block_n: int
    stages: int

    def __post_init__(self) -> None:
        check_pow2("DecodeTile.block_n", self.block_n, MIN_DOT_DIM)
        if not (isinstance(self.stages, int) and 1 <= self.stages <= 8):
            raise ValueError(f"DecodeTile.stages must be an int in [1, 8], got {self.stages!r}")


def decode_tile(q_dtype: torch.dtype, head_dim: int, unsplit_fixed_rows: bool, pairs_per_sm: float,
                fp8: bool) -> DecodeTile:
    """The tile of a call: BLOCK_N keys at NUM_STAGES stages; an FP8 cache's FP8_BLOCK_N x FP8_STAGES; fp32 /
    head_dim 256 tiles are 2x larger, so fewer stages keep shared memory in bounds; an unsplit call
    over host-known rows (`unsplit_fixed_rows`) with fewer than WIDE_TILE_PROGRAMS_PER_SM (sequence,
    kv head) pairs per SM streams wide tiles."""
    if fp8:
        return DecodeTile(FP8_BLOCK_N, FP8_STAGES)
    if q_dtype == torch.float32 or head_dim > 128:
        return DecodeTile(BLOCK_N, 2)
    if unsplit_fixed_rows and pairs_per_sm < WIDE_TILE_PROGRAMS_PER_SM:
        return DecodeTile(WIDE_BLOCK_N, WIDE_STAGES)
    return DecodeTile(BLOCK_N, NUM_STAGES)


def can_fold_merge(num_splits: int, group: int, head_dim: int, pairs: int) -> bool:
    """Whether the last split of each (sequence, kv head) can merge the partials itself (no merge
    kernel): more than one split, a [group, splits, head_dim] tile of at most FOLD_MAX_ELEMS
    (both padded to powers of two) and an arrival counter for each of the `pairs` programs."""
    return (num_splits > 1 and next_pow2(group) * next_pow2(num_splits) * head_dim <= FOLD_MAX_ELEMS
            and pairs <= NUM_COUNTERS)


def heads_per_program(fp8: bool, head_dim: int, num_kv_heads: int) -> int:
    """KV heads one decode program reads side by side (a power of two dividing num_kv_heads): an FP8
    cache's narrow heads are packed up to FP8_PACKED_ROW_VALUES values a key; otherwise 1. The kernel and
    the host's row groups (engine/model_runner.py) both ask here."""
    heads = 1
    while fp8 and heads * head_dim < FP8_PACKED_ROW_VALUES and num_kv_heads % (2 * heads) == 0:
        heads *= 2
    return heads


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, sm_count: int) -> int:
    """Host-only split count: enough programs to fill the GPU, none shorter than MIN_TOKENS_PER_SPLIT.
    A batch that fills the GPU by itself is not split (no partials, no merge pass)."""
    if batch * num_kv_heads >= NO_SPLIT_PROGRAMS_PER_SM * sm_count:
        return 1
    want = cdiv(sm_count * PROGRAMS_PER_SM, max(1, batch * num_kv_heads))
    cap = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, MAX_SPLITS))
