"""Does a CUDA graph's first replay cost more than the next ones (the graph's upload to the
device)? Times replay 1, 2 and 3 of some of the engine's decode and prefill / mixed graphs right
after start-up, each alone and synchronized. Staging buffers hold padding, so replays write nothing.

    PYTHONPATH=. python3 benchmarks/graph_first_replay.py --model benchmarks/configs/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import time

import torch

from nanovllm import LLM


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=4096)
    runner = llm.model_runner
    for name, graphs in (("decode", runner.graphs.graphs), ("varlen", runner.varlen_graphs.graphs)):
        sizes = sorted(graphs)
        picked = sorted({sizes[0], sizes[len(sizes) // 4], sizes[len(sizes) // 2], sizes[-1]})
        for size in picked:
            times = [replay_ms(graphs[size]) for _ in range(3)]
            print(f"{name:>6} graph {size:>6}: replays 1 / 2 / 3: " + " / ".join(f"{t:.3f}" for t in times) + " ms")
    llm.exit()


if __name__ == "__main__":
    main()
