"""The fused MoE kernels (nanovllm/moe/grouped_gemm.py) on Qwen3-30B-A3B's expert shape (E=128 experts,
top-8, H=2048, I=768, bf16), per layer call: ms, distinct experts read, their weight bytes
(distinct x 3 x H x I x 2), GB/s and the fraction of the HBM copy bandwidth measured in the same
run (benchmarks/harness/probes.py), TFLOP/s (6 x T x K x H x I); at 1-2 tokens also the decode GEMVs
(moe/decode.py). `ms` is the whole fused_moe call (alignment, both GEMMs, the sum over the K slots);
`align ms` is moe_align alone, timed the same way. Routings and timing: benchmarks/harness/moe_cases.py.

    python -m benchmarks.kernels.bench_moe [--tokens 1 64 4096] [--sweep] [--json PATH]
    python -m benchmarks.kernels.bench_moe --sweep-gemv [--json PATH]

--sweep / --sweep-gemv pass other tilings as the kernels' `tiles` argument (nothing else changes).
--sweep-gemv times only the decode path (moe/decode.moe_gemv) at T = 1 and 2, for every GemvTiles of
gemv_candidates(), and lists them best first with the default's row last.
FP8 experts: bench_moe_fp8.py; moe_align alone: bench_moe_align.py; prefill tilings: moe_prefill_sweep.py.

Without CUDA it says so in one line and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

import torch

from benchmarks.harness.moe_cases import (E, H, K, bf16_experts, check, expert_bytes, graph_ms, moe_flops, routings,
                                          tiles_name)
from benchmarks.harness.probes import measure_bandwidth

TOKENS = (1, 16, 64, 128, 256, 4096)  # decode batches and one prefill size
# --sweep: (block_n, block_k, num_warps, num_stages) of each GEMM, tried one GEMM at a time for
# every block height; the default tiling of the batch is always the first candidate.
SWEEP_GATE_UP = [(32, 64, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 5),
                 (128, 64, 8, 3), (128, 64, 4, 4), (16, 128, 4, 4)]
SWEEP_DOWN = [(64, 64, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 3), (32, 128, 4, 4),
              (256, 64, 8, 3)]
# --sweep-gemv: (block_n, block_k) of each launch (30B shape, K = 8 slots), varied one launch at a
# time around the defaults (the two are separate kernels: their times add) and pruned by
# gemv_register_tile. Wide K tiles (1,024-2,048) put a row's whole reduction in one or two steps:
# the batch-1 profile showed gate/up at 70% and down at 57% of copy with 8 dependent steps.
SWEEP_GEMV_GATE_UP = [(n, k) for n in (2, 4, 8, 16, 32) for k in (128, 256, 512, 1024, 2048)]
SWEEP_GEMV_DOWN = [(n, k) for n in (1, 2, 4, 8, 16) for k in (128, 256, 512, 1024)]
# 4 warps only: 8 warps on a tile take the registers a thread of 4 warps on half of it (ptxas, sm_90),
# so they hold the same bytes in flight per SM as a smaller tile of this grid.
SWEEP_GEMV_WARPS = (4,)
# float32 values a thread holds per step (the loaded tile or accumulators); past 64 the tile and its
# loads in flight need more than ~128 registers a thread and spill.
SWEEP_GEMV_MAX_PER_THREAD = 64
NO_CUDA_MESSAGE = "bench_moe.py needs a CUDA device; none is visible"


def gemv_tiles_name(tiles) -> str:
    """gu<n>x<k> d<n>x<k> w<warps>: a moe_decode.GemvTiles in one short line."""
    return (f"gu{tiles.gate_up_block_n}x{tiles.gate_up_block_k} d{tiles.down_block_n}x{tiles.down_block_k}"
            f" w{tiles.num_warps}")


def gemv_register_tile(tiles, top_k: int = K) -> int:
    """Largest per-thread float32 tile of the two launches: gate_up 2 x [BN, BK], down [KP, BN, BK]."""
    slots = 1 << (top_k - 1).bit_length()
    gate_up = 2 * tiles.gate_up_block_n * tiles.gate_up_block_k
    down = slots * tiles.down_block_n * tiles.down_block_k
    return max(gate_up, down) // (32 * tiles.num_warps)


def gemv_candidates() -> list:
    """The default GemvTiles first, then each launch's grid points with the other launch at its
    default, where the register tile fits (24 in all)."""
    from nanovllm.moe.decode import DEFAULT_TILES

    grid = [replace(DEFAULT_TILES, num_warps=w, gate_up_block_n=n, gate_up_block_k=k)
            for w in SWEEP_GEMV_WARPS for n, k in SWEEP_GEMV_GATE_UP]
    grid += [replace(DEFAULT_TILES, num_warps=w, down_block_n=n, down_block_k=k)
             for w in SWEEP_GEMV_WARPS for n, k in SWEEP_GEMV_DOWN]
    return list(dict.fromkeys([DEFAULT_TILES] + [t for t in grid if gemv_register_tile(t) <= SWEEP_GEMV_MAX_PER_THREAD]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="batch sizes T")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP_* tilings at every T")
    ap.add_argument("--sweep-gemv", action="store_true",
                    help="only time moe_gemv (decode path) over gemv_candidates() at T = 1 and 2")
    ap.add_argument("--json", metavar="PATH", help="write the rows here")
    return ap.parse_args(argv)


def sweep_gemv(w13: torch.Tensor, w2: torch.Tensor, copy_gbps: float, gen: torch.Generator) -> list[dict]:
    """moe_gemv at T = 1 and 2 for every gemv_candidates() tile: ms, GB/s, fraction of copy."""
    from triton.runtime.errors import OutOfResources

    from nanovllm.moe.decode import DEFAULT_TILES, MAX_TOKENS, moe_gemv

    rows = []
    for t in range(1, MAX_TOKENS + 1):
        hidden = torch.randn(t, H, device="cuda", generator=gen).bfloat16()
        routes = routings(t, gen)
        distinct = statistics.mean(len(ids.unique()) for _, ids in routes)
        timed = []
        for tiles in gemv_candidates():
            name = gemv_tiles_name(tiles)
            try:
                check(moe_gemv(hidden, w13, w2, *routes[0], tiles=tiles), hidden, w13, w2, *routes[0], f"moe_gemv {name}")
                ms = graph_ms([lambda w=w, i=i, c=tiles: moe_gemv(hidden, w13, w2, w, i, tiles=c) for w, i in routes])
            except OutOfResources as exc:
                print(f"      skipped {name}: {exc}")
                continue
            gbps = expert_bytes(distinct) / (ms * 1e-3) / 1e9
            timed.append(dict(sweep="gemv", tokens=t, tiles=name, ms=ms, gbps=gbps, fraction_of_copy=gbps / copy_gbps,
                              default=tiles == DEFAULT_TILES))
        timed.sort(key=lambda r: r["ms"])
        print(f"moe_gemv T={t}: {len(timed)} tiles, {distinct:.1f} experts ({expert_bytes(distinct) / 1e6:.1f} MB)"
              " a call, best first")
        print(f"{'rank':>5}{'ms':>9}{'GB/s':>8}{'of copy':>9}  tiles")
        for rank, r in enumerate(timed, 1):
            print(f"{rank:>5}{r['ms']:>9.4f}{r['gbps']:>8.0f}{r['fraction_of_copy']:>9.1%}  {r['tiles']}"
                  + ("  (default)" if r["default"] else ""))
        rank, default = next(((rank, r) for rank, r in enumerate(timed, 1) if r["default"]), (None, None))
        if default is None:
            print(f"default {gemv_tiles_name(DEFAULT_TILES)}: skipped (out of resources)\n")
        else:
            print(f"default {default['tiles']}: rank {rank} of {len(timed)}, {default['ms']:.4f} ms,"
                  f" {default['fraction_of_copy']:.1%} of copy; best {timed[0]['tiles']} {timed[0]['ms']:.4f} ms\n")
        rows += timed
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    from triton.runtime.errors import OutOfResources

    from nanovllm.moe.grouped_gemm import fused_moe
    from nanovllm.moe.tiles import MoeTiles, Tiling, moe_tiles, size_class
    from nanovllm.moe.align import moe_align
    from nanovllm.moe.decode import MAX_TOKENS as GEMV_MAX_TOKENS
    from nanovllm.moe.decode import moe_gemv

    gen = torch.Generator("cuda").manual_seed(0)
    w13, w2 = bf16_experts(gen)
    copy_gbps = measure_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name()}: HBM copy {copy_gbps:,.0f} GB/s (read + written)")
    if args.sweep_gemv:
        return [dict(device=torch.cuda.get_device_name(), copy_gbps=copy_gbps)] + sweep_gemv(w13, w2, copy_gbps, gen)
    print(f"{'T':>5}{'ms':>9}{'align ms':>10}{'experts':>9}{'MB read':>9}{'GB/s':>8}{'of copy':>9}{'TFLOP/s':>9}"
          "  tiles")
    rows = []
    for t in args.tokens:
        hidden = torch.randn(t, H, device="cuda", generator=gen).bfloat16()
        routes = routings(t, gen)
        check(fused_moe(hidden, w13, w2, *routes[0]), hidden, w13, w2, *routes[0])
        distinct = statistics.mean(len(ids.unique()) for _, ids in routes)
        default = moe_tiles(size_class(t) * K, E)  # what fused_moe picks for t tokens
        candidates = [default]
        if args.sweep:
            for block_m in sorted({default.block_m, 16, 32, 64}):
                base = replace(default, block_m=block_m)
                candidates += [MoeTiles(block_m, Tiling(*g), base.down) for g in SWEEP_GATE_UP]
                candidates += [MoeTiles(block_m, base.gate_up, Tiling(*d)) for d in SWEEP_DOWN]
        timed = []
        for tiles in dict.fromkeys(candidates):  # unique, default first
            try:
                ms = graph_ms([lambda w=w, i=i, c=tiles: fused_moe(hidden, w13, w2, w, i, tiles=c) for w, i in routes])
            except OutOfResources as exc:  # a swept tiling past shared memory or registers
                print(f"      skipped {tiles_name(tiles)}: {exc}")
                continue
            timed.append((ms, tiles))
        ms, tiles = timed[0] if not args.sweep else min(timed, key=lambda x: x[0])
        align_ms = graph_ms([lambda i=i, m=tiles.block_m: moe_align(i, E, m) for _, i in routes])
        gbps = expert_bytes(distinct) / (ms * 1e-3) / 1e9
        row = dict(tokens=t, ms=ms, align_ms=align_ms, distinct_experts=distinct, bytes_read=expert_bytes(distinct),
                   gbps=gbps, fraction_of_copy=gbps / copy_gbps, tflops=moe_flops(t) / (ms * 1e-3) / 1e12,
                   tiles=tiles_name(tiles), default_ms=timed[0][0])
        if args.sweep:  # every candidate, fastest first: the two GEMMs' bests can then be combined
            row["candidates"] = [dict(tiles=tiles_name(c), ms=m) for m, c in sorted(timed, key=lambda x: x[0])]
        rows.append(row)
        print(f"{t:>5}{ms:>9.3f}{align_ms:>10.3f}{distinct:>9.1f}{expert_bytes(distinct) / 1e6:>9.1f}{gbps:>8.0f}"
              f"{gbps / copy_gbps:>9.1%}{row['tflops']:>9.1f}  {tiles_name(tiles)}"
              + (f" (default {timed[0][0]:.3f} ms)" if args.sweep else ""))
        if t <= GEMV_MAX_TOKENS:  # decode steps of this size run the GEMV path instead
            check(moe_gemv(hidden, w13, w2, *routes[0]), hidden, w13, w2, *routes[0], "moe_gemv")
            gemv_ms = graph_ms([lambda w=w, i=i: moe_gemv(hidden, w13, w2, w, i) for w, i in routes])
            gemv_gbps = expert_bytes(distinct) / (gemv_ms * 1e-3) / 1e9
            row.update(gemv_ms=gemv_ms, gemv_fraction_of_copy=gemv_gbps / copy_gbps)
            print(f"{t:>5}{gemv_ms:>9.3f}{'-':>10}{distinct:>9.1f}{expert_bytes(distinct) / 1e6:>9.1f}"
                  f"{gemv_gbps:>8.0f}{gemv_gbps / copy_gbps:>9.1%}{'':>9}  moe_gemv (decode path)")
    return [dict(device=torch.cuda.get_device_name(), copy_gbps=copy_gbps)] + rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(NO_CUDA_MESSAGE)
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
