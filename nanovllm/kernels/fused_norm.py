"""Triton RMSNorm, optionally fused with the residual add that precedes it.

Same arithmetic as `nanovllm.layers.layernorm.RMSNorm` (float32 math, one rounding to the
input dtype per produced tensor)::

    s   = round_to_dtype(x + residual)                    # only with a residual; also returned
    out = round_to_dtype(s * rsqrt(mean(s^2) + eps) * weight)

x is [N, H]; each program normalises ROWS rows held as one [ROWS, BLOCK_H] tile (ROWS > 1
only when H is small, so tiny rows still give every program a useful amount of work).
Input rows may be strided (row stride != H, last dim contiguous); outputs are contiguous.
Launch parameters depend on H only and N is not specialised, so one compiled kernel
serves every batch size and the launch is CUDA-graph capturable (no host syncs).

For an FP8 layer (`rms_norm_fp8`) `out` is quantized in the same kernel, exactly as
fp8_quant.quantize would quantize it (per token, per 128-column group or static, RowQuant),
into as many rows as the matmul takes (padding rows zero); the 16-bit `out` is never written.
Measured (H200, BENCHMARKS.md, eighteenth session): Qwen3-8B FP8 weights + FP8 KV 12,632 against
12,350 tok/s (decode step 8.06 against 8.25 ms), time to first token at 1,000 tokens 17.12
against 18.64 ms (0.918x). `rms_norm_both` (the 16-bit rows kept too, for the W8A8 MoE block), with
the MoE's pair outputs in bf16 (moe/grouped_gemm.py) in the same change: bench.py's Qwen3-30B-A3B FP8
+ FP8 KV run 1.022-1.024x (H100, BENCHMARKS.md, forty-eighth session; the two not measured apart).
Side by side against the norm, then the quantization (H100, fifty-eighth session): 7,193 / 7,195
against 7,149 tok/s, +0.6%. Under the ~3% a new kernel is kept for, but it is a KEEP flag of this
kernel, not a kernel of its own (~20 lines); an H200 A/B is not yet run.

Measured end to end (H200): with fused_rope and fused_activation, 12,112 -> 20,773 tok/s on the
default workload and 4.51 -> 1.65 ms per token at batch 1 (740201d; BENCHMARKS.md, "Throughput and
latency history"); alone 20.4 -> 1.5 us at one row ("Fused elementwise kernels").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.utils.ints import next_pow2

from . import checks
from .checks import check_eps, check_matrix, check_vector
from .fp8_quant import QuantizedRows, RowQuant, quantize_tile
from .pdl import pdl_launch_options, wait_for_prior

# Largest supported hidden size: one row lives in registers (16384 fp32 over 16 warps =
# 32 values per thread); larger rows would need a looped two-pass kernel.
MAX_HIDDEN = 16384
# Target elements per program tile: with small H several rows share one program so a
# program moves >= ~2 KB (bf16) instead of a few hundred bytes.
TILE_ELEMS = 1024
# Cap on rows per program (reached at H <= 64); more would only lengthen the tail.
MAX_ROWS = 16
# About one 16-byte vector (8 bf16) per thread per warp-sized chunk of the tile.
ELEMS_PER_WARP = 256
MIN_WARPS, MAX_WARPS = 4, 16
# Triton's CPU interpreter casts float32 -> bfloat16 by truncation (GPUs round to nearest
# even); under it `round_to` rounds the bits by hand so CPU tests see GPU rounding. A
# tl.constexpr: jitted code may read a global only in that form.
INTERPRET = tl.constexpr(checks.INTERPRET)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 x -> dtype, round to nearest even (the rounding torch's .to(dtype) does)."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000  # NaN/inf: interpreter only
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit(do_not_specialize=["n_rows", "out_rows"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, s_ptr, static_ptr, kept_ptr,
    n_rows, out_rows, hidden, n_groups, stride_x, stride_r, stride_sm, stride_sg, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, QUANT: tl.constexpr,
    GROUP: tl.constexpr, PDL: tl.constexpr, STATIC_PARTS: tl.constexpr, KEEP: tl.constexpr, AMAX_UB: tl.constexpr,
):
    """QUANT None: out_ptr gets the normed rows in x's dtype. Else (fp8_quant.quantize_tile's modes and AMAX_UB)
    out_ptr gets them in e4m3, out_rows of them (rows past n_rows: zeros), with their scales, and
    under KEEP kept_ptr gets them in x's dtype too."""
    wait_for_prior(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < hidden
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out_offs = rows[:, None] * hidden + cols[None, :]  # outputs are contiguous [N, H]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        summed = round_to(x + r, res_out_ptr.dtype.element_ty)  # rounded like the torch path
        tl.store(res_out_ptr + out_offs, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=1) / hidden  # masked columns are 0 and add nothing
    rstd = tl.math.rsqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = round_to((x * rstd[:, None]) * w[None, :], x_ptr.dtype.element_ty)  # the 16-bit output
    if QUANT is None:
        tl.store(out_ptr + out_offs, y, mask=mask)
    else:  # quantized from the 16-bit values, as quantize_rows would quantize the output above
        if KEEP:
            tl.store(kept_ptr + out_offs, y, mask=mask)
        in_out = rows < out_rows
        quantize_tile(y.to(tl.float32), out_ptr + out_offs, in_out[:, None] & col_mask[None, :], s_ptr, rows,
                      in_out, n_groups, stride_sm, stride_sg, static_ptr, QUANT, ROWS, BLOCK_H, GROUP, STATIC_PARTS,
                      AMAX_UB)


def _check_args(x, residual, weight, eps) -> None:
    check_matrix("x", x)
    h = x.shape[1]
    if h < 1 or h > MAX_HIDDEN:
        raise ValueError(f"hidden size must be in [1, {MAX_HIDDEN}], got {h}")
    if residual is not None:
        check_matrix("residual", residual)
        if residual.shape[1] != h:
            raise ValueError(f"residual shape {tuple(residual.shape)} does not match hidden size {h}")
        if residual.shape[0] != x.shape[0]:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device}, x on {x.device}")
    check_vector("weight", weight, h, "x", x)
    check_eps(eps)


