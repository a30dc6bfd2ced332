"""Which Triton kernels compile (or load from the disk cache) while a bench.py workload runs, after
start-up and bench's warm-up should have compiled them all. A fresh machine has an empty Triton
cache, so every such kernel costs a full compile inside the timed run (run this with
TRITON_CACHE_DIR set to a new directory to see that cost).

    python -m benchmarks.engine.compile_watch --model benchmarks/configs/qwen3-0.6b [--workload many]
"""

from __future__ import annotations

import argparse
import time

import triton

from benchmarks.harness.engine_options import add_model_options, require_cuda
from benchmarks.harness.runs import run_engine, warm_up
from benchmarks.harness.workloads import WORKLOADS, WorkloadSampling, make_workload
from nanovllm import LLM

# Characters of a kernel's description kept (name, launch options and the specialisation of each argument).
REPR_CHARS = 700


class CompileLog:
    """Triton's post-compile hook: the kernels compiled in this process, by phase."""

    def __init__(self) -> None:
        self.phase = "start-up"
        self.events: dict[str, list[str]] = {}

    def __call__(self, **kw) -> None:
        self.events.setdefault(self.phase, []).append(kw["repr"][:REPR_CHARS])


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_options(ap, load_format="dummy")
    ap.add_argument("--workload", default="default", choices=sorted(WORKLOADS))
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()
    require_cuda("compile_watch", "the Triton kernels a GPU run compiles")
    log = CompileLog()
    triton.knobs.runtime.jit_post_compile_hook = log
    llm = LLM(args.model, load_format=args.load_format)
    prompts, max_tokens = make_workload(WORKLOADS[args.workload], llm.config.model_config.vocab_size)
    log.phase = "warm-up"
    warm_up(llm)
    log.phase = "run"
    start = time.perf_counter()
    run_engine(llm, prompts, max_tokens, WorkloadSampling(args.top_k, args.top_p))
    wall = time.perf_counter() - start
    print(f"{args.workload}: {sum(max_tokens)} output tokens in {wall:.2f} s = {sum(max_tokens) / wall:,.0f} tok/s")
    for phase, kernels in log.events.items():
        print(f"kernels compiled or loaded during {phase}: {len(kernels)}")
    for what in log.events.get("run", []):
        print(f"  {what}")
    llm.exit()


if __name__ == "__main__":
    main()
