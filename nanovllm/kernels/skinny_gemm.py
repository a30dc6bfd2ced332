"""Triton GEMM for decode batches of a few rows (the layers use it for narrow layers at 3-16 rows,
for FP8 layers at 3-32 rows as W8A16, the e4m3 weights converted in registers, and at 33-192 rows
as W8A8, e4m3 activations x e4m3 weights in the MMAs: skinny_gemm_w8a8).

A decode step's projections at a few rows are latency-bound: cuBLAS takes 5-8 us for Qwen3-0.6B's
4 MB o_proj whatever the row count, its few large tiles leaving most SMs idle. This kernel tiles
the output finely, may launch early (PDL, asking L2 for its first weight tile while the previous
kernel finishes), and for narrow layers splits K so that enough programs share the weight read:

    out[m, n] = x[m, :] . weight[n, :] (+ bias[n])              x [M, K], weight [N, K]

    grid (M / BM, N / BN, S): program (i, j, s) owns out[i*BM : (i+1)*BM, j*BN : (j+1)*BN] over
    K slice s (k_per columns, a multiple of BK; every slice non-empty):

        K:  | slice 0 (k_per) | slice 1 (k_per) | ... | slice S-1 (<= k_per) |
        for k0 in the slice by BK:   acc[BM, BN] += x[i's rows, k0 : k0+BK] @ weight[j's rows, k0 : k0+BK]^T

    S == 1: the program stores its tile. S > 1: it stores a float32 partial ws[s, rows, cols],
    then counts its arrival on the tile's counter; the last to arrive sums the S partials in
    slice order (the same sum whichever arrives last: deterministic), stores the tile and resets
    the counter to 0 for the next call.

The row blocks are grid axis 0, the fastest in launch order: the programs that share a weight
tile (same j) start together, so the weights are read from HBM about once and the few rows of
x stay in L2. Shapes alone set the launch (CUDA-graph capturable). Measured (BENCHMARKS.md,
2026-12-02 fifth session) and dropped: SiLU-and-mul computed in front (slower than its own
kernel), and the product swapped (weight rows on the MMA's M side: no consistent gain).

Measured end to end (H200, bench.py --latency, 0.6B): 1.421 / 1.518 / 1.865 -> 1.326 / 1.443 /
1.790 ms per token at batch 4 / 8 / 16 (-4 to -7%; throughput unchanged; d59f836, BENCHMARKS.md
"Session of 2026-12-02 (fifth)"). Kept: >= 3% on mid-batch latency. FP8 weights (`weight_scale`)
read half the bytes and skip the activation quantization that torch._scaled_mm needs: Qwen3-8B online
FP8 at batch 3 / 8 / 16 / 32, 3.682 / 3.921 / 4.279 / 5.535 against 5.439 / 5.514 / 6.124 / 6.602 ms
per token (BENCHMARKS.md, 2026-12-04 twenty-fourth session). W8A8 at 48 / 64 / 96 / 128: 5.761 /
6.556 / 7.759 / 9.087 against 6.999 / 7.652 / 8.417 / 9.619; the default workload with an FP8 cache
13,313 against 12,843 tok/s (twenty-fifth session). At 144 / 160 / 192: 10.583 / 11.425 / 12.830 against
11.658 / 12.214 / 13.316 (cuBLAS's FP8 GEMMs are slowest there), the default workload 13,431 against
13,208; from 208 rows on neither wins end to end (twenty-sixth session).

Rows past M (a row tile's padding) wrap around to rows 0.. and are never stored. Clamped to row
M - 1 instead, all padding rows read one row and ran slower: a 96-row W8A8 call took 8B gate_up 75.8
us against 39.6 wrapped, 128 rows 40.1; FP8 decode at batch 4 / 8 (graphs of 8 rows, 16-row tiles)
3.760 / 3.944 -> 3.581 / 3.761 ms per token (twenty-fifth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.utils.validation import check_pow2

from .checks import FP8_BLOCK, INTERPRET, MIN_DOT_DIM, ScaleMode, check_linear, linear_scale_mode, sm_count
from .counters import arrival_counters
from .fp8_quant import QuantizedRows
from .fused_norm import round_to
from .pdl import LINE_BYTES, pdl_for_grid, prefetch_rows_l2, wait_for_prior
from .skinny_plan import Operands, SkinnyTiling, skinny_tiling

# Most rows served: past a few hundred rows cuBLAS's large tiles are efficient.
MAX_ROWS = 512
# Arrival counters of split-K tiles, one int32 per output tile, allocated once per device and
# left at 0 by every call (the tile's last program resets its own).
NUM_COUNTERS = 4096

_counter_cache: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _load_k(ptrs, kk, k_in, EVEN_K: tl.constexpr):
    """The elements at `ptrs` (reduction columns kk on the last axis): 0 past k_in, where a
    column can be (EVEN_K: none can, no mask)."""
    if EVEN_K:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(kk < k_in)[None, :], other=0.0)
    return x


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, n_rows, n_out, k_in, stride_x, stride_w, stride_o,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, PREFETCH: tl.constexpr, LINE_ELEMS: tl.constexpr, PDL: tl.constexpr,
    SPLIT_K: tl.constexpr, k_per, ws_ptr, stride_ws, count_ptr,
    scale_ptr, stride_sn, W_SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    xs_ptr, stride_xsr, stride_xsg, X_SCALE: tl.constexpr,
):
    """W_SCALE 0: weight of x's dtype. FP8 weights (e4m3 values x scale): W_SCALE 1 one scale per
    weight row, applied to the tile's columns at the end; 2 per SCALE_BLOCK x SCALE_BLOCK block
    (BLOCK_K == SCALE_BLOCK, BLOCK_N divides it: one scale a step), applied to each step's product.
    X_SCALE 0: x 16-bit / float32, the e4m3 weights converted to its dtype in registers (exact, W8A16).
    X_SCALE > 0: x in e4m3 too (W8A8: e4m3 x e4m3 MMAs, nothing converted), with one scale a row
    (X_SCALE 1, beside W_SCALE 1: at the end) or one a row and SCALE_BLOCK-column group (X_SCALE 2,
    beside W_SCALE 2: each step), xs[r, g] at xs_ptr + r * stride_xsr + g * stride_xsg."""
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # this program's K slice [k_lo, k_hi): k_per is a multiple of BLOCK_K, every slice non-empty
    k_lo = tl.program_id(2) * k_per
    k_hi = tl.minimum(k_lo + k_per, k_in)
    n_ok = rn < n_out
    w_rows = w_ptr + tl.minimum(rn, n_out - 1)[:, None].to(tl.int64) * stride_w  # [BLOCK_N, 1]
    if PREFETCH:  # the first step's weight lines, while the previous kernel finishes
        prefetch_rows_l2(w_rows + k_lo, k_hi - k_lo, BLOCK_K, LINE_ELEMS)
    wait_for_prior(PDL)  # x (and out) belong to earlier kernels
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < n_rows
    # rows past M wrap around to rows 0.. (distinct lines: clamped to row M - 1, a 96-row call's
    # 32 padding rows all read one row, and ran slower than 128 rows on the H200)
    r_in = rm % n_rows
    x_rows = x_ptr + r_in[:, None].to(tl.int64) * stride_x  # [BLOCK_M, 1]
    rk = tl.arange(0, BLOCK_K)
    if W_SCALE == 2:  # this program's weight rows lie in one row of scale blocks
        s_row = scale_ptr + (tl.program_id(1) * BLOCK_N // SCALE_BLOCK).to(tl.int64) * stride_sn
    xs_rows = xs_ptr + r_in.to(tl.int64) * stride_xsr  # [BLOCK_M] (X_SCALE > 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        kk = k0 + rk
        w = _load_k(w_rows + kk[None, :], kk, k_in, EVEN_K)  # [BLOCK_N, BLOCK_K]
        # rows past M load rows 0.. (wrapped above): their results are stored nowhere
        a = _load_k(x_rows + kk[None, :], kk, k_in, EVEN_K)  # [BLOCK_M, BLOCK_K]
        if W_SCALE > 0 and X_SCALE == 0:  # e4m3 -> x's dtype (exact)
            # e4m3 -> fp16 is one instruction a pair; to bf16 through float32 (HADD2.F32, then a packed
            # F2FP) rather than fp16 -> bf16 (a scalar F2F.BF16.F16 a value: sm_90 SASS compiled here).
            # (fp16 MMAs with x converted instead measured no faster: BENCHMARKS.md, twenty-fourth session)
            w = w.to(tl.float16).to(tl.float32).to(a.dtype) if a.dtype == tl.bfloat16 else w.to(a.dtype)
        if UPCAST:  # the interpreter's dot mishandles bfloat16: exact float32 products instead
            a, w = a.to(tl.float32), w.to(tl.float32)
        if W_SCALE == 2:
            step_scale = tl.load(s_row + k0 // SCALE_BLOCK)
            if X_SCALE == 2:  # [BLOCK_M, 1]: the rows' scales of this column group, times the block's
                step_scale = tl.load(xs_rows + (k0 // SCALE_BLOCK) * stride_xsg)[:, None] * step_scale
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PREC) * step_scale
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
    if W_SCALE == 1:
        acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if X_SCALE == 1:
        acc = acc * tl.load(xs_rows)[:, None]
    tile_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        # partials ws [SPLIT_K, n_rows, n_out] float32; the tile's last arrival sums them
        ws_tile = ws_ptr + rm[:, None].to(tl.int64) * n_out + rn[None, :]  # split 0's [BLOCK_M, BLOCK_N]
        tl.store(ws_tile + tl.program_id(2).to(tl.int64) * stride_ws, acc, mask=tile_mask)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        counter = count_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for _ in range(SPLIT_K):  # split order: the same sum whichever program arrives last
                acc += tl.load(ws_tile, mask=tile_mask, other=0.0, cache_modifier=".cg")
                ws_tile += stride_ws
            _store_tile(out_ptr, acc, bias_ptr, rm, rn, n_ok, tile_mask, stride_o, HAS_BIAS)
            tl.atomic_xchg(counter, 0)  # ready for the next call
    else:
        _store_tile(out_ptr, acc, bias_ptr, rm, rn, n_ok, tile_mask, stride_o, HAS_BIAS)


@triton.jit
def _store_tile(out_ptr, acc, bias_ptr, rm, rn, n_ok, tile_mask, stride_o, HAS_BIAS: tl.constexpr):
    """out[rm, rn] = round(acc (+ bias[rn])) in out's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_o + rn[None, :]
    tl.store(out, round_to(acc, out_ptr.dtype.element_ty), mask=tile_mask)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                tile: SkinnyTiling | None = None, *, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) -> [M, N] in x's dtype, like F.linear(x, weight, bias).
    `tile` overrides skinny_tiling's choice (benchmarks). With `weight_scale` the weight is FP8
    (float8_e4m3fn) and the product is F.linear(x, weight * scale, bias), as in gemv: scale [N]
    per row or [ceil(N/128), ceil(K/128)] per 128 x 128 block; the e4m3 values enter the MMAs in
    x's dtype (W8A16)."""
    m, n_out, k_in = check_linear("skinny_gemm", x, weight, bias, False, MAX_ROWS, weight_scale)
    if tile is None:
        operands = Operands.BF16 if weight_scale is None else Operands.W8A16
        tile = skinny_tiling(m, n_out, k_in, sm_count(x.device), operands)
    return _launch(x, None, weight, weight_scale, bias, tile, x.dtype)


