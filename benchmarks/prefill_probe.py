"""Where the time to first token goes: one request on an idle engine, split into host phases
(StepResult's launch / prepare / wait / postprocess) and the device's kernels (torch.profiler
over a few requests; CUDA-graph replays show their kernels too), then cProfile of the host.

    PYTHONPATH=. python3 benchmarks/prefill_probe.py --model benchmarks/configs/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm import LLM, SamplingParams

REPEATS = 7  # timed requests a size, after one untimed


def ttft(llm: LLM, n: int, rng: random.Random, requests: int = 1) -> tuple[float, list]:
    """Seconds from add_request to the first tokens of `requests` prompts of n tokens arriving
    together, and the StepResults of those steps."""
    prompts = [[rng.randrange(10000) for _ in range(n)] for _ in range(requests)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for prompt in prompts:
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    results = []
    while not llm.is_finished():
        results.append(llm.step())
    return time.perf_counter() - t, results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--sizes", default="128,1000,4000")
    ap.add_argument("--profile-size", type=int, default=128)
    ap.add_argument("--rows", type=int, default=20, help="kernel rows printed")
    ap.add_argument("--requests", type=int, default=1, help="prompts arriving together (a batched prefill)")
    ap.add_argument("--host-profile", action="store_true", help="also cProfile the host")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", max_model_len=8192, enforce_eager=args.enforce_eager)
    rng = random.Random(0)
    for n in map(int, args.sizes.split(",")):
        ttft(llm, n, rng, args.requests)  # compile / first-touch
        runs = [ttft(llm, n, rng, args.requests) for _ in range(REPEATS)]
        wall = statistics.median(w for w, _ in runs)
        steps = [r for _, rs in runs for r in rs]
        per = {f: 1e3 * sum(getattr(r, f) for r in steps) / REPEATS
               for f in ("launch_s", "prepare_s", "wait_s", "postprocess_s")}
        print(f"TTFT {args.requests} x {n:>5} tokens: median {1e3 * wall:.3f} ms, min {1e3 * min(w for w, _ in runs):.3f}; "
              f"{len(steps) / REPEATS:.1f} steps; per request: host launch {per['launch_s']:.3f} "
              f"(prepare {per['prepare_s']:.3f}), wait {per['wait_s']:.3f}, post {per['postprocess_s']:.3f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPEATS):
            ttft(llm, args.profile_size, rng, args.requests)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_ms = sum(e.self_device_time_total for e in kernels) / REPEATS / 1e3
    print(f"profiled {args.requests} x {args.profile_size}-token requests: {sum(e.count for e in kernels) / REPEATS:.0f} kernels, "
          f"{device_ms:.3f} ms of device time each")
    kernels.sort(key=lambda e: -e.self_device_time_total)
    for e in kernels[: args.rows]:
        print(f"  {e.self_device_time_total / REPEATS / 1e3:8.3f} ms  x{e.count / REPEATS:5.0f}  {e.key[:90]}")
    if args.host_profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            ttft(llm, args.profile_size, rng)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    llm.exit()


if __name__ == "__main__":
    main()
