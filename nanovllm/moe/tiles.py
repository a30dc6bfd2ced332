"""Tilings of the fused MoE's grouped GEMMs (moe/grouped_gemm.py): block heights, the decode,
prefill and W8A8 prefill tilings, and the plan for a call, a function of the token count's size
class only, so an eager step and the CUDA graph replaying it pick the same tiles and round alike."""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton

from nanovllm.kernels.checks import MIN_DOT_DIM, ScaleMode
from nanovllm.utils.ints import next_pow2

from .align import aligned_blocks

# Block heights: tl.dot needs >= 16 rows. A block is one expert's pairs, so the smallest height
# that holds most experts' pairs whole reads each selected expert's weights once per N tile.
BLOCK_MS = (16, 32, 64)
# block_m >= this x the mean pairs per expert (routing is uneven: room for the busier experts).
PAIRS_SLACK = 2
# Grids below this many programs per SM shrink block_n (down to 16) so every SM streams weights.
MIN_PROGRAMS_PER_SM = 2
# Tiles are picked for the token count's size class, the power of two at or above it (at least
# this), not for the count: CUDA graphs replay a step padded to a size in [T, size_class(T)] (every
# power of two >= 16 is a graph size), so an eager step and its replay pick the same tiles and round alike.
SIZE_CLASS_MIN = 16


@dataclass(frozen=True)
class Tiling:
    block_n: int  # output columns per program (GEMM 1: of gate and of up each)
    block_k: int  # reduction columns per step
    num_warps: int
    num_stages: int  # steps whose loads are in flight (3-4 on Hopper)


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # sorted pairs per block
    gate_up: Tiling
    down: Tiling
    # launch order: False, a weight tile's blocks together (decode: the weights are the bytes); True, a block's
    # N tiles together (prefill: its activation rows, re-read by every N tile, stay in L2)
    n_major: bool = False


# Decode (block_m <= 32): memory-bound; 128-column steps (two 128-byte lines per bf16 weight row)
# 3 in flight were the fastest of each GEMM's candidates at T = 64-256 in the H200 sweep
# (benchmarks/kernels/bench_moe.py --sweep; figures in BENCHMARKS.md).
DECODE_GATE_UP = Tiling(block_n=64, block_k=128, num_warps=4, num_stages=3)
DECODE_DOWN = Tiling(block_n=64, block_k=128, num_warps=4, num_stages=3)
# W8A8 decode gate_up with per-channel scales: 256-column steps, so each step reads 256 bytes of an e4m3
# weight row, as DECODE_GATE_UP's 128 columns do of a bf16 one. H200, 30B-A3B experts, the whole
# W8A8 call: 200.9 / 177.0 / 174.7 us at T = 256 / 128 / 64 against 206.4 / 181.2 / 181.2 with
# DECODE_GATE_UP; the 30B-A3B FP8 + FP8 KV decode step at 256 rows 16.108 -> 15.894 ms (BENCHMARKS.md,
# twenty-ninth session; down's steps gained under 1% and stay). Block scales keep DECODE_GATE_UP: a
# W8A8 step must lie in one 128-column activation group.
DECODE_W8A8_GATE_UP = {ScaleMode.CHANNEL: Tiling(block_n=64, block_k=256, num_warps=4, num_stages=3),
                       ScaleMode.BLOCK: DECODE_GATE_UP}
# Prefill (block_m 64): compute-bound, larger output tiles per weight byte; 3 stages fit shared memory.
PREFILL_GATE_UP = Tiling(block_n=128, block_k=64, num_warps=8, num_stages=3)
PREFILL_DOWN = Tiling(block_n=128, block_k=64, num_warps=8, num_stages=3)
# Prefill W8A8 (both GEMMs): 128-column steps (128 bytes of an e4m3 row, as 64 bf16 columns are);
# the fastest of nine tilings at T = 2,048 / 8,192 on the H200 (BENCHMARKS.md, thirteenth session):
# channel 492 / 1,421 us against 531 / 1,588 with PREFILL_*; block (a scale per 128-column step)
# 756 / 2,387 against 1,075 / 3,431.
PREFILL_W8A8 = {ScaleMode.CHANNEL: Tiling(block_n=256, block_k=128, num_warps=8, num_stages=3),
                ScaleMode.BLOCK: Tiling(block_n=64, block_k=128, num_warps=4, num_stages=4)}
