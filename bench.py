"""Offline throughput benchmark on nano-vllm's workload, against a measured roofline and transformers.

    python bench.py                                    # Qwen3-0.6B shape, random weights, default workload
    python bench.py --workload long                    # or: many; explicit flags override a preset
    python bench.py --workload score                   # prompt scoring: prompt_logprobs=0, max_tokens=1 (lm-eval)
    python bench.py --workload rollout                 # RL group sampling: 64 prompts x n=8 samples (--n N)
    python bench.py --workload fewshot                 # evaluation: 1,024 shared tokens before each question
    python bench.py --model DIR --compare-hf           # + transformers on a prefix of the same prompts
    python bench.py --model DIR --latency              # decode ms/token at batch 1, 8, 32
    python bench.py --model DIR --ttft                 # time to first token of one request, idle engine
    python bench.py --kernel-routes "skinny_max_rows=0" --latency   # another KernelRoutes (A/B runs)
    python bench.py --logprobs 5                       # each request asks the logprobs of its 5 likeliest
    python bench.py --kv-cache-dtype fp8               # K/V stored in float8 e4m3 (1 byte in the roofline)

Workload (nano-vllm's): Random(seed); num_seqs prompts of random ids with lengths in [min_input,
max_input]; then per prompt max_tokens in [min_output, max_output]; temperature 0.6, ignore_eos
(--top-k / --top-p add those filters, on both sides of --compare-hf).
Throughput = output tokens / wall seconds (prefill included), after one warm-up generate. Scoring
(--workload score: 1,024 prompts of 256-1,024 tokens; or --prompt-logprobs K with --max-output 1), each
asking prompt_logprobs (greedy, one output token), reported as prompt tokens / wall seconds against the
FLOP roofline with the lm_head counted at every prompt position. A model directory without *.safetensors
(benchmarks/configs/*) is run with random weights (load_format dummy).

Roofline: time >= max(bytes / copy bandwidth, FLOPs / bf16 GEMM peak), both probed in the same process,
on the idle engine before the run and again after it, each keeping its higher reading (a hot GPU reads
lower; benchmarks/harness/probes.py, DeviceLimits.best_of). What the bytes and FLOPs count,
mixture-of-experts models' experts included: benchmarks/harness/roofline.py's docstring. Decode-only
steps are also summed by row count (1-8, 9-32, ...) next to the memory term's steps of as many rows,
which shows the batch sizes that lose time. Workloads and presets: benchmarks/harness/workloads.py; the engine and transformers runs:
runs.py; the report rows: report.py. Here the command line and main. A/B runs of several
--kernel-routes settings side by side: benchmarks/engine/variants.py (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch import nn

from benchmarks.harness.engine_options import (
    ROUTE_FIELDS, add_format_options, add_model_options, parse_kernel_routes, require_cuda, resolve_load_format,
)
from benchmarks.harness.probes import measure_bandwidth, measure_fp8_gemm_peak, measure_gemm_peak
from benchmarks.harness.report import (
    DeviceLimits, Rows, ThroughputRun, format_table, hf_rows, latency_rows, score_rows, throughput_rows, ttft_rows,
)
from benchmarks.harness.roofline import ByteWidths, decode_weight_elements
from benchmarks.harness.runs import latency, measure_ttft, run_engine, run_hf, warm_up
from benchmarks.harness.workloads import WORKLOADS, Workload, WorkloadSampling, make_workload
from nanovllm import LLM
from nanovllm.config import DEFAULT_MAX_LOGPROBS, Config
from nanovllm.models.model_config import ModelConfig
from nanovllm.moe.layer import MoeExperts

# ----- command line -----
# The flags only some runs read (the model's, the engine's and --json serve every run), by run:
# parse_args refuses a flag the chosen run would ignore. --ttft's prompts are random ids from --seed.
THROUGHPUT_FLAGS = ("workload", *Workload.__dataclass_fields__, "top_k", "top_p", "repetition_penalty",
                    "frequency_penalty", "presence_penalty", "logprobs", "compare_hf")
THROUGHPUT_RUN = "the throughput run (no --latency, --ttft or --compare-hf)"
RUN_FLAGS = {
    THROUGHPUT_RUN: THROUGHPUT_FLAGS,
    "--compare-hf": (*THROUGHPUT_FLAGS, "hf_num_seqs", "hf_batch_size"),
    "--latency": ("latency_batch_sizes", "latency_context", "latency_steps"),
    "--ttft": ("ttft_sizes", "seed"),
}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """argparse type: one or more positive integers, comma-separated ('1,8,32')."""
    try:
        return tuple(positive_int(part) for part in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not positive integers, comma-separated (as 1,8,32)") from None


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def run_of(args: argparse.Namespace) -> str:
    """The RUN_FLAGS key of the run `args` ask for."""
    if args.latency or args.ttft:
        return "--latency" if args.latency else "--ttft"
    return "--compare-hf" if args.compare_hf else THROUGHPUT_RUN


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(ap)
    ap.add_argument("--workload", default="default", choices=sorted(WORKLOADS),
                    help="preset for the workload flags below (an explicit flag wins)")
    for name in ("num_seqs", "min_input", "max_input", "min_output", "max_output", "seed"):
        ap.add_argument(flag(name), dest=name, type=int if name == "seed" else positive_int,
                        default=getattr(WORKLOADS["default"], name), help="default: from --workload")
    ap.add_argument("--n", type=positive_int, default=WORKLOADS["default"].n,
                    help="samples per prompt, SamplingParams(n=...), each making the request's max_tokens "
                         "(default: from --workload; rollout: 8)")
    ap.add_argument("--shared-prefix", type=int, default=WORKLOADS["default"].shared_prefix, metavar="TOKENS",
                    help="one prefix of this many tokens in front of every prompt (default: from --workload; "
                         "fewshot: 1024)")
    ap.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                    help="score the prompts: every request asks prompt_logprobs=K, greedy (default: from --workload; "
                         "score: 0)")
    ap.add_argument("--top-k", type=int, default=0, help="the workload's top-k (0: off), both sides")
    ap.add_argument("--top-p", type=float, default=1.0, help="the workload's top-p (1.0: off), both sides")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="the workload's (1.0: off), both sides")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="the workload's (0: off), nanovllm only")
    ap.add_argument("--presence-penalty", type=float, default=0.0, help="the workload's (0: off), nanovllm only")
    ap.add_argument("--logprobs", type=int, default=None, metavar="K",
                    help="each request asks SamplingParams(logprobs=K) (default: none asked), nanovllm only")
    ap.add_argument("--max-model-len", type=positive_int, default=None,
                    help="default: the engine's (4096, or the model's positions when fewer)")
    ap.add_argument("--max-num-seqs", type=positive_int, default=Config.max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=Config.max_num_batched_tokens)
    ap.add_argument("--tp", type=positive_int, default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    add_format_options(ap)
    ap.add_argument("--kernel-routes", default="", metavar="FIELD=N,...",
                    help=f"LLM(kernel_routes=KernelRoutes(...)): the row counts at which layers switch kernels; "
                         f"fields {', '.join(ROUTE_FIELDS)}; the rest at their defaults")
    ap.add_argument("--compare-hf", action="store_true", help="also time transformers' generate (fresh engines both)")
    ap.add_argument("--hf-num-seqs", type=positive_int, default=64,
                    help="prompts given to both sides (a prefix of the workload)")
    ap.add_argument("--hf-batch-size", type=positive_int, default=64,
                    help="prompts a transformers generate call takes (n rows each with --n)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--latency", action="store_true", help="decode ms/token instead of throughput")
    mode.add_argument("--ttft", action="store_true", help="time to first token of one request on an idle engine")
    ap.add_argument("--latency-batch-sizes", type=positive_ints, default=(1, 8, 32), help="default: 1,8,32")
    ap.add_argument("--latency-context", type=positive_int, default=1024)
    ap.add_argument("--latency-steps", type=positive_int, default=128)
    ap.add_argument("--ttft-sizes", type=positive_ints, default=(128, 1000),
                    help="prompt lengths, comma-separated (default: 128,1000)")
    ap.add_argument("--json", help="write the results here (the report's rows under \"report\")")
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse twice: first to learn --workload, then with that preset as the defaults. Every value (counts
    positive, min <= max, sampling, kernel routes) and every combination of flags is checked here, before
    any engine starts: a flag the chosen run would ignore (RUN_FLAGS) is refused."""
    ap = build_parser()
    known, _ = ap.parse_known_args(argv)
    preset = WORKLOADS[known.workload]
    ap.set_defaults(**{name: getattr(preset, name) for name in Workload.__dataclass_fields__})
    args = ap.parse_args(argv)
    for name in ("input", "output"):
        low, high = getattr(args, "min_" + name), getattr(args, "max_" + name)
        if low > high:
            ap.error(f"--min-{name} {low} is above --max-{name} {high}")
    try:
        args.sampling = WorkloadSampling(args.top_k, args.top_p, args.repetition_penalty, args.frequency_penalty,
                                         args.presence_penalty, args.logprobs)
        args.routes = parse_kernel_routes(args.kernel_routes)
        args.sampling.params(1, args.prompt_logprobs)  # a bad K fails here
    except (TypeError, ValueError) as exc:
        ap.error(str(exc))
    for name in ("logprobs", "prompt_logprobs"):  # the engines run at the default cap
        k = getattr(args, name)
        if k is not None and not 0 <= k <= DEFAULT_MAX_LOGPROBS:
            ap.error(f"{name} must be in [0, {DEFAULT_MAX_LOGPROBS}] (the engines' max_logprobs, vLLM's default), "
                     f"got {k}")
    if args.prompt_logprobs is not None and (args.sampling != WorkloadSampling() or args.compare_hf or args.n > 1
                                             or args.shared_prefix):
        ap.error("--prompt-logprobs scores greedily: no --top-k / --top-p / penalties, no --n, no --compare-hf, "
                 "no --shared-prefix")
    if args.shared_prefix < 0:
        ap.error(f"--shared-prefix must be >= 0, got {args.shared_prefix}")
    if args.quantization and args.tp > 1:  # weight_width reads rank 0's model, one shard of the weights
        ap.error("--quantization with --tp > 1: the roofline's stored weight widths are read from rank 0's shard")
    if args.compare_hf and not args.sampling.transformers_can_run:
        ap.error("--compare-hf cannot run --frequency-penalty / --presence-penalty (transformers' generate has "
                 "neither) or --logprobs (its run asks none)")
    run = run_of(args)
    ignored = [flag(d) for d in sorted(set().union(*RUN_FLAGS.values()) - set(RUN_FLAGS[run]))
               if getattr(args, d) != ap.get_default(d)]
    if ignored:
        ap.error(f"{run} ignores {', '.join(ignored)} (it reads {', '.join(map(flag, RUN_FLAGS[run]))} besides the "
                 f"model's and the engine's flags)")
    if args.prompt_logprobs is not None and args.max_output != 1:  # score_rows counts no decode step
        ap.error(f"--prompt-logprobs scores prompts with one output token each (the scoring report counts no "
                 f"decode): pass --min-output 1 --max-output 1 (or --workload score), got --max-output "
                 f"{args.max_output}")
    return args


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(**{name: getattr(args, name) for name in Workload.__dataclass_fields__})