def skinny_gemm_w8a8(xq: QuantizedRows, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, tile: SkinnyTiling | None = None) -> torch.Tensor:
    """xq's m rows (e4m3, kernels/fp8_quant.quantize) @ (weight *
    weight_scale)^T (+ bias) -> [m, N] in xq.dtype, as fp8_linear's torch._scaled_mm computes it:
    e4m3 x e4m3 MMAs, float32 sums, per-row weight scales with xq's per-token (or static) scales
    [rows, 1], block weight scales with its per-group scales [rows, K/128]."""
    if not isinstance(xq, QuantizedRows) or not isinstance(xq.q, torch.Tensor):
        raise TypeError(f"xq must be QuantizedRows (kernels/fp8_quant.quantize), got {type(xq).__name__}")
    x = xq.q[: xq.m]  # [m, K] e4m3; padding rows past m are not read
    m, n_out, k_in = check_linear("skinny_gemm_w8a8", x, weight, bias, False, MAX_ROWS, weight_scale, x_fp8=True)
    if m != xq.m:
        raise ValueError(f"xq.m is {xq.m}, but xq.q holds {xq.q.shape[0]} rows")
    groups = triton.cdiv(k_in, FP8_BLOCK) if weight_scale.dim() == 2 else 1
    if xq.scales.dim() != 2 or xq.scales.shape[0] < m or xq.scales.shape[1] != groups:
        raise ValueError(f"xq.scales must be [rows >= {m}, {groups}] for this weight's scales, got "
                         f"{tuple(xq.scales.shape)}")
    if tile is None:
        tile = skinny_tiling(m, n_out, k_in, sm_count(x.device), Operands.W8A8)
    return _launch(x, xq.scales, weight, weight_scale, bias, tile, xq.dtype)


