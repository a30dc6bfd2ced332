"""Decode's few-row linear layers (y = x W^T, bf16) under CUDA-graph replay, per Qwen3-0.6B / 8B /
30B-A3B layer: cuBLAS (F.linear) next to our Triton GEMV (nanovllm/kernels/gemv.py) over tilings, and
the down projection with SiLU-and-mul fused in next to the two kernels it replaces.

Each timed graph walks through enough distinct weight copies (>= 256 MB) that the weights come
from HBM, not the 50 MB L2, as they do in a real decode step.

    python -m benchmarks.kernels.bench_gemm [--sweep] [--json PATH]
    python -m benchmarks.kernels.bench_gemm --batch-rows 16,64,128,256,512
    python -m benchmarks.kernels.bench_gemm --fp8 [--shapes ...]
    python -m benchmarks.kernels.bench_gemm --fp8-rows 4,8,16,32,64 [--shapes ...]

--fp8 times the GEMV over FP8 weights (128 x 128 block scales and per-row scales) at 1 and 2 rows,
at the default tiling and each of FP8_TILINGS, in GB/s of the FP8 bytes, beside the bf16 GEMV.

--batch-rows times cuBLAS at a decode batch's (or a short prefill's) row counts instead, each call
against its own roofline: max(bytes / copy bandwidth, FLOPs / dense GEMM peak), both probed in the
run (benchmarks/harness/probes.py); the gap is what such a step loses in its projections. Beside it, up to
the skinny GEMM's MAX_ROWS, kernels/skinny_gemm.py at its default tiling; --sweep-skinny adds the
best of SKINNY_TILINGS.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.harness.engine_options import require_cuda
from benchmarks.harness.probes import measure_bandwidth, measure_gemm_peak
from benchmarks.harness.timing import graph_us
from nanovllm.kernels.checks import cuda_sm_count
from nanovllm.kernels.fused_activation import silu_and_mul
from nanovllm.kernels.gemv import MAX_ROWS, gemv, silu_mul_gemv
from nanovllm.kernels.gemv_plan import Tiling
from nanovllm.kernels.skinny_gemm import MAX_ROWS as SKINNY_MAX_ROWS
from nanovllm.kernels.skinny_gemm import skinny_gemm
from nanovllm.kernels.skinny_plan import SkinnyTiling, skinny_tiling
from nanovllm.utils.ints import next_pow2

SHAPES = {  # name: (N, K)
    "0.6B qkv": (4096, 1024), "0.6B o": (1024, 2048), "0.6B gate_up": (6144, 1024), "0.6B down": (1024, 3072),
    "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (24576, 4096), "8B down": (4096, 12288),
    # Qwen3-30B-A3B's dense projections and its MoE router (128 outputs: 32 programs at 4 rows each)
    "30B qkv": (5120, 2048), "30B o": (2048, 4096), "30B router": (128, 2048),
    # Qwen2.5-0.5B (896 wide, 14 / 2 heads of 64): cuBLAS ran its decode GEMMs at ~3x their bound at 256 rows
    # (BENCHMARKS.md, fifty-third session)
    "0.5B qkv": (1152, 896), "0.5B o": (896, 896), "0.5B gate_up": (9728, 896), "0.5B down": (896, 4864),
}
# Bytes of distinct weights one timed graph reads: several times the H200's 50 MB L2.
ROTATE_BYTES = 256 * 2**20
REPLAYS = 10
# GEMV tilings swept with --sweep: (BLOCK_N, BLOCK_K, pipeline stages, weight eviction policy), 4 warps
TILINGS = [(4, 512, 1, ""), (4, 512, 3, ""), (4, 512, 4, ""), (4, 512, 4, "evict_first"),
           (8, 512, 3, ""), (8, 512, 4, ""), (8, 512, 5, ""), (8, 512, 3, "evict_first"),
           (8, 256, 4, ""), (8, 256, 6, ""), (16, 256, 4, ""), (16, 512, 3, ""),
           # few rows a program, wide steps: grids of 64-128 programs for the router's 128 outputs
           (2, 1024, 2, ""), (2, 2048, 1, ""), (4, 1024, 2, ""), (4, 2048, 1, "")]


# --fp8: GEMV tilings (BLOCK_N, BLOCK_K, stages, eviction) over FP8 weights: the bf16 tilings, and steps of
# 128 columns (one scale a step under 128 x 128 block scales) with more of them in flight.
FP8_TILINGS = [(8, 512, 3, ""), (16, 256, 4, ""), (4, 512, 4, "evict_first"), (8, 128, 12, ""), (16, 128, 8, ""),
               (8, 1024, 3, ""), (16, 512, 3, ""), (4, 1024, 4, "evict_first"),
               (4, 128, 16, "evict_first"), (32, 128, 4, ""), (16, 128, 4, "")]


def fp8_study(shapes: list[str]) -> list[dict]:
    """The GEMV over FP8 weights (block and row scales) at 1-2 rows, default tiling and FP8_TILINGS,
    beside the bf16 GEMV: us and GB/s of the weight bytes."""
    from nanovllm.quantization.config import BLOCK

    rows = []
    for name, n, k, scales, ws, q8, m, x, ref in fp8_cases(shapes, (1, 2)):
        s0 = q8[0][1] if scales == BLOCK else q8[0][1].view(-1)
        row = {"layer": name, "M": m, "scales": scales,
               "bf16_us": graph_time_us([lambda w=w: gemv(x, w) for w in ws])}
        for spec in [None, *FP8_TILINGS]:
            tile = None if spec is None else Tiling(*spec)
            label = "default" if spec is None else "{}x{}s{}{}".format(*spec[:3], "e" if spec[3] else "")
            check(gemv(x, q8[0][0], tile=tile, weight_scale=s0), ref, f"{name} M={m} fp8 {label}")
            t = graph_time_us([lambda q=q, s=s: gemv(x, q, tile=tile, weight_scale=s if scales == BLOCK
                                                       else s.view(-1)) for q, s in q8])
            row[label] = round(t, 2)
        best = min((kk for kk in row if kk not in ("layer", "M", "scales", "bf16_us")), key=row.get)
        print(f"{name:<14} M={m} {scales:<8} bf16 {row['bf16_us']:.2f} us ({n * k * 2 / row['bf16_us'] / 1e3:.0f}"
              f" GB/s); fp8 default {row['default']:.2f} us ({n * k / row['default'] / 1e3:.0f} GB/s); best "
              f"{best} {row[best]:.2f} ({n * k / row[best] / 1e3:.0f} GB/s); " +
              " ".join(f"{kk}:{v}" for kk, v in row.items() if kk not in ("layer", "M", "scales")), flush=True)
        rows.append(row)
    return rows


# --fp8-rows: the skinny GEMM over FP8 weights (W8A16) at its default tiling and a sweep, against
# torch._scaled_mm on quantized activations (FP8 layers' path past KernelRoutes.fp8_skinny_max_rows).
def fp8_skinny_tilings(m: int) -> list[SkinnyTiling]:
    """The sweep at m rows, 128-column steps (a block scale's width), K split 1 / 2 / 4: up to 32
    rows, row tiles of 16 (and 32 past 16 rows), 32 / 64 output columns, 4 / 6 steps in flight;
    past 32 rows, row tiles of 32 / 64, 64 / 128 columns, 3 / 4 steps, 4 warps (and 8 at 64 x 128)."""
    if m <= 32:
        return [SkinnyTiling(bm, bn, 128, st, 4, True, sp) for bm in ((16,) if m <= 16 else (16, 32))
                for bn in (32, 64) for st in (4, 6) for sp in (1, 2, 4)]
    return [SkinnyTiling(bm, bn, 128, st, w, True, sp) for bm in (32, 64) for bn in (64, 128) for st in (3, 4)
            for w in ((4, 8) if (bm, bn) == (64, 128) else (4,)) for sp in (1, 2, 4)]


def fp8_rows_study(shapes: list[str], row_counts: list[int]) -> list[dict]:
    """At each row count, us per call: bf16 cuBLAS and skinny GEMM; FP8 (block and row scales) through
    fp8_linear (quantize + _scaled_mm), the W8A16 skinny GEMM and the W8A8 one (quantize included);
    GB/s of each side's weight bytes."""
    from nanovllm.kernels.fp8_quant import quantize
    from nanovllm.kernels.skinny_gemm import skinny_gemm_w8a8
    from nanovllm.quantization.config import BLOCK
    from nanovllm.quantization.fp8 import Fp8Weights, fp8_linear

    rows = []
    for name, n, k, scales, ws, q8, m, x, ref in fp8_cases(shapes, row_counts):
        fp8 = [Fp8Weights(q, s if scales == BLOCK else s.view(-1), None) for q, s in q8]
        row = {"layer": name, "M": m, "scales": scales,
               "bf16_cublas": graph_time_us([lambda w=w: F.linear(x, w) for w in ws]),
               "bf16_skinny": graph_time_us([lambda w=w: skinny_gemm(x, w) for w in ws]),
               "fp8_scaled_mm": graph_time_us([lambda f=f: fp8_linear(x, f, None) for f in fp8])}
        for label, tile in [("fp8_skinny", None), *((f"fp8_{tiling_name(t)}", t) for t in fp8_skinny_tilings(m))]:
            check(skinny_gemm(x, fp8[0].weight, tile=tile, weight_scale=fp8[0].scale), ref,
                  f"{name} M={m} {scales} {label}")
            row[label] = graph_time_us([lambda f=f: skinny_gemm(x, f.weight, tile=tile, weight_scale=f.scale)
                                        for f in fp8])
        # W8A8: the activation quantized as fp8_linear does, inside the timing
        # checked against fp8_linear's _scaled_mm on the same quantized operands (the activation's
        # e4m3 rounding alone moves the product ~3% off the bf16 reference)
        ref8 = fp8_linear(x, fp8[0], None)
        for label, tile in [("w8a8", None), *((f"w8a8_{tiling_name(t)}", t) for t in w8a8_tilings(m))]:
            check(skinny_gemm_w8a8(quantize(x, fp8[0].row_quant()), fp8[0].weight, fp8[0].scale, tile=tile), ref8,
                  f"{name} M={m} {scales} {label}")
            row[label] = graph_time_us([lambda f=f: skinny_gemm_w8a8(quantize(x, f.row_quant()), f.weight, f.scale,
                                                                     tile=tile) for f in fp8])
        best = min((kk for kk in row if kk.startswith("fp8_") and kk != "fp8_scaled_mm"), key=row.get)
        best8 = min((kk for kk in row if kk.startswith("w8a8")), key=row.get)
        print(f"{name:<14} M={m:<3} {scales:<8} bf16 cuBLAS {row['bf16_cublas']:.2f} us ({n * k * 2 / row['bf16_cublas'] / 1e3:.0f}"
              f" GB/s), fp8 _scaled_mm {row['fp8_scaled_mm']:.2f}, fp8 skinny {row['fp8_skinny']:.2f} "
              f"({n * k / row['fp8_skinny'] / 1e3:.0f} GB/s), best {best} {row[best]:.2f}, w8a8 {row['w8a8']:.2f}, "
              f"best {best8} {row[best8]:.2f}; " +
              " ".join(f"{kk}:{v:.2f}" for kk, v in row.items() if isinstance(v, float)), flush=True)
        rows.append(row)
    return rows


def w8a8_tilings(m: int) -> list[SkinnyTiling]:
    """W8A8: row tiles of 64 (and 128 past 64 rows; wgmma takes 64 a
    warpgroup), 64 / 128 output columns, 3 / 4 stages, 4 warps (8 at 128 rows), K split 1 / 2 / 4."""
    return [SkinnyTiling(bm, bn, 128, st, 8 if bm == 128 else 4, True, sp) for bm in ((64,) if m <= 64 else (64, 128))
            for bn in (64, 128) for st in (3, 4) for sp in (1, 2, 4)]


def fp8_cases(shapes: list[str], row_counts):
    """(name, N, K, scales, bf16 weights, their FP8 copies [(q, scale)], M, x [M, K], the bf16 product
    on the dequantized first copy) for each shape, both scale layouts and each row count; the copy
    bandwidth printed first."""
    from nanovllm.quantization.config import BLOCK, CHANNEL
    from nanovllm.quantization.fp8 import dequantize_weight, quantize_weight

    print(f"copy bandwidth {measure_bandwidth() / 1e12:.2f} TB/s")
    for name in shapes:
        n, k = SHAPES[name]
        ws = rotating_weights(n, k)
        for scales in (BLOCK, CHANNEL):
            q8 = [quantize_weight(w, scales) for w in ws + ws]  # twice the copies: half the bytes each
            for m in row_counts:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, dequantize_weight(q8[0][0], q8[0][1], scales).to(torch.bfloat16))
                yield name, n, k, scales, ws, q8, m, x, ref
            del q8
        del ws


