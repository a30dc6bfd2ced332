"""Triton GEMV for decode's few rows, optionally with the MLP's SiLU-and-mul fused in front.

At 1-2 rows a linear layer is a weight read. cuBLAS picks split-K pairs (a GEMM plus a
reduce kernel) or slow kernels for some of Qwen3's shapes, and the MLP's activation is a
kernel of its own; here one kernel streams the weight once, computing its input on the fly:

    out[m, :] = a[m, :] @ weight^T (+ bias)        m < M <= MAX_ROWS, weight [N, K]

    plain:      a = x                                            x [M, K]
    SILU_MUL:   a = round(round(silu(x[:, :K])) * x[:, K:])      x [M, 2K] = gate | up
    NORM:       a = round(s * rsqrt(mean(s^2) + eps) * g)        s = round(x + residual) (or x),
                                                                 g the RMSNorm weight [K]

FP8 weights (`weight_scale`, W_SCALE): weight = e4m3 values x scale, read as int32 words of four
values and converted in registers two an instruction into four planes (kernels/fp8_kv.e4m3_planes:
plane j holds columns 4c + j; a is split into the same planes). Read byte-wise, the tiles came out
of shared memory one byte a load (32 LDS.U8 a thread a step, sm_90 SASS). A scale per row
multiplies each output sum; a scale per 128 x 128 block multiplies a's columns (a program's
BLOCK_N rows lie in one row of blocks, BLOCK_N dividing 128): one scale a step when the step's
BLOCK_K columns lie in one block, else one gathered per column:

    per row:    out[m, n] = s[n] * sum_k a[m, k] w8[n, k]
    per block:  out[m, n] = sum_k (a[m, k] s[n // 128, k // 128]) w8[n, k]

"round" (to x's dtype) is the rounding the unfused torch path does, so results match
silu_and_mul-then-F.linear (or the add + RMSNorm kernel then F.linear) up to the order of the
float32 sums. With NORM each program first loads the whole row(s) s to get rsqrt(mean(s^2)),
then rebuilds each step's normalised columns from x (and residual) as it goes; program 0 also
stores s, the residual stream the next layer adds to. Grid: one program per
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

Measured end to end (H200, bench.py --latency): the GEMV with its SiLU-and-mul prologue took batch-1
decode from 1.333 to 1.081 ms per token on 0.6B and 5.103 to 4.605 on 8B (2c43c71, "Throughput and
latency history"); the RMSNorm prologue at one row 0.978 -> 0.942 ms on 0.6B (-3.7%; d44b36e,
"Session of 2026-12-02 (fifth)"). Kept: both >= 3% on batch-1 latency. Under block scales (Qwen's FP8
releases), the one-scale steps and BLOCK_SCALED tilings took Qwen3-8B from 7.080 / 7.865 to 4.288 /
4.603 ms per token at batch 1 / 2 (BENCHMARKS.md, nineteenth session). The word reads and the FP8
tilings at two rows: Qwen3-8B `--quantization fp8` 3.482 / 3.946 -> 3.069 / 3.245 ms, its block layout
4.316 / 4.600 -> 4.210 / 4.306; the narrow block-scaled layers' tilings with them, Qwen3-30B-A3B's
block layout 3.427 / 3.950 -> 2.848 / 2.998 (BENCHMARKS.md, twentieth session).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.utils.ints import next_pow2

from .checks import (FP8_BLOCK, ScaleMode, check_eps, check_linear, check_matrix, check_vector, fp8_words,
                     linear_scale_mode)
from .fp8_kv import PER_WORD, e4m3_planes, split_planes
from .fused_activation import silu_mul
from .fused_norm import round_to
from .gemv_plan import Tiling, tiling
from .pdl import LINE_BYTES, one_wave, pdl_for_grid, prefetch_rows_l2, wait_for_prior

# Most rows the kernel serves (its capability, not when it is used: that is decided once, by
# layers/kernel_path.KernelRoutes.gemv_max_rows): past 4 the [M, BLOCK_N, BLOCK_K] accumulator crowds registers.
MAX_ROWS = 4
# Most elements the NORM prologue loads whole (rows x K, each a power of two): 8192 fp32 are 64
# registers a thread at 4 warps, held only before the main loop (e.g. 2 rows of K = 4096).
MAX_NORM_ELEMS = 8192
NUM_WARPS = 4


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, n_rows, n_out, k_in, stride_x, stride_w, stride_o,
    SILU_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr, EVICT: tl.constexpr,
    PREFETCH: tl.constexpr, LINE_ELEMS: tl.constexpr, PDL: tl.constexpr,
    res_ptr, norm_w_ptr, s_out_ptr, stride_r, eps,
    NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_KF: tl.constexpr,
    ws_ptr, stride_ws, W_SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < n_out
    w_rows = w_ptr + tl.minimum(rn, n_out - 1)[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1]
    # FP8 weights (W_SCALE > 0) arrive as int32 words of PER_WORD e4m3 values: BLOCK_K // PER_WORD words a step.
    KW: tl.constexpr = BLOCK_K // PER_WORD if W_SCALE > 0 else BLOCK_K
    if PREFETCH:  # the first step's weight lines, while the previous kernel finishes
        prefetch_rows_l2(w_rows, k_in // PER_WORD if W_SCALE > 0 else k_in, KW, LINE_ELEMS)
    wait_for_prior(PDL)
    dtype = out_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < n_rows
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x  # [BLOCK_M, 1]
    r_rows = res_ptr + rm[:, None].to(tl.int64) * stride_r
    if NORM:  # the whole row(s) once: the norm's scale, and (program 0) the summed residual
        kf = tl.arange(0, BLOCK_KF)
        f_mask = m_ok[:, None] & (kf < k_in)[None, :]
        row = _summed(x_rows + kf[None, :], r_rows + kf[None, :], f_mask, dtype, HAS_RES)  # [BLOCK_M, BLOCK_KF]
        if HAS_RES and tl.program_id(0) == 0:
            tl.store(s_out_ptr + rm[:, None].to(tl.int64) * k_in + kf[None, :], row.to(dtype), mask=f_mask)
        rstd = tl.math.rsqrt(tl.sum(row * row, axis=1) / k_in + eps)  # [BLOCK_M]
    if W_SCALE == 2:  # this program's rows lie in one row of blocks (BLOCK_N divides SCALE_BLOCK)
        ws_row = ws_ptr + ((tl.program_id(0) * BLOCK_N) // SCALE_BLOCK).to(tl.int64) * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N, KW), dtype=tl.float32)
    for k0 in tl.range(0, k_in, BLOCK_K, num_stages=STAGES):
        kk = k0 + rk
        if EVEN_K:
            a_mask = m_ok[:, None]
        else:
            a_mask = m_ok[:, None] & (kk < k_in)[None, :]
        if W_SCALE > 0:
            kw = tl.arange(0, KW) + k0 // PER_WORD
            w_mask = n_ok[:, None] if EVEN_K else n_ok[:, None] & (kw < k_in // PER_WORD)[None, :]
            words = tl.load(w_rows + kw[None, :], mask=w_mask, other=0, eviction_policy=EVICT)  # [BLOCK_N, KW]
        else:
            w_mask = n_ok[:, None] if EVEN_K else n_ok[:, None] & (kk < k_in)[None, :]
            w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        if SILU_MUL:
            gate = tl.load(x_rows + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + k_in + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)
            a = silu_mul(gate, up, dtype).to(tl.float32)
        elif NORM:
            a = _summed(x_rows + kk[None, :], r_rows + kk[None, :], a_mask, dtype, HAS_RES)
            g = tl.load(norm_w_ptr + kk, mask=kk < k_in, other=0.0).to(tl.float32)
            a = round_to(a * rstd[:, None] * g[None, :], dtype).to(tl.float32)
        else:
            a = tl.load(x_rows + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        if W_SCALE == 2:  # the weight blocks' scales, folded into a
            if BLOCK_K <= SCALE_BLOCK:  # the step lies in one block (BLOCK_K divides it): one scale
                a = a * tl.load(ws_row + k0 // SCALE_BLOCK)
            else:  # one per column
                a = a * tl.load(ws_row + kk // SCALE_BLOCK, mask=kk < k_in, other=0.0)[None, :]
        if W_SCALE > 0:
            acc = _fma_word_planes(acc, a, words, BLOCK_M, KW)
        else:
            acc += a[:, None, :] * w[None, :, :]  # w: [BLOCK_N, BLOCK_K]
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if W_SCALE == 1:  # one scale per weight row
        y *= tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_o + rn[None, :]
    tl.store(out, round_to(y, dtype), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fma_word_planes(acc, a, words, BLOCK_M: tl.constexpr, KW: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N, KW] += sum_j a_j w_j: words [BLOCK_N, KW] hold columns 4c + j (byte j,
    kernels/fp8_kv.e4m3_planes), a [BLOCK_M, 4 KW] is split into the same four planes."""
    w0, w1, w2, w3 = e4m3_planes(words, tl.float32)  # [BLOCK_N, KW] each
    a0, a1, a2, a3 = split_planes(a, BLOCK_M, KW)  # [BLOCK_M, KW] each
    return acc + (a0[:, None, :] * w0[None, :, :] + a1[:, None, :] * w1[None, :, :]
                  + a2[:, None, :] * w2[None, :, :] + a3[:, None, :] * w3[None, :, :])


