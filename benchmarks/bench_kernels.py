"""Device timing of nanovllm's Triton attention kernels (needs a CUDA GPU).

Measures (1) HBM bandwidth by a large device-to-device copy (bytes read + written),
(2) decode attention GB/s over the KV bytes that must be read, as % of (1),
(3) prefill TFLOP/s vs torch's FA2 varlen_attn (packed) and our paged variant,
(4) store_kvcache GB/s. Times are triton.testing.do_bench medians.

    python benchmarks/bench_kernels.py [--json PATH] [--sweep] [--sweep-decode]
    python benchmarks/bench_kernels.py --splits | --sweep-decode-engine [--json PATH]
"""

import argparse
import json
from contextlib import contextmanager

import torch
import triton

from graph_timing import graph_us
from nanovllm.kernels.decode_attention import flash_attn_with_kvcache
from nanovllm.kernels.kv_store import store_kvcache
from nanovllm.kernels.prefill_attention import flash_attn_varlen_func

HQ, HKV, D = 16, 8, 128  # Qwen3-0.6B attention heads
DEV = "cuda"


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3  # seconds


def graph_bench(fn, reps=20):
    """Seconds per call of fn, reps calls captured in one CUDA graph (no host launch cost, as in the engine)."""
    return graph_us(lambda: [fn() for _ in range(reps)]) / reps * 1e-6


def hbm_bandwidth():
    x = torch.randn(512 * 2**20, device=DEV, dtype=torch.float32)  # 2 GiB
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / t / 1e9