def rotating_weights(n: int, k: int) -> list[torch.Tensor]:
    """Distinct bf16 [n, k] weights, enough (>= ROTATE_BYTES, at least 2) that a graph walking
    through them reads each from HBM."""
    copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]


def graph_time_us(calls) -> float:
    """Mean us per call of `calls` (a list of thunks) replayed in one CUDA graph."""
    return graph_us(lambda: [fn() for fn in calls], REPLAYS) / len(calls)


def check(out, ref, what):
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    if err > 2e-2:
        raise SystemExit(f"{what}: relative error {err:.2e} vs the unfused path")


# --sweep-skinny: kernels/skinny_gemm.py tilings (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps), each at
# split-K 1, 2, 4 and 8, all with PDL; row tiles past the batch's power of two are skipped. The
# bases led a first sweep without split-K (BENCHMARKS.md, 2026-12-02 fifth session, where a
# swapped product and SiLU-and-mul in front were measured too, and dropped).
SKINNY_BASES = [(16, 32, 128, 3, 4), (32, 32, 128, 3, 4), (64, 32, 128, 3, 4), (64, 64, 128, 3, 4),
                (64, 32, 64, 4, 4), (128, 128, 128, 3, 4)]
SKINNY_SPLITS = (1, 2, 4, 8)
SKINNY_TILINGS = [SkinnyTiling(bm, bn, bk, st, warps, True, split)
                  for bm, bn, bk, st, warps in SKINNY_BASES for split in SKINNY_SPLITS]


