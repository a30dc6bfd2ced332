"""The fused MoE kernels (nanovllm/moe/grouped_gemm.py, align.py) on Qwen3-30B-A3B's expert shape (E=128 experts,
top-8, H=2048, I=768, bf16), per layer call: ms, distinct experts read, their weight bytes
(distinct x 3 x H x I x 2), GB/s and the fraction of the HBM copy bandwidth measured in the same
run (benchmarks/harness/probes.py), TFLOP/s (6 x T x K x H x I).

Routing is uniform: top-8 of torch.randn router logits per token. Each timed CUDA graph holds
ROUTINGS calls on different routings, so at small batches the experts change between calls and
come from HBM (the weights are 1.2 GB, L2 is 50 MB). Times are medians of REPEATS replays (CUDA
events) after WARMUP. `ms` is the whole fused_moe call (alignment, both GEMMs, the sum over the
K slots); `align ms` is moe_align alone, timed the same way.

    python -m benchmarks.kernels.bench_moe [--tokens 1 64 4096] [--sweep] [--json PATH]
    python -m benchmarks.kernels.bench_moe --sweep-gemv [--json PATH]
    python -m benchmarks.kernels.bench_moe --fp8 channel|block [--tokens ...] [--shape tiny]
    python -m benchmarks.kernels.bench_moe --align [--tokens ...] [--json PATH]

--fp8 MODE: FP8 experts (moe/fp8_experts.py; weights quantized here per expert with MODE's scales)
beside the same experts in bf16, in one run: the grouped GEMM (fused_moe) at FP8_TOKENS, W8A16 and
W8A8 (act_fp8: activations quantized per token, FP8 MMAs; a last table sets the three side by side,
from which KernelRoutes.moe_fp8_mma_min_tokens is picked), and the
routed decode GEMVs (moe_gemv_routed, router logits in) at 1 and 2 tokens; us, GB/s of the bytes
each actually reads (FP8 weights + float32 scales, or bf16 weights) and their fraction of the copy
bandwidth, TFLOP/s, and the bf16 / fp8 time ratio. `--shape tiny` (TINY_SHAPE) runs it on CPU under
TRITON_INTERPRET=1 (a smoke test: one untimed-grade wall-clock call, no bandwidth probe).

--align: moe_align alone (its three launches), us per call at ALIGN_TOKENS for every block height of
moe/tiles.BLOCK_MS; `*` marks the one fused_moe picks for that T (moe_tiles). Each routing's
alignment is checked (every pair once, num_used_blocks) before it is timed.

--sweep / --sweep-gemv pass other tilings as the kernels' `tiles` argument (nothing else changes).
--sweep-gemv times only the decode path (moe/decode.moe_gemv) at T = 1 and 2, for every GemvTiles of
gemv_candidates(), and lists them best first with the default's row last.

Without CUDA it says so in one line and exits non-zero (except --fp8 with --shape tiny).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from benchmarks.harness.probes import measure_bandwidth
from benchmarks.harness.timing import capture, event_times_ms

E, K, H, I = 128, 8, 2048, 768  # Qwen3-30B-A3B: experts, experts per token, hidden, expert intermediate
TOKENS = (1, 16, 64, 128, 256, 4096)  # decode batches and one prefill size
# --fp8: decode batches (1: the grouped path a 1-token prefill takes), a decode graph's batch and
# prefill chunks up to the engine's 8,192-token steps.
FP8_TOKENS = (1, 16, 256, 2048, 8192)
# --align: decode batches, then prefill chunks up to the engine's 8,192-token steps.
ALIGN_TOKENS = (1, 16, 64, 256, 512, 2048, 8192)
# --shape: experts, top-k, hidden, expert intermediate. tiny: a CPU smoke test under the interpreter
# (H and I whole 128-blocks, so block scales take their per-step path as at 30B).
SHAPES = {"30b-a3b": (E, K, H, I), "tiny": (4, 2, 256, 128)}
ROUTINGS = 8  # calls (routings) per timed graph
WARMUP, REPEATS = 5, 50
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
# check(): largest error relative to the reference's largest magnitude. bf16 activations round g, u,
# act and the output once each; W8A8 rounds hidden and act to e4m3 too (3 mantissa bits: a few % of
# the largest output, measured up to ~8% at H=200); a wrong kernel (a scale dropped or misplaced) is off by O(1).
CHECK_TOLERANCE = 3e-2
W8A8_CHECK_TOLERANCE = 0.15
NO_CUDA_MESSAGE = "bench_moe.py needs a CUDA device; none is visible"


def expert_bytes(distinct: float, hidden: int = H, inter: int = I, elem_size: int = 2) -> float:
    """Weight bytes of `distinct` experts: w13 (2I x H) and w2 (H x I)."""
    return distinct * 3 * hidden * inter * elem_size


def moe_flops(tokens: int, top_k: int = K, hidden: int = H, inter: int = I) -> int:
    """2 flops per multiply-add: gate_up T*K x 2I x H, down T*K x H x I."""
    return 6 * tokens * top_k * hidden * inter


def tiles_name(tiles) -> str:
    """m<block_m> gu<n>x<k>w<warps>s<stages> d<...>: a MoeTiles in one short word per GEMM."""
    def gemm(t) -> str:
        return f"{t.block_n}x{t.block_k}w{t.num_warps}s{t.num_stages}"
    return f"m{tiles.block_m} gu{gemm(tiles.gate_up)} d{gemm(tiles.down)}"


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
    ap.add_argument("--tokens", type=int, nargs="+",
                    help="batch sizes T (default: TOKENS; --fp8: FP8_TOKENS; --align: ALIGN_TOKENS)")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP_* tilings at every T")
    ap.add_argument("--sweep-gemv", action="store_true",
                    help="only time moe_gemv (decode path) over gemv_candidates() at T = 1 and 2")
    ap.add_argument("--fp8", choices=("channel", "block"),
                    help="only FP8 experts with these scales beside bf16: grouped GEMM and routed decode GEMVs")
    ap.add_argument("--align", action="store_true", help="only time moe_align at every block height")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="30b-a3b",
                    help="expert shape of --fp8 (tiny: CPU smoke test under TRITON_INTERPRET=1)")
    ap.add_argument("--json", metavar="PATH", help="write the rows here")
    args = ap.parse_args(argv)
    if args.shape != "30b-a3b" and not args.fp8:
        ap.error("--shape applies to --fp8 only")
    if args.align and (args.fp8 or args.sweep or args.sweep_gemv):
        ap.error("--align times moe_align alone: not with --fp8, --sweep or --sweep-gemv")
    if args.tokens is None:
        args.tokens = list(FP8_TOKENS if args.fp8 else ALIGN_TOKENS if args.align else TOKENS)
    return args


def graph_ms(calls: list[Callable[[], object]]) -> float:
    """Median ms per call of `calls`, captured together in one CUDA graph (compiled first, outside),
    over REPEATS replays after WARMUP."""
    graph = capture(lambda: [fn() for fn in calls])
    ms = statistics.median(event_times_ms(lambda i: graph.replay(), REPEATS, WARMUP)) / len(calls)
    del graph
    return ms


def routings(tokens: int, gen: torch.Generator, experts: int = E, top_k: int = K,
             count: int = ROUTINGS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (weights [T, K] float32, ids [T, K] int64), renormalised top-K of a softmax."""
    out = []
    for _ in range(count):
        probs = torch.softmax(torch.randn(tokens, experts, device=gen.device, generator=gen), dim=-1)
        weights, ids = probs.topk(top_k, dim=-1)
        out.append(((weights / weights.sum(-1, keepdim=True)).contiguous(), ids.contiguous()))
    return out


