"""FP8 experts (moe/fp8_experts.py; weights quantized here per expert with MODE's scales) beside the same
experts in bf16, in one run, on Qwen3-30B-A3B's expert shape: the grouped GEMM (fused_moe) at FP8_TOKENS, W8A16 and
W8A8 (act_fp8: activations quantized per token, FP8 MMAs; a last table sets the three side by side,
from which KernelRoutes.moe_fp8_mma_min_tokens is picked), and the
routed decode GEMVs (moe_gemv_routed, router logits in) at 1 and 2 tokens; us, GB/s of the bytes
each actually reads (FP8 weights + float32 scales, or bf16 weights) and their fraction of the copy
bandwidth, TFLOP/s, and the bf16 / fp8 time ratio. Routings and timing: benchmarks/harness/moe_cases.py.

    python -m benchmarks.kernels.bench_moe_fp8 channel|block [--tokens ...] [--shape tiny] [--json PATH]

`--shape tiny` runs it on CPU under TRITON_INTERPRET=1 (a smoke test: one untimed-grade wall-clock call, no
bandwidth probe). Otherwise, without CUDA it says so in one line and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.harness.moe_cases import (CHECK_TOLERANCE, ROUTINGS, SHAPES, W8A8_CHECK_TOLERANCE, bf16_experts, check,
                                          fp8_experts, graph_ms, moe_flops, routings, stored_bytes)
from benchmarks.harness.probes import measure_bandwidth

# Decode batches (1: the grouped path a 1-token prefill takes), a decode graph's batch and
# prefill chunks up to the engine's 8,192-token steps.
FP8_TOKENS = (1, 16, 256, 2048, 8192)
NO_CUDA_MESSAGE = "bench_moe_fp8.py needs a CUDA device (or --shape tiny); none is visible"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fp8", choices=("channel", "block"), help="the experts' weight scales")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(FP8_TOKENS), help="grouped-GEMM batch sizes T")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="30b-a3b",
                    help="expert shape (tiny: CPU smoke test under TRITON_INTERPRET=1)")
    ap.add_argument("--json", metavar="PATH", help="write the rows here")
    return ap.parse_args(argv)


def first_call(calls: list[Callable[[], object]]) -> tuple[object, float]:
    """(what calls[0]() returns, its wall-clock ms): the check's output, and on CPU (the interpreter
    smoke test, one routing) the only timing, a figure that shows the path ran and nothing more."""
    start = time.perf_counter()
    out = calls[0]()
    return out, (time.perf_counter() - start) * 1e3


def fp8_study(args: argparse.Namespace) -> list[dict]:
    """The grouped GEMM at args.tokens and the routed decode GEMVs at 1..MAX_TOKENS, each on
    bf16 experts and on the same experts in FP8 (args.fp8 scales; the grouped GEMM W8A16 and W8A8),
    checked against an fp32 loop."""
    from nanovllm.moe.decode import MAX_TOKENS as GEMV_MAX_TOKENS
    from nanovllm.moe.decode import moe_gemv_routed
    from nanovllm.moe.grouped_gemm import fused_moe

    experts, top_k, hidden_size, inter = SHAPES[args.shape]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    count = ROUTINGS if device.type == "cuda" else 1  # routings per timed graph (CPU: one untimed-grade call)
    gen = torch.Generator(device).manual_seed(0)
    w13, w2 = bf16_experts(gen, experts, hidden_size, inter)
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


def grouped_table(rows: list[dict], names: tuple[str, str, str]) -> None:
    """The grouped GEMM's us per T for bf16, W8A16 and W8A8 side by side, and W8A16 / W8A8: the
    steps where W8A8 wins set KernelRoutes.moe_fp8_mma_min_tokens."""
    us = {(r["tokens"], r["weights"]): r["us"] for r in rows if r["kernel"] == "fused_moe"}
    print(f"\nfused_moe us{'T':>7}" + "".join(f"{n:>20}" for n in names) + f"{'w8a16/w8a8':>12}")
    for t in dict.fromkeys(t for t, _ in us):
        print(f"{'':<12}{t:>7}" + "".join(f"{us[t, n]:>20.1f}" for n in names) + f"{us[t, names[1]] / us[t, names[2]]:>12.2f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available() and args.shape != "tiny":
        sys.exit(NO_CUDA_MESSAGE)
    rows = fp8_study(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
