"""Triton fused mixture-of-experts MLP (Qwen3-MoE): alignment (moe/align.py) and two grouped GEMMs.

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(g) * u),   [g | u] = w13[e] @ hidden[t],  e = topk_ids[t, k]

Each (token t, slot k) is a pair p = t * K + k. `moe_align` (moe/align.py: the layout, its
invariants and launches) sorts the T*K pairs by expert into blocks of BLOCK_M rows, each holding pairs
of one expert then padding (the invalid pair T*K); num_used_blocks, on the device, counts the blocks in use.

The GEMMs run on grid (blocks, N tiles); blocks on axis 0, so the programs reading one weight
tile run together (an expert spread over several blocks hits L2). Under MoeTiles.n_major (prefill; while
the blocks fit MAX_GRID_YZ) the grid is (N tiles, blocks): a block's N tiles run together and read its
activation rows from HBM once. A program of a block past num_used_blocks returns at once; padding rows
compute on token 0 and never reach the output:

    gate_up: act[r, n] = silu_mul(w13[e, n] . hidden[t(r)], w13[e, I + n] . hidden[t(r)])   act [P, I]
    down:    pair_out[p(r), h] = topk_weights[p(r)] * (w2[e, h] . act[r])                   [T*K, H]
    out[t, h] = sum_k pair_out[t * K + k, h]  in hidden's dtype (the slot sum: one launch)

Accumulation is float32; g, u, act and each pair's weighted output are rounded to hidden's dtype, as
transformers' Qwen3-MoE block rounds them (which also sums the pairs in that dtype; the slot sum adds in
float32).
Offsets are int64 (w13's expert stride times E passes 2**31 for large models).

FP8 experts (moe/fp8_experts.py, W_SCALE): weight tiles are read at one byte a value and
converted to hidden's dtype in registers (exact). Per-channel scales multiply the finished sums'
columns; block scales multiply each K step's product column by column (BLOCK_K divides 128: the
step lies in one column of blocks), else each weight element before the product (rounded to
hidden's dtype). W_SCALE 0 compiles the bf16 kernels unchanged.

W8A8 (fused_moe(act_fp8=True), ACT_FP8; FP8 experts, block scales per K step only): hidden and act
are quantized to e4m3 first (kernels/fp8_quant: per row; block scales: per row per 128 columns,
the weights' block columns) and tl.dot multiplies e4m3 operands (Hopper's FP8 MMAs, twice the bf16
rate) into float32; channel: acc * a_scale[row] * w_scale[col] on the finished sums, block: each
step's product * a_scale[row, group] * w_scale[col block, group]. The layer takes it for its
grouped-GEMM steps (KernelRoutes.moe_fp8_mma_min_tokens): faster than W8A16 at every T measured.

Measured end to end (H200): Qwen3-30B-A3B default workload 5,464 tok/s (69.4% of the roofline) ->
5,728 (71.5%) after its tile retune (827a097, fe73658; BENCHMARKS.md "Qwen3-MoE (#16)"); no PyTorch
MoE path exists on CUDA to compare with (a per-expert loop cannot be graph-captured).
FP8 experts with the W8A8 grouped GEMMs (`bench.py --quantization fp8 --kv-cache-dtype fp8`, 1e3e352):
7,535 tok/s against bf16's 5,772 (1.305x), prompt scoring 73,528 prompt tok/s against 57,165 with the
experts dequantized to bf16 (1.29x; W8A16 alone: 0.71x); BENCHMARKS.md, thirteenth session.
The launches around the GEMMs (alignment, activation quantization, slot sum) took 40 of a W8A8
call's 222 us at T=256; with the padding rows left unquantized, one read a row and one slot-sum
kernel 21 of 203 us, and the 30B-A3B FP8 decode step (256 rows, profile_step) 16.14 ms against
16.99 (fifteenth session); bench.py with them: 7,901 tok/s against bf16's 5,982 (1.321x, sixteenth
session; 1.305x before them, thirteenth session: a ratio across sessions, not side by side).
hidden quantized by the block's norm (x_fp8: moe/layer.py) and pair_out in hidden's dtype: bench.py's
30B-A3B FP8 + FP8 KV run 1.022-1.024x, its steps with prefill 1.11x (H100, forty-eighth session).
N-major launches and 128-row blocks over many pairs an expert (N_MAJOR; moe/tiles.PREFILL_WIDE): bench.py's
30B-A3B `--workload score` 68,577 against 55,359 prompt tok/s in bf16 (1.239x) and 90,151 against 82,094
with FP8 + FP8 KV (1.098x); the default workload +1.0% / +0.8% (H100, BENCHMARKS.md, fifty-eighth session; the
random weights then sent most of a prompt to one expert a layer, utils/loader.DUMMY_ATTENTION_OUT_SCALE; with the
routing spread, the after-figures read 68,442 / 89,147). The 64-row prefill tiles N-major too: 30B-A3B time to
first token at 1,000 / 2,000 tokens -7.4 / -10.6% in bf16, -3.5 / -4.8% in FP8 (H100, fifty-ninth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.checks import FP8_BLOCK, INTERPRET, MAX_GRID_YZ, ScaleMode, cuda_sm_count
from nanovllm.kernels.fp8_quant import QuantizedRows, RowQuant, quantize_rows
from nanovllm.kernels.fused_activation import silu_mul
from nanovllm.kernels.fused_norm import round_to
from nanovllm.quantization.config import FP8_DTYPE
from nanovllm.utils.ints import next_pow2
from nanovllm.utils.validation import check_bool

from .align import MoeAlignment, moe_align
from .checks import check_experts, check_routing
from .fp8_experts import expert_scale_mode, scale_args, scales_per_step
from .tiles import MoeTiles, Tiling, plan_tiles

# Columns a program of the slot sum adds up (K rows of them): 8 x 1024 float32 is 64 registers a
# thread at 4 warps.
SLOT_SUM_COLUMNS = 1024


@triton.jit
def _block_and_tile(N_MAJOR: tl.constexpr):
    """(block, N tile) of this program: grid (blocks, N tiles), or (N tiles, blocks) under N_MAJOR, where a
    block's N tiles run together and its activation rows come from HBM once (moe/tiles.MoeTiles.n_major)."""
    if N_MAJOR:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _block_rows(block, sorted_ptr, block_expert_ptr, n_pairs, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """Sorted rows, their pairs, which are real (not padding), their tokens (0 for padding) and
    the expert of this program's block."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)  # P is a multiple of BLOCK_M: no mask
    real = pairs < n_pairs
    tokens = tl.where(real, pairs // TOP_K, 0).to(tl.int64)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    return rows.to(tl.int64), pairs.to(tl.int64), real, tokens, expert


@triton.jit
def _load_tile(ptrs, k_ok, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """A [rows, BLOCK_K] operand tile, columns past K (k_ok false) as 0; float32 under UPCAST
    (the interpreter's tl.dot on bfloat16)."""
    if EVEN_K:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=k_ok[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _scaled_dot(a, w, acc, s_ptrs, as_ptrs, stride_asg, k0, rk, k_ok, W_SCALE: tl.constexpr,
                SCALE_PER_STEP: tl.constexpr, SCALE_BLOCK: tl.constexpr, DOT_PREC: tl.constexpr,
                ACT_FP8: tl.constexpr):
    """acc + a @ dequant(w)^T: a [BLOCK_M, BLOCK_K], w [BLOCK_N, BLOCK_K] (FP8 values or, W_SCALE 0
    and 1, hidden's dtype), s_ptrs [BLOCK_N] the scale row of each weight row's block (W_SCALE 2).
    Block scales multiply the step's product (SCALE_PER_STEP: BLOCK_K divides SCALE_BLOCK, the
    step lies in one column of blocks) or, otherwise, each weight element before the product;
    channel scales (W_SCALE 1) are applied to the finished sums by the caller.
    ACT_FP8 (W8A8): a is e4m3 too and the product runs on FP8 operands; under block scales (per
    step only) as_ptrs [BLOCK_M] point at each row's activation scales (group k0 // SCALE_BLOCK
    at stride_asg), which multiply the product's rows; channel: the caller scales the sums."""
    if ACT_FP8:
        if W_SCALE == 2:
            s = tl.load(s_ptrs + k0 // SCALE_BLOCK)  # [BLOCK_N]
            a_s = tl.load(as_ptrs + (k0 // SCALE_BLOCK) * stride_asg)  # [BLOCK_M]
            return acc + tl.dot(a, tl.trans(w)) * (a_s[:, None] * s[None, :])
        return tl.dot(a, tl.trans(w), acc)
    if W_SCALE == 2:
        if SCALE_PER_STEP:
            s = tl.load(s_ptrs + k0 // SCALE_BLOCK)  # [BLOCK_N]
            return acc + tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=DOT_PREC) * s[None, :]
        s = tl.load(s_ptrs[:, None] + ((k0 + rk) // SCALE_BLOCK)[None, :], mask=k_ok[None, :], other=0.0)
        w = (w.to(tl.float32) * s).to(a.dtype)  # [BLOCK_N, BLOCK_K]
    return tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=DOT_PREC)


@triton.jit(do_not_specialize=["n_pairs"])
def _gate_up_kernel(hidden_ptr, w13_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_used_ptr,
                    n_pairs, hidden_size, inter, stride_h, stride_we, stride_wn, s13_ptr, stride_se, stride_sn,
                    as_ptr, stride_asm, stride_asg,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                    W_SCALE: tl.constexpr, SCALE_PER_STEP: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                    ACT_FP8: tl.constexpr, N_MAJOR: tl.constexpr):
    block, tile = _block_and_tile(N_MAJOR)
    if block >= tl.load(num_used_ptr):
        return
    rows, pairs, real, tokens, expert = _block_rows(block, sorted_ptr, block_expert_ptr, n_pairs, TOP_K, BLOCK_M)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = hidden_ptr + tokens[:, None] * stride_h + rk[None, :]  # [BLOCK_M, BLOCK_K]
    as_ptrs = as_ptr + tokens * stride_asm  # [BLOCK_M] each row's activation scales (ACT_FP8)
    n_rows = tl.minimum(rn, inter - 1)  # columns past I repeat row I - 1, never stored
    w_ptrs = w13_ptr + expert * stride_we + rk[None, :]
    g_ptrs = w_ptrs + n_rows[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, BLOCK_K], gate rows n
    u_ptrs = w_ptrs + (n_rows + inter)[:, None].to(tl.int64) * stride_wn  # up rows I + n
    if W_SCALE != 0:  # this expert's scales; [BLOCK_N] each row's row of blocks (W_SCALE 2)
        s_base = s13_ptr + expert * stride_se
        sg_ptrs = s_base + (n_rows // SCALE_BLOCK).to(tl.int64) * stride_sn
        su_ptrs = s_base + ((n_rows + inter) // SCALE_BLOCK).to(tl.int64) * stride_sn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k_ok = k0 + rk < hidden_size
        a = _load_tile(a_ptrs + k0, k_ok, EVEN_K, UPCAST)
        g = _load_tile(g_ptrs + k0, k_ok, EVEN_K, UPCAST)
        u = _load_tile(u_ptrs + k0, k_ok, EVEN_K, UPCAST)
        if W_SCALE == 0:  # the weights in hidden's dtype
            acc_g = tl.dot(a, tl.trans(g), acc_g, input_precision=DOT_PREC)
            acc_u = tl.dot(a, tl.trans(u), acc_u, input_precision=DOT_PREC)
        else:
            acc_g = _scaled_dot(a, g, acc_g, sg_ptrs, as_ptrs, stride_asg, k0, rk, k_ok, W_SCALE, SCALE_PER_STEP,
                                SCALE_BLOCK, DOT_PREC, ACT_FP8)
            acc_u = _scaled_dot(a, u, acc_u, su_ptrs, as_ptrs, stride_asg, k0, rk, k_ok, W_SCALE, SCALE_PER_STEP,
                                SCALE_BLOCK, DOT_PREC, ACT_FP8)
    if W_SCALE == 1:  # one scale per weight row (and, ACT_FP8, per activation row): the finished sums
        acc_g *= tl.load(s_base + n_rows)[None, :]
        acc_u *= tl.load(s_base + n_rows + inter)[None, :]
        if ACT_FP8:
            a_s = tl.load(as_ptrs)[:, None]  # [BLOCK_M, 1]
            acc_g *= a_s
            acc_u *= a_s
    dtype = act_ptr.dtype.element_ty
    act = silu_mul(round_to(acc_g, dtype).to(tl.float32), round_to(acc_u, dtype).to(tl.float32), dtype)
    tl.store(act_ptr + rows[:, None] * inter + rn[None, :], act, mask=(rn < inter)[None, :])


@triton.jit(do_not_specialize=["n_pairs"])
def _down_kernel(act_ptr, w2_ptr, weights_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_used_ptr,
                 n_pairs, hidden_size, inter, stride_we, stride_wn, s2_ptr, stride_se, stride_sn,
                 as_ptr, stride_asm, stride_asg,
                 TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                 W_SCALE: tl.constexpr, SCALE_PER_STEP: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                 ACT_FP8: tl.constexpr, N_MAJOR: tl.constexpr):
    block, tile = _block_and_tile(N_MAJOR)
    if block >= tl.load(num_used_ptr):
        return
    rows, pairs, real, tokens, expert = _block_rows(block, sorted_ptr, block_expert_ptr, n_pairs, TOP_K, BLOCK_M)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * inter + rk[None, :]  # [BLOCK_M, BLOCK_K]
    as_ptrs = as_ptr + rows * stride_asm  # [BLOCK_M] each row's activation scales (ACT_FP8)
    n_rows = tl.minimum(rn, hidden_size - 1)  # columns past H repeat row H - 1, never stored
    w_rows = n_rows.to(tl.int64) * stride_wn
    w_ptrs = w2_ptr + expert * stride_we + w_rows[:, None] + rk[None, :]  # [BLOCK_N, BLOCK_K]
    if W_SCALE != 0:  # this expert's scales; [BLOCK_N] each row's row of blocks (W_SCALE 2)
        s_base = s2_ptr + expert * stride_se
        s_ptrs = s_base + (n_rows // SCALE_BLOCK).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = k0 + rk < inter
        a = _load_tile(a_ptrs + k0, k_ok, EVEN_K, UPCAST)
        w = _load_tile(w_ptrs + k0, k_ok, EVEN_K, UPCAST)
        if W_SCALE == 0:  # the weights in hidden's dtype
            acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PREC)
        else:
            acc = _scaled_dot(a, w, acc, s_ptrs, as_ptrs, stride_asg, k0, rk, k_ok, W_SCALE, SCALE_PER_STEP,
                              SCALE_BLOCK, DOT_PREC, ACT_FP8)
    if W_SCALE == 1:  # one scale per weight row (and, ACT_FP8, per activation row): the finished sums
        acc *= tl.load(s_base + n_rows)[None, :]
        if ACT_FP8:
            acc *= tl.load(as_ptrs)[:, None]
    acc *= tl.load(weights_ptr + pairs, mask=real, other=0.0)[:, None]
    out = out_ptr + pairs[:, None] * hidden_size + rn[None, :]
    tl.store(out, round_to(acc, out_ptr.dtype.element_ty), mask=real[:, None] & (rn < hidden_size)[None, :])


@triton.jit
def _slot_sum_kernel(pair_ptr, out_ptr, hidden_size, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    """out[t, h] = sum_k pair_out[t * K + k, h], float32 sums stored in out's dtype (one read, one write)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slots = tl.arange(0, BLOCK_K)
    ptrs = pair_ptr + (t * TOP_K + slots)[:, None] * hidden_size + cols[None, :]  # [BLOCK_K, BLOCK_H]
    parts = tl.load(ptrs, mask=(slots < TOP_K)[:, None] & (cols < hidden_size)[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden_size + cols, round_to(tl.sum(parts, axis=0), out_ptr.dtype.element_ty),
             mask=cols < hidden_size)


def launch_n_major(tiles: MoeTiles, blocks: int) -> bool:
    """Whether a call of `blocks` blocks launches N-major: as `tiles` says, while the blocks fit the grid's second
    axis (MAX_GRID_YZ, where an N-major launch puts them: a call of more, over ~500,000 tokens at top 8, launches
    blocks-fastest)."""
    return tiles.n_major and blocks <= MAX_GRID_YZ


def _grid(blocks: int, n_tiles: int, n_major: bool) -> tuple[int, int]:
    """A grouped GEMM's launch grid (_block_and_tile)."""
    return (n_tiles, blocks) if n_major else (blocks, n_tiles)


def _act_fp8_args(mode: ScaleMode, x: torch.Tensor, align: MoeAlignment | None = None,
                  n_pairs: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """W8A8: x [M, K] in e4m3 (kernels/fp8_quant.quantize_rows: amax / 448, floored, saturating),
    its float32 scales and their strides: one a row (channel weights: [M, 1]) or one a row per
    FP8_BLOCK-column group, the weights' block columns (block weights: [M, cdiv(K, 128)]). With
    `align` (x in its sorted rows), padding rows are skipped: left unwritten."""
    pair_ids = align.sorted_pair_ids if align is not None else None
    q, scales = quantize_rows(x, group=act_row_quant(mode).group, pair_ids=pair_ids, num_pairs=n_pairs)
    return q, scales, _act_fp8_strides(scales)


def _act_fp8_strides(scales: torch.Tensor) -> dict:
    return dict(stride_asm=scales.stride(0), stride_asg=scales.stride(1), ACT_FP8=True)


def act_row_quant(mode: ScaleMode) -> RowQuant:
    """How a W8A8 call quantizes hidden and act: per token, or per row per FP8_BLOCK columns (the
    weights' block columns) for block-scaled experts."""
    return RowQuant(FP8_BLOCK if mode == ScaleMode.BLOCK else None)


def _check_act_fp8(act_fp8: bool, mode: ScaleMode, x_fp8: QuantizedRows | None, hidden: torch.Tensor) -> None:
    check_bool("act_fp8", act_fp8)
    if act_fp8 and mode == ScaleMode.NONE:
        raise ValueError("act_fp8 (W8A8) takes FP8 experts: w13 / w2 float8_e4m3fn with w13_scale / w2_scale")
    if x_fp8 is None:
        return
    if not act_fp8:
        raise ValueError("x_fp8 (hidden already quantized) takes act_fp8=True")
    if not isinstance(x_fp8, QuantizedRows):
        raise TypeError(f"x_fp8 must be a QuantizedRows, got {type(x_fp8).__name__}")
    t, h = hidden.shape
    group = act_row_quant(mode).group
    want = (t, 1) if group is None else (t, triton.cdiv(h, group))
    q, s = x_fp8.q, x_fp8.scales
    if (q.dtype != FP8_DTYPE or tuple(q.shape) != (t, h) or q.device != hidden.device or q.stride(1) != 1
            or s.dtype != torch.float32 or tuple(s.shape) != want or s.device != hidden.device):
        raise ValueError(f"x_fp8 must be hidden's rows quantized as act_row_quant({mode.name}) says: q {FP8_DTYPE} "
                         f"{(t, h)}, scales float32 {want} on {hidden.device}; got q {q.dtype} {tuple(q.shape)}, "
                         f"scales {s.dtype} {tuple(s.shape)} on {q.device}")


def _check_act_steps(act_fp8: bool, mode: ScaleMode, gate_up: Tiling, down: Tiling) -> None:
    """W8A8 with block scales: each K step lies in one activation group (`tiles` may override)."""
    if act_fp8 and mode == ScaleMode.BLOCK:
        for name, t in (("gate_up", gate_up), ("down", down)):
            if FP8_BLOCK % t.block_k:
                raise ValueError(f"act_fp8 with block scales takes K steps dividing {FP8_BLOCK} (one activation "
                                 f"group a step), got {name} block_k={t.block_k}")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              tiles: MoeTiles | None = None, act_fp8: bool = False, x_fp8: QuantizedRows | None = None) -> torch.Tensor:
    """hidden [T, H] -> [T, H] in hidden's dtype: sum_k topk_weights[t, k] * expert topk_ids[t, k]'s
    SiLU MLP (w13 [E, 2I, H] = gate | up, w2 [E, H, I]). FP8 experts: w13 / w2 float8_e4m3fn with
    w13_scale / w2_scale (per channel or per block: moe/fp8_experts.py); `act_fp8` (W8A8) quantizes
    hidden and the activation per row (block scales: per row per 128 columns) and multiplies FP8
    operands; `x_fp8` is hidden already quantized so (act_row_quant: a norm that quantizes its own
    output, moe/layer.py), else it is quantized here. `tiles` overrides moe_tiles (benchmarks)."""
    e, h, inter = check_experts(hidden, w13, w2)
    check_routing(hidden, topk_weights, topk_ids, e)
    mode = expert_scale_mode(hidden, w13, w2, w13_scale, w2_scale)
    t, k, n_pairs = hidden.shape[0], topk_ids.shape[1], topk_ids.numel()
    if tiles is not None and not isinstance(tiles, MoeTiles):
        raise TypeError(f"tiles must be a MoeTiles, got {type(tiles).__name__}")
    _check_act_fp8(act_fp8, mode, x_fp8, hidden)
    tiles, gate_up, down = plan_tiles(t, k, e, h, inter, cuda_sm_count(hidden.device), tiles,
                                      mode if act_fp8 else None)
    _check_act_steps(act_fp8, mode, gate_up, down)
    if t == 0:
        return torch.empty((0, h), dtype=hidden.dtype, device=hidden.device)
    align = moe_align(topk_ids, e, tiles.block_m)
    blocks = align.block_expert.numel()
    n_major = launch_n_major(tiles, blocks)
    # The interpreter's tl.dot takes e4m3 operands as they are (W8A8); bfloat16 ones in float32 (UPCAST).
    common = dict(TOP_K=k, BLOCK_M=tiles.block_m, N_MAJOR=n_major,
                  UPCAST=INTERPRET and hidden.dtype == torch.bfloat16 and not act_fp8,
                  DOT_PREC="ieee" if hidden.dtype == torch.float32 else None)
    a16 = dict(stride_asm=0, stride_asg=0, ACT_FP8=False)  # W8A16: no activation scales (hidden: placeholder)
    if x_fp8 is not None:
        x, a_scale, acts = x_fp8.q, x_fp8.scales, _act_fp8_strides(x_fp8.scales)
    else:
        x, a_scale, acts = _act_fp8_args(mode, hidden) if act_fp8 else (hidden, hidden, a16)
    act = torch.empty((align.sorted_pair_ids.numel(), inter), dtype=hidden.dtype, device=hidden.device)  # [P, I]
    s13, scales = scale_args(mode, w13_scale, hidden)
    _gate_up_kernel[_grid(blocks, triton.cdiv(inter, gate_up.block_n), n_major)](
        x, w13, act, align.sorted_pair_ids, align.block_expert, align.num_used_blocks,
        n_pairs, h, inter, x.stride(0), w13.stride(0), w13.stride(1), s13, as_ptr=a_scale,
        BLOCK_N=gate_up.block_n, BLOCK_K=gate_up.block_k, EVEN_K=h % gate_up.block_k == 0,
        SCALE_PER_STEP=scales_per_step(mode, gate_up.block_k),
        num_warps=gate_up.num_warps, num_stages=gate_up.num_stages, **scales, **common, **acts)
    # W8A8: act [P, I] in e4m3, its pairs' rows only (padding rows hold torch.empty's bytes: a GEMM
    # row depends on its own row of act alone, and the down kernel stores no padding row)
    act, a_scale, acts = _act_fp8_args(mode, act, align, n_pairs) if act_fp8 else (act, hidden, a16)
    # [T * K, H] in hidden's dtype: half the bytes of float32 to write and to read back in the slot sum
    pair_out = torch.empty((n_pairs, h), dtype=hidden.dtype, device=hidden.device)
    s2, scales = scale_args(mode, w2_scale, hidden)
    _down_kernel[_grid(blocks, triton.cdiv(h, down.block_n), n_major)](
        act, w2, topk_weights, pair_out, align.sorted_pair_ids, align.block_expert, align.num_used_blocks,
        n_pairs, h, inter, w2.stride(0), w2.stride(1), s2, as_ptr=a_scale,
        BLOCK_N=down.block_n, BLOCK_K=down.block_k, EVEN_K=inter % down.block_k == 0,
        SCALE_PER_STEP=scales_per_step(mode, down.block_k),
        num_warps=down.num_warps, num_stages=down.num_stages, **scales, **common, **acts)
    out = torch.empty_like(hidden)  # [T * K, H] -> [T, H]
    _slot_sum_kernel[(t, triton.cdiv(h, SLOT_SUM_COLUMNS))](pair_out, out, h, TOP_K=k, BLOCK_K=next_pow2(k),
                                                            BLOCK_H=SLOT_SUM_COLUMNS, num_warps=4)
    return out
