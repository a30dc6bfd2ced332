"""Triton FP8 quantization of activations, for torch._scaled_mm: x [M, K] -> (q, scales).

    per token (dynamic):    s[m]    = max(amax(x[m, :]) / 448, FP8_MIN_SCALE)         scales [M, 1]
                            (with a bound amax_ub, min(amax, amax_ub) in amax's place: fbgemm_fp8's
                            activation_scale_ub, so an outlier token saturates at +-448)
    per group (dynamic):    s[m, g] = max(amax(x[m, g*128 : (g+1)*128]) / 448, FP8_MIN_SCALE)
                                                scales [M, K/128], column-major (the transpose of a
                                                contiguous [K/128, M]: _scaled_mm's blockwise layout)
    static:                 s[m]    = the given per-tensor scale (the largest of a packed
                                      layer's parts' scales, taken in the kernel)   scales [M, 1]
    q = float8_e4m3fn(clamp(x / s, -448, 448))   (correctly rounded division, as torch divides)

Grid (rows, parts): per token or static, a program reads its row once when it fits one BLOCK step
(up to MAX_BLOCK columns), else walks it twice in BLOCK-column steps (amax, then quantize); per
group, a program takes GROUP_BLOCK columns of a row (whole groups) and reads them once.
`rows` may exceed M (padding rows for the GEMM: zeros, scale FP8_MIN_SCALE); `pair_ids` marks an
aligned MoE activation's padding rows, which are skipped. Shapes only set the launch, so calls are
CUDA-graph capturable.

`RowQuant` is the one description of a layer's choice (mode, padding rows; quantization/fp8.py's
`Fp8Weights.row_quant` makes it), `quantize` applies it and returns `QuantizedRows`, and
`quantize_tile` is the same arithmetic for a kernel that quantizes its own output in registers
(kernels/fused_norm.rms_norm_fp8, whose figures are there; fused_activation.silu_and_mul_fp8).

Measured (H200, fifteenth session, BENCHMARKS.md): the one read and the skipped padding rows took
the W8A8 MoE call's two quantizations from 15.9 to 8.8 us at T=256; with the align and slot-sum
changes beside them (moe/), the Qwen3-30B-A3B FP8 decode step went from 16.99 to 16.14 ms
(`profile_step`, 256 rows); bench.py's figure after them: moe/grouped_gemm.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.utils.ints import next_pow2
from nanovllm.utils.validation import check_int

from . import checks
from .checks import FP8_BLOCK, check_amax_ub, check_matrix

# The clamp bound and scale floor (kernels/checks.py), as constants compiled kernels can read.
FP8_MAX = tl.constexpr(checks.FP8_MAX)
FP8_MIN_SCALE = tl.constexpr(checks.FP8_MIN_SCALE)
# Triton's CPU interpreter loses the carry when a float32 -> e4m3 cast rounds up to the next
# power of two (127.03 -> 64); under it `_to_fp8` rounds to the e4m3 grid by hand first (normal
# values: 3 mantissa bits; below FP8_MIN_NORMAL: multiples of 2^-9, by adding and removing
# SUBNORMAL_SHIFT), so the cast is exact. A tl.constexpr: jitted code may read a global only so.
INTERPRET = tl.constexpr(checks.INTERPRET)
FP8_MIN_NORMAL = tl.constexpr(2.0**-6)
SUBNORMAL_SHIFT = tl.constexpr(1.5 * 2.0**14)
# Columns per step of a per-token program: 4096 bf16 = 8 KB, 32 per thread at 4 warps (an 8B /
# 30B-A3B attention output, 4096 wide, is read once).
MAX_BLOCK = 4096
# Columns per program per group: 1024 = 8 groups of 128, one 16-byte bf16 vector a thread at 4 warps
# (a program a group left 4 warps on 128 columns. With fused_activation.silu_and_mul_fp8, Qwen3-8B
# in Qwen's FP8 layout: TTFT at 1,000 tokens 19.43 -> 17.69 ms, bench.py with an FP8 cache 1.040x;
# H200, twenty-third session).
GROUP_BLOCK = 1024
NUM_WARPS = 4
# Static scales of a packed layer's parts (q | k | v at most): the kernels take their largest,
# reading this many slots (masked to the real count), so no per-call reduction kernel runs first
# (Llama-3.1-8B static FP8 decode at batch 8: 5.309 -> 4.990 ms/token, H200, twenty-third session).
MAX_STATIC_PARTS = tl.constexpr(4)


@triton.jit
def _to_fp8(x, dtype: tl.constexpr):
    """float32 x (|x| <= 448) -> e4m3 `dtype`, round to nearest even (torch's and the GPU's cast)."""
    if INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & 0xFFF00000).to(tl.float32, bitcast=True)
        x = tl.where(tl.abs(x) >= FP8_MIN_NORMAL, normal, (x + SUBNORMAL_SHIFT) - SUBNORMAL_SHIFT)
    return x.to(dtype)


@triton.jit
def _amax_to_scale(amax, AMAX_UB: tl.constexpr):
    """The dynamic scale of a part whose largest magnitude is `amax` (any shape): amax / 448, floored;
    amax taken at most AMAX_UB where that is not None."""
    if AMAX_UB is not None:
        amax = tl.minimum(amax, AMAX_UB)
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX), FP8_MIN_SCALE)


@triton.jit
def _store_fp8(q_ptrs, x, scale, mask):
    """q = e4m3(clamp(x / scale, -448, 448)) stored at q_ptrs where mask."""
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    tl.store(q_ptrs, _to_fp8(q, q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def static_scale(static_ptr, PARTS: tl.constexpr):
    """The static activation scale: the largest of the PARTS scales at static_ptr (float32)."""
    parts = tl.arange(0, MAX_STATIC_PARTS)
    return tl.max(tl.load(static_ptr + parts, mask=parts < PARTS, other=0.0), axis=0).to(tl.float32)


@triton.jit
def quantize_tile(y, q_ptrs, mask, s_ptr, rows, row_valid, n_groups, stride_sm, stride_sg, static_ptr,
                  MODE: tl.constexpr, R: tl.constexpr, C: tl.constexpr, GROUP: tl.constexpr,
                  STATIC_PARTS: tl.constexpr, AMAX_UB: tl.constexpr):
    """Store y [R, C] (float32 holding activation-dtype values, 0 past the row's end) at q_ptrs
    [R, C] where mask, quantized as quantize_rows does: MODE "token" (a scale per row, stored at
    s_ptr + rows * stride_sm; the row's amax bounded by AMAX_UB unless None), "group" (per GROUP
    columns: group g's at + g * stride_sg, groups below n_groups) or "static" (the largest of the
    STATIC_PARTS scales at static_ptr, stored per row too). Rows not row_valid store no scale. For
    kernels that quantize their own output (fused_norm, fused_activation)."""
    if MODE == "group":
        yg = tl.reshape(y, (R, C // GROUP, GROUP))
        scale = _amax_to_scale(tl.max(tl.abs(yg), axis=2), None)  # [R, C / GROUP]
        q = tl.clamp(tl.math.div_rn(yg, scale[:, :, None]), -FP8_MAX, FP8_MAX)
        tl.store(q_ptrs, _to_fp8(tl.reshape(q, (R, C)), q_ptrs.dtype.element_ty), mask=mask)
        groups = tl.arange(0, C // GROUP)
        tl.store(s_ptr + rows[:, None] * stride_sm + groups[None, :] * stride_sg, scale,
                 mask=row_valid[:, None] & (groups < n_groups)[None, :])
    else:
        if MODE == "static":
            scale = static_scale(static_ptr, STATIC_PARTS) + tl.zeros((R,), dtype=tl.float32)
        else:
            scale = _amax_to_scale(tl.max(tl.abs(y), axis=1), AMAX_UB)  # [R]
        _store_fp8(q_ptrs, y, scale[:, None], mask)
        tl.store(s_ptr + rows * stride_sm, scale, mask=row_valid)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, pairs_ptr, num_pairs, n_rows, k_in, stride_x, stride_q,
                  stride_sm, stride_sg, STATIC: tl.constexpr, BLOCK: tl.constexpr, ONE_STEP: tl.constexpr,
                  SKIP_PADDING: tl.constexpr, GROUP: tl.constexpr, STATIC_PARTS: tl.constexpr,
                  AMAX_UB: tl.constexpr):
    """Grid (rows, parts): per token or static (GROUP 0) one part, the row; per GROUP-column group,
    parts of BLOCK columns (BLOCK / GROUP whole groups). AMAX_UB: per token, the amax bound or None."""
    row = tl.program_id(0).to(tl.int64)
    if SKIP_PADDING:  # a padding row of an aligned MoE layout: never read, so not written
        if tl.load(pairs_ptr + row) >= num_pairs:
            return
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    filled = tl.where(row < n_rows, k_in, 0)  # padding rows read nothing: zeros
    if GROUP > 0:  # this program's BLOCK columns, quantized as one tile row
        first = tl.program_id(1) * BLOCK
        cols = first + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < filled, other=0.0).to(tl.float32)
        rows = row + tl.zeros((1,), dtype=tl.int64)
        g0 = first // GROUP  # the program's first scale column
        every_row = rows >= 0  # each grid row is an output row (padding rows get the scale floor)
        quantize_tile(x[None, :], (q_row + cols)[None, :], (cols < k_in)[None, :], s_ptr + g0 * stride_sg, rows,
                      every_row, tl.cdiv(k_in, GROUP) - g0, stride_sm, stride_sg, static_ptr, "group", 1, BLOCK,
                      GROUP, STATIC_PARTS, None)
        return
    s_out = s_ptr + row * stride_sm
    cols = tl.arange(0, BLOCK)
    if ONE_STEP:  # the row fits one step: read once, kept in registers
        x = tl.load(x_row + cols, mask=cols < filled, other=0.0).to(tl.float32)
        scale = (static_scale(static_ptr, STATIC_PARTS) if STATIC
                 else _amax_to_scale(tl.max(tl.abs(x), axis=0), AMAX_UB))
        tl.store(s_out, scale)
        _store_fp8(q_row + cols, x, scale, cols < k_in)
    else:  # wide rows: the amax pass, then the quantizing pass
        if STATIC:
            scale = static_scale(static_ptr, STATIC_PARTS)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for c in range(0, k_in, BLOCK):
                x = tl.load(x_row + c + cols, mask=c + cols < filled, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = _amax_to_scale(tl.max(amax, axis=0), AMAX_UB)
        tl.store(s_out, scale)
        for c in range(0, k_in, BLOCK):
            x = tl.load(x_row + c + cols, mask=c + cols < filled, other=0.0).to(tl.float32)
            _store_fp8(q_row + c + cols, x, scale, c + cols < k_in)


@dataclass(frozen=True)
class RowQuant:
    """How an activation [M, K] becomes e4m3 rows for torch._scaled_mm: per token (`group` None),
    per FP8_BLOCK-column group, or with a per-tensor `static_scale` (a 1-D float32 tensor on the
    activation's device holding a packed layer's parts' scales, 1 to MAX_STATIC_PARTS: their largest
    is the scale); rows padded with zero rows to a multiple of `row_multiple`; per token, each row's
    amax taken at most `amax_ub` where it is given (fbgemm_fp8's activation_scale_ub). The one
    description quantize_rows and the kernels that quantize their own output both follow."""

    group: int | None = None
    static_scale: torch.Tensor | None = None
    row_multiple: int = 1
    amax_ub: float | None = None

    def __post_init__(self) -> None:
        if self.group not in (None, FP8_BLOCK):
            raise ValueError(f"group must be None (per token) or {FP8_BLOCK}, got {self.group!r}")
        if self.static_scale is not None:
            if self.group is not None:
                raise ValueError("a static scale is per tensor: it takes no group")
            s = self.static_scale
            if (not isinstance(s, torch.Tensor) or s.dim() > 1 or not 1 <= s.numel() <= MAX_STATIC_PARTS.value
                    or s.dtype != torch.float32 or not s.is_contiguous()):
                raise ValueError(f"static_scale must be a contiguous float32 tensor of 1 to {MAX_STATIC_PARTS.value} "
                                 f"parts' scales, got {s!r}")
        check_int("row_multiple", self.row_multiple, 1)
        if self.amax_ub is not None:
            check_amax_ub("amax_ub", self.amax_ub)
            if self.mode != "token":
                raise ValueError(f"amax_ub bounds a per-token scale: it takes no group or static scale "
                                 f"(group={self.group!r}, static scale given: {self.static_scale is not None})")

    @property
    def static_parts(self) -> int:
        """How many parts' scales `static_scale` holds (0 without one): the kernels' STATIC_PARTS."""
        return 0 if self.static_scale is None else self.static_scale.numel()

    @property
    def mode(self) -> str:
        """The kernels' name for it (quantize_tile's MODE): "static", "group" or "token"."""
        return "static" if self.static_scale is not None else "group" if self.group is not None else "token"

    def check_device(self, x: torch.Tensor) -> None:
        if self.static_scale is not None and self.static_scale.device != x.device:
            raise ValueError(f"static_scale is on {self.static_scale.device}, the activation on {x.device}")

    def rows(self, m: int) -> int:
        """The rows an activation of m rows is quantized into (m rounded up to row_multiple)."""
        return triton.cdiv(m, self.row_multiple) * self.row_multiple

    def outputs(self, x_rows: int, k: int, x_dtype: torch.dtype, device: torch.device) -> QuantizedRows:
        """Empty QuantizedRows for an activation [x_rows, K] of x_dtype (see `_empty_outputs`)."""
        return QuantizedRows(*_empty_outputs(self.rows(x_rows), k, self.group, device), x_rows, x_dtype)


def _empty_outputs(rows: int, k: int, group: int | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """q [rows, K] e4m3 and its scales: [rows, 1], or [rows, K/128] column-major per group (the
    transpose of a contiguous [K/128, rows]: _scaled_mm's blockwise layout)."""
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=device)
    if group is None:
        return q, torch.empty((rows, 1), dtype=torch.float32, device=device)
    return q, torch.empty((triton.cdiv(k, group), rows), dtype=torch.float32, device=device).t()


@dataclass(frozen=True)
class QuantizedRows:
    """An activation of m rows of `dtype` in e4m3: q [rows >= m, K] (rows past m: zeros) and its
    scales ([rows, 1] per token or static, [rows, K/128] column-major per group)."""

    q: torch.Tensor
    scales: torch.Tensor
    m: int
    dtype: torch.dtype  # the activation's (a matmul on it gives this dtype)


def quantize(x: torch.Tensor, how: RowQuant) -> QuantizedRows:
    """x [M, K] -> QuantizedRows, as `how` says (quantize_rows)."""
    check_matrix("x", x)
    q, scales = quantize_rows(x, group=how.group, static_scale=how.static_scale, rows=how.rows(x.shape[0]),
                              amax_ub=how.amax_ub)
    return QuantizedRows(q, scales, x.shape[0], x.dtype)


def quantize_rows(x: torch.Tensor, *, group: int | None = None, static_scale: torch.Tensor | None = None,
                  rows: int | None = None, pair_ids: torch.Tensor | None = None,
                  num_pairs: int = 0, amax_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [rows, K], scales float32): per token (group None), per
    FP8_BLOCK-column group (group=FP8_BLOCK: scales [rows, K/128] column-major) or with the
    per-tensor `static_scale` (RowQuant's: parts' scales, the largest taken). `rows` >= M pads with zero rows
    (default M). `pair_ids` (int32 [M] on x's device: moe_align's sorted_pair_ids, the rows of
    an aligned MoE activation) with `num_pairs`: rows whose id is >= num_pairs are padding, and
    their q and scales are left unwritten (nothing reads them). `amax_ub`: per token, each row's
    amax taken at most this (RowQuant)."""
    check_matrix("x", x)
    m, k = x.shape
    rows = m if rows is None else rows
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < m:
        raise ValueError(f"rows must be an int >= x's {m} rows, got {rows!r}")
    how = RowQuant(group, static_scale, amax_ub=amax_ub)
    how.check_device(x)
    if pair_ids is not None:
        if (not isinstance(pair_ids, torch.Tensor) or pair_ids.dtype != torch.int32 or pair_ids.shape != (m,)
                or pair_ids.device != x.device or not pair_ids.is_contiguous()):
            raise ValueError(f"pair_ids must be a contiguous int32 [{m}] tensor on {x.device}, got "
                             f"{getattr(pair_ids, 'dtype', type(pair_ids))} {tuple(getattr(pair_ids, 'shape', ()))}")
        if rows != m:
            raise ValueError(f"pair_ids marks padding rows of x itself: rows must be x's {m}, got {rows}")
        check_int("num_pairs", num_pairs, 0)
    q, scales = _empty_outputs(rows, k, group, x.device)
    if group is None:
        parts, block = 1, min(MAX_BLOCK, next_pow2(k))
    else:  # whole groups, GROUP_BLOCK columns a program
        block = max(group, min(GROUP_BLOCK, next_pow2(k)))
        parts = triton.cdiv(k, block)
    if rows == 0 or k == 0:
        return q, scales
    _quant_kernel[(rows, parts)](
        x, q, scales, static_scale if static_scale is not None else scales,
        pair_ids if pair_ids is not None else scales, num_pairs, m, k, x.stride(0), q.stride(0),
        scales.stride(0), scales.stride(1), STATIC=static_scale is not None, BLOCK=block, ONE_STEP=block >= k,
        SKIP_PADDING=pair_ids is not None, GROUP=group or 0, STATIC_PARTS=how.static_parts, AMAX_UB=amax_ub,
        num_warps=NUM_WARPS,
    )
    return q, scales