def _launch(x, residual, weight, eps, quant: RowQuant | None = None, keep: bool = False):
    """(the normed rows: [N, H] in x's dtype, or QuantizedRows under `quant`; s or None; under `keep`
    (with `quant`) the normed rows in x's dtype too, else None)."""
    n, h = x.shape
    res_out = torch.empty((n, h), dtype=x.dtype, device=x.device) if residual is not None else None
    kept = torch.empty((n, h), dtype=x.dtype, device=x.device) if keep else None
    if quant is None:
        result = out = torch.empty((n, h), dtype=x.dtype, device=x.device)
        scales, static, out_rows, group = out, out, n, 1  # the scale pointers: stand-ins, never touched
    else:
        result = quant.outputs(n, h, x.dtype, x.device)
        out, scales, out_rows, group = result.q, result.scales, result.q.shape[0], quant.group or 1
        static = quant.static_scale if quant.static_scale is not None else scales
    if out_rows == 0:
        return result, res_out, kept
    block_h = max(next_pow2(h), group)  # whole groups in the tile
    rows = max(1, min(MAX_ROWS, TILE_ELEMS // block_h))
    num_warps = max(MIN_WARPS, min(MAX_WARPS, rows * block_h // ELEMS_PER_WARP))
    has_res = residual is not None
    _rms_norm_kernel[(triton.cdiv(out_rows, rows),)](
        x, residual if has_res else x, weight, out, res_out if has_res else out, scales, static,
        kept if keep else out, n, out_rows, h, triton.cdiv(h, group), x.stride(0), residual.stride(0) if has_res else 0,
        scales.stride(0), scales.stride(-1), float(eps),
        HAS_RESIDUAL=has_res, BLOCK_H=block_h, ROWS=rows, QUANT=None if quant is None else quant.mode,
        GROUP=group, STATIC_PARTS=0 if quant is None else quant.static_parts, KEEP=keep,
        AMAX_UB=None if quant is None else quant.amax_ub, num_warps=num_warps,
        **pdl_launch_options(x),
    )
    return result, res_out, kept


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H] (rows may be strided) -> contiguous [N, H] in x.dtype: x * rsqrt(mean(x^2) + eps) * weight."""
    _check_args(x, None, weight, eps)
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) with s = x + residual rounded to x.dtype; both outputs contiguous [N, H]."""
    _check_args(x, residual, weight, eps)
    return _launch(x, residual, weight, eps)[:2]


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 quant: RowQuant) -> tuple[QuantizedRows, torch.Tensor | None]:
    """(quantize(norm(s), quant), s), s = x + residual (x when residual is None; then None is
    returned for it): rms_norm / add_rms_norm with the 16-bit output quantized in the same kernel,
    identical to quantizing that output with fp8_quant.quantize."""
    _check_quant_args(x, residual, weight, eps, quant)
    return _launch(x, residual, weight, eps, quant)[:2]


def rms_norm_both(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  quant: RowQuant) -> tuple[torch.Tensor, QuantizedRows, torch.Tensor | None]:
    """(norm(s) [N, H] in x's dtype, quantize(norm(s), quant), s or None): rms_norm_fp8 that also
    writes the 16-bit rows, for a consumer of both (a W8A8 MoE block: its router reads the 16-bit rows,
    its experts the e4m3 ones), one launch in place of the norm and a quantization."""
    _check_quant_args(x, residual, weight, eps, quant)
    xq, s, normed = _launch(x, residual, weight, eps, quant, keep=True)
    return normed, xq, s


def _check_quant_args(x, residual, weight, eps, quant) -> None:
    _check_args(x, residual, weight, eps)
    if not isinstance(quant, RowQuant):
        raise TypeError(f"quant must be a RowQuant, got {type(quant).__name__}")
    quant.check_device(x)
