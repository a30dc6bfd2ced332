"""Device timing of nanovllm's Triton attention kernels at their defaults (needs a CUDA GPU).

Measures (1) decode attention GB/s over the KV bytes that must be read, as % of the HBM copy
bandwidth (benchmarks/harness/probes.py), timed as CUDA-graph replays, (2) prefill TFLOP/s vs
torch's FA2 varlen_attn (packed) and our paged variant, a triton.testing.do_bench median (the KV
write is inside the fused q/k-norm + RoPE kernel: benchmarks/kernels/bench_fused.py). --splits instead times decode at each forced split count next to
the automatic choice: few long sequences, and engine-like batches. --fp8-tiles times engine-like
decode batches over a 16-bit cache and an FP8 one, each at its default tile and over DECODE_TILES; --pack
the same batches unsplit with 1, 2 and 4 kv heads a program (decode_plan.heads_per_program).

    python -m benchmarks.kernels.bench_kernels [--json PATH]
    python -m benchmarks.kernels.bench_kernels --splits [--json PATH]
    python -m benchmarks.kernels.bench_kernels --fp8-tiles [--json PATH]
    python -m benchmarks.kernels.bench_kernels --splits --heads 14,2,64   # another model's heads (Qwen2.5-0.5B)
    python -m benchmarks.kernels.bench_kernels --pack --heads 14,2,64
"""

from __future__ import annotations

import argparse
import json
from typing import NamedTuple

import torch
import triton

from benchmarks.harness.engine_options import require_cuda
from benchmarks.harness.probes import measure_bandwidth
from benchmarks.harness.timing import graph_us, median_s
from nanovllm.kernels.checks import cuda_sm_count
from nanovllm.kernels.decode_attention import flash_attn_with_kvcache
from nanovllm.kernels.decode_plan import DecodeTile, choose_num_splits, heads_per_program
from nanovllm.kernels.prefill_attention import flash_attn_varlen_func


class Heads(NamedTuple):
    """A model's attention heads: query heads, kv heads, head_dim (`--heads Q,KV,D`)."""

    q: int
    kv: int
    dim: int


QWEN3_0_6B = Heads(16, 8, 128)  # the default
DEV = "cuda"
# Tiles (keys per step, stages in flight) timed by --fp8-tiles beside each cache's default.
DECODE_TILES = [DecodeTile(32, 3), DecodeTile(32, 4), DecodeTile(64, 2), DecodeTile(64, 3), DecodeTile(64, 4),
                DecodeTile(128, 2), DecodeTile(128, 3)]


def graph_bench(fn, reps=20):
    """Seconds per call of fn, reps calls captured in one CUDA graph (no host launch cost, as in the engine)."""
    return graph_us(lambda: [fn() for _ in range(reps)]) / reps * 1e-6


