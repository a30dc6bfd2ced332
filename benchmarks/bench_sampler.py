"""Times nanovllm's Sampler.forward on CUDA at serving size (batch 256 x vocab 151936).

Cases: all greedy, plain temperature sampling, top-k only, a mix of top-k/top-p/min-p
rows, and 16 seeded rows (plain and mixed), each with noise from torch generators and from
per-row keys (the Triton kernel, the engine's CUDA path). Each case reports the median and p90 of
per-call CUDA-event timings in ms (the SamplingBatch is built once per case; its
build time is reported separately).

    PYTHONPATH=. python3 benchmarks/bench_sampler.py [--dtype bf16|fp32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from nanovllm.layers.sampler import Sampler, SamplingBatch, make_generator, row_key
from nanovllm.sampling_params import SamplingParams

MIXED = [
    SamplingParams(temperature=0.8, top_k=50),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0),
]


def case_params(name: str, batch: int) -> list[SamplingParams]:
    if name == "greedy":
        return [SamplingParams(temperature=0.0)] * batch
    if name == "plain":
        return [SamplingParams(temperature=0.8)] * batch
    if name == "top_k_only":
        return [SamplingParams(temperature=0.8, top_k=50)] * batch
    if name == "mixed_topk_topp":
        return [MIXED[i % len(MIXED)] for i in range(batch)]
    if name == "plain_16_seeded":
        return [SamplingParams(temperature=0.8, seed=i if i < 16 else None) for i in range(batch)]
    if name == "mixed_16_seeded":
        return [
            SamplingParams(**{**MIXED[i % len(MIXED)].__dict__, "seed": i if i < 16 else None})
            for i in range(batch)
        ]
    raise ValueError(name)


CASES = ["greedy", "plain", "top_k_only", "mixed_topk_topp", "plain_16_seeded", "mixed_16_seeded"]


def time_cuda(fn: Callable[[], object], warmup: int, iters: int) -> list[float]:
    """Per-call device times in ms, from CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--cases", nargs="*", choices=CASES, default=CASES)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampler needs a CUDA device")

    device = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    logits = (torch.randn(args.batch, args.vocab, device=device) * 3).to(dtype)
    sampler = Sampler()
    results = []
    for name, noise in [(c, n) for c in args.cases for n in ("generators", "keys")]:
        params = case_params(name, args.batch)
        t0 = time.perf_counter()
        for _ in range(10):
            if noise == "keys":  # the engine's CUDA path: one noise key per row
                keys = [row_key(p.seed, 0) if p.seed is not None else i for i, p in enumerate(params)]
                batch = SamplingBatch.build(params, [None] * len(params), device, args.vocab, keys=keys)
            else:
                gens = [None if p.seed is None else make_generator(p.seed, device) for p in params]
                batch = SamplingBatch.build(params, gens, device, args.vocab)
        build_ms = (time.perf_counter() - t0) / 10 * 1e3
        times = time_cuda(lambda: sampler(logits, batch), args.warmup, args.iters)
        times.sort()
        results.append({
            "case": f"{name}/{noise}",
            "median_ms": statistics.median(times),
            "p90_ms": times[min(len(times) - 1, int(0.9 * len(times)))],
            "min_ms": times[0],
            "build_host_ms": build_ms,
        })

    print(f"Sampler.forward  batch={args.batch} vocab={args.vocab} logits={args.dtype} "
          f"({torch.cuda.get_device_name(device)}, torch {torch.__version__})")
    print(f"{'case':<28}{'median ms':>11}{'p90 ms':>9}{'min ms':>9}{'build ms':>10}")
    for r in results:
        print(f"{r['case']:<28}{r['median_ms']:>11.3f}{r['p90_ms']:>9.3f}{r['min_ms']:>9.3f}{r['build_host_ms']:>10.3f}")
    if args.json:
        meta = {"batch": args.batch, "vocab": args.vocab, "dtype": args.dtype, "iters": args.iters,
                "device": torch.cuda.get_device_name(device), "torch": torch.__version__}
        with open(args.json, "w") as f:
            json.dump({"config": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
