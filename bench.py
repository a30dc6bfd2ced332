"""Offline throughput benchmark on nano-vllm's workload, against a measured roofline and transformers.

    python bench.py                                    # Qwen3-0.6B shape, random weights, default workload
    python bench.py --workload long                    # or: many; explicit flags override a preset
    python bench.py --model DIR --compare-hf           # + transformers on a prefix of the same prompts
    python bench.py --model DIR --latency              # decode ms/token at batch 1, 8, 32
    python bench.py --model DIR --ttft                 # time to first token of one request, idle engine

Workload (nano-vllm's): Random(seed); num_seqs prompts of random ids with lengths in [min_input,
max_input]; then per prompt max_tokens in [min_output, max_output]; temperature 0.6, ignore_eos
(--top-k / --top-p add those filters, on both sides of --compare-hf).
Throughput = output tokens / wall seconds (prefill included), after one warm-up generate. A model
directory without *.safetensors (benchmarks/configs/*) is run with random weights (load_format dummy).

Roofline: time >= max(bytes / copy bandwidth, FLOPs / bf16 GEMM peak), both probed in the same run
(benchmarks/probes.py). What the bytes and FLOPs count, mixture-of-experts models' experts included:
benchmarks/roofline.py's docstring. Decode-only steps are also summed by row count (1-8, 9-32, ...)
next to the memory term's steps of as many rows, which shows the batch sizes that lose time.
Workloads and presets: benchmarks/workloads.py. The engine and transformers runs: benchmarks/runs.py;
here the command line, the report rows and main.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from collections.abc import Sequence

import torch

from benchmarks.probes import measure_bandwidth, measure_gemm_peak
from benchmarks.roofline import (
    DecodeStep, decode_rows, decode_steps, decode_weight_elements, expected_experts_hit, phase_bound_s, prefill_flops,
    roofline, workload_bytes, workload_flops,
)
from benchmarks.runs import LATENCY_PERCENTILES, EngineRun, latency, measure_ttft, run_engine, run_hf, warm_up
from benchmarks.stats import bucket_edges, percentile, sum_by_rows
from benchmarks.workloads import WORKLOADS, Workload, WorkloadSampling, make_workload
from nanovllm import LLM
from nanovllm.config import Config
from nanovllm.models.model_config import ModelConfig

NO_CUDA_MESSAGE = "bench.py measures GPU throughput and needs a CUDA device; torch sees none"
# The Qwen3-0.6B shape (config.json only), found from the script so any working directory works.
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks", "configs", "qwen3-0.6b")


# ----- command line -----
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="auto: the checkpoint's weights, random ones if the directory has no *.safetensors")
    ap.add_argument("--workload", default="default", choices=sorted(WORKLOADS),
                    help="preset for the six workload flags below (an explicit flag wins)")
    for name in ("num_seqs", "min_input", "max_input", "min_output", "max_output", "seed"):
        ap.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=getattr(WORKLOADS["default"], name),
                        help="default: from --workload")
    ap.add_argument("--top-k", type=int, default=0, help="the workload's top-k (0: off), both sides")
    ap.add_argument("--top-p", type=float, default=1.0, help="the workload's top-p (1.0: off), both sides")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=Config.max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int, default=Config.max_num_batched_tokens)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--compare-hf", action="store_true", help="also time transformers' generate (fresh engines both)")
    ap.add_argument("--hf-num-seqs", type=int, default=64, help="prompts given to both sides (a prefix of the workload)")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--latency", action="store_true", help="decode ms/token instead of throughput")
    mode.add_argument("--ttft", action="store_true", help="time to first token of one request on an idle engine")
    ap.add_argument("--latency-batch-sizes", default="1,8,32")
    ap.add_argument("--latency-context", type=int, default=1024)
    ap.add_argument("--latency-steps", type=int, default=128)
    ap.add_argument("--ttft-sizes", default="128,1000", help="prompt lengths, comma-separated")
    ap.add_argument("--json", help="write the results here")
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse twice: first to learn --workload, then with that preset as the defaults."""
    ap = build_parser()
    known, _ = ap.parse_known_args(argv)
    preset = WORKLOADS[known.workload]
    ap.set_defaults(**{name: getattr(preset, name) for name in Workload.__dataclass_fields__})
    args = ap.parse_args(argv)
    try:
        args.sampling = WorkloadSampling(args.top_k, args.top_p)
    except (TypeError, ValueError) as exc:
        ap.error(str(exc))
    return args


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(**{name: getattr(args, name) for name in Workload.__dataclass_fields__})


