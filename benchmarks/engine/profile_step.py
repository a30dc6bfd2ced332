"""Profile prefill and decode steps of the engine with torch.profiler (CUDA).

    python -m benchmarks.engine.profile_step --model benchmarks/configs/qwen3-0.6b --batch 256 --context 512
    python -m benchmarks.engine.profile_step --model benchmarks/configs/qwen3-30b-a3b --quantization fp8 --kv-cache-dtype fp8

Prints the top CUDA kernels of a few decode steps (eager, so each kernel is visible),
the kernel count per step, and host-side timings of graph-replayed steps. With
`--mixed-prompt L` every timed and profiled step is a mixed one: the running rows' decode
tokens plus a new L-token prompt (a one-token request, so the batch stays the same), as when
requests arrive while others decode (bench.py --workload long).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness.engine_options import add_format_options, add_model_options, require_cuda, resolve_load_format
from nanovllm import LLM, SamplingParams
from nanovllm.engine.scheduled_batch import StepKind


def fill(llm: LLM, batch: int, context: int, steps: int, repetition_penalty: float) -> None:
    vocab = llm.config.model_config.vocab_size
    for i in range(batch):
        llm.add_request([(13 * i + j) % vocab for j in range(context)],
                        SamplingParams(temperature=0.6, max_tokens=steps + 64, ignore_eos=True,
                                       repetition_penalty=repetition_penalty))
    while True:  # run the prefill steps
        if llm.step().kind is StepKind.DECODE:
            return


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_options(ap, load_format="dummy")
    add_format_options(ap)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5, help="profiled steps")
    ap.add_argument("--timed-steps", type=int, default=50, help="unprofiled steps timed first")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--mixed-prompt", type=int, default=0, help="prompt tokens added to every step (0: decode steps)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="every row's (1.0: off)")
    args = ap.parse_args()
    require_cuda("profile_step", "CUDA kernel time")

    load_format, _ = resolve_load_format(args.load_format, args.model)
    for eager in (True, False):
        llm = LLM(args.model, load_format=load_format, enforce_eager=eager,
                  kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
        fill(llm, args.batch, args.context, args.timed_steps + args.steps, args.repetition_penalty)
        times = []
        vocab = llm.config.model_config.vocab_size

        def arrive(step: int) -> None:  # one new prompt per step: every step mixed
            if args.mixed_prompt:
                llm.add_request([(7 * step + j) % vocab for j in range(args.mixed_prompt)],
                                SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True))

        for i in range(args.timed_steps):  # without the profiler attached
            arrive(i)
            t = time.perf_counter()
            r = llm.step()
            times.append((time.perf_counter() - t, r.launch_s, r.prepare_s, r.wait_s, r.postprocess_s))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(args.steps):
                arrive(args.timed_steps + i)
                llm.step()
        mode = "eager" if eager else "graphs"
        kind = f"mixed (+{args.mixed_prompt} prompt tokens a step)" if args.mixed_prompt else "decode"
        print(f"===== {kind}, batch {args.batch}, context ~{args.context}, {mode}, "
              f"repetition penalty {args.repetition_penalty}, weights {args.quantization or 'as stored'}, "
              f"KV {args.kv_cache_dtype}")
        total, launch, prep, wait, post = (1e3 * sum(col) / len(times) for col in zip(*times))
        print(f"mean of {len(times)} unprofiled steps: {total:.3f} ms (host: launch {launch:.3f} incl. "
              f"prepare {prep:.3f}, post {post:.3f}; waiting on the device {wait:.3f})")
        events = prof.key_averages()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        n = sum(e.count for e in kernels)
        cuda_total = sum(e.self_device_time_total for e in kernels)
        print(f"kernels per step: {n / args.steps:.0f}; device time per step: {cuda_total / args.steps / 1e3:.2f} ms")
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        llm.exit()


if __name__ == "__main__":
    main()