@triton.jit
def _summed(x_ptrs, r_ptrs, mask, dtype: tl.constexpr, HAS_RES: tl.constexpr):
    """float32 x, or round(x + residual) to dtype (as the add + RMSNorm kernel rounds it)."""
    s = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        s = round_to(s + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32), dtype).to(tl.float32)
    return s


@dataclass(frozen=True)
class _Norm:
    """The RMSNorm in front (NORM): its weight and eps, and the residual added before it."""
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None


def _check_norm(norm: _Norm, x: torch.Tensor) -> None:
    """The NORM prologue's arguments beside x [M, K] (already checked by check_linear)."""
    if next_pow2(x.shape[0]) * next_pow2(x.shape[1]) > MAX_NORM_ELEMS:
        raise ValueError(f"rms_norm_gemv holds rows x K <= {MAX_NORM_ELEMS} (in powers of two), got x {tuple(x.shape)}")
    if norm.residual is not None:
        check_matrix("residual", norm.residual, x.dtype)
        if norm.residual.shape != x.shape or norm.residual.device != x.device:
            raise ValueError(f"residual {tuple(norm.residual.shape)} on {norm.residual.device} must match x "
                             f"{tuple(x.shape)} on {x.device}")
    check_vector("norm_weight", norm.weight, x.shape[1], "x", x)
    check_eps(norm.eps)


