"""Triton GEMM for decode's few rows: out[M, N] = x[M, K] @ w[N, K]^T with M <= MAX_M.

At small M a linear layer is a weight read: the work is streaming w once at HBM
bandwidth. cuBLAS picks slow kernels for some of these shapes (a split-K pair, or
~0.3 TB/s for Qwen3-0.6B's o_proj at M = 1); this kernel gives each program
BLOCK_N rows of w and the whole K, so there is one kernel and no reduction pass:

    program p:  w[p*BLOCK_N : (p+1)*BLOCK_N, :]  --(BLOCK_K columns per step)-->  out[:, p*BLOCK_N ...]
    acc[BLOCK_M, BLOCK_N] (fp32) += x[:, k:k+BLOCK_K] @ w[rows, k:k+BLOCK_K]^T

x rows past M are masked (zeros); the output is rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import INTERPRET, check_float_dtype
from .fused_norm import round_to

# Largest M served (tl.dot needs 16 rows; more rows make cuBLAS the better choice).
MAX_M = 16
BLOCK_M = 16
# Tile defaults (from benchmarks/bench_gemm.py on the H200): 16 weight rows x 256 columns = 8 KB
# of bf16 per step, four steps in flight.
BLOCK_N = 16
BLOCK_K = 256
NUM_WARPS = 4
NUM_STAGES = 4


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + rk) < K
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # Triton's CPU interpreter mis-computes low-precision tl.dot
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, round_to(acc, out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
                num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES) -> torch.Tensor:
    """x [M, K] (M <= MAX_M) @ w [N, K]^T -> [M, N] in x's dtype, like F.linear(x, w)."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x and w must be 2-D, got {tuple(x.shape)} and {tuple(w.shape)}")
    check_float_dtype("x", x)
    if w.dtype != x.dtype:
        raise TypeError(f"w dtype {w.dtype} != x dtype {x.dtype}")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} disagree on K")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"skinny_gemm serves 1..{MAX_M} rows, got {m}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"x and w need a contiguous last dim, got strides {x.stride()} and {w.stride()}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=INTERPRET,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
