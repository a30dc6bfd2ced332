"""Triton SiLU-and-multiply, the gate of Qwen3's MLP: x [N, 2I] -> out [N, I].

Same arithmetic as `nanovllm.layers.activation.SiluAndMul` (`F.silu(gate) * up` in x's
dtype), float32 math with the torch path's intermediate rounding::

    gate, up = x[:, :I], x[:, I:]
    out = round_to_dtype(round_to_dtype(gate / (1 + exp(-gate))) * up)

Grid (N, cdiv(I, BLOCK)): one program per (row, column block). Input rows may be strided
(last dim contiguous); the output is contiguous. N is only the grid size, so one compiled
kernel serves every batch size and the launch is CUDA-graph capturable.

`silu_and_mul_fp8` is the FP8 down projection's input: the same values quantized for
torch._scaled_mm (fp8_quant.RowQuant), per 128-column group or with a static scale in the same
grid (fp8_quant.quantize_tile on each program's columns). With it and fp8_quant's 8-group programs,
Qwen3-8B in Qwen's FP8 layout (128 x 128 weight blocks, per-group activations) took 19.43 -> 17.69
ms to its first token at 1,000 tokens and 37.2% -> 38.7% of its roofline in bench.py with an FP8
cache (H200, BENCHMARKS.md, twenty-third session).

Measured end to end (H200): part of the fused-kernel change that took the default workload from
12,112 to 20,773 tok/s (740201d; BENCHMARKS.md, "Throughput and latency history"); alone 265 -> 72.6
us at 16,384 rows ("Fused elementwise kernels").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.utils.ints import next_pow2

from .checks import MAX_GRID_YZ, check_matrix
from .fp8_quant import QuantizedRows, RowQuant, quantize, quantize_tile
from .fused_norm import round_to
from .pdl import pdl_launch_options, wait_for_prior

# Columns per program: 1024 bf16 = 2 KB per operand, one 16-byte vector per thread at 4 warps.
MAX_BLOCK = 1024
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


@triton.jit
def _silu_mul_cols(x_row, inter, cols, filled):
    """round(silu(gate) * up) at columns `cols` of one row, 0 from column `filled` on (inter, or 0
    for a padding row), as float32 holding the row's dtype's values."""
    mask = cols < filled
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    return silu_mul(gate, up, x_row.dtype.element_ty).to(tl.float32)


@triton.jit(do_not_specialize=["n_rows", "out_rows"])
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, static_ptr, n_rows, out_rows, inter, n_groups, stride_x, stride_q,
                             stride_sm, stride_sg, QUANT: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                             STATIC_PARTS: tl.constexpr, PDL: tl.constexpr):
    """Grid (out_rows, column blocks of whole groups): silu_and_mul's rows quantized per group or
    with the static scale (fp8_quant.quantize_tile); rows past n_rows are zeros."""
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    filled = tl.where(row < n_rows, inter, 0)  # padding rows read nothing: zeros
    first = tl.program_id(1) * BLOCK
    cols = first + tl.arange(0, BLOCK)
    y = _silu_mul_cols(x_ptr + row * stride_x, inter, cols, filled)
    rows = row + tl.zeros((1,), dtype=tl.int64)
    g0 = first // GROUP if QUANT == "group" else 0  # the program's first scale column
    quantize_tile(y[None, :], (q_ptr + row * stride_q + cols)[None, :], (cols < inter)[None, :], s_ptr + g0 * stride_sg,
                  rows, rows < out_rows, n_groups - g0, stride_sm, stride_sg, static_ptr, QUANT, 1, BLOCK, GROUP,
                  STATIC_PARTS, None)


def silu_and_mul_fp8(x: torch.Tensor, quant: RowQuant) -> QuantizedRows:
    """fp8_quant.quantize(silu_and_mul(x), quant) (the same values): x [N, 2I] (rows may be
    strided) -> QuantizedRows of [N, I]. Per group or static: one kernel (column blocks, no 16-bit
    activation written and read back: 7.4 against 21.0 us at Qwen3-8B's 256 x 12288, per group).
    Per token: the two kernels, since a row's scale needs the whole row first (one-row programs
    measured no faster: 33.4 against 35.9 us at 1,024 x 12288, slower below 512 rows; H200,
    twenty-third session)."""
    if not isinstance(quant, RowQuant):
        raise TypeError(f"quant must be a RowQuant, got {type(quant).__name__}")
    if quant.mode == "token":  # each checks its own arguments
        return quantize(silu_and_mul(x), quant)
    inter = _check(x)
    quant.check_device(x)
    n = x.shape[0]
    result = quant.outputs(n, inter, x.dtype, x.device)
    q, scales = result.q, result.scales
    if q.shape[0] == 0:
        return result
    group = quant.group or 1
    block = max(min(MAX_BLOCK, next_pow2(inter)), group)  # whole groups in a program
    static = quant.static_scale if quant.static_scale is not None else scales
    _silu_and_mul_fp8_kernel[(q.shape[0], triton.cdiv(inter, block))](
        x, q, scales, static, n, q.shape[0], inter, triton.cdiv(inter, group), x.stride(0), q.stride(0),
        scales.stride(0), scales.stride(-1), QUANT=quant.mode, GROUP=group, BLOCK=block,
        STATIC_PARTS=quant.static_parts, num_warps=NUM_WARPS, **pdl_launch_options(x))
    return result


def _check(x: torch.Tensor) -> int:
    """x [N, 2I] checked; returns I."""
    check_matrix("x", x)
    two_i = x.shape[1]
    if two_i < 2 or two_i % 2:
        raise ValueError(f"x last dim must be even and >= 2 (gate | up), got {two_i}")
    inter = two_i // 2
    if triton.cdiv(inter, min(MAX_BLOCK, next_pow2(inter))) > MAX_GRID_YZ:
        raise ValueError(f"x last dim {two_i} too large: needs more than {MAX_GRID_YZ} column blocks")
    return inter


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] (rows may be strided) -> contiguous [N, I] in x.dtype: silu(x[:, :I]) * x[:, I:]."""
    inter = _check(x)
    n = x.shape[0]
    block = min(MAX_BLOCK, next_pow2(inter))
    col_blocks = triton.cdiv(inter, block)
    out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    _silu_and_mul_kernel[(n, col_blocks)](x, out, inter, x.stride(0), BLOCK=block, num_warps=NUM_WARPS,
                                         **pdl_launch_options(x))
    return out
