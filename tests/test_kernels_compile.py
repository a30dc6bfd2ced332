"""The kernels compile for a Hopper GPU (sm_90), on a machine without one.

CI runs the kernels under Triton's CPU interpreter only, which executes them as Python and so
accepts code the compiler refuses (a plain float global cost 57 GPU tests once). Triton ships the
NVIDIA backend and ptxas, so `triton.compile` with an explicit target builds the kernel to a cubin
with no GPU present. This runs in a subprocess with the interpreter off (pytest's process has the
kernels decorated for the interpreter), for every kernel the engine launches, in the variants
listed in SPECS: each constexpr branch the engine takes (PDL on and off, k = 0 and k > 0, top-k not
a power of two, paged or packed, tiled or not, split or folded decode, ...).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nanovllm.kernels.checks import FP8_PER_WORD
from nanovllm.kernels.decode_plan import FP8_BLOCK_N, FP8_STAGES
from nanovllm.moe import tiles as moe_tiles
from nanovllm.kernels.checks import ScaleMode
from nanovllm.moe.fp8_experts import scales_per_step
from nanovllm.moe.decode import DEFAULT_TILES as DECODE_TILES
from nanovllm.sampling.topk_sample import LIST_SHAPES

ROOT = Path(__file__).resolve().parent.parent
# Hopper: the GPU the project is measured on (H200); PDL needs compute capability 9.0.
TARGET_ARCH = 90
WARP_SIZE = 32

# The packages that define Triton kernels.
KERNEL_PACKAGES = ("kernels", "moe", "sampling")
# Launch options a variant may set beside its constexprs, with the values a launch takes by default.
DEFAULT_OPTIONS = {"num_warps": 4, "num_stages": 3}
# The KV-cache kernels' scale pointers: None (a constexpr) for a 16-bit cache, float32 for an FP8 one,
# whose K/V pointers are then e4m3 (kernels/fp8_kv.py).
NO_KV_SCALES = {"k_scale_ptr": None, "v_scale_ptr": None}
FP8_KV_SCALES = {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
FP8 = "*fp8e4nv"
# The decode kernel reads an FP8 cache as int32 words of FP8_PER_WORD values (kernels/decode_fp8.py).
FP8_WORDS = "*i32"
# The MoE kernels' FP8 experts: e4m3 weights and float32 scales (moe/fp8_experts.py).
MOE_FP8 = {"w13_ptr": FP8, "w2_ptr": FP8, "s13_ptr": "*fp32", "s2_ptr": "*fp32"}
# ... which the decode gate_up GEMV reads as int32 words of four under block scales (moe/decode.py).
MOE_FP8_WORDS = {**MOE_FP8, "w13_ptr": FP8_WORDS}
# ... and their W8A8 variant's float32 activation scales (the e4m3 activation pointer is per kernel).
MOE_FP8_ACT = {**MOE_FP8, "as_ptr": "*fp32"}
# W8A8 blocks of this many rows and more must multiply on Hopper's FP8 tensor cores (wgmma with e4m3
# operands, FP8_MMA in the PTX); 32-row blocks lower to mma.sync, which takes the e4m3 values as fp16.
WGMMA_ROWS = 64
FP8_MMA = "f32.e4m3.e4m3"
# The attention kernels over the paged cache: at 3+ stages their K/V tiles must be double-buffered in
# shared memory (the next tile's copies in flight while this one's MMAs run; kernels/paging.py says
# what once left them single-buffered).
PIPELINED_KV_KERNELS = ("_decode_split_kernel", "_prefill_kernel")
# An int parameter that real launches pass as a multiple of 16, which Triton then specializes on
# (its `tt.divisibility`). Left unmarked, the skinny GEMM's K offsets have no known alignment: its
# weight loads compile one element at a time and are not pipelined, which a real launch never sees
# (the twenty-third session read byte-wise FP8 loads from such a compile; the twenty-fourth found why).
INT_MULTIPLE_OF_16 = "i32 (multiple of 16)"
# Kernels whose operand tiles must reach shared memory through async copies with some in flight.
PIPELINED_TILE_KERNELS = ("_skinny_gemm_kernel",)
# the skinny GEMM's shape ints on engine layers (widths and K slices are multiples of 16)
SKINNY_INTS = {name: INT_MULTIPLE_OF_16 for name in ("n_out", "k_in", "k_per")}
ROPE_TYPES = {"pos_ptr": "*i64", "cache_ptr": "*fp32", "slot_ptr": "*i64", "eps": "fp32"}
PREFILL_TYPES = {"cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "bt_ptr": "*i32", "tile_seq_ptr": "*i32",
                 "tile_block_ptr": "*i32", "num_tiles_ptr": "*i32", "qk_scale": "fp32"}
DECODE_TYPES = {"seqlens_ptr": "*i32", "bt_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32",
                "count_ptr": "*i32", "num_seqs_ptr": "*i32", "members_ptr": "*i32", "shared_ptr": "*i32",
                "qk_scale": "fp32"}
# A decode launch without rows in groups (kernels/decode_groups.py): its group pointers are None.
NO_GROUPS = {"members_ptr": None, "shared_ptr": None}
# The decode kernel's launches: (splits, fold, rows on device, keys per tile, rows in groups); 128-key
# tiles are those of unsplit grids with few programs per SM.
DECODE_LAUNCHES = ((1, False, False, 64, False), (8, True, False, 64, False), (8, False, False, 64, False),
                   (1, False, True, 64, False), (1, False, False, 64, True), (1, False, False, 128, False),
                   (1, False, False, 128, True))
# An FP8 cache's launches: the same, at its own tile (decode_plan.FP8_BLOCK_N keys).
FP8_DECODE_LAUNCHES = [(splits, fold, rows, FP8_BLOCK_N, grouped) for splits, fold, rows, n, grouped in DECODE_LAUNCHES
                       if n == 64]

# (module, kernel, argument types by name (pointers default to *bf16, strides to i64, other
# scalars to i32), each variant's constexpr values and launch options)

def grouped_gemm_constexprs(block_m: int, t: moe_tiles.Tiling, scale: int, act_fp8: bool, n_major: bool = False) -> dict:
    """A grouped-GEMM kernel's constexprs and launch options (both GEMMs take the same), as fused_moe
    sets them for a block height, a tiling, a scale mode (W_SCALE) and W8A8 or not."""
    return {"TOP_K": 8, "BLOCK_M": block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "EVEN_K": True,
            "UPCAST": False, "DOT_PREC": None, "W_SCALE": scale,
            "SCALE_PER_STEP": scales_per_step(ScaleMode(scale), t.block_k), "SCALE_BLOCK": 128, "ACT_FP8": act_fp8,
            "N_MAJOR": n_major,
            "num_warps": t.num_warps, "num_stages": t.num_stages}


def wide(scale: int | None, gemm: str) -> tuple[int, moe_tiles.Tiling, bool]:
    """(block_m, tiling, n_major) of a gemm ("gate_up" / "down") under PREFILL_WIDE: the prefill calls over many
    pairs an expert, W8A8 at a scale mode, or bf16 / W8A16 (None)."""
    tiles = moe_tiles.PREFILL_WIDE[None if scale is None else ScaleMode(scale)]
    return tiles.block_m, getattr(tiles, gemm), tiles.n_major

SPECS = [
    # logprobs at the serving vocabulary (151,936 = 38 chunks of 4096): k = 0, 5 and 20, scored rows
    # given or all (the prompt-logprobs path), bfloat16 and float32 logits.
    ("sampling.logprobs_kernel", "_logprobs_kernel", {"rows_ptr": "*i64", "tokens_ptr": "*i64", "counter_ptr": "*i32", "work_ptr": "*i64",
                                      "chosen_ptr": "*fp32", "rank_ptr": "*i64", "top_id_ptr": "*i64",
                                      "top_lp_ptr": "*fp32"},
     [{"HAS_ROWS": rows, "K": k, "K_PAD": max(1, 1 << (k - 1).bit_length()) if k else 1, "BLOCK": 4096, "S": 32,
       "C_PAD": 64, "KEYS_PAD": 1 << (38 * k - 1).bit_length() if k else 1}
      for rows, k in ((True, 0), (True, 5), (True, 20), (False, 5))]),
    ("sampling.logprobs_kernel", "_logprobs_kernel", {"x_ptr": "*fp32", "rows_ptr": "*i64", "tokens_ptr": "*i64",
                                      "counter_ptr": "*i32", "work_ptr": "*i64", "chosen_ptr": "*fp32", "rank_ptr": "*i64",
                                      "top_id_ptr": "*i64", "top_lp_ptr": "*fp32"},
     [{"HAS_ROWS": True, "K": k, "K_PAD": 8 if k else 1, "BLOCK": 4096, "S": 32, "C_PAD": 64,
       "KEYS_PAD": 256 if k else 1} for k in (0, 5)]),
    # penalties on float32 logits rows from int32 token counts, at the serving block: in place, and
    # from the model's bfloat16 logits (the copy in the same pass)
    *(("sampling.penalties_kernel", "_penalties_kernel", {"src_ptr": src, "x_ptr": "*fp32", "counts_ptr": "*i32",
                                                        "rows_ptr": "*i64", "slots_ptr": "*i64", "rep_ptr": "*fp32",
                                                        "freq_ptr": "*fp32", "pres_ptr": "*fp32"},
       [{"BLOCK": 4096, "num_warps": 8}]) for src in ("*fp32", "*bf16")),
    # top-k/top-p radix select at the serving vocabulary (38 chunks of 4096): first / second / later
    # passes, counts (top-k) and masses (top-p), and the final choice
    ("sampling.radix_filter", "_histogram_kernel", {"probs_ptr": "*fp32", "target_ptr": "*fp32", "floor_ptr": "*i32",
                                              "part_in_ptr": "*fp32", "part_out_ptr": "*fp32",
                                              "prefix_in_ptr": "*i32", "state_in_ptr": "*fp32",
                                              "prefix_out_ptr": "*i32", "state_out_ptr": "*fp32"},
     [{"PASS0": i == 0, "FIRST": i == 1, "WEIGHTED": w, "BINS": 16, "CHUNK": 4096, "TILE": 256, "C_PAD": 64}
      for i in (0, 1, 2) for w in (False, True)]),
    ("sampling.radix_filter", "_final_kernel", {"target_ptr": "*fp32", "floor_ptr": "*i32", "part_ptr": "*fp32",
                                          "prefix_ptr": "*i32", "state_ptr": "*fp32", "out_ptr": "*i32"},
     [{"WEIGHTED": w, "BINS": 16, "C_PAD": 64} for w in (False, True)]),
    ("moe.routing", "_route_kernel", {"weights_ptr": "*fp32", "ids_ptr": "*i32"},
     [{"TOP_K": 8, "K_PAD": 8, "BLOCK_E": 128, "RENORMALIZE": r, "PDL": p} for r in (True, False) for p in (True, False)]),
    # routed ids given, or routing from bf16 logits folded in (128 experts, top 8); bf16 weights, or
    # FP8 ones with a scale per row (W_SCALE 1) or per 128 x 128 block (2: per step or per element)
    *[("moe.decode", "_gate_up_gemv", {"ids_ptr": "*i32", "weights_ptr": "*fp32", **types},
       [{"TOP_K": 8, "BLOCK_N": DECODE_TILES.gate_up_block_n, "BLOCK_K": DECODE_TILES.gate_up_block_k,
         "ROUTE": route, "K_PAD": 8, "BLOCK_E": 128, "RENORMALIZE": route, "PDL": p, "W_SCALE": scale,
         "SCALE_BLOCK": 128} for route in (False, True) for p in (True, False)])
      for scale, types in ((0, {}), (1, MOE_FP8), (2, MOE_FP8_WORDS))],
    *[("moe.decode", "_down_gemv", {"ids_ptr": "*i32", "weights_ptr": "*fp32", **types},
       [{"TOP_K": k, "K_PAD": 1 << (k - 1).bit_length(), "BLOCK_N": DECODE_TILES.down_block_n,
         "BLOCK_K": block_k, "PDL": p, "W_SCALE": scale, "SCALE_PER_STEP": block_k <= 128, "SCALE_BLOCK": 128}
        for k in (8, 6, 1) for p in (True, False)])
      for scale, types, block_k in ((0, {}, DECODE_TILES.down_block_k), (1, MOE_FP8, DECODE_TILES.down_block_k),
                                    (2, MOE_FP8, 128), (2, MOE_FP8, 256))],
    # The fused MoE's grouped GEMMs at the engine's decode and prefill tilings (moe/grouped_gemm.py),
    # bf16 or FP8 weights as above (block scales per K step; 256-column steps: per element).
    *[("moe.grouped_gemm", "_gate_up_kernel", {"sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                                               "num_used_ptr": "*i32", **types},
       [grouped_gemm_constexprs(m, t, scale, act_fp8=False, n_major=major)
        for m, t, major in ((16, moe_tiles.DECODE_GATE_UP, False), (32, moe_tiles.DECODE_GATE_UP, False),
                            (64, moe_tiles.PREFILL_GATE_UP, True), (16, replace(moe_tiles.DECODE_GATE_UP, block_k=256), False),
                            wide(None, "gate_up"))])
      for scale, types in ((0, {}), (1, MOE_FP8), (2, MOE_FP8))],
    # ... W8A8 (ACT_FP8): e4m3 hidden with float32 per-token (per-group) scales, e4m3 x e4m3 MMAs
    # (checked in the PTX at 64 rows, the block height of the steps the route sends there)
    *[("moe.grouped_gemm", "_gate_up_kernel", {"sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                                               "num_used_ptr": "*i32", **MOE_FP8_ACT, "hidden_ptr": FP8},
       [grouped_gemm_constexprs(m, t, scale, act_fp8=True, n_major=major)
        for m, t, major in ((64, moe_tiles.PREFILL_W8A8[ScaleMode(scale)], True),
                            (32, moe_tiles.DECODE_W8A8_GATE_UP[ScaleMode(scale)], False),
                            wide(scale, "gate_up"))])
      for scale in (1, 2)],
    *[("moe.grouped_gemm", "_down_kernel", {"weights_ptr": "*fp32", "out_ptr": "*fp32", "sorted_ptr": "*i32",
                                            "block_expert_ptr": "*i32", "num_used_ptr": "*i32", **types},
       [grouped_gemm_constexprs(m, t, scale, act_fp8=False, n_major=major)
        for m, t, major in ((16, moe_tiles.DECODE_DOWN, False), (32, moe_tiles.DECODE_DOWN, False),
                            (64, moe_tiles.PREFILL_DOWN, True), (16, replace(moe_tiles.DECODE_DOWN, block_k=256), False),
                            wide(None, "down"))])
      for scale, types in ((0, {}), (1, MOE_FP8), (2, MOE_FP8))],
    *[("moe.grouped_gemm", "_down_kernel", {"weights_ptr": "*fp32", "out_ptr": "*fp32", "sorted_ptr": "*i32",
                                            "block_expert_ptr": "*i32", "num_used_ptr": "*i32", **MOE_FP8_ACT,
                                            "act_ptr": FP8},
       [grouped_gemm_constexprs(m, t, scale, act_fp8=True, n_major=major)
        for m, t, major in ((64, moe_tiles.PREFILL_W8A8[ScaleMode(scale)], True), (32, moe_tiles.DECODE_DOWN, False),
                            wide(scale, "down"))])
      for scale in (1, 2)],
    # the slot sum: [T * K, H] float32 -> [T, H] bf16 (K = 8, Qwen3-30B-A3B)
    ("moe.grouped_gemm", "_slot_sum_kernel", {"pair_ptr": "*fp32", "out_ptr": "*bf16"},
     [{"TOP_K": 8, "BLOCK_K": 8, "BLOCK_H": 1024}]),
    # The 1-4 row projections (kernels/gemv.py): wide (PDL, L2 prefetch) and narrow (evict-first) tilings.
    ("kernels.gemv", "_gemv_kernel", {"eps": "fp32"},
     [{"SILU_MUL": silu, "HAS_BIAS": bias, "BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "EVEN_K": True, "STAGES": st,
       "EVICT": ev, "PREFETCH": pdl, "LINE_ELEMS": 64, "PDL": pdl, "NORM": norm, "HAS_RES": res,
       "BLOCK_KF": 1024 if norm else 16, "W_SCALE": 0, "SCALE_BLOCK": 128}
      for silu, bias, m, n, k, st, ev, pdl, norm, res in (
          (False, False, 1, 8, 512, 3, "", True, False, False),
          (True, True, 2, 4, 512, 4, "evict_first", False, False, False),
          (False, False, 1, 16, 256, 4, "", True, True, True),  # the add + RMSNorm in front (TALL tiles)
          (False, True, 2, 8, 512, 3, "", True, True, False))]),
    # ... with FP8 weights (int32 words of four e4m3), a scale per row (1) or per 128 x 128 block (2), each prologue
    ("kernels.gemv", "_gemv_kernel", {"eps": "fp32", "w_ptr": FP8_WORDS, "ws_ptr": "*fp32"},
     [{"SILU_MUL": silu, "HAS_BIAS": False, "BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "EVEN_K": True, "STAGES": st,
       "EVICT": ev, "PREFETCH": pdl, "LINE_ELEMS": 32, "PDL": pdl, "NORM": norm, "HAS_RES": norm,
       "BLOCK_KF": 4096 if norm else 16, "W_SCALE": scale, "SCALE_BLOCK": 128}
      for silu, m, n, k, st, ev, pdl, norm, scale in (
          (False, 1, 8, 512, 3, "", True, False, 2),
          (True, 2, 4, 512, 4, "evict_first", False, False, 2),
          (False, 1, 16, 256, 4, "", True, True, 2),
          (False, 2, 8, 512, 3, "", True, False, 1),
          (True, 1, 8, 512, 3, "", True, False, 1),
          # block scales at 128-column steps (gemv_plan.BLOCK_SCALED_*): one scale a step
          (False, 1, 32, 128, 4, "", True, True, 2),
          (True, 2, 16, 128, 8, "", True, False, 2),
          # two rows, per-row scales, 1,024-column steps (gemv_plan.FP8_ROWS_WIDE): o and down
          (False, 2, 8, 1024, 3, "", True, False, 1),
          (True, 2, 8, 1024, 3, "", True, False, 1),
          # ... and at one row past a wave (8B gate_up, behind the add + RMSNorm: no PDL)
          (False, 1, 8, 1024, 3, "", False, True, 1))]),
    # FP8 activation quantization: per token (4096-column steps), per 128-group, static
    # (one step when the part fits a BLOCK; MoE activations skip their padding rows); per token with
    # fbgemm_fp8's amax bound
    ("kernels.fp8_quant", "_quant_kernel", {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "static_ptr": "*fp32",
                                            "pairs_ptr": "*i32"},
     [{"STATIC": static, "BLOCK": block, "ONE_STEP": one, "SKIP_PADDING": skip, "GROUP": group, "STATIC_PARTS": parts,
       "AMAX_UB": ub}
      for static, block, one, skip, group, parts, ub in (
          (False, 4096, False, False, 0, 0, None), (False, 1024, True, True, 0, 0, None),
          (False, 1024, True, False, 128, 0, None), (False, 1024, True, True, 128, 0, None),
          (True, 4096, True, False, 0, 3, None), (True, 4096, False, False, 0, 1, None),
          (False, 4096, True, False, 0, 0, 1200.0), (False, 4096, False, False, 0, 0, 1200.0))]),
    # The rest of the engine's kernels, at the Qwen3 shapes (head_dim 128, hidden 1024, GQA 2, block 256).
    ("kernels.fused_norm", "_rms_norm_kernel", {"eps": "fp32"},
     [{"HAS_RESIDUAL": r, "BLOCK_H": h, "ROWS": rows, "QUANT": None, "GROUP": 1, "PDL": p, "STATIC_PARTS": 0,
       "AMAX_UB": None, "num_warps": w}
      for r in (True, False) for p in (True, False) for h, rows, w in ((1024, 1, 4), (128, 8, 4))]),
    # ... quantizing its output for an FP8 layer (8B hidden 4096: one row a program at 16 warps)
    ("kernels.fused_norm", "_rms_norm_kernel", {"eps": "fp32", "out_ptr": FP8, "s_ptr": "*fp32", "static_ptr": "*fp32"},
     [{"HAS_RESIDUAL": r, "BLOCK_H": 4096, "ROWS": 1, "QUANT": mode, "GROUP": group, "PDL": True,
       "STATIC_PARTS": 3 if mode == "static" else 0, "AMAX_UB": ub, "num_warps": 16}
      for r in (True, False) for mode, group, ub in (("token", 1, None), ("group", 128, None), ("static", 1, None),
                                                     ("token", 1, 1200.0))]),
    ("kernels.fused_activation", "_silu_and_mul_kernel", {}, [{"BLOCK": 1024, "PDL": p} for p in (True, False)]),
    # ... quantizing its output per 128-column group or with a static scale
    ("kernels.fused_activation", "_silu_and_mul_fp8_kernel", {"q_ptr": FP8, "s_ptr": "*fp32", "static_ptr": "*fp32"},
     [{"QUANT": mode, "GROUP": group, "BLOCK": 1024, "PDL": True, "STATIC_PARTS": parts, "num_warps": 4}
      for mode, group, parts in (("group", 128, 0), ("static", 1, 2))]),
    ("kernels.fused_rope", "_qk_norm_rope_kernel", ROPE_TYPES,
     [{"HEAD_DIM": 128, "HEADS": 8, "BLOCK_HALF": 64, "APPLY_NORM": n, "STORE_KV": kv, "BLOCK_SIZE": 256 if kv else 1,
       "PDL": p, **NO_KV_SCALES} for n in (True, False) for kv in (True, False) for p in (True, False)]),
    # the K/V write into an FP8 cache (quantized with the layer's scales)
    ("kernels.fused_rope", "_qk_norm_rope_kernel", {**ROPE_TYPES, "k_cache_ptr": FP8, "v_cache_ptr": FP8, **FP8_KV_SCALES},
     [{"HEAD_DIM": 128, "HEADS": 8, "BLOCK_HALF": 64, "APPLY_NORM": n, "STORE_KV": True, "BLOCK_SIZE": 256, "PDL": True}
      for n in (True, False)]),
    ("kernels.prefill_attention", "_prefill_kernel", PREFILL_TYPES,
     [{"GROUP": 2, "HEAD_DIM": 128, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_SIZE": 256, "CAUSAL": True,
       "PAGED": paged, "TILED": tiled, "DOT_PREC": None, "UPCAST": False, **NO_KV_SCALES} for paged in (True, False)
      for tiled in (True, False)]),
    # paged FP8 caches (packed K/V are never FP8)
    ("kernels.prefill_attention", "_prefill_kernel", {**PREFILL_TYPES, "k_ptr": FP8, "v_ptr": FP8, **FP8_KV_SCALES},
     [{"GROUP": 2, "HEAD_DIM": 128, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_SIZE": 256, "CAUSAL": True,
       "PAGED": True, "TILED": tiled, "DOT_PREC": None, "UPCAST": False} for tiled in (True, False)]),
    *[("kernels.decode_attention", "_decode_split_kernel", types,
       [{"GROUP": 2, "PACK": 1, "BLOCK_G": 16, "HEAD_DIM": 128, "BLOCK_N": n, "BLOCK_SIZE": 256, "NUM_SPLITS": splits,
         "DOT_PREC": None, "UPCAST": False, "FOLD": fold, "GP": 2, "BLOCK_S": splits,
         "ROWS_ON_DEVICE": rows, "PDL": True, **extra, **({} if grouped else NO_GROUPS)}
        for splits, fold, rows, n, grouped in launches])
      # 16-bit caches, then FP8 ones: int32 words of four values, at their own tile (decode_plan)
      for types, extra, launches in (
          (DECODE_TYPES, NO_KV_SCALES, DECODE_LAUNCHES),
          ({**DECODE_TYPES, "k_ptr": FP8_WORDS, "v_ptr": FP8_WORDS, **FP8_KV_SCALES}, {"num_stages": FP8_STAGES},
           FP8_DECODE_LAUNCHES),
          # an FP8 cache of narrow heads (Qwen2.5-0.5B's 14 / 2 of 64): two kv heads a program (heads_per_program)
          ({**DECODE_TYPES, "k_ptr": FP8_WORDS, "v_ptr": FP8_WORDS, **FP8_KV_SCALES},
           {"num_stages": FP8_STAGES, "GROUP": 7, "PACK": 2, "HEAD_DIM": 64, "GP": 16}, FP8_DECODE_LAUNCHES))],
    # a float32 q over an FP8 cache: fp32 planes, IEEE dots
    ("kernels.decode_attention", "_decode_split_kernel",
     {**DECODE_TYPES, "q_ptr": "*fp32", "out_ptr": "*fp32", "k_ptr": FP8_WORDS, "v_ptr": FP8_WORDS, **FP8_KV_SCALES},
     [{"GROUP": 2, "PACK": 1, "BLOCK_G": 16, "HEAD_DIM": 128, "BLOCK_N": FP8_BLOCK_N, "BLOCK_SIZE": 256, "NUM_SPLITS": 1,
       "DOT_PREC": "ieee", "UPCAST": False, "FOLD": False, "GP": 2, "BLOCK_S": 1,
       "ROWS_ON_DEVICE": False, "PDL": True, "num_stages": FP8_STAGES, **NO_GROUPS}]),
    ("kernels.decode_attention", "_decode_merge_kernel", {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32"},
     [{"NUM_SPLITS": 8, "BLOCK_S": 8, "HEAD_DIM": 128, "PDL": True}]),
    # the skinny GEMM: the default tiles of a narrow layer at 16 rows (split-K 8), 64-row tiles with a bias
    ("kernels.skinny_gemm", "_skinny_gemm_kernel", {"ws_ptr": "*fp32", "count_ptr": "*i32", **SKINNY_INTS},
     [{"HAS_BIAS": bias, "BLOCK_M": bm, "BLOCK_N": 32, "BLOCK_K": 128, "EVEN_K": True, "STAGES": 3,
       "DOT_PREC": None, "UPCAST": False, "PREFETCH": True, "LINE_ELEMS": 64, "PDL": True, "SPLIT_K": split,
       "W_SCALE": 0, "SCALE_BLOCK": 128, "X_SCALE": 0}
      for bias, bm, split in ((False, 16, 8), (True, 64, 1), (False, 64, 4))]),
    # ... on FP8 weights (per-row and block scales), the layers' FP8 tilings (_fp8_tiling)
    ("kernels.skinny_gemm", "_skinny_gemm_kernel", {"w_ptr": FP8, "ws_ptr": "*fp32", "count_ptr": "*i32",
                                                    "scale_ptr": "*fp32", **SKINNY_INTS},
     [{"HAS_BIAS": False, "BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "EVEN_K": True, "STAGES": stages,
       "DOT_PREC": None, "UPCAST": False, "PREFETCH": True, "LINE_ELEMS": 128, "PDL": True, "SPLIT_K": split,
       "W_SCALE": w_scale, "SCALE_BLOCK": 128, "X_SCALE": 0}
      for bm, stages, split, w_scale in ((16, 6, 1, 1), (16, 4, 4, 2), (32, 4, 2, 1), (32, 6, 1, 2))]),
    # ... W8A8: e4m3 activations with per-token / per-group scales
    ("kernels.skinny_gemm", "_skinny_gemm_kernel", {"x_ptr": FP8, "w_ptr": FP8, "ws_ptr": "*fp32", "count_ptr": "*i32",
                                                    "scale_ptr": "*fp32", "xs_ptr": "*fp32", **SKINNY_INTS},
     [{"HAS_BIAS": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "EVEN_K": True, "STAGES": 4,
       "DOT_PREC": None, "UPCAST": False, "PREFETCH": True, "LINE_ELEMS": 128, "PDL": True, "SPLIT_K": split,
       "W_SCALE": mode, "SCALE_BLOCK": 128, "X_SCALE": mode}
      for split, mode in ((1, 1), (4, 2))]
     + [{"HAS_BIAS": False, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "EVEN_K": True, "STAGES": 3,
         "DOT_PREC": None, "UPCAST": False, "PREFETCH": True, "LINE_ELEMS": 128, "PDL": True, "SPLIT_K": 1,
         "W_SCALE": 1, "SCALE_BLOCK": 128, "X_SCALE": 1}]),
    ("sampling.gumbel_max", "_gumbel_sample_kernel", {"temperature_ptr": "*fp32", "key_ptr": "*i64", "best_ptr": "*fp32",
                                             "best_col_ptr": "*i32"},
     [{"IS_PROBS": False, "SUB": 256, "TILES_PER_CHUNK": 4}]),
    ("sampling.gumbel_max", "_gumbel_sample_kernel", {"x_ptr": "*fp32", "temperature_ptr": "*fp32", "key_ptr": "*i64",
                                             "best_ptr": "*fp32", "best_col_ptr": "*i32"},
     [{"IS_PROBS": True, "SUB": 256, "TILES_PER_CHUNK": 4}]),
    # top-p / min-p by the candidate walk: each filter alone and both, bfloat16 and float32 logits
    *[("sampling.candidate_walk", "_walk_sample_kernel", {"x_ptr": x, "temperature_ptr": "*fp32", "key_ptr": "*i64",
                                                 "top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "out_ptr": "*i64"},
       [{"HAS_TOP_P": p, "HAS_MIN_P": mp, "SUB": 256, "STEP_TILES": 8, "num_warps": 8}
        for p, mp in ((True, False), (False, True), (True, True))])
      for x in ("*bf16", "*fp32")],
    # top-k sampling (sampling/topk_sample.py) at the serving vocabulary (38 chunks): every list shape,
    # bfloat16 and float32 logits, with and without top-p / min-p
    *[("sampling.topk_sample", "_chunk_top_kernel", {"x_ptr": x, "temperature_ptr": "*fp32", "slot_ptr": "*i64",
                                                    "eq_ptr": "*i32"},
       [{"K": sh.k, "NG": sh.groups, "CAP": sh.cap, "CHUNK": 4096, "num_warps": 8} for sh in LIST_SHAPES])
      for x in ("*bf16", "*fp32")],
    *[("sampling.topk_sample", "_row_sample_kernel", {"x_ptr": x, "temperature_ptr": "*fp32", "key_ptr": "*i64",
                                                     "top_k_ptr": "*i64", "top_p_ptr": "*fp32", "min_p_ptr": "*fp32",
                                                     "slot_ptr": "*i64", "eq_ptr": "*i32", "out_ptr": "*i64"},
       [{"HAS_TOP_P": p, "HAS_MIN_P": mp, "K": sh.k, "CAP": sh.cap, "C_PAD": 64, "SUB": 256, "num_warps": 8}
        for sh in LIST_SHAPES for p, mp in ((False, False), (True, False), (True, True))])
      for x in ("*bf16", "*fp32")],
    # structured outputs' token masks: bfloat16 and float32 logits
    *[("sampling.token_mask_kernel", "_token_mask_kernel", {"logits_ptr": x, "rows_ptr": "*i64", "bitmask_ptr": "*i32"},
       [{"BLOCK": 1024}]) for x in ("*bf16", "*fp32")],
    ("moe.align", "_count_kernel", {f"{n}_ptr": "*i32" for n in ("ids", "counts", "sorted")},
     [{"SLICE": 32, "BLOCK_E": 128, "FILL": 1024}]),
    ("moe.align", "_scan_kernel", {f"{n}_ptr": "*i32" for n in ("counts", "offsets", "base", "num_used")},
     [{"BLOCK_E": 128, "BLOCK_M": 16, "ROWS": 32}]),
    ("moe.align", "_scatter_kernel", {f"{n}_ptr": "*i32" for n in ("ids", "offsets", "base", "sorted", "block_expert")},
     [{"SLICE": 32, "BLOCK_E": 128, "BLOCK_M": m} for m in (16, 64, 128)]),
]


def _signature(fn, types: dict[str, str], constexprs: dict) -> tuple[dict[str, str], dict]:
    """(Triton's type string of each parameter: as `types` gives, else pointers *bf16, strides i64,
    other scalars i32, constexprs marked; the specialization a real launch gives: pointers 16-byte
    aligned and strides multiples of 16, which lets the compiler vectorize and pipeline loads)."""
    sig, attrs = {}, {}
    for i, name in enumerate(inspect.signature(fn).parameters):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        default = "*bf16" if name.endswith("_ptr") else "i64" if name.startswith("stride") else "i32"
        sig[name] = types.get(name, default)
        if sig[name] == INT_MULTIPLE_OF_16:
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        if name.endswith("_ptr") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _check_kv_pipelined(ttgir: str, constexprs: dict, types: dict, name: str) -> None:
    """The K/V tiles ([BLOCK_N, PACK * HEAD_DIM] values, or [BLOCK_N, PACK * HEAD_DIM / 4] int32 words of
    an FP8 cache; PACK kv heads a program, 1 where the kernel has no such constexpr) sit in shared
    buffers of >= 2 slots, and a wait in the loop leaves copies in flight (an `async_wait` with
    num >= 1): the next tile loads while this one is used."""
    per_word = FP8_PER_WORD if types.get("k_ptr") == FP8_WORDS else 1
    width = constexprs.get("PACK", 1) * constexprs["HEAD_DIM"] // per_word
    tile = rf"local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x{constexprs['BLOCK_N']}x{width}x"
    slots = [int(n) for n in re.findall(tile, ttgir)]
    waits = [int(n) for n in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)", ttgir)]
    if not slots or min(slots) < 2 or max(waits, default=0) < 1:
        raise SystemExit(f"{name} {constexprs}: K/V tiles in {slots}-slot shared buffers, waits {waits}: "
                         f"the loads do not overlap the MMAs")


def _check_tiles_pipelined(ttgir: str, constexprs: dict, name: str) -> None:
    """The loop's operand tiles arrive by async copies into shared memory, a wait in the loop leaving
    copies in flight (`async_wait` num >= 1): the next steps load while this one multiplies."""
    copies = ttgir.count("async_copy_global_to_local")
    waits = [int(n) for n in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)", ttgir)]
    if copies == 0 or max(waits, default=0) < 1:
        raise SystemExit(f"{name} {constexprs}: {copies} async copies, waits {waits}: the tiles are not pipelined")


def compile_all() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", TARGET_ARCH, WARP_SIZE)
    for module, kernel, types, variants in SPECS:
        jit = getattr(importlib.import_module(f"nanovllm.{module}"), kernel)
        for variant in variants:
            constexprs = {k: v for k, v in variant.items() if k not in DEFAULT_OPTIONS}
            options = {k: variant.get(k, v) for k, v in DEFAULT_OPTIONS.items()}
            sig, attrs = _signature(jit.fn, types, constexprs)
            src = ASTSource(jit, sig, constexprs=constexprs, attrs=attrs)
            compiled = triton.compile(src, target=target, options=options)
            if not compiled.asm.get("cubin"):
                raise SystemExit(f"{module}.{kernel} {constexprs}: no cubin")
            if constexprs.get("ACT_FP8") and constexprs["BLOCK_M"] >= WGMMA_ROWS and FP8_MMA not in compiled.asm["ptx"]:
                raise SystemExit(f"{module}.{kernel} {constexprs}: no {FP8_MMA} MMA (the W8A8 point)")
            if kernel in PIPELINED_KV_KERNELS and options["num_stages"] >= 3:
                _check_kv_pipelined(compiled.asm["ttgir"], constexprs, types, f"{module}.{kernel}")
            if kernel in PIPELINED_TILE_KERNELS:
                _check_tiles_pipelined(compiled.asm["ttgir"], constexprs, f"{module}.{kernel}")
            print(f"compiled {module}.{kernel} {constexprs}")


def _nvidia_backend_present() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def test_every_kernel_has_a_spec():
    """Each kernel the package defines (a @triton.jit function named *_kernel in nanovllm/kernels,
    nanovllm/moe or nanovllm/sampling) is listed in SPECS, so a new kernel cannot skip the sm_90
    compile."""
    import triton

    found = set()
    for package in KERNEL_PACKAGES:
        for path in sorted((ROOT / "nanovllm" / package).glob("*.py")):
            mod = importlib.import_module(f"nanovllm.{package}.{path.stem}")
            for name, obj in vars(mod).items():
                fn = getattr(obj, "fn", None)
                if (isinstance(obj, triton.runtime.KernelInterface) and name.endswith("_kernel")
                        and getattr(fn, "__module__", None) == mod.__name__):
                    found.add((f"{package}.{path.stem}", name))
    assert ("kernels.gemv", "_gemv_kernel") in found  # the scan sees kernels at all
    assert ("moe.routing", "_route_kernel") in found and ("sampling.gumbel_max", "_gumbel_sample_kernel") in found
    assert found - {(module, kernel) for module, kernel, *_ in SPECS} == set()


@pytest.mark.skipif(not _nvidia_backend_present(), reason="Triton's NVIDIA backend (ptxas) is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the gpu tests compile and run every kernel")
def test_kernels_compile_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("compiled ") == sum(len(variants) for *_, variants in SPECS)


if __name__ == "__main__":
    compile_all()