def check(out, hidden, w13, w2, weights, ids, what: str = "fused_moe", tolerance: float = CHECK_TOLERANCE) -> None:
    """Stop on a wrong kernel: `out` [T, H] (what the kernel gave for this routing) against an fp32
    loop over the experts w13 / w2 (FP8 ones: their dequantized values), within `tolerance` of
    the reference's largest magnitude."""
    ref = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = (hidden[tok].float() @ w13[e].float().T).chunk(2, dim=-1)
        ref.index_add_(0, tok, (torch.nn.functional.silu(gate) * up) @ w2[e].float().T * weights[tok, slot, None])
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    if err > tolerance:
        raise SystemExit(f"{what}: relative error {err:.2e} against the fp32 reference")


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


def fp8_experts(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked experts w [E, N, K] -> (float8_e4m3fn [E, N, K], float32 scales as the kernels take
    them: [E, N] per channel or [E, ceil(N/128), ceil(K/128)] per block, the dequantized weights in
    w's dtype), quantized one expert at a time as the loader does (quantization/fp8.py)."""
    from nanovllm.quantization.config import CHANNEL
    from nanovllm.quantization.fp8 import dequantize_weight, quantize_weight

    pairs = [quantize_weight(x, mode) for x in w]  # mode: CHANNEL / BLOCK's value
    q = torch.stack([qx for qx, _ in pairs])
    scales = torch.stack([sx.view(-1) if mode == CHANNEL else sx for _, sx in pairs])  # channel: [N, 1] -> [N]
    return q, scales, torch.stack([dequantize_weight(qx, sx, mode) for qx, sx in pairs]).to(w.dtype)


def stored_bytes(distinct: float, tensors: tuple[torch.Tensor, ...]) -> float:
    """Bytes a call reads from `distinct` experts of the stacked `tensors` ([E, ...] each: weights
    and any scales), at their stored widths."""
    return distinct * sum(t.numel() * t.element_size() for t in tensors) / tensors[0].shape[0]


def first_call(calls: list[Callable[[], object]]) -> tuple[object, float]:
    """(what calls[0]() returns, its wall-clock ms): the check's output, and on CPU (the interpreter
    smoke test, one routing) the only timing, a figure that shows the path ran and nothing more."""
    start = time.perf_counter()
    out = calls[0]()
    return out, (time.perf_counter() - start) * 1e3


def fp8_study(args: argparse.Namespace) -> list[dict]:
    """--fp8: the grouped GEMM at args.tokens and the routed decode GEMVs at 1..MAX_TOKENS, each on
    bf16 experts and on the same experts in FP8 (args.fp8 scales; the grouped GEMM W8A16 and W8A8),
    checked against an fp32 loop."""
    from nanovllm.moe.decode import MAX_TOKENS as GEMV_MAX_TOKENS
    from nanovllm.moe.decode import moe_gemv_routed
    from nanovllm.moe.grouped_gemm import fused_moe

    experts, top_k, hidden_size, inter = SHAPES[args.shape]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    count = ROUTINGS if device.type == "cuda" else 1  # routings per timed graph (CPU: one untimed-grade call)
    gen = torch.Generator(device).manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden_size, device=device, generator=gen) * hidden_size ** -0.5).bfloat16()
    w2 = (torch.randn(experts, hidden_size, inter, device=device, generator=gen) * inter ** -0.5).bfloat16()
    q13, s13, d13 = fp8_experts(w13, args.fp8)
    q2, s2, d2 = fp8_experts(w2, args.fp8)
    # name -> (weights passed, their scales (and act_fp8), weights the reference multiplies, tensors read)
    fp8, w8a8 = f"fp8-{args.fp8}", f"fp8-{args.fp8}-w8a8"
    formats = {"bf16": ((w13, w2), {}, (w13, w2), (w13, w2)),
               fp8: ((q13, q2), dict(w13_scale=s13, w2_scale=s2), (d13, d2), (q13, q2, s13, s2)),
               w8a8: ((q13, q2), dict(w13_scale=s13, w2_scale=s2, act_fp8=True), (d13, d2), (q13, q2, s13, s2))}
    copy_gbps = measure_bandwidth() / 1e9 if device.type == "cuda" else None
    print(f"{torch.cuda.get_device_name() if copy_gbps else 'CPU (interpreter)'}: shape {args.shape} (E={experts}, "
          f"top-{top_k}, H={hidden_size}, I={inter}); HBM copy "
          + (f"{copy_gbps:,.0f} GB/s (read + written)" if copy_gbps else "not probed (no CUDA)"))
    print(f"{'kernel':<10}{'T':>6}  {'weights':<18}{'us':>10}{'MB read':>9}{'GB/s':>8}{'of copy':>9}{'TFLOP/s':>9}"
          f"{'bf16/this':>10}")
    rows = []

    def report(kernel: str, t: int, name: str, ms: float, distinct: float, bf16_ms: float) -> None:
        read = stored_bytes(distinct, formats[name][3])
        gbps = read / (ms * 1e-3) / 1e9
        row = dict(kernel=kernel, tokens=t, weights=name, us=ms * 1e3, distinct_experts=distinct, bytes_read=read,
                   gbps=gbps, fraction_of_copy=gbps / copy_gbps if copy_gbps else None,
                   tflops=moe_flops(t, top_k, hidden_size, inter) / (ms * 1e-3) / 1e12, bf16_over_this=bf16_ms / ms)
        rows.append(row)
        print(f"{kernel:<10}{t:>6}  {name:<18}{row['us']:>10.1f}{read / 1e6:>9.2f}{gbps:>8.0f}"
              f"{format(row['fraction_of_copy'], '.1%') if copy_gbps else '-':>9}{row['tflops']:>9.1f}"
              f"{row['bf16_over_this']:>10.2f}", flush=True)

    for t in args.tokens:
        hidden = torch.randn(t, hidden_size, device=device, generator=gen).bfloat16()
        routes = routings(t, gen, experts, top_k, count)
        distinct = statistics.mean(len(ids.unique()) for _, ids in routes)
        bf16_ms = None
        for name, (w, scales, ref, _) in formats.items():
            calls = [lambda rw=rw, ri=ri, w=w, sc=scales: fused_moe(hidden, *w, rw, ri, **sc) for rw, ri in routes]
            out, ms = first_call(calls)
            check(out, hidden, *ref, *routes[0], f"fused_moe {name}",
                  W8A8_CHECK_TOLERANCE if name == w8a8 else CHECK_TOLERANCE)
            ms = graph_ms(calls) if device.type == "cuda" else ms
            bf16_ms = bf16_ms or ms  # formats start with bf16
            report("fused_moe", t, name, ms, distinct, bf16_ms)
    for t in range(1, GEMV_MAX_TOKENS + 1):
        hidden = torch.randn(t, hidden_size, device=device, generator=gen).bfloat16()
        logits = [torch.randn(t, experts, device=device, generator=gen).bfloat16() for _ in range(count)]
        # each routing's distinct experts: the top k of its logits (the kernel's own ids are checked below)
        distinct = statistics.mean(len(lg.float().topk(top_k, dim=-1).indices.unique()) for lg in logits)
        bf16_ms = None
        for name, (w, scales, ref, _) in formats.items():
            if name == w8a8:  # the GEMVs read FP8 weights only (W8A16)
                continue
            calls = [lambda lg=lg, w=w, sc=scales: moe_gemv_routed(hidden, *w, lg, top_k, True, **sc) for lg in logits]
            (out, weights, ids), ms = first_call(calls)
            check(out, hidden, *ref, weights, ids, f"moe_gemv_routed {name}")
            ms = graph_ms(calls) if device.type == "cuda" else ms
            bf16_ms = bf16_ms or ms
            report("gemv", t, name, ms, distinct, bf16_ms)
    grouped_table(rows, ("bf16", fp8, w8a8))
    return [dict(device=torch.cuda.get_device_name() if copy_gbps else "cpu", copy_gbps=copy_gbps,
                 shape=args.shape, scales=args.fp8)] + rows


