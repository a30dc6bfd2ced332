"""bench.py's report: rows of (name, value) computed from what a run measured and the device's probed
limits, passed in as numbers (so the whole report is built, and tested, without a GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.harness.roofline import (
    DecodeStep, decode_rows, decode_steps, expected_experts_hit, lm_head_elements, per_sample, phase_bound_s,
    prefill_flops, roofline, score_flops, step_weight_bytes, ByteWidths, workload_bytes, workload_flops,
)
from benchmarks.harness.runs import LATENCY_PERCENTILES, EngineRun, HFRun
from benchmarks.harness.stats import bucket_edges, percentile, sum_by_rows
from benchmarks.harness.workloads import Workload, WorkloadSampling
from nanovllm.models.model_config import ModelConfig

Rows = list[tuple[str, str]]
# Marks a run that beat its roofline: it did less work than the roofline counts. (A MoE prompt that reached
# few experts did: random weights once sent a prompt to one expert a layer, utils/loader.DUMMY_ATTENTION_OUT_SCALE.)
BEAT_ROOFLINE = " (faster than its roofline: the run did less work than the roofline counts)"


def beat_note(roofline_s: float, measured_s: float) -> str:
    """BEAT_ROOFLINE for a run measured faster than its roofline, else nothing."""
    return BEAT_ROOFLINE if measured_s < roofline_s else ""


def reached(roofline_s: float, measured_s: float) -> str:
    """The fraction of its roofline a run reached, in percent; BEAT_ROOFLINE past 100%."""
    return f"{100 * roofline_s / measured_s:.1f} %" + beat_note(roofline_s, measured_s)


@dataclass(frozen=True)
class DeviceLimits:
    """One GPU's probed limits (benchmarks/harness/probes.py) and how many GPUs the run used;
    `readings` holds the probes they were kept from, (bytes/s, FLOP/s) each, in the order taken."""

    bandwidth: float  # HBM copy bytes/s
    gemm_peak: float  # dense GEMM FLOP/s of the weights' format (bf16, or FP8 when the linears hold FP8)
    gpus: int = 1
    readings: tuple[tuple[float, float], ...] = ()

    @classmethod
    def best_of(cls, readings: Sequence[tuple[float, float]], gpus: int) -> DeviceLimits:
        """The highest reading of each limit. A run heats the GPU and its clocks drop: a probe taken
        after it read up to ~5% below one taken idle (BENCHMARKS.md, twenty-seventh session), and the
        roofline holds the engine to what the device can do, not to its slowest reading."""
        if not readings:
            raise ValueError("best_of needs at least one (bandwidth, gemm_peak) reading")
        return cls(max(b for b, _ in readings), max(p for _, p in readings), gpus, tuple(readings))

    def row(self) -> tuple[str, str]:
        """The report's row: the limits kept and, when there were several, every probe's reading."""
        per_gpu = f" x {self.gpus} GPUs" if self.gpus > 1 else ""
        text = f"{self.bandwidth / 1e12:.2f} TB/s / {self.gemm_peak / 1e12:.0f} TFLOP/s{per_gpu}"
        if len(self.readings) > 1:
            each = ", ".join(f"{b / 1e12:.2f} / {p / 1e12:.0f}" for b, p in self.readings)
            text += f" (the highest of the probes before and after the run: {each})"
        return "HBM copy bandwidth / GEMM peak (the weights' format)", text


@dataclass(frozen=True)
class ThroughputRun:
    """What a throughput run was given and measured: the workload (its preset's name, its draws),
    the model, the engine's run and its peak memory."""

    preset: str
    workload: Workload
    sampling: WorkloadSampling
    cfg: ModelConfig
    widths: ByteWidths  # bytes of one stored KV / weight element
    decode_weights: int  # decode_weight_elements of the model, counted before any tensor-parallel set-up
    prompt_lens: list[int]
    max_tokens: list[int]
    run: EngineRun
    peak_mem_bytes: int


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of equal length as text: columns left-aligned, two spaces apart (the report's rows, and
    the side-by-side tables of benchmarks/engine)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([f"{cell:<{w}}" for cell, w in zip(row, widths)] + [row[-1]]) for row in rows)


