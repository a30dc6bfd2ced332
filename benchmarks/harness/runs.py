"""bench.py's runs: the engine over a workload (timed per step kind, every output checked), decode
latency at fixed batch sizes, time to first token on an idle engine, and transformers' generate on
the same prompts (the --compare-hf baseline). bench.py turns what they return into report rows."""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from benchmarks.harness.stats import percentile
from benchmarks.harness.workloads import PROMPT_ID_MAX, WORKLOAD_TEMPERATURE, WorkloadSampling
from nanovllm import LLM, SamplingParams
from nanovllm.engine.scheduled_batch import StepKind
from nanovllm.outputs import RequestOutput

# --ttft: timed requests per prompt size (after TTFT_WARMUP untimed ones, which compile shapes).
TTFT_REPEATS = 7
TTFT_WARMUP = 1
# Percentiles reported for time to first token and inter-token latency.
LATENCY_PERCENTILES = (50, 99)
# transformers' attention kernel for the --compare-hf baseline.
HF_ATTENTION = "sdpa"
# Tokens of transformers' untimed warm-up generate (as warm_up's 8 for nanovllm).
HF_WARMUP_TOKENS = 8


@dataclass
class EngineRun:
    """One timed run_engine: wall time, per-kind step totals and per-token arrival latencies."""

    wall_s: float = 0.0
    prefill_s: float = 0.0  # steps with prefill in them (PREFILL and MIXED)
    prefill_tokens: int = 0
    prefill_padding: int = 0  # tokens those steps' CUDA graphs padded them with (0 without prefill graphs)
    prefill_steps: int = 0
    prefill_host_s: float = 0.0  # launch + postprocess of those steps
    prefill_wait_s: float = 0.0
    decode_s: float = 0.0  # decode-only steps
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_host_s: float = 0.0  # launch + postprocess of decode-only steps
    decode_wait_s: float = 0.0
    decode_step_rows: list[int] = field(default_factory=list)  # each decode-only step's rows ...
    decode_step_s: list[float] = field(default_factory=list)  # ... and its wall time
    steps_by_kind: Counter = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)  # from all requests queued to the first token
    itl_s: list[float] = field(default_factory=list)  # gaps between a request's successive tokens

    def summary(self) -> dict:
        lists = ("ttft_s", "itl_s", "steps_by_kind", "decode_step_rows", "decode_step_s")
        out = {k: v for k, v in vars(self).items() if k not in lists}
        out["steps_by_kind"] = dict(self.steps_by_kind)
        for name, values in (("ttft", self.ttft_s), ("itl", self.itl_s)):
            for q in LATENCY_PERCENTILES if values else ():  # none between tokens when each request makes one
                out[f"{name}_p{q}_ms"] = 1e3 * percentile(values, q)
        return out


def run_engine(llm: LLM, prompts: list[list[int]], max_tokens: list[int],
               sampling: WorkloadSampling = WorkloadSampling(), prompt_logprobs: int | None = None,
               n: int = 1) -> EngineRun:
    """Queue every request (`n` samples each), step to completion, and check each returned the tokens
    counted (and with `prompt_logprobs`, which every request then asks, an entry per prompt token).
    Latencies are per sequence: StepResult.sampled names each sample."""
    ids = [llm.add_request(p, sampling.params(m, prompt_logprobs, n)) for p, m in zip(prompts, max_tokens, strict=True)]
    wanted = dict(zip(ids, max_tokens))
    run = EngineRun()
    outputs: dict[int, RequestOutput] = {}
    sampled: Counter = Counter()
    last_token_at: dict[int, float] = {}
    graphs = llm.model_runner.varlen_graphs  # None: prefill / mixed steps run at their own size
    start = time.perf_counter()
    while not llm.is_finished():
        t = time.perf_counter()
        r = llm.step()
        now = time.perf_counter()
        run.steps_by_kind[r.kind.value] += 1
        if r.kind is StepKind.DECODE:
            run.decode_s += now - t
            run.decode_tokens += r.num_tokens
            run.decode_steps += 1
            run.decode_host_s += r.launch_s + r.postprocess_s
            run.decode_wait_s += r.wait_s
            run.decode_step_rows.append(r.num_tokens)
            run.decode_step_s.append(now - t)
        else:
            run.prefill_s += now - t
            run.prefill_tokens += r.num_tokens
            bucket = graphs.bucket(r.num_tokens) if graphs is not None else None
            run.prefill_padding += bucket - r.num_tokens if bucket is not None else 0
            run.prefill_steps += 1
            run.prefill_host_s += r.launch_s + r.postprocess_s
            run.prefill_wait_s += r.wait_s
        for rid in r.sampled:
            if rid in last_token_at:
                run.itl_s.append(now - last_token_at[rid])
            else:
                run.ttft_s.append(now - start)
            last_token_at[rid] = now
            sampled[rid] += 1
        outputs.update((out.request_id, out) for out in r.finished)
    run.wall_s = time.perf_counter() - start
    check_outputs(wanted, outputs, sampled, n)
    if prompt_logprobs is not None:
        check_prompt_logprobs(dict(zip(ids, map(len, prompts))), outputs)
    return run


