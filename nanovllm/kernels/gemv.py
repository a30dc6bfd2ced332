"""Triton GEMV for decode's few rows, with the elementwise step before the matmul fused in.

At 1-4 rows a linear layer is a weight read: cuBLAS spends ~1.5 us per launch on the
RMSNorm or SiLU kernel in front of it, and picks split-K pairs (a GEMM plus a reduce
kernel) for some shapes. Here one kernel computes the layer's input on the fly
(the "prologue") and streams the weight once:

    out[m, :] = a[m, :] @ weight^T (+ bias)        m < M <= MAX_ROWS, weight [N, K]

    prologue NONE:      a = x                                            x [M, K]
    prologue RMS_NORM:  s = round(x + residual)  (s = x without one)     x [M, K]
                        a = round(s * rsqrt(mean(s^2) + eps) * norm_weight); s is returned too
    prologue SILU_MUL:  a = round(round(silu(x[:, :K])) * x[:, K:])      x [M, 2K]

Rounding ("round" = to x's dtype) is the one the unfused torch path does, so results match
norm-then-F.linear up to the order of the float32 sums. Grid: one program per BLOCK_N
weight rows, each walking the whole K in BLOCK_K steps (no split-K, no reduce pass):

    program p:  weight[p*BLOCK_N : (p+1)*BLOCK_N, :]   --BLOCK_K columns per step-->
                acc[M, BLOCK_N, BLOCK_K] (fp32) += a[:, None, k:k+BLOCK_K] * w[None, :, k:k+BLOCK_K]
                out[:, p*BLOCK_N ...] = round(sum(acc, axis=2))

Shapes only set the launch, so calls are CUDA-graph capturable.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from .checks import check_float_dtype, next_pow2
from .fused_norm import round_to

# Most rows served: past 4 the [M, BLOCK_N, BLOCK_K] accumulator crowds registers and cuBLAS's
# tensor-core kernels hold bandwidth (benchmarks/bench_gemm.py, H200).
MAX_ROWS = 4
# Accumulator elements per program (M x BLOCK_N x BLOCK_K fp32): 64 registers per thread at 4 warps.
ACC_ELEMS = 8192
# Tiling from benchmarks/bench_gemm.py --sweep (H200, weights streamed from HBM): 8 weight rows x
# 512 columns per step, 3 steps in flight, for layers at least WIDE_N wide, 4 rows below that.
# At 1 row this beat cuBLAS on every Qwen3-0.6B/8B projection (8B down 26.5 vs 30.5 us, o 10.8
# vs 13.5) or tied it (8B gate_up 50.9 vs 50.6).
BLOCK_K = 512
WIDE_N = 4096
STAGES = 3
# Largest K the RMS_NORM prologue loads whole (to compute the row's norm before the main loop).
MAX_NORM_K = 16384
NUM_WARPS = 4


class Prologue(enum.IntEnum):
    NONE = 0
    RMS_NORM = 1
    SILU_MUL = 2


@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, norm_w_ptr, w_ptr, bias_ptr, out_ptr, s_out_ptr,
    n_rows, n_out, k_in, stride_x, stride_r, stride_w, stride_o, eps,
    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KF: tl.constexpr,
    EVEN_K: tl.constexpr, STAGES: tl.constexpr, EVICT: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < n_rows
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < n_out
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x  # [BLOCK_M, 1]
    r_rows = res_ptr + rm[:, None].to(tl.int64) * stride_r

    if PROLOGUE == 1:  # the whole row once: its norm (and, from program 0, the summed residual)
        kf = tl.arange(0, BLOCK_KF)
        full = m_ok[:, None] & (kf < k_in)[None, :]
        s = tl.load(x_rows + kf[None, :], mask=full, other=0.0).to(tl.float32)
        if HAS_RES:
            s = round_to(s + tl.load(r_rows + kf[None, :], mask=full, other=0.0).to(tl.float32), dtype)
            if pid == 0:
                tl.store(s_out_ptr + rm[:, None].to(tl.int64) * k_in + kf[None, :], s, mask=full)
            s = s.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(s * s, axis=1) / k_in + eps)[:, None]  # [BLOCK_M, 1]

    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, k_in, BLOCK_K, num_stages=STAGES):
        kk = k0 + rk
        if EVEN_K:
            a_mask = m_ok[:, None]
            w_mask = n_ok[:, None]
        else:
            a_mask = m_ok[:, None] & (kk < k_in)[None, :]
            w_mask = n_ok[:, None] & (kk < k_in)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0, eviction_policy=EVICT).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        if PROLOGUE == 2:
            gate = tl.load(x_rows + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + k_in + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)
            act = round_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)  # F.silu rounds
            a = round_to(act * up, dtype).to(tl.float32)
        else:
            a = tl.load(x_rows + kk[None, :], mask=a_mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
            if PROLOGUE == 1:
                if HAS_RES:
                    a = round_to(a + tl.load(r_rows + kk[None, :], mask=a_mask, other=0.0).to(tl.float32),
                                 dtype).to(tl.float32)
                g = tl.load(norm_w_ptr + kk, mask=kk < k_in, other=0.0).to(tl.float32)
                a = round_to((a * rstd) * g[None, :], dtype).to(tl.float32)
        acc += a[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_o + rn[None, :]
    tl.store(out, round_to(y, dtype), mask=m_ok[:, None] & n_ok[None, :])


def _check_matrix(name: str, t, dtype=None) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got {getattr(t, 'shape', type(t))}")
    check_float_dtype(name, t)
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} dtype {t.dtype} != x dtype {dtype}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def _check_vector(name: str, t, n: int, x: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.shape != (n,):
        raise ValueError(f"{name} must be a tensor of shape ({n},), got {getattr(t, 'shape', type(t))}")
    check_float_dtype(name, t)
    if t.stride(0) != 1 and n > 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def tiles(rows: int, n_out: int, k_in: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for a call. Narrow layers get 4-row programs so there are still >= ~256
    of them (two per SM on an H200) to spread the weight read; BLOCK_K shrinks with more rows to
    keep the accumulator at ACC_ELEMS."""
    block_n = 8 if n_out >= WIDE_N else 4
    block_k = max(16, min(next_pow2(k_in), BLOCK_K, ACC_ELEMS // (next_pow2(rows) * block_n)))
    return block_n, block_k


def _gemv(prologue: Prologue, x, weight, bias, residual=None, norm_weight=None, eps=0.0,
          block_n=None, block_k=None, num_warps=NUM_WARPS, stages=STAGES, evict=""):
    _check_matrix("x", x)
    _check_matrix("weight", weight, x.dtype)
    m, xk = x.shape
    n_out, k_in = weight.shape
    want_k = 2 * k_in if prologue is Prologue.SILU_MUL else k_in
    if xk != want_k:
        raise ValueError(f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)} "
                         f"(x needs {want_k} columns for prologue {prologue.name})")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv serves 1..{MAX_ROWS} rows, got {m}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if bias is not None:
        _check_vector("bias", bias, n_out, x)
    if residual is not None:
        _check_matrix("residual", residual, x.dtype)
        if residual.shape != x.shape or residual.device != x.device:
            raise ValueError(f"residual {tuple(residual.shape)} on {residual.device} must match x "
                             f"{tuple(x.shape)} on {x.device}")
    if prologue is Prologue.RMS_NORM:
        _check_vector("norm_weight", norm_weight, k_in, x)
        if k_in > MAX_NORM_K:
            raise ValueError(f"RMS_NORM prologue supports K <= {MAX_NORM_K}, got {k_in}")
        if not isinstance(eps, (float, int)) or isinstance(eps, bool) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    auto_n, auto_k = tiles(m, n_out, k_in)
    block_n, block_k = block_n or auto_n, block_k or auto_k
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    s_out = torch.empty_like(x) if residual is not None else None
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x,
        weight, bias if bias is not None else x, out, s_out if s_out is not None else out,
        m, n_out, k_in, x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0),
        out.stride(0), float(eps),
        PROLOGUE=int(prologue), HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=next_pow2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_KF=next_pow2(k_in) if prologue is Prologue.RMS_NORM else 16, EVEN_K=k_in % block_k == 0,
        STAGES=stages, EVICT=evict, num_warps=num_warps,
    )
    return out, s_out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **tiling) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) -> [M, N] in x's dtype, like F.linear(x, weight, bias)."""
    return _gemv(Prologue.NONE, x, weight, bias, **tiling)[0]


def rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None,
                  **tiling) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(s), weight, bias), s) with s = x + residual rounded to x's dtype (s = x
    when residual is None): RMSNorm, its residual add and the projection in one kernel."""
    out, s = _gemv(Prologue.RMS_NORM, x, weight, bias, residual, norm_weight, eps, **tiling)
    return out, (x if s is None else s)


def silu_mul_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  **tiling) -> torch.Tensor:
    """x [M, 2K] = gate | up -> F.linear(silu(gate) * up, weight, bias): the MLP's down projection."""
    return _gemv(Prologue.SILU_MUL, x, weight, bias, **tiling)[0]