def _ms(values: Sequence[float]) -> str:
    return " / ".join(f"{1e3 * percentile(values, q):.1f}" for q in LATENCY_PERCENTILES)


def throughput_rows(t: ThroughputRun, limits: DeviceLimits, res: dict) -> Rows:
    """The throughput report: the run's rates and latencies, then the roofline and phase bound at
    `limits` (per GPU, times limits.gpus), experts counted and decode steps by row count. Adds the
    figures to `res` (bench.py's --json)."""
    w, run, cfg = t.workload, t.run, t.cfg
    out_tokens, in_tokens = w.n * sum(t.max_tokens), sum(t.prompt_lens)
    tput = out_tokens / run.wall_s
    res.update(run.summary(), workload=vars(w), sampling=vars(t.sampling), output_tokens=out_tokens,
               input_tokens=in_tokens, throughput=tput, peak_mem_bytes=t.peak_mem_bytes)
    steps = ", ".join(f"{n} {kind}" for kind, n in sorted(run.steps_by_kind.items()))
    samples = f" x {w.n} samples" if w.n > 1 else ""
    prefix = f"{w.shared_prefix} shared tokens + " if w.shared_prefix else ""
    rows = [("workload", f"{t.preset}: {w.num_seqs} requests{samples}, prompts {prefix}{w.min_input}-{w.max_input}, "
                         f"outputs {w.min_output}-{w.max_output}, seed {w.seed}, {t.sampling.describe()}"),
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

    bw, peak = limits.gpus * limits.bandwidth, limits.gpus * limits.gemm_peak
    kv_bytes, w_bytes = workload_bytes(cfg, t.widths, t.prompt_lens, t.max_tokens, t.decode_weights, w.n,
                                       w.shared_prefix)
    mm_flops, attn_flops = workload_flops(cfg, t.prompt_lens, t.max_tokens, w.n, w.shared_prefix)
    roof = roofline(kv_bytes + w_bytes, mm_flops + attn_flops, bw, peak)
    floor_steps = decode_steps(cfg, t.widths, t.prompt_lens, t.max_tokens, t.decode_weights, w.n, w.shared_prefix)
    phase_s = phase_bound_s(cfg, t.widths, t.prompt_lens, floor_steps, t.decode_weights, bw, peak, w.shared_prefix)
    res.update(bandwidth=limits.bandwidth, gemm_peak_flops=limits.gemm_peak, kv_bytes=kv_bytes, weight_bytes=w_bytes,
               matmul_flops=mm_flops, attention_flops=attn_flops, memory_s=roof.memory_s, compute_s=roof.compute_s,
               roofline_s=roof.seconds, roofline_binds=roof.binding, roofline_fraction=roof.seconds / run.wall_s,
               phase_bound_s=phase_s)
    rows += [limits.row(),
             ("memory term: KV + weights", f"{kv_bytes / 1e12:.2f} + {w_bytes / 1e12:.2f} TB = {roof.memory_s:.2f} s"),
             ("compute term: matmul + attention", f"{mm_flops / 1e15:.2f} + {attn_flops / 1e15:.2f} PFLOP "
                                                  f"= {roof.compute_s:.2f} s"),
             (f"roofline ({roof.binding} binds)", f"{roof.seconds:.2f} s = {out_tokens / roof.seconds:,.0f} tok/s"),
             ("fraction of roofline reached", reached(roof.seconds, run.wall_s)),
             ("phase bound: prefill, then each step's projections and attention in turn",
              f"{phase_s:.2f} s (the roofline is {100 * roof.seconds / phase_s:.1f}% of it); "
              f"reached {100 * phase_s / run.wall_s:.1f}%"),
             *expert_rows(cfg, per_sample(t.max_tokens, w.n)),
             *decode_bucket_rows(run, floor_steps, bw, res),
             ("peak memory (torch)", f"{t.peak_mem_bytes / 2**30:.1f} GiB")]
    return rows


def score_rows(t: ThroughputRun, limits: DeviceLimits, res: dict) -> Rows:
    """The scoring report (a workload with prompt_logprobs, one output token each): prompt tokens per
    second, each step's host work and waiting, and the fraction of the roofline, whose FLOPs count the
    lm_head at every prompt position (roofline.score_flops) and whose bytes are the weights read once (an
    MoE model's experts: those its prompt tokens pick, expected under uniform routing).
    Adds the figures to `res` (bench.py's --json)."""
    w, run, cfg = t.workload, t.run, t.cfg
    tokens = sum(t.prompt_lens)
    rate = tokens / run.wall_s
    res.update(run.summary(), workload=vars(w), input_tokens=tokens, output_tokens=sum(t.max_tokens),
               throughput=rate, peak_mem_bytes=t.peak_mem_bytes)
    n = max(run.prefill_steps, 1)
    res.update(step_ms=1e3 * run.prefill_s / n, step_host_ms=1e3 * run.prefill_host_s / n,
               step_wait_ms=1e3 * run.prefill_wait_s / n)
    bw, peak = limits.gpus * limits.bandwidth, limits.gpus * limits.gemm_peak
    mm_flops, attn_flops = score_flops(cfg, t.prompt_lens)
    head_flops = 2 * lm_head_elements(cfg) * tokens
    # the weights every token goes through, and each expert some prompt token picks (read at least once)
    weight_bytes = step_weight_bytes(cfg, t.widths, t.decode_weights, tokens)
    roof = roofline(weight_bytes, mm_flops + attn_flops, bw, peak)
    res.update(bandwidth=limits.bandwidth, gemm_peak_flops=limits.gemm_peak, weight_bytes=weight_bytes,
               matmul_flops=mm_flops, lm_head_flops=head_flops, attention_flops=attn_flops, memory_s=roof.memory_s,
               compute_s=roof.compute_s, roofline_s=roof.seconds, roofline_binds=roof.binding,
               roofline_fraction=roof.seconds / run.wall_s)
    steps = ", ".join(f"{k} {kind}" for kind, k in sorted(run.steps_by_kind.items()))
    return [("workload", f"{t.preset}: {w.num_seqs} prompts of {w.min_input}-{w.max_input} tokens, seed {w.seed}, "
                         f"prompt_logprobs={w.prompt_logprobs}, max_tokens {w.min_output}-{w.max_output}, "
                         f"temperature 0"),
            ("prompt tokens / wall", f"{tokens} / {run.wall_s:.2f} s = {rate:,.0f} tok/s"),
            ("steps", steps),
            ("step mean: total / host work / waiting",
             f"{res['step_ms']:.2f} / {res['step_host_ms']:.2f} / {res['step_wait_ms']:.2f} ms"),
            ("their graph padding", f"{run.prefill_padding:,} tokens = "
                                    f"{100 * run.prefill_padding / max(run.prefill_tokens, 1):.1f}% of their tokens"),
            limits.row(),
            ("compute term: layers + lm_head (every prompt position) + attention",
             f"{(mm_flops - head_flops) / 1e15:.3f} + {head_flops / 1e15:.3f} + {attn_flops / 1e15:.3f} PFLOP "
             f"= {roof.compute_s:.3f} s"),
            ("memory term: the weights once (experts: those picked)",
             f"{weight_bytes / 1e9:.2f} GB = {roof.memory_s:.4f} s"),
            (f"roofline ({roof.binding} binds)", f"{roof.seconds:.3f} s = {tokens / roof.seconds:,.0f} tok/s"),
            ("fraction of roofline reached", reached(roof.seconds, run.wall_s)),
            ("peak memory (torch)", f"{t.peak_mem_bytes / 2**30:.1f} GiB")]


def decode_bucket_rows(run: EngineRun, floor_steps: list[DecodeStep], bandwidth: float, res: dict) -> Rows:
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


def expert_rows(cfg: ModelConfig, max_tokens: Sequence[int]) -> Rows:
    """How the weight term counts an MoE model's experts (nothing for a dense model)."""
    if cfg.moe is None:
        return []
    moe, rows = cfg.moe, decode_rows(max_tokens)
    mean = sum(expected_experts_hit(moe.num_experts, moe.num_experts_per_tok, b) for b in rows) / max(len(rows), 1)
    return [("experts in the weight term",
             f"expected distinct under uniform routing (random weights route near-uniformly): "
             f"E (1 - (1 - K/E)^B) of E = {moe.num_experts}, K = {moe.num_experts_per_tok} at B decode rows; "
             f"mean {mean:.1f} per step and sparse layer over {len(rows)} steps")]


def hf_rows(k: int, ours: EngineRun, ours_tokens: int, hf: HFRun, res: dict) -> Rows:
    """--compare-hf: our fresh engine and transformers on the first k prompts."""
    ours_rate, theirs = ours_tokens / ours.wall_s, hf.generated_tokens / hf.seconds
    res.update(hf_seqs=k, hf_s=hf.seconds, hf_generated_tokens=hf.generated_tokens, hf_settings=hf.settings,
               nano_sub_s=ours.wall_s, nano_sub_tokens=ours_tokens, hf_tok_s_ratio=ours_rate / theirs,
               hf_time_ratio=hf.seconds / ours.wall_s)
    return [("transformers settings", hf.settings),
            (f"first {k}: nanovllm, fresh engine, n x sum(max_tokens)",
             f"{ours_tokens} / {ours.wall_s:.2f} s = {ours_rate:,.0f} tok/s"),
            (f"first {k}: transformers, rows x n x batch max_new",
             f"{hf.generated_tokens} / {hf.seconds:.2f} s = {theirs:,.0f} tok/s"),
            ("speed-up over transformers: tok/s / time",
             f"{ours_rate / theirs:.1f}x / {hf.seconds / ours.wall_s:.1f}x")]


def ttft_rows(times: dict[int, list[float]], cfg: ModelConfig, widths: ByteWidths, decode_weights: int,
              limits: DeviceLimits, res: dict) -> Rows:
    """--ttft: each prompt size's median and best time to first token, against the roofline of its
    prefill (of one GPU, times limits.gpus): its FLOPs at the GEMM peak, or reading the weights once
    (decode_weights elements at widths.weights, and an MoE model's experts its tokens pick) at the
    copy bandwidth, whichever takes longer; its FLOP time shown too."""
    bw, peak = limits.gpus * limits.bandwidth, limits.gpus * limits.gemm_peak
    res.update(bandwidth=limits.bandwidth, gemm_peak_flops=limits.gemm_peak, ttft={})
    rows = [limits.row()]
    for size, ts in times.items():
        med, best = percentile(ts, 50), min(ts)
        flops = prefill_flops(cfg, size)
        weight_bytes = step_weight_bytes(cfg, widths, decode_weights, size)
        roof = roofline(weight_bytes, flops, bw, peak)
        res["ttft"][size] = dict(times_s=ts, median_s=med, min_s=best, flop_s=roof.compute_s,
                                 weights_s=roof.memory_s, roofline_s=roof.seconds,
                                 median_over_roofline=med / roof.seconds)
        rows.append((f"TTFT {size} tokens, idle: median / min; roofline (FLOPs, weights read once)",
                     f"{1e3 * med:.2f} / {1e3 * best:.2f} ms; {1e3 * roof.seconds:.3f} ms, {roof.binding} binds "
                     f"(FLOPs {1e3 * roof.compute_s:.3f}, weights {1e3 * roof.memory_s:.3f} ms); "
                     f"median = {med / roof.seconds:.1f}x" + beat_note(roof.seconds, med)))
    return rows


def latency_rows(ms_per_token: dict[int, float], context: int) -> Rows:
    return [(f"decode ms/token, batch {b}, context {context}", f"{ms:.3f}") for b, ms in ms_per_token.items()]
