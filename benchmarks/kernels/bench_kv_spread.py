"""Decode attention as a decode step runs it: every layer in one CUDA graph, over the engine's
cache layout [2, layers, blocks, block_size, kv_heads, head_dim] sized like the engine's (~100 GB),
with the batch's blocks packed at the lowest ids, drawn from the lowest 10%, or from anywhere (the
engine's free list hands out the least recently freed block, so a long run spreads a step's blocks
over the whole cache; H200, 2026-12-02: no difference, BENCHMARKS.md). Rates are % of the HBM copy
bandwidth.

    python -m benchmarks.kernels.bench_kv_spread [--cache-gb 100] [--cases 256x1024,64x2048]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness.engine_options import require_cuda
from benchmarks.harness.probes import measure_bandwidth
from benchmarks.harness.timing import graph_us
from nanovllm.kernels.decode_attention import flash_attn_with_kvcache

LAYERS, HQ, HKV, D, BLOCK = 28, 16, 8, 128, 256  # Qwen3-0.6B, the engine's block size
TABLE_WIDTH = 16  # max_model_len 4096 / 256


def step_us(cache, q, seqlens, table) -> float:
    """us per replay of all layers' decode attention for this batch."""
    return graph_us(lambda: [flash_attn_with_kvcache(q, cache[0, layer], cache[1, layer], seqlens, table)
                             for layer in range(LAYERS)])


def batch_of(batch: int, ctx: int, pool: int, gen: torch.Generator):
    """(q, seqlens, block table, KV bytes) of `batch` rows, lengths uniform in [ctx/8, ctx],
    longest first (as the engine orders them), blocks drawn from the lowest `pool` ids."""
    dev = "cuda"
    lens = torch.randint(ctx // 8, ctx + 1, (batch,), generator=gen, device=dev).sort(descending=True).values
    need = [-(-int(n) // BLOCK) for n in lens.tolist()]
    ids = torch.randperm(max(pool, sum(need)), generator=gen, device=dev)[: sum(need)].to(torch.int32)
    table = torch.zeros((batch, TABLE_WIDTH), dtype=torch.int32, device=dev)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[at : at + n]
        at += n
    q = torch.randn((batch, 1, HQ, D), generator=gen, device=dev).to(torch.bfloat16)
    return q, lens.to(torch.int32), table, 2 * LAYERS * int(lens.sum()) * HKV * D * 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-gb", type=float, default=100.0)
    ap.add_argument("--cases", default="256x1024,192x1024,128x1024,96x2048,64x2048,32x2048")
    args = ap.parse_args()
    require_cuda("bench_kv_spread.py", "kernel time")
    bw = measure_bandwidth() / 1e9
    block_bytes = 2 * LAYERS * BLOCK * HKV * D * 2
    num_blocks = int(args.cache_gb * 1e9 // block_bytes)
    cache = torch.zeros((2, LAYERS, num_blocks, BLOCK, HKV, D), dtype=torch.bfloat16, device="cuda")
    print(f"copy bandwidth {bw:.0f} GB/s; cache {num_blocks} blocks = {cache.numel() * 2 / 1e9:.1f} GB", flush=True)
    gen = torch.Generator("cuda").manual_seed(0)
    for case in args.cases.split(","):
        batch, ctx = map(int, case.split("x"))
        line = f"{batch:>4} rows x ctx <= {ctx:<5}"
        for name, pool in (("packed", 0), ("lowest 10%", num_blocks // 10), ("anywhere", num_blocks)):
            q, seqlens, table, nbytes = batch_of(batch, ctx, pool, gen)
            us = step_us(cache, q, seqlens, table)
            line += f"  {name}: {us:8.1f} us {100 * nbytes / us / 1e3 / bw:5.1f}%"
        print(line, flush=True)


if __name__ == "__main__":
    main()