# Prefill over many pairs an expert (from WIDE_MIN_PAIRS mean pairs, the size class's), by the experts' scales
# (None: bf16 activations): launched N-major, a block's N tiles together, so its activation rows come from
# HBM once instead of once per N tile; bf16 and per-channel W8A8 also take 128-row blocks (half the K-step
# loads per multiply-add of 64). Each its mode's pick of benchmarks/kernels/moe_prefill_sweep.py (8-12
# candidates, the whole call on Qwen3-30B-A3B's experts; H100, 2026-12-07, its first version, BENCHMARKS.md
# fifty-eighth session), us against the 64-row blocks-fastest tilings above, T = 4,096 / 8,192 / 16,384:
# channel 644.6 / 1,084 / 1,974 against 722.9 / 1,257 / 2,313 (1.12-1.17x; 1.085x at 2,048); block
# 1,033 / 1,849 / 3,431 against 1,182 / 2,168 / 4,140 (1.14-1.21x); bf16 955.3 / - / 2,796 against
# 1,273 / - / 3,991 (1.33 / 1.43x).
WIDE_MIN_PAIRS = 256  # T = 4,096 at 128 experts, top 8: the smallest T every mode was measured to win at
PREFILL_WIDE = {None: MoeTiles(128, Tiling(block_n=128, block_k=64, num_warps=8, num_stages=3),
                               Tiling(block_n=256, block_k=64, num_warps=8, num_stages=3), n_major=True),
                ScaleMode.CHANNEL: MoeTiles(128, Tiling(block_n=128, block_k=128, num_warps=8, num_stages=4),
                                            Tiling(block_n=256, block_k=128, num_warps=8, num_stages=3), n_major=True),
                ScaleMode.BLOCK: MoeTiles(64, PREFILL_W8A8[ScaleMode.BLOCK], PREFILL_W8A8[ScaleMode.BLOCK],
                                          n_major=True)}


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Smallest block height of BLOCK_MS holding PAIRS_SLACK x the mean pairs per expert."""
    want = PAIRS_SLACK * num_pairs / max(1, num_experts)
    return next((m for m in BLOCK_MS if m >= want), BLOCK_MS[-1])


def _fit(t: Tiling, n_out: int, k_in: int, blocks: int, sms: int | None) -> Tiling:
    """t clamped to the problem (tiles >= 16 for tl.dot) and, on a GPU, block_n halved while the
    grid is under MIN_PROGRAMS_PER_SM programs per SM."""
    block_n = max(MIN_DOT_DIM, min(t.block_n, next_pow2(n_out)))
    while (sms is not None and block_n > MIN_DOT_DIM
           and blocks * triton.cdiv(n_out, block_n) < MIN_PROGRAMS_PER_SM * sms):
        block_n //= 2
    return replace(t, block_n=block_n, block_k=max(MIN_DOT_DIM, min(t.block_k, next_pow2(k_in))))


def size_class(num_tokens: int) -> int:
    """The token count tiles are chosen for (see SIZE_CLASS_MIN)."""
    return max(SIZE_CLASS_MIN, next_pow2(num_tokens))


def plan_tiles(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, sms: int | None,
               tiles: MoeTiles | None = None, w8a8: ScaleMode | None = None) -> tuple[MoeTiles, Tiling, Tiling]:
    """(tiles, gate_up tiling, down tiling) for num_tokens tokens (`w8a8`: the experts' scales of a
    W8A8 call): every choice is a function of size_class(num_tokens), never of the count itself.
    `tiles` overrides moe_tiles (benchmarks)."""
    size = size_class(num_tokens)
    if tiles is None:
        tiles = moe_tiles(size * top_k, num_experts, w8a8)
    # block_n shrinks until the class's smallest count fills the GPU (one token: K blocks of one
    # pair each), so every count of the class keeps every SM streaming weights.
    smallest = 1 if size == SIZE_CLASS_MIN else size // 2 + 1
    blocks = aligned_blocks(smallest * top_k, num_experts, tiles.block_m)
    return tiles, _fit(tiles.gate_up, inter, hidden, blocks, sms), _fit(tiles.down, hidden, inter, blocks, sms)


def moe_tiles(num_pairs: int, num_experts: int, w8a8: ScaleMode | None = None) -> MoeTiles:
    """The batch-based choice: block_m_for, then decode or prefill tilings (W8A8: the gate_up decode
    tiling and the prefill tilings by the experts' scales; PREFILL_WIDE from WIDE_MIN_PAIRS an expert)."""
    if num_pairs >= WIDE_MIN_PAIRS * num_experts:
        return PREFILL_WIDE[w8a8]
    block_m = block_m_for(num_pairs, num_experts)
    if block_m <= 32:
        return MoeTiles(block_m, DECODE_GATE_UP if w8a8 is None else DECODE_W8A8_GATE_UP[w8a8], DECODE_DOWN)
    # Prefill below WIDE_MIN_PAIRS: 64-row blocks, launched N-major as PREFILL_WIDE. moe_prefill_sweep at T = 1,024 /
    # 2,048 (H100), each mode's best 64-row tiling N-major against the blocks-fastest baseline: bf16 (the baseline's
    # tiling) 1.107x / 1.185x, per-channel 1.105x / 1.121x, block 1.053x / 1.035x.
    # Qwen3-30B-A3B time to first token at 512 / 1,000 / 2,000 tokens (H100): bf16 27.61 / 33.61 / 52.33 -> 26.38 /
    # 31.13 / 46.78 ms (-4.5 / -7.4 / -10.6%), online FP8 17.78 / 22.22 / 33.88 -> 17.47 / 21.45 / 32.27 ms (-1.7 /
    # -3.5 / -4.8%) (BENCHMARKS.md, fifty-ninth session).
    if w8a8 is not None:
        return MoeTiles(block_m, PREFILL_W8A8[w8a8], PREFILL_W8A8[w8a8], n_major=True)
    return MoeTiles(block_m, PREFILL_GATE_UP, PREFILL_DOWN, n_major=True)
