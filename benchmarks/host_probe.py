"""Where the host time of a decode step goes: cProfile over engine steps at a small batch,
plus the cost of the pinned-memory operations one step uses.

    PYTHONPATH=. python3 benchmarks/host_probe.py --model benchmarks/configs/qwen3-0.6b --batch 1
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from nanovllm import LLM, SamplingParams


def time_op(name: str, fn, n: int = 200) -> None:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    print(f"{name:<48} {1e6 * dt:8.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()

    dev = torch.device("cuda")
    rows = np.zeros((1, 20), dtype=np.int32)
    dst = torch.zeros(1, 20, dtype=torch.int32, device=dev)
    time_op("torch.empty(1, pin_memory=True)", lambda: torch.empty(1, pin_memory=True))
    time_op("torch.from_numpy(rows).pin_memory()", lambda: torch.from_numpy(rows).pin_memory())
    time_op("torch.tensor([0.5], pin_memory=True)", lambda: torch.tensor([0.5], pin_memory=True))
    time_op("pinned copy_ to device (non_blocking)", lambda: dst.copy_(torch.from_numpy(rows).pin_memory(), non_blocking=True))
    time_op("torch.cuda.Event().record()", lambda: torch.cuda.Event().record())

    llm = LLM(args.model, load_format="dummy", max_model_len=4096)
    for i in range(args.batch):
        llm.add_request([(7 * i + j) % 1000 for j in range(1024)],
                        SamplingParams(temperature=0.6, max_tokens=args.steps + 50, ignore_eos=True))
    for _ in range(20):
        llm.step()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        llm.step()
    prof.disable()
    print(f"{args.steps} steps at batch {args.batch}: {1e3 * (time.perf_counter() - t) / args.steps:.3f} ms/step under cProfile")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    llm.exit()


if __name__ == "__main__":
    main()
