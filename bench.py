"""Offline throughput benchmark on nano-vllm's workload, against the memory floor and transformers.

    python bench.py --model benchmarks/configs/qwen3-0.6b --load-format dummy
    python bench.py --model DIR --load-format dummy --compare-hf      # + transformers, same prompts
    python bench.py --model DIR --load-format dummy --latency         # decode ms/token at batch 1, 8, 32

Workload (nano-vllm's): random.seed(seed); num_seqs prompts of random ids with lengths in
[min_input, max_input]; then per prompt max_tokens in [min_output, max_output];
temperature 0.6, ignore_eos. Throughput = output tokens / wall seconds (prefill included),
after one warm-up generate.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.scheduler import StepKind

# Largest token id used for random prompts (nano-vllm's bench draws ids in [0, 10000]).
PROMPT_ID_MAX = 10000
# Bytes moved by the copy that measures HBM bandwidth (well past the 60 MB L2).
BANDWIDTH_PROBE_BYTES = 2 * 2**30


def make_workload(args, vocab_size: int) -> tuple[list[list[int]], list[SamplingParams]]:
    random.seed(args.seed)
    id_max = min(PROMPT_ID_MAX, vocab_size - 1)
    prompts = [[random.randint(0, id_max) for _ in range(random.randint(args.min_input, args.max_input))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(args.min_output, args.max_output))
              for _ in range(args.num_seqs)]
    return prompts, params


def measure_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = BANDWIDTH_PROBE_BYTES // 2
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n / sorted(times)[len(times) // 2]


def memory_floor_bytes(llm: LLM, prompts, params) -> tuple[float, float]:
    """(KV bytes, weight bytes) that any engine must read for this workload's decode steps.

    Each decode step of a sequence reads its whole context's KV once; weights are read
    once per step, and there are at least max(max_tokens) - 1 decode steps.
    """
    cfg = llm.config.model_config
    elem = torch.empty((), dtype=llm.config.torch_dtype).element_size()
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem
    # decode step t (t = 1 .. n-1) reads len(p) + t tokens: sum = (n-1) len(p) + n(n-1)/2
    kv_tokens = sum((sp.max_tokens - 1) * len(p) + sp.max_tokens * (sp.max_tokens - 1) // 2 for p, sp in zip(prompts, params))
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.model_runner.model.parameters())
    steps = max(sp.max_tokens for sp in params) - 1
    return kv_tokens * kv_per_token, weight_bytes * steps


def run_engine(llm: LLM, prompts, params) -> dict:
    for p, sp in zip(prompts, params):
        llm.add_request(p, sp)
    stats = {k: 0.0 for k in ("prefill_s", "decode_s", "prefill_tokens", "decode_tokens", "decode_steps",
                              "decode_launch_s", "decode_prepare_s", "decode_wait_s", "decode_post_s")}
    start = time.perf_counter()
    while not llm.is_finished():
        t = time.perf_counter()
        r = llm.step()
        dt = time.perf_counter() - t
        if r.kind is StepKind.PREFILL:
            stats["prefill_s"] += dt
            stats["prefill_tokens"] += r.num_tokens
        else:
            stats["decode_s"] += dt
            stats["decode_tokens"] += r.num_tokens
            stats["decode_steps"] += 1
            stats["decode_launch_s"] += r.launch_s
            stats["decode_prepare_s"] += r.prepare_s
            stats["decode_wait_s"] += r.wait_s
            stats["decode_post_s"] += r.postprocess_s
    stats["wall_s"] = time.perf_counter() - start
    return stats


def run_hf(model_dir: str, prompts, params, batch_size: int) -> float:
    """transformers' generate on the same prompts (left-padded batches, bf16, sdpa); returns seconds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    pad = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in idx], device="cuda")
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx], device="cuda")
        new = max(params[i].max_tokens for i in idx)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=pad)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return seconds


