"""Times nanovllm's Sampler.forward on CUDA at serving size (batch 256 x vocab 151936).

Cases: all greedy, plain temperature sampling, top-k only, top-p only, top-k with top-p (Qwen3's
suggested 20 / 0.95), a mix of top-k/top-p/min-p rows, and 16 seeded rows (plain and mixed); every
row's noise comes from its key (the Triton kernel, the engine's CUDA path). Logprob cases
("<case>+lp5_all", "<case>+lp5_16") are a case with logprobs k=5 on all rows or on 16 of them;
penalty cases ("<case>+rep_all", "<case>+freq_pres_all") the case with a repetition penalty, or
frequency and presence penalties, on every row (counts of a PENALTY_PROMPT-token prompt each, the
engine's logits rules: float32 copy and the Triton penalties kernel); both also report the ms they
add to the same case without them. Each case reports the median and p90
of per-call CUDA-event timings in ms (the SamplingBatch is built once per case; its host build time,
one packed host-to-device copy included, is reported separately).

The Sampler is built on CUDA under --kernel-routes (bench.py's syntax; KernelRoutes' sampling fields:
radix_min_rows, the fewest rows whose top-k / top-p thresholds come from the radix select,
topk_max_k, and topk_kernel_max_k, the largest top_k the Triton top-k kernel samples): e.g.
radix_min_rows=1000000 takes torch.topk / the full sort at every batch size, and
topk_kernel_max_k=0 the threshold path for "top_k_only" / "top_k_top_p" (the kernel's before / after).

    python -m benchmarks.kernels.bench_sampler [--batch 256] [--dtype bf16|fp32] [--kernel-routes F=N,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.harness.engine_options import parse_kernel_routes
from benchmarks.harness.timing import event_times_ms
from nanovllm.engine.request_rules import RequestRules
from nanovllm.engine.rules_builder import RulesBuilder
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.kernel_path import kernel_routes
from nanovllm.sampling.batch import SamplingBatch, row_key
from nanovllm.sampling.logits_rules import StepRules
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling_params import SamplingParams

MIXED = [
    SamplingParams(temperature=0.8, top_k=50),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0),
]


# Logprobs asked for by the logprob cases, and the rows of a "some rows" case.
LOGPROBS_K = 5
SOME_LOGPROB_ROWS = 16
# The penalty cases' settings, and each row's prompt length (its token counts)
PENALTIES = {"rep_all": {"repetition_penalty": 1.1}, "freq_pres_all": {"frequency_penalty": 0.5, "presence_penalty": 0.5}}
PENALTY_PROMPT = 512


def base_params(name: str, batch: int) -> list[SamplingParams]:
    if name == "greedy":
        return [SamplingParams(temperature=0.0)] * batch
    if name == "plain":
        return [SamplingParams(temperature=0.8)] * batch
    if name == "top_k_only":
        return [SamplingParams(temperature=0.8, top_k=50)] * batch
    if name == "top_p_only":  # no top-k bound: the candidate walk
        return [SamplingParams(temperature=0.7, top_p=0.9)] * batch
    if name == "min_p_only":
        return [SamplingParams(temperature=1.0, min_p=0.05)] * batch
    if name == "top_k_top_p":  # Qwen3's suggested settings: the top-k kernel's small list (K = 32)
        return [SamplingParams(temperature=0.6, top_k=20, top_p=0.95)] * batch
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


def case_params(name: str, batch: int) -> list[SamplingParams]:
    """A base case, or "<base>+lp5_all" / "<base>+lp5_16": the base with logprobs k=5 on all rows /
    on SOME_LOGPROB_ROWS rows spread over the batch."""
    base, _, logprobs = name.partition("+")
    params = base_params(base, batch)
    if not logprobs or logprobs in PENALTIES:
        return params
    if logprobs == "lp5_all":
        asking = set(range(batch))
    else:
        asking = set(range(0, batch, max(1, batch // SOME_LOGPROB_ROWS))[:SOME_LOGPROB_ROWS])
    return [SamplingParams(**{**p.__dict__, "logprobs": LOGPROBS_K}) if i in asking else p for i, p in enumerate(params)]


BASE_CASES = ["greedy", "plain", "top_k_only", "top_p_only", "min_p_only", "top_k_top_p", "mixed_topk_topp",
              "plain_16_seeded", "mixed_16_seeded"]
LOGPROB_CASES = [f"{base}+{rows}" for base in ("greedy", "plain", "mixed_topk_topp") for rows in ("lp5_all", "lp5_16")]
PENALTY_CASES = [f"{base}+{pen}" for base in ("greedy", "plain", "top_k_top_p") for pen in PENALTIES]
CASES = BASE_CASES + LOGPROB_CASES + PENALTY_CASES


def case_rules(name: str, batch: int, vocab: int, device: torch.device) -> StepRules | None:
    """A penalty case's step rules (every row penalized, its counts set from a random prompt), as the
    engine builds them; None for the other cases."""
    penalty = name.partition("+")[2]
    if penalty not in PENALTIES:
        return None
    params = SamplingParams(**PENALTIES[penalty])
    rules = RequestRules.of(params, frozenset(), None, vocab)
    g = torch.Generator().manual_seed(1)
    seqs = [Sequence(i, torch.randint(0, vocab, (PENALTY_PROMPT,), generator=g).tolist(), params, request_id=i,
                     seed=None, max_tokens=params.max_tokens, rules=rules) for i in range(batch)]
    builder = RulesBuilder(vocab, device)
    builder.admit(seqs)
    return builder.upload(builder.build(seqs, [PENALTY_PROMPT] * batch, []), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--cases", nargs="*", choices=CASES, default=CASES)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--kernel-routes", default="", metavar="FIELD=N,...",
                        help="KernelRoutes fields the Sampler is built under (the rest at their defaults)")
    parser.add_argument("--logit-scale", type=float, default=3.0,
                        help="logits ~ N(0, scale^2): 3 peaked rows, 0.3 near-flat ones (random-weight models)")
    args = parser.parse_args()
    try:
        routes = parse_kernel_routes(args.kernel_routes)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampler needs a CUDA device")

    device = torch.device("cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    logits = (torch.randn(args.batch, args.vocab, device=device) * args.logit_scale).to(dtype)
    with device, kernel_routes(routes):
        sampler = Sampler()  # built on CUDA: the Triton kernels, as in the engine
    results = []
    medians: dict[str, float] = {}
    for name in args.cases:
        params = case_params(name, args.batch)
        t0 = time.perf_counter()
        for _ in range(10):  # seeded rows keyed as the engine does, the others distinct (the engine's RNG draws them)
            keys = [row_key(p.seed, 0) if p.seed is not None else i for i, p in enumerate(params)]
            batch = SamplingBatch.build(params, keys, device, args.vocab)
        build_ms = (time.perf_counter() - t0) / 10 * 1e3
        rules = case_rules(name, args.batch, args.vocab, device)
        times = event_times_ms(lambda i: sampler(logits, batch, rules), args.iters, args.warmup)
        times.sort()
        medians[name] = statistics.median(times)
        base = name.partition("+")[0]
        results.append({
            "case": name,
            "median_ms": medians[name],
            "p90_ms": times[min(len(times) - 1, int(0.9 * len(times)))],
            "min_ms": times[0],
            "build_host_ms": build_ms,
            # what the logprobs / penalties add to the same case without them (when that case ran first)
            "added_ms": medians[name] - medians[base] if base != name and base in medians else None,
        })

    print(f"Sampler.forward  batch={args.batch} vocab={args.vocab} logits={args.dtype} "
          f"kernel routes: {args.kernel_routes or 'defaults'} ({torch.cuda.get_device_name(device)}, "
          f"torch {torch.__version__})")
    print(f"{'case':<30}{'median ms':>11}{'p90 ms':>9}{'min ms':>9}{'build ms':>10}{'added ms':>14}")
    for r in results:
        added = "" if r["added_ms"] is None else f"{r['added_ms']:.3f}"
        print(f"{r['case']:<30}{r['median_ms']:>11.3f}{r['p90_ms']:>9.3f}{r['min_ms']:>9.3f}"
              f"{r['build_host_ms']:>10.3f}{added:>14}")
    if args.json:
        meta = {"batch": args.batch, "vocab": args.vocab, "dtype": args.dtype, "iters": args.iters,
                "kernel_routes": vars(routes),
                "device": torch.cuda.get_device_name(device), "torch": torch.__version__}
        with open(args.json, "w") as f:
            json.dump({"config": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
