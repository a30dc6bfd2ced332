"""Does decode attention slow down when a batch's KV blocks are spread over a large cache?

The engine's cache fills most of the GPU (~110 GB for Qwen3-0.6B on an H200) and the block
manager hands out the least recently freed block first, so after a while a step's blocks lie
anywhere in it; bench_kernels.py's decode cases read a cache holding only their own blocks.
This times one decode step's attention (every layer, one CUDA graph) over the engine's cache
layout [2, layers, blocks, block_size, kv_heads, head_dim] with the batch's blocks either
packed at the lowest ids or drawn at random from the whole cache (or its lowest `--fraction`).

    PYTHONPATH=. python3 benchmarks/bench_kv_spread.py --cache-gb 100
"""

from __future__ import annotations

import argparse

import torch

from graph_timing import graph_us
from nanovllm.kernels.decode_attention import flash_attn_with_kvcache

LAYERS, HQ, HKV, D, BLOCK = 28, 16, 8, 128, 256  # Qwen3-0.6B, the engine's block size
TABLE_WIDTH = 16  # max_model_len 4096 / 256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-gb", type=float, default=100.0)
    ap.add_argument("--cases", default="256x1024,128x1024,64x2048")
    args = ap.parse_args()
    dev, bf16 = "cuda", torch.bfloat16
    block_bytes = 2 * LAYERS * BLOCK * HKV * D * 2
    num_blocks = int(args.cache_gb * 1e9 // block_bytes)
    cache = torch.zeros((2, LAYERS, num_blocks, BLOCK, HKV, D), dtype=bf16, device=dev)
    print(f"cache {num_blocks} blocks x {block_bytes / 2**20:.0f} MiB = {cache.numel() * 2 / 1e9:.1f} GB", flush=True)
    gen = torch.Generator(dev).manual_seed(0)
    for case in args.cases.split(","):
        batch, ctx = map(int, case.split("x"))
        lens = torch.randint(ctx // 8, ctx + 1, (batch,), generator=gen, device=dev).sort(descending=True).values
        need = [-(-int(n) // BLOCK) for n in lens.tolist()]
        total = sum(need)
        q = torch.randn((batch, 1, HQ, D), generator=gen, device=dev).to(bf16)
        seqlens = lens.to(torch.int32)
        nbytes = 2 * LAYERS * int(lens.sum()) * HKV * D * 2
        line = f"{batch:>4} rows x ctx <= {ctx}: {total} blocks;"
        for name, pool in (("packed", total), ("lowest 10%", max(total, num_blocks // 10)), ("anywhere", num_blocks)):
            ids = torch.randperm(pool, generator=gen, device=dev)[:total].to(torch.int32)
            table = torch.zeros((batch, TABLE_WIDTH), dtype=torch.int32, device=dev)
            at = 0
            for i, n in enumerate(need):
                table[i, :n] = ids[at : at + n]
                at += n
            us = graph_us(lambda: [flash_attn_with_kvcache(q, cache[0, layer], cache[1, layer], seqlens, table)
                                   for layer in range(LAYERS)])
            line += f"  {name}: {us:8.1f} us {nbytes / us / 1e3:6.0f} GB/s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