def paged_cache(lens, block_size, dtype, gen, heads: Heads):
    nblk = [-(-n // block_size) for n in lens]
    num_blocks = sum(nblk)
    perm = torch.randperm(num_blocks, device=DEV, generator=gen).int()
    table = torch.zeros((len(lens), max(nblk)), dtype=torch.int32, device=DEV)
    pos = 0
    for i, nb in enumerate(nblk):
        table[i, :nb] = perm[pos:pos + nb]
        pos += nb
    kc = torch.randn((num_blocks, block_size, heads.kv, heads.dim), device=DEV, generator=gen).to(dtype)
    vc = torch.randn((num_blocks, block_size, heads.kv, heads.dim), device=DEV, generator=gen).to(dtype)
    return kc, vc, table


def bench_decode(batch, ctx, bw, heads: Heads, dtype=torch.bfloat16, block_size=256):
    gen = torch.Generator(DEV).manual_seed(0)
    lens = [ctx] * batch
    kc, vc, table = paged_cache(lens, block_size, dtype, gen, heads)
    q = torch.randn((batch, 1, heads.q, heads.dim), device=DEV, generator=gen).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    t = graph_bench(lambda: flash_attn_with_kvcache(q, kc, vc, seqlens, table))
    nbytes = 2 * batch * ctx * heads.kv * heads.dim * kc.element_size()
    return {"batch": batch, "ctx": ctx, "us": t * 1e6, "GB/s": nbytes / t / 1e9,
            "pct_bw": 100 * nbytes / t / 1e9 / bw}


def small_batch_splits(bw, heads: Heads):
    """Few long sequences, graph-replayed, block table as wide as the context: us per num_splits."""
    rows = []
    for batch, ctx in [(1, 1024), (1, 4096), (8, 8192), (1, 32768)]:
        gen = torch.Generator(DEV).manual_seed(3)
        kc, vc, table = paged_cache([ctx] * batch, 256, torch.bfloat16, gen, heads)
        q = torch.randn((batch, 1, heads.q, heads.dim), device=DEV, generator=gen).to(torch.bfloat16)
        seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        nbytes = 2 * batch * ctx * heads.kv * heads.dim * 2
        row = {"batch": batch, "ctx": ctx}
        for n in (0, 1, 2, 4, 8, 16, 32, 64, 128):
            if n * 64 > ctx:
                continue
            t = graph_bench(lambda: flash_attn_with_kvcache(q, kc, vc, seqlens, table, num_splits=n))
            row[f"us_{n}"] = round(t * 1e6, 2)
            row[f"pct_{n}"] = round(100 * nbytes / t / 1e9 / bw, 1)
        rows.append(row)
        print("small-batch splits", row, flush=True)
    return rows


def engine_batch(batch, ctx, heads: Heads):
    """An engine-like decode batch: lengths uniform in [ctx/8, ctx], block table as wide as
    max_model_len 4096. Returns the call's arguments (q, k_cache, v_cache, seqlens, table) and the
    KV bytes it must read."""
    gen = torch.Generator(DEV).manual_seed(1)
    lens = torch.randint(ctx // 8, ctx + 1, (batch,), generator=gen, device=DEV).tolist()
    kc, vc, table = paged_cache(lens, 256, torch.bfloat16, gen, heads)
    table = torch.nn.functional.pad(table, (0, 16 - table.shape[1]))
    q = torch.randn((batch, 1, heads.q, heads.dim), device=DEV, generator=gen).to(torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return (q, kc, vc, seqlens, table), 2 * sum(lens) * heads.kv * heads.dim * 2


def split_study(bw, heads: Heads):
    """Engine-like decode batches (engine_batch): time per num_splits (0 = the automatic choice)."""
    rows = []
    for batch, ctx in [(256, 1024), (256, 2048), (160, 1024), (128, 1024), (64, 2048), (32, 2048)]:
        (q, kc, vc, seqlens, table), nbytes = engine_batch(batch, ctx, heads)
        row = {"batch": batch, "ctx": ctx, "auto": choose_num_splits(batch, heads.kv, 4096, cuda_sm_count(q.device))}
        for n in (0, 1, 2, 4, 8):
            t = median_s(lambda: flash_attn_with_kvcache(q, kc, vc, seqlens, table, num_splits=n))
            row[f"us_{n}"] = t * 1e6
            row[f"pct_{n}"] = 100 * nbytes / t / 1e9 / bw
        rows.append(row)
        print("splits", {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows


def both_caches(batch, ctx, heads: Heads):
    """engine_batch's decode call over its bf16 cache and over the same values in FP8 (scale 1/64: randn
    fits e4m3's range): {"bf16" / "fp8": (call arguments, keyword arguments, KV bytes to read)}."""
    (q, kc, vc, seqlens, table), nbytes = engine_batch(batch, ctx, heads)
    scale = torch.full((1,), 1 / 64, device=DEV)
    k8, v8 = (c.float().div(scale).to(torch.float8_e4m3fn) for c in (kc, vc))
    return {"bf16": ((q, kc, vc, seqlens, table), {}, nbytes),
            "fp8": ((q, k8, v8, seqlens, table), {"k_scale": scale, "v_scale": scale}, nbytes // 2)}


def cache_study(bw, heads: Heads, tag, shapes, variants, plan=None):
    """Engine-like decode batches (engine_batch) of `shapes` ((batch, ctx) pairs) over the bf16 cache and
    the same values in FP8 (both_caches): us and % of copy bandwidth over the bytes each must read, for
    each (label, flash_attn_with_kvcache keyword arguments) of `variants`; plan(cache name) adds the
    plan's own choice to each row."""
    rows = []
    for batch, ctx in shapes:
        for name, (args, extra, nb) in both_caches(batch, ctx, heads).items():
            row = {"batch": batch, "ctx": ctx, "cache": name, **({} if plan is None else {"plan": plan(name)})}
            for label, kwargs in variants:
                t = graph_bench(lambda: flash_attn_with_kvcache(*args, **kwargs, **extra))
                row[f"us_{label}"] = round(t * 1e6, 1)
                row[f"pct_{label}"] = round(100 * nb / t / 1e9 / bw, 1)
            rows.append(row)
            print(tag, row, flush=True)
    return rows


def fp8_tile_study(bw, heads: Heads):
    """cache_study at the default tile and each of DECODE_TILES."""
    tiles = [("default", {})] + [(f"{t.block_n}x{t.stages}", {"tile": t}) for t in DECODE_TILES]
    return cache_study(bw, heads, "fp8 tiles", [(256, 1024), (256, 2048), (128, 1024), (64, 2048), (32, 4096)], tiles)


def pack_study(bw, heads: Heads):
    """cache_study unsplit (as the decode graphs run) with 1, 2, 4 kv heads a program (up to 256 values a
    key's row), beside the plan's choice (decode_plan.heads_per_program)."""
    packs = [(str(p), {"num_splits": 1, "kv_heads_per_program": p})
             for p in (1, 2, 4) if heads.kv % p == 0 and p * heads.dim <= 256]
    return cache_study(bw, heads, "pack", [(256, 1024), (128, 1024), (64, 2048)], packs,
                       plan=lambda name: heads_per_program(name == "fp8", heads.dim, heads.kv))


def causal_flops(lens, heads: Heads):
    return sum(4 * heads.q * heads.dim * n * (n + 1) / 2 for n in lens)


def bench_prefill(nseq, seqlen, heads: Heads, dtype=torch.bfloat16, block_size=256):
    gen = torch.Generator(DEV).manual_seed(1)
    lens = [seqlen] * nseq
    total = sum(lens)
    q = torch.randn((total, heads.q, heads.dim), device=DEV, generator=gen).to(dtype)
    k = torch.randn((total, heads.kv, heads.dim), device=DEV, generator=gen).to(dtype)
    v = torch.randn((total, heads.kv, heads.dim), device=DEV, generator=gen).to(dtype)
    cu = torch.arange(0, total + 1, seqlen, dtype=torch.int32, device=DEV)
    flops = causal_flops(lens, heads)
    res = {"nseq": nseq, "seqlen": seqlen}
    res["ours_tflops"] = flops / median_s(lambda: flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, causal=True)) / 1e12
    try:
        from torch.nn.attention.varlen import varlen_attn
        res["torch_tflops"] = flops / median_s(lambda: varlen_attn(q, k, v, cu, cu, seqlen, seqlen,
                                                                  window_size=(-1, 0))) / 1e12
        res["ratio"] = res["ours_tflops"] / res["torch_tflops"]
    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
        res["torch_error"] = repr(exc)[:120]
    kc, vc, table = paged_cache(lens, block_size, dtype, gen, heads)
    res["paged_tflops"] = flops / median_s(lambda: flash_attn_varlen_func(
        q, kc, vc, cu, cu, seqlen, seqlen, causal=True, block_table=table)) / 1e12
    return res


def report(res, bw, heads: Heads):
    """Decode and prefill at the kernels' defaults, and their table."""
    res["decode"] = []
    for batch, ctx in [(256, 1024), (256, 4096), (64, 4096), (8, 8192), (8, 32768), (1, 32768)]:
        res["decode"].append(bench_decode(batch, ctx, bw, heads))
        print("decode", res["decode"][-1], flush=True)
    res["prefill"] = []
    for nseq, seqlen in [(16, 1024), (4, 4096), (64, 256)]:
        res["prefill"].append(bench_prefill(nseq, seqlen, heads))
        print("prefill", res["prefill"][-1], flush=True)
    print(f"\n== HBM copy {bw:.0f} GB/s | heads {heads.q}q/{heads.kv}kv D{heads.dim}, bf16, block 256 ==")
    print(f"{'decode batch x ctx':>20} {'us':>9} {'GB/s':>8} {'%bw':>6}")
    for r in res["decode"]:
        print(f"{r['batch']:>9} x {r['ctx']:<8} {r['us']:9.1f} {r['GB/s']:8.0f} {r['pct_bw']:6.1f}")
    print(f"{'prefill causal':>20} {'ours':>8} {'torchFA2':>9} {'ratio':>6} {'paged':>8}  (TFLOP/s)")
    for r in res["prefill"]:
        print(f"{r['nseq']:>9} x {r['seqlen']:<8} {r['ours_tflops']:8.1f} {r.get('torch_tflops', float('nan')):9.1f} "
              f"{r.get('ratio', float('nan')):6.2f} {r['paged_tflops']:8.1f}")


def parse_heads(text: str) -> Heads:
    """`--heads Q,KV,D`: three positive ints, Q a multiple of KV."""
    try:
        heads = Heads(*(int(v) for v in text.split(",")))
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"--heads takes Q,KV,D (three ints), got {text!r}") from None
    if min(heads) < 1 or heads.q % heads.kv:
        raise argparse.ArgumentTypeError(f"--heads: positive ints with Q a multiple of KV, got {text!r}")
    return heads


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write results to this path")
    ap.add_argument("--splits", action="store_true", help="only the split-count studies")
    ap.add_argument("--fp8-tiles", action="store_true", help="only the 16-bit / FP8 cache decode tile study")
    ap.add_argument("--pack", action="store_true", help="only the kv-heads-a-program study, 16-bit and FP8 caches")
    ap.add_argument("--heads", type=parse_heads, default=QWEN3_0_6B,
                    help="query heads, kv heads, head_dim (default: Qwen3-0.6B's 16,8,128; Qwen2.5-0.5B: 14,2,64)")
    args = ap.parse_args()
    require_cuda("bench_kernels.py", "kernel time")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    bw = measure_bandwidth() / 1e9
    res = {"hbm_GBps": bw}
    print(f"copy bandwidth: {bw:.0f} GB/s", flush=True)
    if args.fp8_tiles:
        res["fp8_tiles"] = fp8_tile_study(bw, args.heads)
    elif args.pack:
        res["pack"] = pack_study(bw, args.heads)
    elif args.splits:
        res["small_batch_splits"] = small_batch_splits(bw, args.heads)
        res["splits"] = split_study(bw, args.heads)
    else:
        report(res, bw, args.heads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