def engine_kwargs(args: argparse.Namespace, load_format: str) -> dict:
    return dict(load_format=load_format, max_model_len=args.max_model_len, tensor_parallel_size=args.tp,
                enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, kernel_routes=args.routes,
                kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def probe(llm: LLM) -> tuple[float, float]:
    """One reading of the device's limits: copy bandwidth (bytes/s) and the GEMM peak (FLOP/s) of
    the format the linears compute in: FP8 when the engine holds FP8 linears (--quantization fp8,
    or a checkpoint quantized so: configs/qwen3-8b-fp8). The probes' buffers are freed on return."""
    peak = measure_fp8_gemm_peak() if llm.config.quant_config is not None else measure_gemm_peak()
    return measure_bandwidth(), peak


def probe_before(llm: LLM) -> tuple[float, float]:
    """`probe` on the idle engine before a run; the run's peak memory is then counted afresh, so
    that it holds the engine's memory and not the probes' buffers."""
    reading = probe(llm)
    torch.cuda.reset_peak_memory_stats()
    return reading


def weight_width(llm: LLM, decode_weights: int) -> float:
    """Bytes per decode-step weight element as the engine stores them: the compute dtype's width,
    or with FP8 linears the stored parameter bytes (FP8 weights, their scales, the bf16 rest; no untied
    input embedding, no MoE experts, as decode_weight_elements counts) over the elements."""
    if llm.config.quant_config is None:
        return element_bytes(llm.config.torch_dtype)
    cfg = llm.config.model_config
    model = llm.model_runner.model
    skip = {id(t) for m in model.modules() if isinstance(m, MoeExperts) for t in m.parameters()}
    if not cfg.tie_word_embeddings:
        skip.add(id(model.model.embed_tokens.weight))
    stored = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    return stored / decode_weights


def experts_width(model: nn.Module, compute_bytes: int) -> float:
    """Bytes per MoE expert weight element as the engine stores them: the MoE layers' stored
    parameter bytes (FP8 weights and their float32 scales, or the compute dtype's) over the
    elements of w13 and w2; `compute_bytes` for a model without experts."""
    layers = [m for m in model.modules() if isinstance(m, MoeExperts)]
    elements = sum(m.w13.numel() + m.w2.numel() for m in layers)
    if not elements:
        return compute_bytes
    return sum(p.numel() * p.element_size() for m in layers for p in m.parameters()) / elements


def byte_widths(llm: LLM, decode_weights: int) -> ByteWidths:
    """The roofline's bytes of one stored element: of the KV cache, the weights and the experts."""
    return ByteWidths(kv=element_bytes(llm.config.kv_cache_torch_dtype), weights=weight_width(llm, decode_weights),
                      experts=experts_width(llm.model_runner.model, element_bytes(llm.config.torch_dtype)))


# ----- runs -----
def throughput(args: argparse.Namespace, llm: LLM, kwargs: dict, res: dict, decode_weights: int) -> tuple[Rows, LLM]:
    """The throughput run (and --compare-hf); returns report rows and the engine left to exit."""
    cfg = llm.config.model_config
    w = workload_of(args)
    prompts, max_tokens = make_workload(w, cfg.vocab_size)
    before = probe_before(llm)
    warm_up(llm, args.sampling, w.prompt_logprobs, w.n)
    run = run_engine(llm, prompts, max_tokens, args.sampling, w.prompt_logprobs, w.n)
    peak_mem = torch.cuda.max_memory_allocated()  # before the probes allocate their buffers
    limits = DeviceLimits.best_of([before, probe(llm)], args.tp)
    widths = byte_widths(llm, decode_weights)
    t = ThroughputRun(args.workload, w, args.sampling, cfg, widths, decode_weights, [len(p) for p in prompts],
                      max_tokens, run, peak_mem)
    if w.prompt_logprobs is not None:
        return score_rows(t, limits, res), llm
    rows = throughput_rows(t, limits, res)
    if args.compare_hf:
        k = min(args.hf_num_seqs, len(prompts))
        llm.exit()
        llm = LLM(args.model, **kwargs)  # fresh: no prefix cache from the run above
        warm_up(llm, args.sampling, n=w.n)
        ours = run_engine(llm, prompts[:k], max_tokens[:k], args.sampling, n=w.n)
        llm.exit()
        hf = run_hf(args.model, prompts[:k], max_tokens[:k], args.hf_batch_size, args.sampling, w.n)
        rows += hf_rows(k, ours, w.n * sum(max_tokens[:k]), hf, res)
    return rows, llm


def main() -> None:
    args = parse_args(sys.argv[1:])
    require_cuda("bench.py")
    load_format, weights = resolve_load_format(args.load_format, args.model)
    print(weights, flush=True)
    kwargs = engine_kwargs(args, load_format)
    decode_weights = decode_weight_elements(ModelConfig.from_pretrained(args.model))  # before any TP set-up
    t0 = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    startup_s = time.perf_counter() - t0
    res: dict = {"model": args.model, "weights": weights, "load_format": load_format, "startup_s": startup_s,
                 "kv_blocks": llm.num_kvcache_blocks, "device": torch.cuda.get_device_name(),
                 "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                 "kernel_routes": vars(args.routes), "kv_cache_dtype": args.kv_cache_dtype,
                 "quantization": args.quantization}
    weights_format = args.quantization or ("fp8, as the checkpoint stores them" if llm.config.quant_config is not None
                                           else "as the checkpoint stores them")
    rows = [("weights", weights),
            ("model / device", f"{args.model} / {res['device']}, tp {args.tp}, max_num_seqs {args.max_num_seqs}, "
                               f"max_num_batched_tokens {args.max_num_batched_tokens}"),
            ("kernel routes", args.kernel_routes or "defaults"),
            ("weights format", weights_format),
            ("KV cache", f"{args.kv_cache_dtype}: {llm.config.kv_cache_torch_dtype}, {llm.num_kvcache_blocks} blocks"),
            ("startup (load, warm-up, graphs)", f"{startup_s:.1f} s")]
    if args.latency:
        res["decode_ms_per_token"] = latency(llm, list(args.latency_batch_sizes), args.latency_context,
                                             args.latency_steps)
        rows += latency_rows(res["decode_ms_per_token"], args.latency_context)
    elif args.ttft:
        before = probe_before(llm)
        times = measure_ttft(llm, list(args.ttft_sizes), args.seed)
        rows += ttft_rows(times, llm.config.model_config, byte_widths(llm, decode_weights), decode_weights,
                          DeviceLimits.best_of([before, probe(llm)], args.tp), res)
    else:
        more, llm = throughput(args, llm, kwargs, res, decode_weights)
        rows += more
    llm.exit()
    print(format_table(rows))
    if args.json:
        res["report"] = rows
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
