"""Skinny GEMMs of decode (y = x W^T, x [M, K] bf16) under CUDA-graph replay: time and GB/s
of the weight read, per linear layer of Qwen3-0.6B / 8B (cuBLAS through F.linear).

    PYTHONPATH=. python3 benchmarks/bench_gemm.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N, K)
    "0.6B qkv": (4096, 1024), "0.6B o": (1024, 2048), "0.6B gate_up": (6144, 1024), "0.6B down": (1024, 3072),
    "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (24576, 4096), "8B down": (4096, 12288),
}
REPS = 20


def graph_time_us(fn) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (10 * REPS)


def main() -> None:
    torch.manual_seed(0)
    print(f"{'layer':<14}{'M':>5}{'us':>9}{'GB/s':>9}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (1, 2, 4, 8, 16, 32, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = graph_time_us(lambda: F.linear(x, w))
            print(f"{name:<14}{m:>5}{us:>9.2f}{w.numel() * 2 / us / 1e3:>9.0f}")

if __name__ == "__main__":
    main()
