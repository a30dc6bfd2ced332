"""sleep / wake_up (RL colocated with training): the device memory an engine holds awake, asleep at
level 1 and level 2 and woken again, and how long sleep and each wake_up step take.

    python -m benchmarks.engine.bench_sleep [--model DIR] [--load-format auto] [--gpu-memory-utilization 0.9]

Builds bench.py's engine for --model (a config-only shape runs with random weights), runs a few of
bench.py's default prompts, then per level: sleep(level), wake_up(["weights"]) and wake_up(["kv_cache"])
(the second also captures the CUDA graphs again), each timed (CUDA synchronized after it), with
torch.cuda.memory_allocated / memory_reserved after each. After level 1 the prompts run again and
must give the tokens of before (greedy), which the report says.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness.engine_options import add_model_options, require_cuda, resolve_load_format
from benchmarks.harness.workloads import workload_prefix
from nanovllm import LLM, SamplingParams

# Prompts of the default workload run before sleeping and after each level-1 wake_up.
CHECK_PROMPTS = 8
CHECK_TOKENS = 32
GIB = 2**30


def memory_line(label: str, seconds: float | None) -> str:
    torch.cuda.synchronize()
    took = f"{seconds:8.3f} s" if seconds is not None else " " * 10
    return (f"{label:28s} {took}   allocated {torch.cuda.memory_allocated() / GIB:8.3f} GiB   "
            f"reserved {torch.cuda.memory_reserved() / GIB:8.3f} GiB")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_options(ap)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = ap.parse_args()
    require_cuda("bench_sleep.py", "GPU memory")
    load_format, weights_line = resolve_load_format(args.load_format, args.model)
    prompts, _ = workload_prefix(n=CHECK_PROMPTS)
    greedy = SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    llm = LLM(args.model, load_format=load_format, gpu_memory_utilization=args.gpu_memory_utilization)
    print(f"{args.model}: {weights_line}; engine built in {time.perf_counter() - start:.1f} s")
    try:
        runner = llm.model_runner
        weight_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                            for t in [*runner.model.parameters(), *runner.model.buffers()]}.values())
        kv_bytes = runner.kv_cache.untyped_storage().nbytes()
        print(f"weights {weight_bytes / GIB:.3f} GiB, KV cache {kv_bytes / GIB:.3f} GiB "
              f"({runner.num_blocks} blocks of {runner.block_size} tokens)")

        def run() -> list[list[int]]:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

        before = run()
        print(memory_line("awake", None))
        for level in (1, 2):
            print(memory_line(f"sleep(level={level})", timed(lambda: llm.sleep(level=level))))
            print(memory_line("wake_up(['weights'])", timed(lambda: llm.wake_up(tags=["weights"]))))
            print(memory_line("wake_up(['kv_cache']) + graphs", timed(lambda: llm.wake_up(tags=["kv_cache"]))))
            if level == 1:
                print(f"tokens after level 1 identical to before: {run() == before}")
    finally:
        llm.exit()


if __name__ == "__main__":
    main()