def _gemv(x, weight, bias, silu_mul: bool, tile: Tiling | None, norm: _Norm | None = None, weight_scale=None):
    m, n_out, k_in = check_linear("gemv", x, weight, bias, silu_mul, MAX_ROWS, weight_scale)
    if norm is not None:
        _check_norm(norm, x)
    wave = one_wave(x.device)
    w_scale = linear_scale_mode(weight_scale)
    fp8 = w_scale != ScaleMode.NONE
    if tile is None:
        tile = tiling(m, n_out, k_in, wave, block_scales=w_scale == ScaleMode.BLOCK, fp8=fp8)
    elif not isinstance(tile, Tiling):
        raise TypeError(f"tile must be a Tiling, got {type(tile).__name__}")
    if w_scale == ScaleMode.BLOCK and FP8_BLOCK % tile.block_n:
        raise ValueError(f"block-scaled weights need tile.block_n dividing {FP8_BLOCK}, got {tile.block_n}")
    w_arg = fp8_words(weight, "an FP8 weight's values") if fp8 else weight  # strides in words for FP8
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    res = norm.residual if norm is not None else None
    s_out = torch.empty((m, k_in), dtype=x.dtype, device=x.device) if res is not None else None
    grid = triton.cdiv(n_out, tile.block_n)
    pdl = pdl_for_grid(x, grid)
    line_elems = LINE_BYTES // w_arg.element_size()  # in the kernel's weight elements (words for FP8)
    _gemv_kernel[(grid,)](
        x, w_arg, bias if bias is not None else x, out, m, n_out, k_in, x.stride(0), w_arg.stride(0),
        out.stride(0),
        SILU_MUL=silu_mul, HAS_BIAS=bias is not None, BLOCK_M=next_pow2(m), BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, EVEN_K=k_in % tile.block_k == 0, STAGES=tile.stages, EVICT=tile.evict,
        PREFETCH=pdl["PDL"] and tile.block_k * weight.element_size() >= LINE_BYTES, LINE_ELEMS=line_elems,
        num_warps=NUM_WARPS,
        res_ptr=x if res is None else res, norm_w_ptr=x if norm is None else norm.weight,
        s_out_ptr=x if s_out is None else s_out, stride_r=0 if res is None else res.stride(0),
        eps=0.0 if norm is None else float(norm.eps), NORM=norm is not None, HAS_RES=res is not None,
        BLOCK_KF=next_pow2(k_in) if norm is not None else 16,
        ws_ptr=x if weight_scale is None else weight_scale,
        stride_ws=weight_scale.stride(0) if w_scale == ScaleMode.BLOCK else 0,
        W_SCALE=int(w_scale), SCALE_BLOCK=FP8_BLOCK, **pdl,
    )
    return out, s_out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         tile: Tiling | None = None, *, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) -> [M, N] in x's dtype, like F.linear(x, weight, bias).
    `tile` overrides the shape-based tiling (benchmarks). With `weight_scale` the weight is FP8
    (float8_e4m3fn) and the product is F.linear(x, weight * scale, bias): scale [N] per row or
    [ceil(N/128), ceil(K/128)] per 128 x 128 block (checks.check_fp8_weight)."""
    return _gemv(x, weight, bias, False, tile, weight_scale=weight_scale)[0]


def silu_mul_gemv(x: torch.Tensor, weight: torch.Tensor, *, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, 2K] = gate | up -> F.linear(silu(gate) * up, weight, bias): the MLP's down projection
    (`weight_scale`: an FP8 weight, as in gemv)."""
    return _gemv(x, weight, None, True, None, weight_scale=weight_scale)[0]


def rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(F.linear(rms_norm(s), weight, bias), s) with s = x + residual rounded to x's dtype, the
    residual stream after the add (None without a residual: s = x): the add + RMSNorm kernel and
    the projection in one launch. x [M, K] (next_pow2(M) x next_pow2(K) <= MAX_NORM_ELEMS),
    norm_weight [K] (`weight_scale`: an FP8 weight, as in gemv)."""
    return _gemv(x, weight, bias, False, None, _Norm(norm_weight, eps, residual), weight_scale)
