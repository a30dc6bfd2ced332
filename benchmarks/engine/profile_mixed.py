"""Kernel time of mixed steps (decode rows + prefill chunks) under torch.profiler.

    python -m benchmarks.engine.profile_mixed --model benchmarks/configs/qwen3-0.6b

Fills the engine with requests of the long workload's shape, steps until a mixed step
carries many decode rows, then profiles a few mixed steps (eager, so every kernel shows).
"""

from __future__ import annotations

import argparse
import random

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness.engine_options import add_model_options, require_cuda, resolve_load_format
from nanovllm import LLM, SamplingParams
from nanovllm.engine.scheduled_batch import StepKind


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_options(ap, load_format="dummy")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--min-decode-rows", type=int, default=200)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    require_cuda("profile_mixed", "CUDA kernel time")
    load_format, _ = resolve_load_format(args.load_format, args.model)
    llm = LLM(args.model, load_format=load_format, enforce_eager=args.enforce_eager)
    rng = random.Random(7)
    for _ in range(1024):
        llm.add_request([rng.randrange(10000) for _ in range(rng.randint(100, 2048))],
                        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 512)))
    while True:
        r = llm.step()
        if r.kind is StepKind.MIXED and r.num_seqs - 1 >= args.min_decode_rows:
            break
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        n = 0
        while n < args.steps:
            r = llm.step()
            if r.kind is StepKind.MIXED:
                n += 1
                print(f"mixed step: {r.num_tokens} tokens, {r.num_seqs} sequences")
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    print(f"device time over the profiled steps: {total / 1e3:.1f} ms")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
        print(f"{e.self_device_time_total / 1e3:9.2f} ms {e.count:6d}x  {e.key[:90]}")
    llm.exit()


if __name__ == "__main__":
    main()