def check_alignment(align, ids: torch.Tensor, block_m: int) -> None:
    """Stop on a wrong alignment: every pair of ids [T, K] once in sorted_pair_ids (the rest
    padding), and num_used_blocks the experts' pairs each rounded up to block_m."""
    n = ids.numel()
    real = align.sorted_pair_ids[align.sorted_pair_ids != n].long().sort().values
    blocks = (torch.bincount(ids.view(-1), minlength=E) + block_m - 1) // block_m
    if not torch.equal(real, torch.arange(n, device=ids.device)) or int(align.num_used_blocks) != int(blocks.sum()):
        raise SystemExit(f"moe_align T={ids.shape[0]} block_m={block_m}: wrong alignment")


def align_study(args: argparse.Namespace) -> list[dict]:
    """--align: moe_align's us per call at args.tokens for each block height (E, K: 30B-A3B)."""
    from nanovllm.moe.align import moe_align
    from nanovllm.moe.tiles import BLOCK_MS, moe_tiles, size_class

    gen = torch.Generator("cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: moe_align us per call, E={E}, top-{K}; * = fused_moe's block_m")
    print(f"{'T':>6}" + "".join(f"{f'm{m}':>10}" for m in BLOCK_MS))
    rows = []
    for t in args.tokens:
        ids = [i for _, i in routings(t, gen)]
        picked = moe_tiles(size_class(t) * K, E).block_m
        line = f"{t:>6}"
        for block_m in BLOCK_MS:
            for i in ids:
                check_alignment(moe_align(i, E, block_m), i, block_m)
            us = graph_ms([lambda i=i, m=block_m: moe_align(i, E, m) for i in ids]) * 1e3
            rows.append(dict(kernel="moe_align", tokens=t, block_m=block_m, us=us, picked=block_m == picked))
            line += f"{us:>9.2f}" + ("*" if block_m == picked else " ")
        print(line, flush=True)
    return [dict(device=torch.cuda.get_device_name(), experts=E, top_k=K)] + rows