def engine_kwargs(args: argparse.Namespace, load_format: str) -> dict:
    return dict(load_format=load_format, max_model_len=args.max_model_len, tensor_parallel_size=args.tp,
                enforce_eager=args.enforce_eager, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens)


def resolve_load_format(requested: str, model_dir: str) -> tuple[str, str]:
    """(load_format for LLM, a line saying which weights run): auto = dummy iff no *.safetensors."""
    if requested == "dummy":
        return "dummy", "random weights (--load-format dummy)"
    if not glob.glob(os.path.join(model_dir, "*.safetensors")):
        return "dummy", f"random weights: {model_dir} has no *.safetensors (load_format=dummy)"
    return requested, f"checkpoint weights from {model_dir}"


def _ms(values: Sequence[float]) -> str:
    return " / ".join(f"{1e3 * percentile(values, q):.1f}" for q in LATENCY_PERCENTILES)


def throughput_rows(
    args: argparse.Namespace, llm: LLM, kwargs: dict, res: dict, decode_weights: int
) -> tuple[list[tuple[str, str]], LLM]:
    """The throughput run (and --compare-hf); returns report rows and the engine left to exit.
    decode_weights: decode_weight_elements of the model."""
    cfg = llm.config.model_config
    w = workload_of(args)
    prompts, max_tokens = make_workload(w, cfg.vocab_size)
    prompt_lens = [len(p) for p in prompts]
    warm_up(llm)
    run = run_engine(llm, prompts, max_tokens, args.sampling)
    peak_mem = torch.cuda.max_memory_allocated()
    out_tokens, in_tokens = sum(max_tokens), sum(prompt_lens)
    tput = out_tokens / run.wall_s
    res.update(run.summary(), workload=vars(w), sampling=vars(args.sampling), output_tokens=out_tokens,
               input_tokens=in_tokens, throughput=tput, peak_mem_bytes=peak_mem)
    steps = ", ".join(f"{n} {kind}" for kind, n in sorted(run.steps_by_kind.items()))
    rows = [("workload", f"{args.workload}: {w.num_seqs} requests, prompts {w.min_input}-{w.max_input}, "
                         f"outputs {w.min_output}-{w.max_output}, seed {w.seed}, {args.sampling.describe()}"),
            ("output tokens / wall", f"{out_tokens} / {run.wall_s:.2f} s = {tput:,.0f} tok/s"),
            ("steps", steps),
            ("steps with prefill (prefill, mixed) tok/s", f"{run.prefill_tokens / max(run.prefill_s, 1e-9):,.0f}"),
            ("their graph padding", f"{run.prefill_padding:,} tokens = "
                                    f"{100 * run.prefill_padding / max(run.prefill_tokens, 1):.1f}% of their tokens"),
            ("decode-only steps tok/s", f"{run.decode_tokens / max(run.decode_s, 1e-9):,.0f}")]
    n = max(run.decode_steps, 1)
    res.update(decode_step_ms=1e3 * run.decode_s / n, decode_host_ms=1e3 * run.decode_host_s / n,
               decode_wait_ms=1e3 * run.decode_wait_s / n)
    # With overlap scheduling the host works while the device runs: waiting ~ step - host.
    rows += [("decode step mean: total / host work / waiting",
              f"{res['decode_step_ms']:.2f} / {res['decode_host_ms']:.2f} / {res['decode_wait_ms']:.2f} ms"),
             ("TTFT from all queued (incl. queueing) p50 / p99", f"{_ms(run.ttft_s)} ms"),
             ("inter-token latency p50 / p99", f"{_ms(run.itl_s)} ms")]

    bw, peak = measure_bandwidth(), measure_gemm_peak()
    elem = torch.empty((), dtype=llm.config.torch_dtype).element_size()
    kv_bytes, w_bytes = workload_bytes(cfg, elem, prompt_lens, max_tokens, decode_weights)
    mm_flops, attn_flops = workload_flops(cfg, prompt_lens, max_tokens)
    roof = roofline(kv_bytes + w_bytes, mm_flops + attn_flops, args.tp * bw, args.tp * peak)
    steps = decode_steps(cfg, elem, prompt_lens, max_tokens, decode_weights)
    phase_s = phase_bound_s(cfg, elem, prompt_lens, steps, decode_weights, args.tp * bw, args.tp * peak)
    res.update(bandwidth=bw, gemm_peak_flops=peak, kv_bytes=kv_bytes, weight_bytes=w_bytes, matmul_flops=mm_flops,
               attention_flops=attn_flops, memory_s=roof.memory_s, compute_s=roof.compute_s, roofline_s=roof.seconds,
               roofline_binds=roof.binding, roofline_fraction=roof.seconds / run.wall_s,
               phase_bound_s=phase_s)
    per_gpu = f" x {args.tp} GPUs" if args.tp > 1 else ""
    rows += [("HBM copy bandwidth / bf16 GEMM peak", f"{bw / 1e12:.2f} TB/s / {peak / 1e12:.0f} TFLOP/s{per_gpu}"),
             ("memory term: KV + weights", f"{kv_bytes / 1e12:.2f} + {w_bytes / 1e12:.2f} TB = {roof.memory_s:.2f} s"),
             ("compute term: matmul + attention", f"{mm_flops / 1e15:.2f} + {attn_flops / 1e15:.2f} PFLOP "
                                                  f"= {roof.compute_s:.2f} s"),
             (f"roofline ({roof.binding} binds)", f"{roof.seconds:.2f} s = {out_tokens / roof.seconds:,.0f} tok/s"),
             ("fraction of roofline reached", f"{100 * roof.seconds / run.wall_s:.1f} %"),
             ("phase bound: prefill, then each step's projections and attention in turn",
              f"{phase_s:.2f} s (the roofline is {100 * roof.seconds / phase_s:.1f}% of it); "
              f"reached {100 * phase_s / run.wall_s:.1f}%"),
             *expert_rows(cfg, max_tokens),
             *decode_bucket_rows(run, steps, args.tp * bw, res),
             ("peak memory (torch)", f"{peak_mem / 2**30:.1f} GiB")]

    if args.compare_hf:
        k = min(args.hf_num_seqs, len(prompts))
        llm.exit()
        llm = LLM(args.model, **kwargs)  # fresh: no prefix cache from the run above
        warm_up(llm)
        sub = run_engine(llm, prompts[:k], max_tokens[:k], args.sampling)
        llm.exit()
        hf = run_hf(args.model, prompts[:k], max_tokens[:k], args.hf_batch_size, args.sampling)
        ours_tokens = sum(max_tokens[:k])
        ours, theirs = ours_tokens / sub.wall_s, hf.generated_tokens / hf.seconds
        res.update(hf_seqs=k, hf_s=hf.seconds, hf_generated_tokens=hf.generated_tokens, hf_settings=hf.settings,
                   nano_sub_s=sub.wall_s, nano_sub_tokens=ours_tokens, hf_tok_s_ratio=ours / theirs,
                   hf_time_ratio=hf.seconds / sub.wall_s)
        rows += [("transformers settings", hf.settings),
                 (f"first {k}: nanovllm, fresh engine, sum(max_tokens)",
                  f"{ours_tokens} / {sub.wall_s:.2f} s = {ours:,.0f} tok/s"),
                 (f"first {k}: transformers, rows x batch max_new",
                  f"{hf.generated_tokens} / {hf.seconds:.2f} s = {theirs:,.0f} tok/s"),
                 ("speed-up over transformers: tok/s / time",
                  f"{ours / theirs:.1f}x / {hf.seconds / sub.wall_s:.1f}x")]
    return rows, llm