def _launch(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor | None,
            bias: torch.Tensor | None, tile: SkinnyTiling, out_dtype: torch.dtype) -> torch.Tensor:
    """The kernel on checked operands (x [M, K], e4m3 when x_scale is given), `tile` checked here."""
    m, k_in = x.shape
    n_out = weight.shape[0]
    w_scale = linear_scale_mode(weight_scale)
    # the activations' scales: per row beside per-row weights, per 128-column group beside blocks
    x_scale_mode = ScaleMode.NONE if x_scale is None else w_scale
    if not isinstance(tile, SkinnyTiling):
        raise TypeError(f"tile must be a SkinnyTiling, got {type(tile).__name__}")
    for name in ("block_m", "block_n", "block_k"):
        check_pow2(f"tile.{name}", getattr(tile, name), MIN_DOT_DIM)
    if tile.stages < 1 or tile.num_warps < 1 or tile.num_warps & (tile.num_warps - 1):
        raise ValueError(f"tile.stages must be >= 1 and tile.num_warps a power of two, got {tile}")
    if tile.split_k < 1:
        raise ValueError(f"tile.split_k must be >= 1, got {tile.split_k}")
    if w_scale == ScaleMode.BLOCK and (tile.block_k != FP8_BLOCK or FP8_BLOCK % tile.block_n):
        raise ValueError(f"block-scaled weights need tile.block_k == {FP8_BLOCK} and tile.block_n dividing it, "
                         f"got {tile}")
    out = torch.empty((m, n_out), dtype=out_dtype, device=x.device)
    # K slices of whole steps, none empty: split_k shrinks to the slices K fills
    k_per = triton.cdiv(triton.cdiv(k_in, tile.split_k), tile.block_k) * tile.block_k
    split_k = triton.cdiv(k_in, k_per)
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(n_out, tile.block_n), split_k)
    counters = arrival_counters(_counter_cache, x.device, grid[0] * grid[1], NUM_COUNTERS) if split_k > 1 else None
    if counters is None:  # no split (or no counters to fold with): one program walks all of K
        split_k, k_per, grid = 1, k_in, grid[:2] + (1,)
    ws = torch.empty((split_k, m, n_out), dtype=torch.float32, device=x.device) if split_k > 1 else None
    line_elems = LINE_BYTES // weight.element_size()
    # the interpreter's dot mishandles bfloat16 and e4m3: exact float32 products instead
    upcast = INTERPRET and x.dtype in (torch.bfloat16, torch.float8_e4m3fn)
    # PDL, as the GEMV takes it, only for a grid resident at once (kernels/pdl.py, pdl_for_grid)
    pdl = pdl_for_grid(x, grid[0] * grid[1] * grid[2]) if tile.pdl else {"PDL": False}
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else out, out, m, n_out, k_in, x.stride(0), weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, EVEN_K=k_in % tile.block_k == 0, STAGES=tile.stages,
        DOT_PREC="ieee" if x.dtype == torch.float32 or upcast else None, UPCAST=upcast,
        PREFETCH=pdl["PDL"] and tile.block_k >= line_elems, LINE_ELEMS=line_elems,
        SPLIT_K=split_k, k_per=k_per,
        ws_ptr=out if ws is None else ws, stride_ws=0 if ws is None else ws.stride(0),
        count_ptr=out if counters is None else counters,
        scale_ptr=out if weight_scale is None else weight_scale,
        stride_sn=weight_scale.stride(0) if w_scale == ScaleMode.BLOCK else 0,
        W_SCALE=int(w_scale), SCALE_BLOCK=FP8_BLOCK,
        xs_ptr=out if x_scale is None else x_scale,
        stride_xsr=0 if x_scale is None else x_scale.stride(0),
        stride_xsg=0 if x_scale is None else x_scale.stride(1),
        X_SCALE=int(x_scale_mode),
        num_warps=tile.num_warps, **pdl,
    )
    return out
