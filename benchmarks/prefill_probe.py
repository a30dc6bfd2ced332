"""Host cost of one prefill step: time to first token of one request on an idle engine, and
cProfile of those steps (where the host time goes).

    PYTHONPATH=. python3 benchmarks/prefill_probe.py --model benchmarks/configs/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from nanovllm import LLM, SamplingParams


def ttft(llm: LLM, n: int, rng: random.Random) -> float:
    llm.add_request([rng.randrange(10000) for _ in range(n)], SamplingParams(temperature=0, max_tokens=1))
    torch.cuda.synchronize()
    t = time.perf_counter()
    while not llm.is_finished():
        llm.step()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--sizes", default="128,1000,4000")
    ap.add_argument("--profile-size", type=int, default=128)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=8192, enforce_eager=args.enforce_eager)
    rng = random.Random(0)
    for n in map(int, args.sizes.split(",")):
        times = sorted(ttft(llm, n, rng) for _ in range(7))
        print(f"TTFT {n:>5} tokens: median {1e3 * times[3]:.2f} ms, min {1e3 * times[0]:.2f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        ttft(llm, args.profile_size, rng)
    prof.disable()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(30)
    llm.exit()


if __name__ == "__main__":
    main()
