"""Tilings of the skinny GEMM (kernels/skinny_gemm.py): the dataclass a launch takes and the rules
that pick one from the shape and the GPU's SM count, for 16-bit weights, FP8 weights (W8A16) and
e4m3 activations x FP8 weights (W8A8). Each rule's constants come from an H200 sweep (named).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import triton

from nanovllm.utils.ints import prev_pow2

from .checks import FP8_BLOCK, MIN_DOT_DIM


class Operands(Enum):
    """What the skinny GEMM multiplies: each has its own tiling rule."""

    BF16 = "16-bit activations x 16-bit weights"
    W8A16 = "16-bit activations x FP8 weights (converted in registers)"
    W8A8 = "e4m3 activations x FP8 weights (e4m3 MMAs)"


@dataclass(frozen=True)
class SkinnyTiling:
    block_m: int  # output rows per program (>= 16, power of two)
    block_n: int  # output columns per program (>= 16, power of two)
    block_k: int  # reduction columns per step (>= 16, power of two)
    stages: int  # steps whose loads are in flight at once
    num_warps: int
    pdl: bool  # launch early (PDL, when the grid fits one wave) and prefetch the first weight tile into L2
    # programs per output tile, each over a 1/split_k slice of K; the last to finish (an arrival
    # counter) sums the float32 partials in split order (deterministic) and writes the tile
    split_k: int = 1


# The default tiling, from bench_gemm.py --batch-rows --sweep-skinny (f1ce559) (H200, Qwen3-0.6B shapes at
# 16 and 64 rows, BENCHMARKS.md 2026-12-02 fifth session): 32 output columns x 128-column steps,
# 3 in flight, 4 warps, token rows as the MMA's M side; row tiles of 16 up to 16 rows, else 64.
DEFAULT_BLOCK_N = 32
DEFAULT_BLOCK_K = 128
DEFAULT_STAGES = 3
DEFAULT_WARPS = 4
# A grid of fewer output tiles than this many per SM splits K (narrow layers: 0.6B o / down have
# 32 tiles of 32 columns) ...
SPLIT_BELOW_TILES_PER_SM = 0.5
# ... into as many slices as give ~2 programs per SM at 16 rows, ~1 at 64, at most 8, none
# shorter than this many columns.
MIN_SPLIT_COLUMNS = 256
MAX_SPLIT_K = 8
# FP8 weights (W8A16), from bench_gemm.py --fp8-rows (H200, Qwen3-8B's four layers at 4-64 rows, both
# scale layouts; BENCHMARKS.md 2026-12-04 twenty-fourth session): row tiles of 16, 32 past 16 rows;
# 64 output columns x FP8_BLOCK-column steps (one block scale a step); K split into up to 4 slices until
# the grid holds ~4 programs an SM per 16 rows; 4 steps in flight, 6 in unsplit (longer) programs.
FP8_BLOCK_M = 32
FP8_BLOCK_N = 64
FP8_PROGRAMS_PER_SM = 4
FP8_MAX_SPLIT_K = 4
FP8_STAGES = 4
FP8_UNSPLIT_STAGES = 6
# FP8 weights x e4m3 activations (W8A8), from bench_gemm.py --fp8-rows (H200, 8B's four layers at
# 48-256 rows; BENCHMARKS.md 2026-12-04 twenty-fifth session): row tiles of 64 (a wgmma warpgroup's),
# 64 output columns, K split until the grid holds ~2 programs an SM (4 an SM lost 10-15% at 128
# rows); a layer whose 64-column tiles alone pass that, past one row tile (8B gate_up at 96-128
# rows), takes 128 columns 3 steps deep (34-35 against 39-40 us).
W8A8_BLOCK_M = 64
W8A8_PROGRAMS_PER_SM = 2
W8A8_WIDE_BLOCK_N = 128
W8A8_WIDE_STAGES = 3


def skinny_tiling(rows: int, n_out: int, k_in: int, sms: int,
                  operands: Operands = Operands.BF16) -> SkinnyTiling:
    """The default tiling for a rows x K @ K x n_out call of `operands` on a device of `sms` SMs
    (checks.sm_count: a stand-in count under the interpreter)."""
    if operands is Operands.W8A8:
        return _w8a8_tiling(rows, n_out, k_in, sms)
    if operands is Operands.W8A16:
        return _fp8_tiling(rows, n_out, k_in, sms)
    block_m = MIN_DOT_DIM if rows <= MIN_DOT_DIM else 64
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(n_out, DEFAULT_BLOCK_N)
    split = 1
    if tiles < SPLIT_BELOW_TILES_PER_SM * sms:
        per_sm = 2 if rows <= MIN_DOT_DIM else 1
        split = _split_k(per_sm * sms, tiles, k_in, MAX_SPLIT_K)
    return SkinnyTiling(block_m, DEFAULT_BLOCK_N, DEFAULT_BLOCK_K, DEFAULT_STAGES, DEFAULT_WARPS, pdl=True,
                        split_k=split)


def _fp8_tiling(rows: int, n_out: int, k_in: int, sms: int) -> SkinnyTiling:
    """FP8 weights (half the bytes a step): 64 output columns, K split until the grid holds ~4
    programs an SM per 16 rows, 6 steps in flight where K is not split (fewer, longer programs)."""
    block_m = MIN_DOT_DIM if rows <= MIN_DOT_DIM else FP8_BLOCK_M
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(n_out, FP8_BLOCK_N)
    per_sm = FP8_PROGRAMS_PER_SM * triton.cdiv(rows, MIN_DOT_DIM)
    split = _split_k(per_sm * sms, tiles, k_in, FP8_MAX_SPLIT_K)
    stages = FP8_UNSPLIT_STAGES if split == 1 else FP8_STAGES
    return SkinnyTiling(block_m, FP8_BLOCK_N, FP8_BLOCK, stages, DEFAULT_WARPS, pdl=True, split_k=split)


def _split_k(programs: int, tiles: int, k_in: int, most: int) -> int:
    """K slices per output tile: a power of two that brings `tiles` up to ~`programs` programs, at
    most `most`, none shorter than MIN_SPLIT_COLUMNS columns; at least 1."""
    return max(1, min(most, prev_pow2(programs // tiles), prev_pow2(k_in // MIN_SPLIT_COLUMNS)))


def _w8a8_tiling(rows: int, n_out: int, k_in: int, sms: int) -> SkinnyTiling:
    """The W8A8 tiling (W8A8_* constants above)."""
    row_tiles = triton.cdiv(rows, W8A8_BLOCK_M)
    programs = W8A8_PROGRAMS_PER_SM * sms
    tiles = row_tiles * triton.cdiv(n_out, FP8_BLOCK_N)
    if row_tiles > 1 and tiles > programs:
        return SkinnyTiling(W8A8_BLOCK_M, W8A8_WIDE_BLOCK_N, FP8_BLOCK, W8A8_WIDE_STAGES, DEFAULT_WARPS, pdl=True)
    split = _split_k(programs, tiles, k_in, FP8_MAX_SPLIT_K)
    return SkinnyTiling(W8A8_BLOCK_M, FP8_BLOCK_N, FP8_BLOCK, FP8_STAGES, DEFAULT_WARPS, pdl=True, split_k=split)