def tiling_name(t: SkinnyTiling) -> str:
    return f"{t.block_m}x{t.block_n}x{t.block_k}s{t.stages}w{t.num_warps}k{t.split_k}"


def sweep_skinny(x, ws, m: int) -> dict[SkinnyTiling, float]:
    """us per call of every SKINNY_TILINGS tiling that fits m rows (x [m, K], weights ws)."""
    times = {}
    for tile in SKINNY_TILINGS:
        if tile.block_m > max(16, next_pow2(m)):
            continue
        check(skinny_gemm(x, ws[0], tile=tile), F.linear(x, ws[0]), f"M={m} {tile}")
        times[tile] = graph_time_us([lambda w=w: skinny_gemm(x, w, tile=tile) for w in ws])
    return times


def batch_rows_study(row_counts: list[int], sweep: bool, shapes: list[str], top: int) -> list[dict]:
    """cuBLAS (and with `sweep` our skinny GEMM's tilings) at each row count, per layer shape,
    against the call's roofline (and cuBLAS's achieved GB/s and TFLOP/s)."""
    bw, peak = measure_bandwidth(), measure_gemm_peak()
    sms = cuda_sm_count(torch.device("cuda"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 GEMM peak {peak / 1e12:.0f} TFLOP/s")
    print(f"{'layer':<14}{'M':>5}{'cuBLAS us':>11}{'GB/s':>7}{'TFLOP/s':>9}{'roofline us':>13}{'of roofline':>13}"
          f"  skinny default us (split){', best us (tiling) ...' if sweep else ''}")
    rows = []
    for name in shapes:
        n, k = SHAPES[name]
        ws = rotating_weights(n, k)
        for m in row_counts:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = graph_time_us([lambda w=w: F.linear(x, w) for w in ws])
            moved, flops = (n * k + m * (n + k)) * 2, 2 * m * n * k
            floor_us = 1e6 * max(moved / bw, flops / peak)
            row = {"layer": name, "M": m, "cublas_us": us, "roofline_us": floor_us}
            line = (f"{name:<14}{m:>5}{us:>11.2f}{moved / us / 1e3:>7.0f}{flops / us / 1e6:>9.1f}"
                    f"{floor_us:>13.2f}{100 * floor_us / us:>12.1f}%")
            if m <= SKINNY_MAX_ROWS:  # the default tiling (what the layers would run)
                check(skinny_gemm(x, ws[0]), F.linear(x, ws[0]), f"{name} M={m} default tiling")
                row["skinny_default_us"] = graph_time_us([lambda w=w: skinny_gemm(x, w) for w in ws])
                line += f"  {row['skinny_default_us']:.2f} ({skinny_tiling(m, n, k, sms).split_k})"
            if sweep and m <= SKINNY_MAX_ROWS:
                times = sweep_skinny(x, ws, m)
                row["skinny"] = {tiling_name(t): us for t, us in times.items()}
                ranked = sorted(times, key=times.get)
                line += "  " + ", ".join(f"{times[t]:.2f} ({tiling_name(t)})" for t in ranked[:top])
            rows.append(row)
            print(line, flush=True)
        del ws
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time every tiling in TILINGS")
    ap.add_argument("--batch-rows", help="comma-separated row counts (e.g. 16,64,128,256): cuBLAS against its "
                                         "roofline, and the skinny GEMM's default tiling, instead of the GEMV table")
    ap.add_argument("--sweep-skinny", action="store_true", help="with --batch-rows: also kernels/skinny_gemm.py")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated SHAPES names")
    ap.add_argument("--top", type=int, default=4, help="with --sweep-skinny: tilings printed per row")
    ap.add_argument("--fp8", action="store_true", help="the GEMV over FP8 weights instead (FP8_TILINGS)")
    ap.add_argument("--fp8-rows", help="comma-separated row counts (e.g. 4,8,16,32,64): FP8 weights through "
                                       "_scaled_mm and the W8A16 skinny GEMM, beside bf16")
    ap.add_argument("--json")
    args = ap.parse_args()
    require_cuda("bench_gemm.py", "kernel time")
    torch.manual_seed(0)
    if args.fp8_rows:
        rows = fp8_rows_study(args.shapes.split(","), [int(m) for m in args.fp8_rows.split(",")])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    if args.fp8:
        rows = fp8_study(args.shapes.split(","))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    if args.batch_rows:
        rows = batch_rows_study([int(m) for m in args.batch_rows.split(",")], args.sweep_skinny,
                                args.shapes.split(","), args.top)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    dev, bf16 = "cuda", torch.bfloat16
    rows = []
    print(f"{'layer':<14}{'M':>3}{'cuBLAS':>9}{'gemv':>9}{'GB/s':>7}{'unfused':>9}{'fused':>9}  sweep (us)")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws = rotating_weights(n, k)
        for m in (1, 2, 4, 8):  # 4: the kernel's MAX_ROWS, past KernelRoutes.gemv_max_rows = 2
            x = torch.randn(m, k, device=dev, dtype=bf16)
            gu = torch.randn(m, 2 * k, device=dev, dtype=bf16)
            row = {"layer": name, "M": m, "cublas_us": graph_time_us([lambda w=w: F.linear(x, w) for w in ws])}
            line = f"{name:<14}{m:>3}{row['cublas_us']:>9.2f}"
            if m <= MAX_ROWS:
                check(gemv(x, ws[0]), F.linear(x, ws[0]), f"{name} M={m} gemv")
                row["gemv_us"] = graph_time_us([lambda w=w: gemv(x, w) for w in ws])
                line += f"{row['gemv_us']:>9.2f}{n * k * 2 / row['gemv_us'] / 1e3:>7.0f}"
                if "down" in name:  # SiLU-and-mul before it
                    unfused = [lambda w=w: F.linear(silu_and_mul(gu), w) for w in ws]
                    fused = [lambda w=w: silu_mul_gemv(gu, w) for w in ws]
                    check(silu_mul_gemv(gu, ws[0]), F.linear(silu_and_mul(gu), ws[0]), f"{name} silu_mul_gemv")
                else:
                    unfused = fused = None
                if fused:
                    row["unfused_us"], row["fused_us"] = graph_time_us(unfused), graph_time_us(fused)
                    line += f"{row['unfused_us']:>9.2f}{row['fused_us']:>9.2f}"
                else:
                    line += " " * 18
                if args.sweep:
                    row["sweep"] = {}
                    for bn, bk, st, ev in TILINGS:
                        if m * bn * bk > 4 * 8192 or bk > k:
                            continue
                        tile = Tiling(block_n=bn, block_k=bk, stages=st, evict=ev)
                        check(gemv(x, ws[0], tile=tile), F.linear(x, ws[0]), f"{name} M={m} {tile}")
                        t = graph_time_us([lambda w=w: gemv(x, w, tile=tile) for w in ws])
                        row["sweep"][f"{bn}x{bk}s{st}{'e' if ev else ''}"] = t
                    best = min(row["sweep"], key=row["sweep"].get)
                    line += f"  best {best} {row['sweep'][best]:.2f}; " + " ".join(
                        f"{kk}:{v:.1f}" for kk, v in row["sweep"].items())
            print(line, flush=True)
            rows.append(row)
        del ws
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