def grouped_table(rows: list[dict], names: tuple[str, str, str]) -> None:
    """The grouped GEMM's us per T for bf16, W8A16 and W8A8 side by side, and W8A16 / W8A8: the
    steps where W8A8 wins set KernelRoutes.moe_fp8_mma_min_tokens."""
    us = {(r["tokens"], r["weights"]): r["us"] for r in rows if r["kernel"] == "fused_moe"}
    print(f"\nfused_moe us{'T':>7}" + "".join(f"{n:>20}" for n in names) + f"{'w8a16/w8a8':>12}")
    for t in dict.fromkeys(t for t, _ in us):
        print(f"{'':<12}{t:>7}" + "".join(f"{us[t, n]:>20.1f}" for n in names) + f"{us[t, names[1]] / us[t, names[2]]:>12.2f}")


def run(args: argparse.Namespace) -> list[dict]:
    from triton.runtime.errors import OutOfResources

    from nanovllm.moe.grouped_gemm import fused_moe
    from nanovllm.moe.tiles import MoeTiles, Tiling, moe_tiles, size_class
    from nanovllm.moe.align import moe_align
    from nanovllm.moe.decode import MAX_TOKENS as GEMV_MAX_TOKENS
    from nanovllm.moe.decode import moe_gemv

    gen = torch.Generator("cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * I ** -0.5).bfloat16()
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
    if not torch.cuda.is_available() and args.shape != "tiny":
        sys.exit(NO_CUDA_MESSAGE)
    rows = fp8_study(args) if args.fp8 else align_study(args) if args.align else run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
