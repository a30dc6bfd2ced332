"""One Ray Data replica against the same engine in this process, in output tok/s, on bench.py's workload.

    python -m benchmarks.engine.bench_ray [--model DIR] [--load-format auto] [--workload default] [--batch-size N]

Needs the ray extra (pip install -e '.[ray]') and a CUDA device. Both sides run the workload's
prompts (token ids, each with its own max_tokens, temperature 0.6, EOS ignored: every token is
made), each on a fresh engine after one short warm-up generate:
  in-process   one LLM.generate call over all prompts in this process (bench.py's throughput run,
               as one generate call)
  replica      ray.data.from_items(rows).map_batches(LLMPredictor, one actor, one GPU), the rows'
               max_tokens in their sampling_params column, batch_size the whole workload unless
               --batch-size says otherwise. Its tok/s counts the time inside the actor's calls (rows
               in, generate, rows out); the end-to-end line adds Ray's start, the actor's engine
               start-up and the rows' trips.
The in-process side runs first and exits its engine, so the actor's engine finds the GPU free.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness.engine_options import add_model_options, require_cuda, resolve_load_format
from benchmarks.harness.runs import warm_up
from benchmarks.harness.workloads import WORKLOADS, WorkloadSampling, workload_prefix
from nanovllm import LLM

# Columns the timed predictor adds: its batch's start (actor clock) and seconds inside the call.
BATCH_START = "bench_batch_start"
BATCH_SECONDS = "bench_batch_seconds"


def timed_predictor(base: type) -> type:
    """`base` (LLMPredictor) that warms its engine up once after start-up and writes each batch's
    start and seconds into every row of it. Built here, not at import: ray is an optional extra,
    and Ray ships a class defined in a function to the actor by value."""

    class TimedPredictor(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            warm_up(self.llm)

        def __call__(self, batch):
            start = time.perf_counter()
            out = super().__call__(batch)
            seconds = time.perf_counter() - start
            rows = len(out["generated_token_ids"])
            out[BATCH_START], out[BATCH_SECONDS] = [start] * rows, [seconds] * rows
            return out

    return TimedPredictor


def check_lengths(token_counts: list[int], max_tokens: list[int], side: str) -> int:
    """Every request made exactly its max_tokens (EOS ignored); returns the total."""
    bad = [i for i, (got, want) in enumerate(zip(token_counts, max_tokens, strict=True)) if got != want]
    if bad:
        raise RuntimeError(f"{side}: request {bad[0]} made {token_counts[bad[0]]} tokens, not {max_tokens[bad[0]]}")
    return sum(token_counts)


def in_process(model: str, load_format: str, prompts, max_tokens, sampling: WorkloadSampling) -> tuple[int, float]:
    llm = LLM(model, load_format=load_format)
    try:
        warm_up(llm)
        start = time.perf_counter()
        outs = llm.generate(prompts, [sampling.params(m) for m in max_tokens], use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.exit()
    return check_lengths([len(o["token_ids"]) for o in outs], max_tokens, "in-process"), seconds


def replica(model: str, load_format: str, prompts, max_tokens, sampling: WorkloadSampling,
            batch_size: int) -> tuple[int, float, float]:
    """(tokens, seconds inside the actor's calls, end-to-end seconds) of one Ray Data replica."""
    import ray
    import ray.data

    from nanovllm.ray_data import LLMPredictor

    start = time.perf_counter()
    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False)
    try:
        rows = [{"id": i, "prompt_token_ids": p, "sampling_params": {"max_tokens": m}}
                for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        ds = ray.data.from_items(rows).map_batches(
            timed_predictor(LLMPredictor),
            fn_constructor_kwargs=dict(model=model, sampling_params=sampling.params(1),
                                       llm_kwargs=dict(load_format=load_format)),
            compute=ray.data.ActorPoolStrategy(size=1), batch_size=batch_size, num_gpus=1)
        out = sorted(ds.take_all(), key=lambda r: r["id"])
        end_to_end = time.perf_counter() - start
    finally:
        ray.shutdown()
    inside = sum(seconds for _, seconds in {(r[BATCH_START], r[BATCH_SECONDS]) for r in out})
    tokens = check_lengths([len(r["generated_token_ids"]) for r in out], max_tokens, "replica")
    return tokens, inside, end_to_end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(ap)
    ap.add_argument("--workload", default="default", choices=sorted(WORKLOADS))
    ap.add_argument("--batch-size", type=int, default=None, help="rows per generate call of the replica (default: all)")
    args = ap.parse_args()
    require_cuda("bench_ray.py")
    load_format, weights_line = resolve_load_format(args.load_format, args.model)
    prompts, max_tokens = workload_prefix(args.workload)
    sampling = WorkloadSampling()
    batch_size = args.batch_size or len(prompts)
    print(weights_line)
    print(f"workload {args.workload}: {len(prompts)} prompts, {sum(max_tokens):,} output tokens ({sampling.describe()}, "
          f"EOS ignored); replica batch size {batch_size}", flush=True)
    tokens, seconds = in_process(args.model, load_format, prompts, max_tokens, sampling)
    base = tokens / seconds
    print(f"in-process LLM.generate      {tokens:,} tokens / {seconds:.2f} s = {base:,.0f} tok/s", flush=True)
    tokens, inside, end_to_end = replica(args.model, load_format, prompts, max_tokens, sampling, batch_size)
    print(f"Ray Data replica (in actor)  {tokens:,} tokens / {inside:.2f} s = {tokens / inside:,.0f} tok/s "
          f"({tokens / inside / base:.3f} of in-process)")
    print(f"Ray Data replica end to end  {end_to_end:.1f} s (Ray's start, the engine's start-up and warm-up included)")


if __name__ == "__main__":
    main()