def latency(llm: LLM, batch_sizes: list[int], context: int, steps: int) -> dict[int, float]:
    """Mean decode ms per step (= per token of each sequence) at each batch size."""
    out = {}
    for bs in batch_sizes:
        for i in range(bs):
            llm.add_request([(7 * i + j) % min(PROMPT_ID_MAX, llm.config.model_config.vocab_size) for j in range(context)],
                            SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
        times = []
        while not llm.is_finished():
            t = time.perf_counter()
            r = llm.step()
            if r.kind is StepKind.DECODE:
                times.append(time.perf_counter() - t)
        times = times[len(times) // 4 :]  # drop the first quarter (warm-up of caches and clocks)
        out[bs] = 1e3 * sum(times) / len(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--compare-hf", action="store_true", help="also time transformers' generate")
    ap.add_argument("--hf-num-seqs", type=int, default=64, help="prompts given to transformers (a prefix of the workload)")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--latency", action="store_true", help="decode ms/token instead of throughput")
    ap.add_argument("--latency-batch-sizes", default="1,8,32")
    ap.add_argument("--latency-context", type=int, default=1024)
    ap.add_argument("--latency-steps", type=int, default=128)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tp, enforce_eager=args.enforce_eager)
    startup_s = time.perf_counter() - t0
    res: dict = {"model": args.model, "startup_s": startup_s, "kv_blocks": llm.num_kvcache_blocks,
                 "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    rows = [("startup (load, warm-up, graphs)", f"{startup_s:.1f} s")]
    if args.latency:
        bss = [int(b) for b in args.latency_batch_sizes.split(",")]
        res["decode_ms_per_token"] = latency(llm, bss, args.latency_context, args.latency_steps)
        rows += [(f"decode ms/token, batch {b}, context {args.latency_context}", f"{ms:.3f}")
                 for b, ms in res["decode_ms_per_token"].items()]
    else:
        prompts, params = make_workload(args, llm.config.model_config.vocab_size)
        llm.generate(["Benchmark: "] if llm.tokenizer else [[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)
        stats = run_engine(llm, prompts, params)
        out_tokens = sum(sp.max_tokens for sp in params)
        tput = out_tokens / stats["wall_s"]
        res.update(stats, output_tokens=out_tokens, input_tokens=sum(map(len, prompts)), throughput=tput)
        rows += [("output tokens / wall", f"{out_tokens} / {stats['wall_s']:.2f} s = {tput:,.0f} tok/s"),
                 ("prefill tok/s", f"{stats['prefill_tokens'] / max(stats['prefill_s'], 1e-9):,.0f}"),
                 ("decode tok/s", f"{stats['decode_tokens'] / max(stats['decode_s'], 1e-9):,.0f}")]
        n = max(stats["decode_steps"], 1)
        host = (stats["decode_launch_s"] + stats["decode_post_s"]) / n
        wait = stats["decode_wait_s"] / n
        step = stats["decode_s"] / n
        res.update(decode_step_ms=1e3 * step, decode_host_ms=1e3 * host, decode_wait_ms=1e3 * wait)
        # With overlap scheduling the host works while the device runs: waiting ~ step - host.
        rows.append(("mean decode step: total / host work / host waiting on device",
                     f"{1e3 * step:.2f} / {1e3 * host:.2f} / {1e3 * wait:.2f} ms"))
        if torch.cuda.is_available():
            bw = measure_bandwidth()
            kv_bytes, w_bytes = memory_floor_bytes(llm, prompts, params)
            floor_s = (kv_bytes + w_bytes) / bw
            res.update(bandwidth=bw, floor_kv_bytes=kv_bytes, floor_weight_bytes=w_bytes, floor_s=floor_s,
                       floor_fraction=floor_s / stats["wall_s"], peak_mem_bytes=torch.cuda.max_memory_allocated())
            rows += [("HBM bandwidth (copy, read+write)", f"{bw / 1e12:.2f} TB/s"),
                     ("memory floor (KV + weights)", f"{kv_bytes / 1e12:.1f} + {w_bytes / 1e12:.1f} TB "
                      f"= {floor_s:.2f} s = {out_tokens / floor_s:,.0f} tok/s"),
                     ("fraction of floor reached", f"{100 * floor_s / stats['wall_s']:.1f} %"),
                     ("peak memory (torch)", f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")]
        if args.compare_hf:
            k = args.hf_num_seqs
            sub = run_engine(llm, prompts[:k], params[:k])
            llm.exit()
            hf_s = run_hf(args.model, prompts[:k], params[:k], args.hf_batch_size)
            sub_tokens = sum(sp.max_tokens for sp in params[:k])
            res.update(hf_seqs=k, hf_s=hf_s, nano_sub_s=sub["wall_s"], hf_ratio=hf_s / sub["wall_s"])
            rows += [(f"first {k} prompts: nanovllm", f"{sub_tokens / sub['wall_s']:,.0f} tok/s"),
                     (f"first {k} prompts: transformers", f"{sub_tokens / hf_s:,.0f} tok/s"),
                     ("speed-up over transformers", f"{hf_s / sub['wall_s']:.1f}x")]
    llm.exit()
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