def check_outputs(max_tokens: dict[int, int], outputs: dict[int, RequestOutput], sampled: Counter,
                  n: int = 1) -> None:
    """Raise unless every request finished holding `n` samples of exactly max_tokens tokens each, every
    token seen in `sampled` (counts by sequence id: a request's when n = 1, its samples' otherwise, which
    are checked in total)."""
    missing = sorted(set(max_tokens) - set(outputs))
    if missing:
        raise RuntimeError(f"{len(missing)} request(s) never finished, e.g. id {missing[0]}")
    for rid, m in max_tokens.items():
        samples = outputs[rid].outputs
        if len(samples) != n:
            raise RuntimeError(f"request {rid} returned {len(samples)} samples, {n} asked")
        for sample in samples:
            if len(sample.token_ids) != m:
                raise RuntimeError(f"request {rid} returned {len(sample.token_ids)} tokens, {m} counted (ignore_eos: "
                                   f"all must be made)")
        if n == 1 and sampled[rid] != m:
            raise RuntimeError(f"request {rid}: StepResult.sampled named it {sampled[rid]} times for {m} tokens")
    counted = n * sum(max_tokens.values())
    if sum(sampled.values()) != counted:
        raise RuntimeError(f"StepResult.sampled named {sum(sampled.values())} tokens for the {counted} counted")


def check_prompt_logprobs(prompt_lens: dict[int, int], outputs: dict[int, RequestOutput]) -> None:
    """Raise unless each request's prompt_logprobs has one entry per prompt token, entry 0 None."""
    for rid, n in prompt_lens.items():
        got = outputs[rid].prompt_logprobs
        if got is None or len(got) != n or got[0] is not None:
            raise RuntimeError(f"request {rid}: prompt_logprobs of {None if got is None else len(got)} entries "
                               f"for {n} prompt tokens")


def warm_up(llm: LLM, sampling: WorkloadSampling | None = None, prompt_logprobs: int | None = None,
            n: int = 1) -> None:
    """One short generate unrelated to the workload (compiles, fills allocator pools); sampled as the
    workload is when given (a kernel specialised on its settings, e.g. the logprobs count or the
    prompt-logprobs k, compiles here; with n samples, their forks)."""
    params = (SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs, n=n) if sampling is None
              else sampling.params(8, prompt_logprobs, n))
    llm.generate(["Benchmark: "] if llm.tokenizer else [[1, 2, 3]], params, use_tqdm=False)


@dataclass(frozen=True)
class HFRun:
    seconds: float
    generated_tokens: int  # every token transformers made: rows x the batch's max_new_tokens
    settings: str
    warmup_s: float  # the untimed warm-up generate's (as nanovllm's engine has one, warm_up)


def run_hf(model_dir: str, prompts: list[list[int]], max_tokens: list[int], batch_size: int,
           sampling: WorkloadSampling = WorkloadSampling(), n: int = 1, device: str = "cuda") -> HFRun:
    """transformers' generate on the same prompts, `n` samples each (num_return_sequences: a batch of
    prompts becomes n x as many rows). Batches group prompts of similar max_tokens (sorted) and every row
    runs to the batch's maximum; all those tokens are counted. Before the timed batches, one untimed
    warm-up generate of HF_WARMUP_TOKENS tokens on the first prompt, sampled the same way (its first call's
    one-off costs, as nanovllm's engine has its warm_up before its timed run)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=HF_ATTENTION).eval()
    cache = model.generation_config.cache_implementation or "dynamic (transformers' default)"
    order = sorted(range(len(prompts)), key=lambda i: max_tokens[i], reverse=True)
    pad = 0

    def generate(idx: list[int], new: int) -> torch.Tensor:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in idx], device=device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=True, temperature=WORKLOAD_TEMPERATURE, top_k=sampling.top_k,
                                 top_p=sampling.top_p, repetition_penalty=sampling.repetition_penalty,
                                 num_return_sequences=n, pad_token_id=pad)
        if out.shape != (n * len(idx), width + new):
            raise RuntimeError(f"transformers made {tuple(out.shape)} rows x positions, {n * len(idx)} x "
                               f"{width + new} counted")
        return out

    on_cuda = torch.device(device).type == "cuda"

    def synchronize() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    start = time.perf_counter()
    generate(order[:1], HF_WARMUP_TOKENS)
    synchronize()
    warmup_s = time.perf_counter() - start
    generated = 0
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        new = max(max_tokens[i] for i in idx)
        generate(idx, new)
        generated += n * len(idx) * new
    synchronize()
    seconds = time.perf_counter() - start
    del model
    if on_cuda:
        torch.cuda.empty_cache()
    settings = (f"transformers {transformers.__version__}, bf16, attn_implementation={HF_ATTENTION}, random weights, "
                f"batches of {batch_size} prompts sorted by max_tokens, num_return_sequences={n}, left padding, "
                f"do_sample {sampling.describe()}, "
                f"min_new_tokens=max_new_tokens, cache {cache}, after one untimed warm-up generate "
                f"({warmup_s:.2f} s)")
    return HFRun(seconds, generated, settings, warmup_s)


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


def measure_ttft(llm: LLM, sizes: list[int], seed: int) -> dict[int, list[float]]:
    """Seconds from add_request to the first token of one request alone on the engine, per prompt size.
    Every prompt is fresh random ids, so no prefix-cache block is ever hit."""
    rng = random.Random(seed)
    id_max = min(PROMPT_ID_MAX, llm.config.model_config.vocab_size - 1)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = {}
    for size in sizes:
        times = []
        for _ in range(TTFT_WARMUP + TTFT_REPEATS):
            prompt = [rng.randint(0, id_max) for _ in range(size)]
            t = time.perf_counter()
            llm.add_request(prompt, params)
            while not llm.is_finished():
                llm.step()
            times.append(time.perf_counter() - t)
        out[size] = times[TTFT_WARMUP:]
    return out
