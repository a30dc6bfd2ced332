"""Triton SiLU-and-multiply, the gate of Qwen3's MLP: x [N, 2I] -> out [N, I].

Same arithmetic as `nanovllm.layers.activation.SiluAndMul` (`F.silu(gate) * up` in x's
dtype), float32 math with the torch path's intermediate rounding::

    gate, up = x[:, :I], x[:, I:]
    out = round_to_dtype(round_to_dtype(gate / (1 + exp(-gate))) * up)

Grid (N, cdiv(I, BLOCK)): one program per (row, column block). Input rows may be strided
(last dim contiguous); the output is contiguous. N is only the grid size, so one compiled
kernel serves every batch size and the launch is CUDA-graph capturable.

Measured end to end (H200): part of the fused-kernel change that took the default workload from
12,112 to 20,773 tok/s (740201d; BENCHMARKS.md, "Throughput and latency history"); alone 265 -> 72.6
us at 16,384 rows ("Fused elementwise kernels").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_matrix, next_pow2
from .fused_norm import round_to
from .pdl import pdl_launch_options, wait_for_prior

# Columns per program: 1024 bf16 = 2 KB per operand, one 16-byte vector per thread at 4 warps.
MAX_BLOCK = 1024
# Column blocks ride grid axis 1, which CUDA caps at 65535.
MAX_COL_BLOCKS = 65535
NUM_WARPS = 4


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """float32 gate, up -> round(round(silu(gate)) * up) in dtype: the roundings of F.silu then
    the product in torch (also the GEMV's SILU_MUL prologue)."""
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
    return round_to(act * up, dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, silu_mul(gate, up, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] (rows may be strided) -> contiguous [N, I] in x.dtype: silu(x[:, :I]) * x[:, I:]."""
    check_matrix("x", x)
    n, two_i = x.shape
    if two_i < 2 or two_i % 2:
        raise ValueError(f"x last dim must be even and >= 2 (gate | up), got {two_i}")
    inter = two_i // 2
    block = min(MAX_BLOCK, next_pow2(inter))
    col_blocks = triton.cdiv(inter, block)
    if col_blocks > MAX_COL_BLOCKS:
        raise ValueError(f"x last dim {two_i} too large: needs {col_blocks} > {MAX_COL_BLOCKS} column blocks")
    out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    _silu_and_mul_kernel[(n, col_blocks)](x, out, inter, x.stride(0), BLOCK=block, num_warps=NUM_WARPS,
                                         **pdl_launch_options(x))
    return out