def decode_bucket_rows(run: EngineRun, floor_steps: list[DecodeStep], bandwidth: float,
                       res: dict) -> list[tuple[str, str]]:
    """Decode-only steps by row count: measured wall time next to the memory term's steps of as
    many rows (floor_steps: decode_steps, every request running from the start), so the
    report shows which batch sizes lose time against the roofline."""
    floor_rows = [step.rows for step in floor_steps]
    edges = bucket_edges(max(run.decode_step_rows + floor_rows, default=1))
    measured = sum_by_rows(run.decode_step_rows, run.decode_step_s, edges)
    floor = sum_by_rows(floor_rows, [step.bytes / bandwidth for step in floor_steps], edges)
    rows, res["decode_by_rows"] = [], []
    for lo, hi, (n, s), (nf, sf) in zip([1] + [e + 1 for e in edges], edges, measured, floor):
        if n or nf:
            res["decode_by_rows"].append(dict(rows=[lo, hi], steps=n, s=s, floor_steps=nf, floor_s=sf))
            share = f" ({sf / s:.0%})" if s else ""
            rows.append((f"decode-only steps of {lo}-{hi} rows: measured / memory floor",
                         f"{n} steps {s:.2f} s / {nf} steps {sf:.2f} s{share}"))
    return rows


def expert_rows(cfg: ModelConfig, max_tokens: Sequence[int]) -> list[tuple[str, str]]:
    """How the weight term counts an MoE model's experts (nothing for a dense model)."""
    if cfg.moe is None:
        return []
    moe, rows = cfg.moe, decode_rows(max_tokens)
    mean = sum(expected_experts_hit(moe.num_experts, moe.num_experts_per_tok, b) for b in rows) / max(len(rows), 1)
    return [("experts in the weight term",
             f"expected distinct under uniform routing (random weights route near-uniformly): "
             f"E (1 - (1 - K/E)^B) of E = {moe.num_experts}, K = {moe.num_experts_per_tok} at B decode rows; "
             f"mean {mean:.1f} per step and sparse layer over {len(rows)} steps")]


