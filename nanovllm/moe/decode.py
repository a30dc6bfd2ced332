"""Triton mixture-of-experts for decode steps of 1-2 tokens: two GEMV-style launches, no
alignment, no [T*K, H] intermediate, no separate sum over the top k (moe/grouped_gemm.py needs
seven launches; at one token those launches, not the weight reads, dominate).

    gate_up  grid (T*K pairs, I / BN):  pair p = t*K + k, e = ids[t, k]
             act[p, n] = silu_mul(w13[e, n] . hidden[t], w13[e, I + n] . hidden[t])     act [T*K, I]
             each step: [BN, BK] of gate and of up (one expert)
    down     grid (T, H / BN):  all K experts of token t at once
             acc[k, n] = w2[ids[t, k], n] . act[t*K + k]                              acc [KP, BN]
             out[t, n] = sum_k weights[t, k] * acc[k, n]                              out [T, H]
             each step: [KP, BN, BK] = BN rows of every picked expert, KP = next_pow2(K)

moe_gemv_routed folds the routing (moe/routing.route_row) into gate_up: each program
computes its token's softmax and top k from the router logits (E values) and takes its slot's
expert; the slot-0, first-tile program of each token also writes the token's weights and ids for
the down launch. One launch (the separate routing kernel) fewer a layer.

gate_up streams BN weight rows over H in BK steps (accumulators [BN, BK] float32, as
kernels/gemv.py). down loads one 3-D tile a step, so the K experts' reads are in flight together
(one expert after another left ~4 KB in flight per program: latency-bound); it reduces over BK
every step into [KP, BN] float32. Slots K..KP-1 are masked (no loads, weight 0).
FP8 experts (moe/fp8_experts.py, W_SCALE): weights are read at one byte and converted in registers,
except gate_up's under block scales, read as int32 words of four e4m3 values converted two values
an instruction into four planes (kernels/fp8_kv.e4m3_planes; x split into the same planes,
`split_planes`): at 30B-A3B's experts 10.0 / 15.7 us at T = 1 / 2 against 10.4 / 23.3 in bytes,
where under per-channel scales words lost at T = 1 (10.3 against 7.7) and down lost 2-9% (H200,
BENCHMARKS.md, twentieth session). End to end, with the dense GEMV's word reads and tilings beside
it, Qwen3-30B-A3B's release layout went from 3.427 / 3.950 to 2.848 / 2.998 ms per token at batch
1 / 2; the gate_up words' share of that, from the kernel times, is ~0.36 ms at batch 2 (48 layers x
7.6 us), ~0.02 ms at batch 1 (not isolated end to end). Per-channel scales multiply the row sums
(gate_up) or each slot's [BN] sums (down).
Block scales: gate_up folds them into x column by column (each program's gate rows, and its up
rows, lie in one row of blocks: the wrapper halves BN until BN divides 128 and I); down multiplies
each step's [KP, BN] sums (BK divides 128), else each weight element. g, u and act are
rounded to the input dtype as the unfused MLP does; the sum over k stays float32 until the
output. Offsets are int64; no atomics (deterministic). One-wave grids launch with PDL
(kernels/pdl.py): each waits for its inputs before its first load. Shapes only set the launch: CUDA-graph
capturable. Tiles are GemvTiles; moe_gemv(tiles=...) overrides them (benchmarks/kernels/bench_moe.py
--sweep-gemv).

Measured end to end (H200, bench.py --latency, Qwen3-30B-A3B batch 1): 5.172 ms per token on the
grouped kernels -> 3.562 with these GEMVs, 2.891 after tiling and routing inside (827a097 -> bf5065a;
BENCHMARKS.md "Qwen3-MoE (#16)"); FP8 experts (`--quantization fp8`) read at one byte: 2.401 / 3.463 ms
at batch 1 / 2 against 2.916 / 4.168 with the experts dequantized to bf16 (BENCHMARKS.md, twelfth session).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from nanovllm.kernels.checks import FP8_BLOCK, MIN_DOT_DIM, ScaleMode, fp8_words
from nanovllm.kernels.fp8_kv import PER_WORD, e4m3_planes, split_planes
from nanovllm.kernels.fused_activation import silu_mul
from nanovllm.kernels.fused_norm import round_to
from nanovllm.kernels.pdl import pdl_for_grid, wait_for_prior
from nanovllm.utils.ints import next_pow2
from nanovllm.utils.validation import check_pow2

from .checks import check_experts, check_routing
from .fp8_experts import expert_scale_mode, scale_args, scales_per_step
from .routing import check_router_logits, expert_block, route_row

# Most tokens this path serves: past 2 the grouped GEMMs of moe/grouped_gemm.py read each picked
# expert once for all its tokens, where this path reads it once per (token, slot).
MAX_TOKENS = 2


@dataclass(frozen=True)
class GemvTiles:
    """Powers of two. Per-thread register tiles: gate_up 2 * BN * BK, down KP * BN * BK float32
    values over 32 * num_warps threads."""
    gate_up_block_n: int  # gate (and up) rows per program
    gate_up_block_k: int  # H columns per step
    down_block_n: int  # output columns per program
    down_block_k: int  # I columns per step
    num_warps: int  # both launches

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            check_pow2(f"GemvTiles.{f.name}", v)


# Timed by bench_moe.py --sweep-gemv on the H200 (30 candidates at 1 and 2 tokens, BENCHMARKS.md,
# 2026-12-01): 16 x 256 / 2 x 128 is 2nd at one token (0.0280 ms against 0.0272 for the best) and
# 5th at two, 2nd on the sum; the earlier 16 x 128 / 2 x 256 ranked 22nd (0.0388 ms). Wider gate/up
# tiles cost registers (164 a thread for 16 x 256, 3 programs per SM) but halve the programs.
# 16 gate/up rows: 384 programs at one token (8 pairs x 768 / 16), within one wave of 3 x 132 SMs.
GATE_UP_BLOCK_N = 16
# 256 columns: 512-byte bf16 row segments; 2 x [16, 256] float32 accumulators.
GATE_UP_BLOCK_K = 256
# 1 row: 2,048 down programs at one token, each streaming 8 experts x 1 row. The 2026-12-02 sweep
# (24 candidates): 16 x 256 / 1 x 128 first at one token (0.0263 ms, 67% of copy; 2 rows 0.0276),
# 8th at two (0.0464 ms against 0.0462 for 2 rows).
DOWN_BLOCK_N = 1
# 128 columns: [8, 1, 128] bf16 = 2 KB of weights in flight per step.
DOWN_BLOCK_K = 128
NUM_WARPS = 4
DEFAULT_TILES = GemvTiles(GATE_UP_BLOCK_N, GATE_UP_BLOCK_K, DOWN_BLOCK_N, DOWN_BLOCK_K, NUM_WARPS)


@triton.jit
def _fma_planes(acc, x, words, KW: tl.constexpr):
    """acc [N, KW] + sum_j x_j w_j: x [1, 4 KW] split into the planes (kernels/fp8_kv.split_planes)
    of the words [N, KW] of four e4m3 values (one row's columns 4c .. 4c + 3 each)."""
    w0, w1, w2, w3 = e4m3_planes(words, tl.float32)
    x0, x1, x2, x3 = split_planes(x, 1, KW)
    return acc + (x0 * w0 + x1 * w1 + x2 * w2 + x3 * w3)


@triton.jit
def _gate_up_gemv(hidden_ptr, w13_ptr, ids_ptr, act_ptr, logits_ptr, weights_ptr, hidden_size, inter, num_experts,
                  stride_h, stride_we, stride_wn, stride_l, s13_ptr, stride_se, stride_sn,
                  TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROUTE: tl.constexpr,
                  K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr,
                  W_SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    wait_for_prior(PDL)  # before any load: hidden and the ids (or the router logits) are written upstream
    pair = tl.program_id(0)
    token = pair // TOP_K
    if ROUTE:  # this token's routing, from its E logits; ids / weights are outputs
        w, ids = route_row(logits_ptr + token.to(tl.int64) * stride_l, num_experts, TOP_K, K_PAD, BLOCK_E,
                           RENORMALIZE)  # [K_PAD] each
        slots = tl.arange(0, K_PAD)
        expert = tl.sum(tl.where(slots == pair % TOP_K, ids, 0), axis=0).to(tl.int64)
        # slot 0's first tile (one program a token) publishes its TOP_K slots; the others none
        publish = slots < tl.where(pair % TOP_K + tl.program_id(1) == 0, TOP_K, 0)
        tl.store(weights_ptr + token * TOP_K + slots, w, mask=publish)
        tl.store(ids_ptr + token * TOP_K + slots, ids, mask=publish)
    else:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < inter
    rows = tl.minimum(rn, inter - 1).to(tl.int64)  # columns past I repeat row I - 1, never stored
    rk = tl.arange(0, BLOCK_K)
    # Block-scaled FP8 experts (W_SCALE 2) arrive as int32 words of PER_WORD e4m3 values (strides in words)
    KW: tl.constexpr = BLOCK_K // PER_WORD if W_SCALE == 2 else BLOCK_K
    rkw = tl.arange(0, KW)
    w = w13_ptr + expert * stride_we + rkw[None, :]
    g_ptrs = w + rows[:, None] * stride_wn  # [BLOCK_N, KW]
    u_ptrs = w + (rows + inter)[:, None] * stride_wn
    x_ptrs = hidden_ptr + token.to(tl.int64) * stride_h + rk  # [BLOCK_K]
    if W_SCALE != 0:
        s_base = s13_ptr + expert * stride_se  # this expert's scales
    if W_SCALE == 2:  # this program's gate rows lie in one row of blocks, its up rows in one (wrapper)
        first = tl.program_id(1) * BLOCK_N
        sg_row = s_base + (first // SCALE_BLOCK).to(tl.int64) * stride_sn
        su_row = s_base + ((first + inter) // SCALE_BLOCK).to(tl.int64) * stride_sn
    acc_g = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, KW), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k_ok = k0 + rk < hidden_size
        x = tl.load(x_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        if W_SCALE == 2:  # the blocks' scales, one per column here: folded into x
            kb = (k0 + rk) // SCALE_BLOCK
            xg = x * tl.load(sg_row + kb, mask=k_ok, other=0.0)[None, :]
            xu = x * tl.load(su_row + kb, mask=k_ok, other=0.0)[None, :]
        else:
            xg = x
            xu = x
        if W_SCALE == 2:
            kw_ok = (rkw + k0 // PER_WORD < hidden_size // PER_WORD)[None, :]
            acc_g = _fma_planes(acc_g, xg, tl.load(g_ptrs + k0 // PER_WORD, mask=kw_ok, other=0), KW)
            acc_u = _fma_planes(acc_u, xu, tl.load(u_ptrs + k0 // PER_WORD, mask=kw_ok, other=0), KW)
        else:
            acc_g += tl.load(g_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32) * xg
            acc_u += tl.load(u_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32) * xu
    dtype = act_ptr.dtype.element_ty
    g = tl.sum(acc_g, axis=1)  # [BLOCK_N]
    u = tl.sum(acc_u, axis=1)
    if W_SCALE == 1:  # one scale per weight row
        g *= tl.load(s_base + rows)
        u *= tl.load(s_base + rows + inter)
    g = round_to(g, dtype).to(tl.float32)
    u = round_to(u, dtype).to(tl.float32)
    tl.store(act_ptr + pair.to(tl.int64) * inter + rn, silu_mul(g, u, dtype), mask=n_ok)


@triton.jit
def _down_gemv(act_ptr, w2_ptr, ids_ptr, weights_ptr, out_ptr, hidden_size, inter, stride_we, stride_wn, stride_o,
               s2_ptr, stride_se, stride_sn,
               TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PDL: tl.constexpr, W_SCALE: tl.constexpr, SCALE_PER_STEP: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    wait_for_prior(PDL)  # act comes from the gate_up launch
    token = tl.program_id(0)
    slot = tl.arange(0, K_PAD)  # [K_PAD]; slots >= TOP_K are padding
    slot_ok = slot < TOP_K
    pair = (token * TOP_K + slot).to(tl.int64)
    expert = tl.load(ids_ptr + pair, mask=slot_ok, other=0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < hidden_size
    rows = tl.minimum(rn, hidden_size - 1).to(tl.int64)  # columns past H repeat row H - 1, never stored
    rk = tl.arange(0, BLOCK_K)
    # [K_PAD, BLOCK_N, BLOCK_K]: row rn of each slot's expert
    w_ptrs = (w2_ptr + (expert * stride_we)[:, None, None] + (rows * stride_wn)[None, :, None]
              + rk[None, None, :])
    a_ptrs = act_ptr + (pair * inter)[:, None] + rk[None, :]  # [K_PAD, BLOCK_K]
    if W_SCALE != 0:  # [K_PAD, BLOCK_N]: each slot's expert's scales of rows rn (W_SCALE 1) or their row of blocks
        s_ptrs = s2_ptr + (expert * stride_se)[:, None]
        if W_SCALE == 1:
            s_ptrs += rows[None, :]
        else:
            s_ptrs += ((rows // SCALE_BLOCK) * stride_sn)[None, :]
    acc = tl.zeros((K_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = k0 + rk < inter
        a_ok = slot_ok[:, None] & k_ok[None, :]
        a = tl.load(a_ptrs + k0, mask=a_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k0, mask=a_ok[:, None, :], other=0.0).to(tl.float32)
        if W_SCALE == 2:
            if SCALE_PER_STEP:  # BLOCK_K divides SCALE_BLOCK: one column of blocks a step
                s = tl.load(s_ptrs + k0 // SCALE_BLOCK, mask=slot_ok[:, None], other=0.0)  # [K_PAD, BLOCK_N]
                acc += tl.sum(w * a[:, None, :], axis=2) * s
            else:  # each weight element's block
                s = tl.load(s_ptrs[:, :, None] + ((k0 + rk) // SCALE_BLOCK)[None, None, :],
                            mask=a_ok[:, None, :], other=0.0)  # [K_PAD, BLOCK_N, BLOCK_K]
                acc += tl.sum(w * s * a[:, None, :], axis=2)
        else:
            acc += tl.sum(w * a[:, None, :], axis=2)
    if W_SCALE == 1:  # one scale per weight row
        acc *= tl.load(s_ptrs, mask=slot_ok[:, None], other=0.0)
    weights = tl.load(weights_ptr + pair, mask=slot_ok, other=0.0)  # float32 [K_PAD]
    total = tl.sum(acc * weights[:, None], axis=0)  # [BLOCK_N] float32
    out = out_ptr + token.to(tl.int64) * stride_o + rn
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@dataclass(frozen=True)
class _Experts:
    """Stacked experts checked for a 1..MAX_TOKENS token step (`_check_experts`) and their scale mode."""

    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    mode: ScaleMode


def _check_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                   w2_scale: torch.Tensor | None) -> _Experts:
    """These stacked experts with their scale mode, for a 1..MAX_TOKENS token step; else a clear error."""
    check_experts(hidden, w13, w2)
    if not 1 <= hidden.shape[0] <= MAX_TOKENS:
        raise ValueError(f"moe_gemv serves 1..{MAX_TOKENS} tokens, got {hidden.shape[0]}")
    return _Experts(w13, w2, w13_scale, w2_scale, expert_scale_mode(hidden, w13, w2, w13_scale, w2_scale))


def moe_gemv(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, tiles: GemvTiles | None = None, *, w13_scale: torch.Tensor | None = None,
             w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as moe/grouped_gemm.fused_moe for 1..MAX_TOKENS tokens: hidden [T, H] -> [T, H]
    in hidden's dtype; w13 [E, 2I, H] (gate | up), w2 [E, H, I] (FP8 with w13_scale / w2_scale:
    moe/fp8_experts.py), topk_weights [T, K] float32, topk_ids [T, K] int32/int64 (contiguous).
    `tiles` overrides DEFAULT_TILES (benchmarks)."""
    experts = _check_experts(hidden, w13, w2, w13_scale, w2_scale)
    check_routing(hidden, topk_weights, topk_ids, w13.shape[0])
    return _launch(hidden, experts, topk_weights, topk_ids, None, False, tiles)


def moe_gemv_routed(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
                    top_k: int, renormalize: bool, tiles: GemvTiles | None = None, *,
                    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_route + moe_gemv in moe_gemv's two launches: router_logits [T, E] (E = w13's experts;
    float16/bfloat16/float32, contiguous last dim) -> (out [T, H], weights [T, K] float32, ids
    [T, K] int32), the routing exactly as moe_route gives it. FP8 experts as in moe_gemv."""
    experts = _check_experts(hidden, w13, w2, w13_scale, w2_scale)
    t = hidden.shape[0]
    tokens, num_experts = check_router_logits(router_logits, top_k)
    if tokens != t or num_experts != w13.shape[0] or router_logits.device != hidden.device:
        raise ValueError(f"router_logits {tuple(router_logits.shape)} on {router_logits.device} must be "
                         f"[{t}, {w13.shape[0]}] on {hidden.device}")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=hidden.device)  # [T, K], written by gate_up
    ids = torch.empty((t, top_k), dtype=torch.int32, device=hidden.device)  # [T, K], written by gate_up
    out = _launch(hidden, experts, weights, ids, router_logits, bool(renormalize), tiles)
    return out, weights, ids


def _gate_up_rows(block_n: int, inter: int, mode: ScaleMode) -> int:
    """gate_up's rows per program: block_n, halved under block scales until every program's gate
    rows and up rows each lie in one row of blocks (a power of two dividing FP8_BLOCK and I)."""
    while mode == ScaleMode.BLOCK and (FP8_BLOCK % block_n or inter % block_n):
        block_n //= 2
    return block_n


def _launch(hidden: torch.Tensor, experts: _Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            router_logits: torch.Tensor | None, renormalize: bool, tiles: GemvTiles | None) -> torch.Tensor:
    """The two launches on checked arguments; with router_logits, gate_up routes and writes
    topk_weights / topk_ids."""
    w13, w2, mode = experts.w13, experts.w2, experts.mode
    if tiles is None:
        tiles = DEFAULT_TILES
    if not isinstance(tiles, GemvTiles):
        raise TypeError(f"tiles must be a GemvTiles or None, got {type(tiles).__name__}")
    (t, h), inter, k = hidden.shape, w2.shape[2], topk_ids.shape[1]
    route = router_logits is not None
    act = torch.empty((t * k, inter), dtype=hidden.dtype, device=hidden.device)  # [T * K, I]
    gate_up_n = _gate_up_rows(tiles.gate_up_block_n, inter, mode)
    gate_up_grid = (t * k, triton.cdiv(inter, gate_up_n))
    s13, scales13 = scale_args(mode, experts.w13_scale, hidden)
    w13_arg = fp8_words(w13, "block-scaled FP8 experts") if mode == ScaleMode.BLOCK else w13  # gate_up's words
    _gate_up_gemv[gate_up_grid](
        hidden, w13_arg, topk_ids, act, router_logits if route else hidden, topk_weights, h, inter, w13.shape[0],
        hidden.stride(0), w13_arg.stride(0), w13_arg.stride(1), router_logits.stride(0) if route else 0, s13,
        **scales13,
        TOP_K=k, BLOCK_N=gate_up_n, BLOCK_K=max(MIN_DOT_DIM, min(tiles.gate_up_block_k, next_pow2(h))),
        ROUTE=route, K_PAD=next_pow2(k), BLOCK_E=expert_block(w13.shape[0]), RENORMALIZE=renormalize,
        num_warps=tiles.num_warps, **pdl_for_grid(hidden, gate_up_grid[0] * gate_up_grid[1]))
    out = torch.empty((t, h), dtype=hidden.dtype, device=hidden.device)  # [T, H]
    down_grid = (t, triton.cdiv(h, tiles.down_block_n))
    down_k = max(MIN_DOT_DIM, min(tiles.down_block_k, next_pow2(inter)))
    s2, scales2 = scale_args(mode, experts.w2_scale, hidden)
    _down_gemv[down_grid](
        act, w2, topk_ids, topk_weights, out, h, inter, w2.stride(0), w2.stride(1), out.stride(0), s2, **scales2,
        TOP_K=k, K_PAD=next_pow2(k), BLOCK_N=tiles.down_block_n, BLOCK_K=down_k,
        SCALE_PER_STEP=scales_per_step(mode, down_k),
        num_warps=tiles.num_warps, **pdl_for_grid(hidden, down_grid[0] * down_grid[1]))
    return out
