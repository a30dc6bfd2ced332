"""Triton GEMV for decode's few rows, optionally with the MLP's SiLU-and-mul fused in front.

At 1-2 rows a linear layer is a weight read. cuBLAS picks split-K pairs (a GEMM plus a
reduce kernel) or slow kernels for some of Qwen3's shapes, and the MLP's activation is a
kernel of its own; here one kernel streams the weight once, computing its input on the fly:

    out[m, :] = a[m, :] @ weight^T (+ bias)        m < M <= MAX_ROWS, weight [N, K]

    plain:      a = x                                            x [M, K]
    SILU_MUL:   a = round(round(silu(x[:, :K])) * x[:, K:])      x [M, 2K] = gate | up

"round" (to x's dtype) is the rounding the unfused torch path does, so results match
silu_and_mul-then-F.linear up to the order of the float32 sums. Grid: one program per
BLOCK_N weight rows, each walking the whole K in BLOCK_K steps with STAGES loads in flight
(no split-K, no reduce pass):

    program p:  weight[p*BLOCK_N : (p+1)*BLOCK_N, :]   --BLOCK_K columns per step-->
                acc[M, BLOCK_N, BLOCK_K] (fp32) += a[:, None, k:k+BLOCK_K] * w[None, :, k:k+BLOCK_K]
                out[:, p*BLOCK_N ...] = round(sum(acc, axis=2))

Launched with PDL (kernels/pdl.py) only when the whole grid is resident at once (one wave):
its programs then sit on the SMs while the kernel before runs, and each asks L2 for its first
weight tile before waiting, so the read starts at L2 latency. A grid of several waves gains
nothing from the early launch and measured slower with it. Wide layers whose 8-row grid spills
into a second wave take 16-row programs instead. (Measurements: BENCHMARKS.md, "Tuning notes
moved from kernel docstrings".)

Shapes only set the launch, so calls are CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .checks import check_linear, next_pow2
from .fused_activation import silu_mul
from .fused_norm import round_to
from .pdl import LINE_BYTES, one_wave, pdl_for_grid, prefetch_l2, wait_for_prior

# Most rows the kernel serves (its capability, not when it is used: that is decided once, by
# layers/linear.GEMV_MAX_ROWS): past 4 the [M, BLOCK_N, BLOCK_K] accumulator crowds registers.
MAX_ROWS = 4
# Accumulator elements per program (M x BLOCK_N x BLOCK_K fp32): 64 registers per thread at 4 warps.
ACC_ELEMS = 8192
NUM_WARPS = 4
# The tilings below are the fastest of benchmarks/bench_gemm.py --sweep (timings: BENCHMARKS.md,
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


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, n_rows, n_out, k_in, stride_x, stride_w, stride_o,
    SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr, EVICT: tl.constexpr,
    PREFETCH: tl.constexpr, LINE_ELEMS: tl.constexpr, PDL: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < n_out
    w_rows = w_ptr + tl.minimum(rn, n_out - 1)[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1]
    if PREFETCH:  # the first step's weight lines, while the previous kernel finishes
        first_lines = tl.minimum(tl.arange(0, BLOCK_K // LINE_ELEMS) * LINE_ELEMS, k_in - 1)
        prefetch_l2(w_rows + first_lines[None, :])
    wait_for_prior(PDL)
    dtype = out_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < n_rows
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x  # [BLOCK_M, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, k_in, BLOCK_K, num_stages=STAGES):
        kk = k0 + rk
        if EVEN_K:
            a_mask = m_ok[:, None]
            w_mask = n_ok[:, None]
        else:
            a_mask = m_ok[:, None] & (kk < k_in)[None, :]
            w_mask = n_ok[:, None] & (kk < k_in)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        if SILU_MUL:
            gate = tl.load(x_rows + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + k_in + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)
            a = silu_mul(gate, up, dtype).to(tl.float32)
        else:
            a = tl.load(x_rows + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        acc += a[:, None, :] * w[None, :, :]  # w: [BLOCK_N, BLOCK_K]
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_o + rn[None, :]
    tl.store(out, round_to(y, dtype), mask=m_ok[:, None] & n_ok[None, :])


def tiling(rows: int, n_out: int, k_in: int, wave: int | None = None) -> Tiling:
    """The tiling for a call: NARROW_TILING below WIDE_N outputs, else WIDE_TILING, or (one row
    only) TALL_TILING where that alone fits the grid into one wave of `wave` programs (None: no
    GPU, no waves). BLOCK_K shrinks with more rows to keep the accumulator at ACC_ELEMS, and to K
    for short rows."""
    t = NARROW_TILING
    if n_out >= WIDE_N:
        # TALL's [rows, 16, 256] accumulator only pays at one row (2026-12-02 sweep, 2 rows: 0.6B
        # gate_up 8.9 us TALL vs 6.9 WIDE, 8B qkv 19.4 vs 16.6; 30B qkv 8.9 vs 9.2 the exception)
        spills = wave is not None and rows == 1 and triton.cdiv(n_out, WIDE_TILING.block_n) > wave
        t = TALL_TILING if spills and triton.cdiv(n_out, TALL_TILING.block_n) <= wave else WIDE_TILING
    return replace(t, block_k=max(16, min(next_pow2(k_in), t.block_k, ACC_ELEMS // (next_pow2(rows) * t.block_n))))


def _gemv(x, weight, bias, silu_mul: bool, tile: Tiling | None) -> torch.Tensor:
    m, n_out, k_in = check_linear("gemv", x, weight, bias, silu_mul, MAX_ROWS)
    wave = one_wave(x.device)
    if tile is None:
        tile = tiling(m, n_out, k_in, wave)
    elif not isinstance(tile, Tiling):
        raise TypeError(f"tile must be a Tiling, got {type(tile).__name__}")
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    grid = triton.cdiv(n_out, tile.block_n)
    pdl = pdl_for_grid(x, grid)
    line_elems = LINE_BYTES // x.element_size()
    _gemv_kernel[(grid,)](
        x, weight, bias if bias is not None else x, out, m, n_out, k_in, x.stride(0), weight.stride(0),
        out.stride(0),
        SILU_MUL=silu_mul, HAS_BIAS=bias is not None, BLOCK_M=next_pow2(m), BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, EVEN_K=k_in % tile.block_k == 0, STAGES=tile.stages, EVICT=tile.evict,
        PREFETCH=pdl["PDL"] and tile.block_k >= line_elems, LINE_ELEMS=line_elems, num_warps=NUM_WARPS, **pdl,
    )
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tile: Tiling | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) -> [M, N] in x's dtype, like F.linear(x, weight, bias).
    `tile` overrides the shape-based tiling (benchmarks)."""
    return _gemv(x, weight, bias, False, tile)


def silu_mul_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tile: Tiling | None = None) -> torch.Tensor:
    """x [M, 2K] = gate | up -> F.linear(silu(gate) * up, weight, bias): the MLP's down projection."""
    return _gemv(x, weight, bias, True, tile)