def ttft_rows(args: argparse.Namespace, llm: LLM, res: dict) -> list[tuple[str, str]]:
    sizes = [int(s) for s in args.ttft_sizes.split(",")]
    times = measure_ttft(llm, sizes, args.seed)
    peak = measure_gemm_peak()
    res.update(gemm_peak_flops=peak, ttft={})
    rows = [("bf16 GEMM peak", f"{peak / 1e12:.0f} TFLOP/s")]
    cfg = llm.config.model_config
    for size, ts in times.items():
        med, best = percentile(ts, 50), min(ts)
        flop_s = prefill_flops(cfg, size) / (args.tp * peak)
        res["ttft"][size] = dict(times_s=ts, median_s=med, min_s=best, flop_s=flop_s, median_over_flop=med / flop_s)
        rows.append((f"TTFT {size} tokens, idle: median / min; FLOP time",
                     f"{1e3 * med:.2f} / {1e3 * best:.2f} ms; {1e3 * flop_s:.3f} ms (median = {med / flop_s:.1f}x)"))
    return rows


def main() -> None:
    args = parse_args(sys.argv[1:])
    if not torch.cuda.is_available():
        sys.exit(NO_CUDA_MESSAGE)
    load_format, weights = resolve_load_format(args.load_format, args.model)
    print(weights, flush=True)
    kwargs = engine_kwargs(args, load_format)
    decode_weights = decode_weight_elements(ModelConfig.from_pretrained(args.model))  # before any TP set-up
    t0 = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    startup_s = time.perf_counter() - t0
    res: dict = {"model": args.model, "weights": weights, "load_format": load_format, "startup_s": startup_s,
                 "kv_blocks": llm.num_kvcache_blocks, "device": torch.cuda.get_device_name(),
                 "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    rows = [("weights", weights),
            ("model / device", f"{args.model} / {res['device']}, tp {args.tp}, max_num_seqs {args.max_num_seqs}, "
                               f"max_num_batched_tokens {args.max_num_batched_tokens}"),
            ("startup (load, warm-up, graphs)", f"{startup_s:.1f} s")]
    if args.latency:
        bss = [int(b) for b in args.latency_batch_sizes.split(",")]
        res["decode_ms_per_token"] = latency(llm, bss, args.latency_context, args.latency_steps)
        rows += [(f"decode ms/token, batch {b}, context {args.latency_context}", f"{ms:.3f}")
                 for b, ms in res["decode_ms_per_token"].items()]
    elif args.ttft:
        rows += ttft_rows(args, llm, res)
    else:
        more, llm = throughput_rows(args, llm, kwargs, res, decode_weights)
        rows += more
    llm.exit()
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