def paged_cache(lens, block_size, dtype, gen):
    nblk = [-(-n // block_size) for n in lens]
    num_blocks = sum(nblk)
    perm = torch.randperm(num_blocks, device=DEV, generator=gen).int()
    table = torch.zeros((len(lens), max(nblk)), dtype=torch.int32, device=DEV)
    pos = 0
    for i, nb in enumerate(nblk):
        table[i, :nb] = perm[pos:pos + nb]
        pos += nb
    kc = torch.randn((num_blocks, block_size, HKV, D), device=DEV, generator=gen).to(dtype)
    vc = torch.randn((num_blocks, block_size, HKV, D), device=DEV, generator=gen).to(dtype)
    return kc, vc, table


def bench_decode(batch, ctx, bw, dtype=torch.bfloat16, block_size=256):
    gen = torch.Generator(DEV).manual_seed(0)
    lens = [ctx] * batch
    kc, vc, table = paged_cache(lens, block_size, dtype, gen)
    q = torch.randn((batch, 1, HQ, D), device=DEV, generator=gen).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    t = graph_bench(lambda: flash_attn_with_kvcache(q, kc, vc, seqlens, table))
    nbytes = 2 * batch * ctx * HKV * D * kc.element_size()
    return {"batch": batch, "ctx": ctx, "us": t * 1e6, "GB/s": nbytes / t / 1e9,
            "pct_bw": 100 * nbytes / t / 1e9 / bw}


def small_batch_splits(bw):
    """Few long sequences, graph-replayed, block table as wide as the context: us per num_splits."""
    rows = []
    for batch, ctx in [(1, 1024), (1, 4096), (8, 8192), (1, 32768)]:
        gen = torch.Generator(DEV).manual_seed(3)
        kc, vc, table = paged_cache([ctx] * batch, 256, torch.bfloat16, gen)
        q = torch.randn((batch, 1, HQ, D), device=DEV, generator=gen).to(torch.bfloat16)
        seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
        nbytes = 2 * batch * ctx * HKV * D * 2
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


def engine_batch(batch, ctx, longest_first=False):
    """An engine-like decode batch: lengths uniform in [ctx/8, ctx] (longest first, as the engine
    orders its rows, if asked), block table as wide as max_model_len 4096. Returns the call's
    arguments (q, k_cache, v_cache, seqlens, table) and the KV bytes it must read."""
    gen = torch.Generator(DEV).manual_seed(1)
    lens = torch.randint(ctx // 8, ctx + 1, (batch,), generator=gen, device=DEV).tolist()
    if longest_first:
        lens.sort(reverse=True)
    kc, vc, table = paged_cache(lens, 256, torch.bfloat16, gen)
    table = torch.nn.functional.pad(table, (0, 16 - table.shape[1]))
    q = torch.randn((batch, 1, HQ, D), device=DEV, generator=gen).to(torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return (q, kc, vc, seqlens, table), 2 * sum(lens) * HKV * D * 2


def split_study(bw):
    """Engine-like decode batches (engine_batch): time per num_splits (0 = the automatic choice)."""
    from nanovllm.kernels.decode_attention import _sm_count, choose_num_splits
    rows = []
    for batch, ctx in [(256, 1024), (256, 2048), (160, 1024), (128, 1024), (64, 2048), (32, 2048)]:
        (q, kc, vc, seqlens, table), nbytes = engine_batch(batch, ctx)
        row = {"batch": batch, "ctx": ctx, "auto": choose_num_splits(batch, HKV, 4096, _sm_count(q.device))}
        for n in (0, 1, 2, 4, 8):
            t = bench(lambda: flash_attn_with_kvcache(q, kc, vc, seqlens, table, num_splits=n))
            row[f"us_{n}"] = t * 1e6
            row[f"pct_{n}"] = 100 * nbytes / t / 1e9 / bw
        rows.append(row)
        print("splits", {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows


def causal_flops(lens):
    return sum(4 * HQ * D * n * (n + 1) / 2 for n in lens)


def bench_prefill(nseq, seqlen, dtype=torch.bfloat16, block_size=256):
    gen = torch.Generator(DEV).manual_seed(1)
    lens = [seqlen] * nseq
    total = sum(lens)
    q = torch.randn((total, HQ, D), device=DEV, generator=gen).to(dtype)
    k = torch.randn((total, HKV, D), device=DEV, generator=gen).to(dtype)
    v = torch.randn((total, HKV, D), device=DEV, generator=gen).to(dtype)
    cu = torch.arange(0, total + 1, seqlen, dtype=torch.int32, device=DEV)
    flops = causal_flops(lens)
    res = {"nseq": nseq, "seqlen": seqlen}
    res["ours_tflops"] = flops / bench(lambda: flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, causal=True)) / 1e12
    try:
        from torch.nn.attention.varlen import varlen_attn
        res["torch_tflops"] = flops / bench(lambda: varlen_attn(q, k, v, cu, cu, seqlen, seqlen,
                                                                  window_size=(-1, 0))) / 1e12
        res["ratio"] = res["ours_tflops"] / res["torch_tflops"]
    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
        res["torch_error"] = repr(exc)[:120]
    kc, vc, table = paged_cache(lens, block_size, dtype, gen)
    res["paged_tflops"] = flops / bench(lambda: flash_attn_varlen_func(
        q, kc, vc, cu, cu, seqlen, seqlen, causal=True, block_table=table)) / 1e12
    return res


def bench_store(n=65536, dtype=torch.bfloat16, block_size=256):
    gen = torch.Generator(DEV).manual_seed(2)
    key = torch.randn((n, HKV, D), device=DEV, generator=gen).to(dtype)
    value = torch.randn((n, HKV, D), device=DEV, generator=gen).to(dtype)
    num_blocks = 2 * n // block_size
    kc = torch.empty((num_blocks, block_size, HKV, D), device=DEV, dtype=dtype)
    vc = torch.empty_like(kc)
    slots = torch.randperm(num_blocks * block_size, device=DEV, generator=gen)[:n].int()
    t = bench(lambda: store_kvcache(key, value, kc, vc, slots))
    return {"n": n, "us": t * 1e6, "GB/s": 4 * key.numel() * key.element_size() / t / 1e9}


@contextmanager
def patched(module, names, values):
    """The module's constants `names` set to `values` inside the block, restored after (a sweep's
    tiling, read by the kernel wrappers at each call)."""
    saved = tuple(getattr(module, n) for n in names)
    for n, v in zip(names, values):
        setattr(module, n, v)
    try:
        yield
    finally:
        for n, v in zip(names, saved):
            setattr(module, n, v)


def sweep_prefill():
    """Try a few tile configs on causal prefill cases (module constants patched)."""
    import nanovllm.kernels.prefill_attention as pf
    out = []
    for cfg, shape in [(c, s) for s in [(16, 1024), (4, 4096)]
                       for c in [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3),
                                 (64, 64, 8, 3), (128, 128, 8, 2)]]:
        with patched(pf, ("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES"), cfg):
            try:
                r = bench_prefill(*shape)
                out.append({"cfg": cfg, "shape": shape, "ours": r["ours_tflops"], "paged": r["paged_tflops"]})
            except Exception as exc:  # noqa: BLE001
                out.append({"cfg": cfg, "error": repr(exc)[:100]})
        print("sweep", out[-1], flush=True)
    return out


# Engine-like decode batches (rows x longest context) for --sweep-decode-engine: the row counts
# of the default workload's decode steps (bench.py's buckets), mid-size batches most.
ENGINE_DECODE_CASES = [(32, 2048), (48, 2048), (64, 1024), (64, 2048), (96, 1024), (96, 2048),
                       (128, 1024), (128, 2048), (192, 1024), (256, 1024), (256, 2048)]
# (BLOCK_N, NUM_STAGES, NUM_WARPS, NO_SPLIT_PROGRAMS_PER_SM) candidates; the default runs first.
ENGINE_DECODE_CONFIGS = [(64, 4, 4, 3), (64, 2, 4, 3), (128, 2, 4, 3), (128, 3, 8, 3), (128, 2, 8, 3),
                         (64, 3, 4, 6), (128, 2, 4, 6), (128, 2, 8, 6)]


def sweep_decode_engine(bw):
    """(BLOCK_N, NUM_STAGES, NUM_WARPS, NO_SPLIT_PROGRAMS_PER_SM) of the decode kernel (module
    constants patched) on engine-like batches, rows longest first, graph-replayed as in the
    engine: % of copy bandwidth. The default is the first row."""
    import nanovllm.kernels.decode_attention as dec
    names = ("BLOCK_N", "NUM_STAGES", "NUM_WARPS", "NO_SPLIT_PROGRAMS_PER_SM")
    cases = {(b, c): engine_batch(b, c, longest_first=True) for b, c in ENGINE_DECODE_CASES}
    out = []
    default = tuple(getattr(dec, n) for n in names)
    print("engine decode sweep, % of copy; columns rows x longest context:",
          " ".join(f"{b}x{c}" for b, c in cases), flush=True)
    for cfg in [default] + [c for c in ENGINE_DECODE_CONFIGS if c != default]:
        row = {"cfg": cfg}
        with patched(dec, names, cfg):
            for (batch, ctx), (call, nbytes) in cases.items():
                try:
                    t = graph_bench(lambda call=call: flash_attn_with_kvcache(*call))
                    row[f"{batch}x{ctx}"] = round(100 * nbytes / t / 1e9 / bw, 1)
                except Exception as exc:  # noqa: BLE001 - report, keep sweeping
                    row[f"{batch}x{ctx}"] = repr(exc)[:80]
        out.append(row)
        print(f"{str(cfg):>18}", " ".join(f"{row[f'{b}x{c}']!s:>8}" for b, c in cases), flush=True)
    return out


def sweep_decode(bw):
    """Try decode tile/split settings (module constants patched) on the weaker points."""
    import nanovllm.kernels.decode_attention as dec
    names = ("BLOCK_N", "NUM_STAGES", "NUM_WARPS", "MIN_TOKENS_PER_SPLIT", "PROGRAMS_PER_SM")
    out = []
    for cfg in [(64, 3, 4, 256, 16), (64, 2, 4, 256, 16), (32, 4, 4, 256, 16), (64, 3, 4, 512, 16),
                (32, 3, 4, 256, 16), (64, 2, 4, 512, 8), (128, 2, 8, 512, 16)]:
        with patched(dec, names, cfg):
            for batch, ctx in [(8, 8192), (1, 32768), (256, 4096)]:
                try:
                    r = bench_decode(batch, ctx, bw)
                    out.append({"cfg": cfg, "batch": batch, "ctx": ctx, "pct_bw": r["pct_bw"], "us": r["us"]})
                except Exception as exc:  # noqa: BLE001
                    out.append({"cfg": cfg, "batch": batch, "error": repr(exc)[:100]})
                print("dsweep", out[-1], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="write results to this path")
    ap.add_argument("--sweep", action="store_true", help="also sweep prefill tile configs")
    ap.add_argument("--sweep-decode", action="store_true", help="also sweep decode settings")
    ap.add_argument("--splits", action="store_true", help="only the num_splits study on engine-like batches")
    ap.add_argument("--sweep-decode-engine", action="store_true",
                    help="only the decode kernel's tilings on engine-like batches")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    res = {"hbm_GBps": hbm_bandwidth()}
    bw = res["hbm_GBps"]
    print(f"copy bandwidth: {bw:.0f} GB/s", flush=True)
    if args.splits or args.sweep_decode_engine:
        if args.splits:
            res["splits"] = split_study(bw)
        if args.sweep_decode_engine:
            res["sweep_decode_engine"] = sweep_decode_engine(bw)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
        return
    res["small_batch_splits"] = small_batch_splits(bw)
    res["decode"] = []
    for batch, ctx in [(256, 1024), (256, 4096), (64, 4096), (8, 8192), (8, 32768), (1, 32768)]:
        res["decode"].append(bench_decode(batch, ctx, bw))
        print("decode", res["decode"][-1], flush=True)
    res["prefill"] = []
    for nseq, seqlen in [(16, 1024), (4, 4096), (64, 256)]:
        res["prefill"].append(bench_prefill(nseq, seqlen))
        print("prefill", res["prefill"][-1], flush=True)
    res["store"] = bench_store()
    if args.sweep:
        res["sweep"] = sweep_prefill()
    if args.sweep_decode:
        res["sweep_decode"] = sweep_decode(bw)

    print(f"\n== HBM copy {bw:.0f} GB/s | Qwen3-0.6B heads {HQ}q/{HKV}kv D{D}, bf16, block 256 ==")
    print(f"{'decode batch x ctx':>20} {'us':>9} {'GB/s':>8} {'%bw':>6}")
    for r in res["decode"]:
        print(f"{r['batch']:>9} x {r['ctx']:<8} {r['us']:9.1f} {r['GB/s']:8.0f} {r['pct_bw']:6.1f}")
    print(f"{'prefill causal':>20} {'ours':>8} {'torchFA2':>9} {'ratio':>6} {'paged':>8}  (TFLOP/s)")
    for r in res["prefill"]:
        print(f"{r['nseq']:>9} x {r['seqlen']:<8} {r['ours_tflops']:8.1f} {r.get('torch_tflops', float('nan')):9.1f} "
              f"{r.get('ratio', float('nan')):6.2f} {r['paged_tflops']:8.1f}")
    s = res["store"]
    print(f"store_kvcache {s['n']} tokens: {s['us']:.1f} us, {s['GB/s']:.0f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
