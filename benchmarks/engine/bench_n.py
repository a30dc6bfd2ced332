"""n samples per prompt against n copies of the prompt, in output tokens per second.

    python -m benchmarks.engine.bench_n [--model DIR] [--load-format auto] [--num-prompts 64] [--n 8]

Takes the first --num-prompts prompts of bench.py's default workload (each with its own
max_tokens, EOS ignored, temperature 1.0) and runs, each on a fresh engine (no warm prefix
cache on either side), in the same process:
  n      one request per prompt with SamplingParams(n=N)
  copies N requests per prompt (each prompt repeated N times in a row) with n=1
Both generate the same number of tokens; the report gives each side's output tok/s and
their ratio, and how many KV blocks each found in the prefix cache (the copies reuse the
first copy's prompt blocks through it; n's samples fork from sample 0 and need none).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.harness.engine_options import add_model_options, require_cuda, resolve_load_format
from benchmarks.harness.workloads import workload_prefix
from nanovllm import LLM, SamplingParams


def timed_generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    """(seconds, output tokens) of one generate() call; every returned token is counted."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for out in outs for o in out.get("outputs", [out]))
    return seconds, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_options(ap)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    require_cuda("bench_n.py")
    load_format, weights_line = resolve_load_format(args.load_format, args.model)
    prompts, max_tokens = workload_prefix(n=args.num_prompts)

    def params(m: int, n: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=m, n=n)

    sides = {
        "n": (prompts, [params(m, args.n) for m in max_tokens]),
        "copies": ([p for p in prompts for _ in range(args.n)], [params(m, 1) for m in max_tokens for _ in range(args.n)]),
    }
    print(weights_line)
    results = {}
    for name, (side_prompts, side_params) in sides.items():
        llm = LLM(args.model, load_format=load_format)
        try:
            timed_generate(llm, side_prompts[:2], side_params[:2])  # warm-up: compile, first launches
            llm.block_manager.clear_prefix_cache()
            hits = llm.block_manager.num_prefix_hit_blocks
            seconds, tokens = timed_generate(llm, side_prompts, side_params)
            results[name] = (seconds, tokens, llm.block_manager.num_prefix_hit_blocks - hits)
        finally:
            llm.exit()
    for name, (seconds, tokens, hits) in results.items():
        print(f"{name:7s} {tokens} tokens / {seconds:.2f} s = {tokens / seconds:,.0f} tok/s, prefix-hit blocks {hits}")
    (s_n, t_n, _), (s_c, t_c, _) = results["n"], results["copies"]
    print(f"n={args.n} over {args.n} copies, tok/s ratio: {(t_n / s_n) / (t_c / s_c):.3f}")


if __name__ == "__main__":
    main()
