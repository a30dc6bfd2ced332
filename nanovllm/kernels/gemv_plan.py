"""How a GEMV call (kernels/gemv.py) is tiled, from shapes only (so CUDA graphs can capture the
launch): weight rows per program, columns per step, steps in flight, eviction. The numbers are the
fastest of benchmarks/kernels/bench_gemm.py sweeps on an H200 (BENCHMARKS.md, "Tuning notes moved
from kernel docstrings", nineteenth and twentieth sessions).

    program p: weight rows [p * block_n, (p + 1) * block_n), K walked in block_k steps, `stages` in flight
    grid:      cdiv(N, block_n) programs; "one wave": all resident at once (kernels/pdl.one_wave)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton

from nanovllm.utils.ints import next_pow2

from .checks import FP8_BLOCK, FP8_PER_WORD, MIN_DOT_DIM

# Accumulator elements per program (M x BLOCK_N x BLOCK_K fp32): 64 registers per thread at 4 warps.
ACC_ELEMS = 8192
# The tilings below are the fastest of benchmarks/kernels/bench_gemm.py --sweep (timings: BENCHMARKS.md,
# "Tuning notes moved from kernel docstrings").
# Weight columns per step (before shrinking for more rows or a short K).
BLOCK_K = 512
# Layers at least this wide take 8-row programs; narrower ones 4 rows, so enough programs share the read.
WIDE_N = 4096


@dataclass(frozen=True)
class Tiling:
    block_n: int  # weight rows per program
    block_k: int  # weight columns per step
    stages: int  # steps whose loads are in flight at once
    evict: str  # eviction policy of the weight loads ("" = the default)


# 8 weight rows x BLOCK_K columns per step, 3 steps in flight.
WIDE_TILING = Tiling(block_n=8, block_k=BLOCK_K, stages=3, evict="")
# Twice the rows per program, half the grid: for wide layers whose 8-row grid needs a second wave.
TALL_TILING = Tiling(block_n=16, block_k=256, stages=4, evict="")
# 4 weight rows per program, 4 steps in flight, weight loads marked evict-first.
NARROW_TILING = Tiling(block_n=4, block_k=BLOCK_K, stages=4, evict="evict_first")
# FP8 weights under 128 x 128 block scales: 128-column steps take one scale each (kernel: BLOCK_K <=
# SCALE_BLOCK) where wider steps gather one per column. Two rows: 16 x 128 x 8; 32 x 128 x 4 on layers
# wide enough to fill a wave with it (8B gate_up), else (one row) TALL_TILING. BENCHMARKS.md, nineteenth
# and twentieth sessions: 8B and 30B layer us at 1 / 2 rows; 30B o (2,048 outputs) 6.47 / 5.73 us against
# 14.13 / 16.25 for the narrow tiling, whose 512-column steps gather a scale per column.
BLOCK_SCALED_TILING = Tiling(block_n=16, block_k=FP8_BLOCK, stages=8, evict="")
BLOCK_SCALED_WIDE = Tiling(block_n=32, block_k=FP8_BLOCK, stages=4, evict="")
# FP8 weights read as words at two rows: 1,024-column steps (8 KB a step, as WIDE_TILING's in bf16).
# H200, 8B shapes at 2 rows, per-row scales (BENCHMARKS.md, twentieth session): o 6.84 us against 9.51
# for WIDE_TILING, down 14.89 against 22.61; at 768+ programs (qkv) TALL_TILING wins (9.37 against
# 11.27), and where 32-row programs fill a wave (gate_up) BLOCK_SCALED_WIDE (28.21, block scales 29.32).
# At one row, where neither the 8-row nor the 16-row grid fits a wave (8B gate_up): 27.33 / 27.11 us
# against WIDE_TILING's 29.19 / 29.08 (twentieth and twenty-first sessions' sweeps); end to end,
# Qwen3-8B --quantization fp8 batch 1 3.050 -> 2.997 ms (-1.7%, two machines: twenty-second session).
FP8_ROWS_WIDE = Tiling(block_n=8, block_k=1024, stages=3, evict="")


def tiling(rows: int, n_out: int, k_in: int, wave: int | None = None, block_scales: bool = False,
           fp8: bool = False) -> Tiling:
    """The tiling for a call: NARROW_TILING below WIDE_N outputs, else WIDE_TILING, or (one row
    only) TALL_TILING where that alone fits the grid into one wave of `wave` programs (None: no
    GPU, no waves). FP8 weights (`fp8`) under 128 x 128 block scales (`block_scales`), any width:
    BLOCK_SCALED_WIDE where its grid fills a wave (8B gate_up), else BLOCK_SCALED_TILING at two rows
    or more and TALL_TILING at one. Under per-row scales, from WIDE_N outputs at two rows or more:
    BLOCK_SCALED_WIDE where it fills a wave, FP8_ROWS_WIDE where its grid fits one wave, else
    TALL_TILING; at one row the plain rule, but FP8_ROWS_WIDE where it would take WIDE_TILING past
    one wave. BLOCK_K shrinks with more rows to keep the accumulator at ACC_ELEMS (in words of
    FP8_PER_WORD columns for FP8), and to K for short rows."""
    fp8 = fp8 or block_scales  # block scales are FP8 weights' only
    t = NARROW_TILING
    fills_wave = wave is not None and n_out >= BLOCK_SCALED_WIDE.block_n * wave
    if block_scales:  # steps inside one block (one scale each), or the tall tiling's 256 columns at one row
        t = BLOCK_SCALED_WIDE if fills_wave else BLOCK_SCALED_TILING if rows > 1 else TALL_TILING
    elif fp8 and rows > 1 and n_out >= WIDE_N:
        one_wave = wave is not None and triton.cdiv(n_out, FP8_ROWS_WIDE.block_n) <= wave
        t = BLOCK_SCALED_WIDE if fills_wave else FP8_ROWS_WIDE if one_wave else TALL_TILING
    elif n_out >= WIDE_N:
        # TALL's [rows, 16, 256] accumulator only pays at one row (2026-12-02 sweep, 2 rows: 0.6B
        # gate_up 8.9 us TALL vs 6.9 WIDE, 8B qkv 19.4 vs 16.6; 30B qkv 8.9 vs 9.2 the exception)
        spills = wave is not None and rows == 1 and triton.cdiv(n_out, WIDE_TILING.block_n) > wave
        if spills and triton.cdiv(n_out, TALL_TILING.block_n) <= wave:
            t = TALL_TILING
        else:  # neither grid fits a wave (8B gate_up): FP8 words take FP8_ROWS_WIDE's 1,024-column steps
            t = FP8_ROWS_WIDE if spills and fp8 else WIDE_TILING
    acc_k = ACC_ELEMS * (FP8_PER_WORD if fp8 else 1) // (next_pow2(rows) * t.block_n)
    return replace(t, block_k=max(MIN_DOT_DIM, min(next_pow2(k_in), t.block_k, acc_k)))
