"""Where a whole bench.py workload's device time goes: torch.profiler (CUDA) over one run of the
workload, the kernels' time summed by group (decode attention, prefill attention, GEMMs, the rest).

    python -m benchmarks.engine.profile_run --kv-cache-dtype fp8
    python -m benchmarks.engine.profile_run --model benchmarks/configs/qwen3-8b --quantization fp8 --kv-cache-dtype fp8

The wall time is read from an unprofiled run first (bench.py's prompts, sampling, warm-up and timed
loop: benchmarks/harness/runs.run_engine); the profiled run after it gives each group's summed kernel
durations. A kernel launched early (programmatic dependent launch: kernels/pdl.py) counts its wait for
the kernel before it in its own duration, so the sums can overlap and exceed the wall (H200, Qwen3-8B FP8: 9.8 s of durations in an 8.2 s run): each group's
sum is an upper bound on its own work. That still bounds what a faster kernel of one group can buy:
e.g. a run whose decode attention read its cache at copy bandwidth would take at least
wall - decode attention + KV bytes / bandwidth (bench.py's roofline counts the bytes).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile

from benchmarks.harness.engine_options import (add_format_options, add_model_options, require_cuda,
                                               resolve_load_format)
from benchmarks.harness.runs import run_engine, warm_up
from benchmarks.harness.workloads import WORKLOADS, WorkloadSampling, make_workload
from nanovllm import LLM

# Kernels listed by name under the group sums.
TOP_KERNELS = 14


def kernel_group(name: str) -> str:
    """The group a CUDA kernel's time is summed in, from its name."""
    if name.startswith("_decode_"):
        return "decode attention"
    if name.startswith("_prefill_"):
        return "prefill attention"
    if name.startswith(("nvjet", "cutlass")) or "gemm" in name.lower() or "splitKreduce" in name:
        return "GEMMs"
    return "other kernels"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_options(ap, load_format="dummy")
    add_format_options(ap)
    ap.add_argument("--workload", default="default", choices=[w for w, v in WORKLOADS.items() if v.prompt_logprobs is None])
    args = ap.parse_args()
    require_cuda("profile_run")

    load_format, weights = resolve_load_format(args.load_format, args.model)
    llm = LLM(args.model, load_format=load_format, kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    # bench.py's run: its prompts, sampling, warm-up and timed loop (run_engine checks every output's length)
    prompts, max_tokens = make_workload(WORKLOADS[args.workload], llm.config.model_config.vocab_size)
    warm_up(llm, WorkloadSampling())
    wall = run_engine(llm, prompts, max_tokens).wall_s
    tokens = sum(max_tokens)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        profiled_wall = run_engine(llm, prompts, max_tokens).wall_s
    by_kernel: dict[str, float] = defaultdict(float)  # seconds of device time
    for event in prof.key_averages():
        by_kernel[event.key] += max(event.self_device_time_total, 0) / 1e6
    by_group: dict[str, float] = defaultdict(float)
    for name, seconds in by_kernel.items():
        by_group[kernel_group(name)] += seconds
    device = sum(by_kernel.values())

    print(f"{args.model} ({weights}), weights {args.quantization or 'as stored'}, KV {args.kv_cache_dtype}, "
          f"workload {args.workload}")
    print(f"wall {wall:.3f} s = {tokens / wall:,.0f} output tok/s; profiled run: wall {profiled_wall:.3f} s, "
          f"kernel durations {device:.3f} s (early-launched kernels count their wait: groups may overlap)")
    for group, seconds in sorted(by_group.items(), key=lambda item: -item[1]):
        print(f"  {group:18s} {seconds:7.3f} s  {100 * seconds / device:5.1f}%")
    for name, seconds in sorted(by_kernel.items(), key=lambda item: -item[1])[:TOP_KERNELS]:
        print(f"    {seconds:8.4f} s  {name[:100]}")


if __name__ == "__main__":
    main()
