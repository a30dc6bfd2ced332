"""bench.py and benchmarks/ on CPU: bench.py refuses to run without CUDA, parses its flags (kernel
routes included), its roofline counting (benchmarks/harness/roofline.py) is right, its whole report
is built from a CPU engine's run and injected device limits, compare.py's table, and benchmarks/
holds together (no module imports bench.py, no import cycle, one import style, no private names).

Expected values are worked out by hand below for a 2-layer toy shape, not by calling the
functions under test a second way; the parameter count is also checked against the real
model module built on the meta device.
"""

import ast
import json
import os
import random
import shlex
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import bench
from checkpoints import build_checkpoint, cpu_llm
from benchmarks.engine import compare
from benchmarks.engine.profile_run import kernel_group
from benchmarks.harness import runs
from benchmarks.harness.engine_options import parse_kernel_routes, resolve_load_format
from benchmarks.harness.report import (
    BEAT_ROOFLINE, DeviceLimits, ThroughputRun, decode_bucket_rows, expert_rows, reached, throughput_rows, ttft_rows,
)
from benchmarks.harness.roofline import (
    DecodeStep, decode_expert_elements, decode_rows, decode_steps, decode_weight_elements, expected_experts_hit,
    ByteWidths, expert_elements, per_sample, phase_bound_s, prefill_flops, roofline, token_linear_elements, workload_bytes,
    workload_flops,
)
from benchmarks.harness.stats import bucket_edges, percentile, sum_by_rows
from benchmarks.harness.workloads import WORKLOADS, WorkloadSampling, make_workload
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.layers.kernel_path import KernelRoutes
from nanovllm.models.model_config import ModelConfig
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.registry import build_model

REPO = Path(__file__).resolve().parent.parent

# Toy shape: vocab 100, hidden 8, intermediate 16, 2 layers, 2 query heads, 1 kv head, head_dim 4.
#   per layer: q 8x8=64, k 8x4=32, v 32, o 8x8=64, gate 8x16=128, up 128, down 128  -> 576
#   norms per layer: 8 + 8 (input/post) + 4 + 4 (q/k)                                -> 24
#   lm_head 100x8 = 800; final norm 8; embedding 100x8 = 800
TOY_DECODE_WEIGHTS = 2 * (576 + 24) + 8 + 800  # 2008
TOY_EMBEDDING = 800


def toy_config(tied: bool) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "tie_word_embeddings": tied,
    })


def model_parameter_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())  # a tied weight is one parameter


def test_no_cuda_exits_with_one_line():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(REPO / "bench.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "CUDA" in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


# benchmarks/ modules whose main drives bench.py runs in fresh processes (bench.py checks for CUDA itself);
# each other module with a main measures on the GPU.
NOT_GPU_ONLY = {"benchmarks.engine.variants", "benchmarks.engine.compare", "benchmarks.engine.bench_process"}
# The arguments a module requires before it gets as far as its CUDA check.
REQUIRED_ARGS = {"benchmarks.engine.bench_structured": ["--tokenizer", "nanovllm/default_model"],
                 "benchmarks.kernels.bench_moe_fp8": ["channel"]}


def test_every_gpu_benchmark_exits_with_one_line_without_cuda():
    """benchmarks/README.md: without a CUDA device each script says so and exits, rather than a
    traceback from torch.cuda or minutes of the GPU workload run on the CPU (profile_step,
    profile_mixed and compile_watch used to start the 0.6B engine on the CPU; bench_kernels,
    bench_gemm, bench_kv_spread and bench_fused raised torch's AssertionError)."""
    names = [module_name(p) for p in BENCHMARK_MODULES
             if "def main(" in p.read_text() and module_name(p) not in NOT_GPU_ONLY]
    assert "benchmarks.engine.profile_step" in names and "benchmarks.kernels.bench_kernels" in names
    code = (
        "import importlib, json, sys\n"
        "for name, args in json.loads(sys.argv[1]):\n"
        "    sys.argv = [name, *args]\n"
        "    try:\n"
        "        importlib.import_module(name).main()\n"
        "    except SystemExit as exc:\n"
        "        print(json.dumps([name, exc.code]))\n"
        "    else:\n"
        "        print(json.dumps([name, 'returned']))\n"
    )
    todo = json.dumps([[name, REQUIRED_ARGS.get(name, [])] for name in names])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-c", code, todo], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exits = dict(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("["))
    assert sorted(exits) == sorted(names), proc.stdout
    for name, message in exits.items():
        assert isinstance(message, str) and "CUDA" in message and "\n" not in message, (name, message)


@pytest.mark.parametrize("name, group", [
    ("_decode_split_kernel", "decode attention"), ("_decode_merge_kernel", "decode attention"),
    ("_prefill_kernel", "prefill attention"), ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT", "GEMMs"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "GEMMs"), ("_skinny_gemm_kernel", "GEMMs"),
    ("_rms_norm_kernel", "other kernels"), ("_qk_norm_rope_kernel", "other kernels"),
])
def test_profile_run_groups_kernels_by_name(name, group):
    assert kernel_group(name) == group


def test_decode_weights_hand_count_and_model():
    untied, tied = toy_config(tied=False), toy_config(tied=True)
    # Untied: everything but the embedding, whose rows are only gathered.
    assert decode_weight_elements(untied) == TOY_DECODE_WEIGHTS
    assert model_parameter_count(untied) == TOY_DECODE_WEIGHTS + TOY_EMBEDDING
    # Tied: the embedding is the lm_head, read once per step, so the count is every parameter.
    assert decode_weight_elements(tied) == TOY_DECODE_WEIGHTS
    assert model_parameter_count(tied) == TOY_DECODE_WEIGHTS


@pytest.mark.parametrize("name, published_params, untied_embedding", [
    ("llama-3.1-8b", 8_030_261_248, 128_256 * 4096),  # no q/k norms, no biases
    ("llama-3.2-1b", 1_235_814_400, 0),  # tied: the embedding is the lm_head, read every step
    ("qwen2.5-7b", 7_615_616_512, 152_064 * 3584),  # q/k/v biases, no q/k norms
])
def test_decode_weights_follow_each_family(name, published_params, untied_embedding):
    """The published parameter count less an untied input embedding: each family's own norms and
    biases, not Qwen3's."""
    cfg = ModelConfig.from_pretrained(str(REPO / "benchmarks" / "configs" / name))
    assert decode_weight_elements(cfg) == published_params - untied_embedding


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-30b-a3b"])
def test_fp8_release_configs_are_their_shapes_in_block_fp8(name):
    """configs/<name>-fp8: the shape of configs/<name> with the quantization_config of Qwen's FP8
    releases, read as 128 x 128 block-scaled e4m3 weights (so bench.py probes the FP8 GEMM peak)."""
    from nanovllm.quantization.checkpoint_config import resolve_quantization
    from nanovllm.quantization.config import BLOCK

    fp8 = ModelConfig.from_pretrained(str(REPO / "benchmarks" / "configs" / f"{name}-fp8"))
    bf16 = ModelConfig.from_pretrained(str(REPO / "benchmarks" / "configs" / name))
    assert fp8 == bf16 and decode_weight_elements(fp8) == decode_weight_elements(bf16)
    quant = resolve_quantization(None, fp8.quantization_config, f"{name}-fp8")
    assert quant is not None and quant.format_of("model.layers.0.mlp.down_proj").scales == BLOCK


def test_workload_bytes_by_hand():
    cfg = toy_config(tied=False)
    # Requests (prompt 3, 2 outputs) and (prompt 5, 4 outputs).
    # Decode reads: request 1 one step at context 4; request 2 steps at 6, 7, 8 -> 4 + 21 = 25 tokens.
    # KV per token: 2 (K, V) x 2 layers x 1 kv head x 4 dims x 2 bytes = 32 bytes -> 800 bytes.
    # Weights: at least 4 - 1 = 3 decode steps x 2008 elements x 2 bytes = 12,048 bytes.
    assert workload_bytes(cfg, ByteWidths.uniform(2), [3, 5], [2, 4], decode_weight_elements(cfg)) == (800, 12048)


def test_workload_flops_by_hand():
    cfg = toy_config(tied=False)
    # Through the layers: (3 + 2 - 1) + (5 + 4 - 1) = 12 tokens x 2 x 1152 = 27,648;
    # lm_head: one row per output token, 6 x 2 x 800 = 9,600.
    # Pairs: request 1 prefill 1+2+3 = 6, decode 4 -> 10; request 2 prefill 1+..+5 = 15,
    # decode 6+7+8 = 21 -> 36; 46 pairs x 4 x 2 heads x 4 dims x 2 layers = 2,944.
    assert workload_flops(cfg, [3, 5], [2, 4]) == (27648 + 9600, 2944)
    # Prefill of 3 tokens sampling one: 2 x 1152 x 3 + 2 x 800 + 6 pairs x 64 = 6912 + 1600 + 384.
    assert prefill_flops(cfg, 3) == 8896
    # Two samples a request: each prompt once, each sample its own decode tokens.
    # Layers: (3 + 2 x 1) + (5 + 2 x 3) = 16 tokens x 2304 = 36,864; lm_head (1 + 2) + (1 + 6) = 10 rows x 1600 =
    # 16,000. Pairs: 6 + 2 x 4 = 14 and 15 + 2 x 21 = 57 -> 71 x 64 = 4,544.
    assert workload_flops(cfg, [3, 5], [2, 4], n=2) == (36864 + 16000, 4544)
    assert per_sample([3, 5], 2) == [3, 3, 5, 5]


def test_samples_share_their_prompts_kv_in_the_memory_term():
    """Two samples a request: a decode step reads each prompt's KV once and each sample's own tokens.
    Request (3, 2): step 1 reads 3 + 2 x 1 = 5 tokens; request (5, 4): steps 1-3 read 3 x 5 + 2 x (1 + 2 + 3)
    = 27; 32 tokens x 32 bytes = 1,024 (one sample each: 800, test_workload_bytes_by_hand). Weights unchanged."""
    cfg = toy_config(tied=False)
    weights = decode_weight_elements(cfg)
    assert workload_bytes(cfg, ByteWidths.uniform(2), [3, 5], [2, 4], weights, n=2) == (1024, 12048)
    steps = decode_steps(cfg, ByteWidths.uniform(2), [3, 5], [2, 4], weights, n=2)
    # step 1: prompts 3 + 5, 4 samples x 1 token; steps 2, 3: prompt 5, 2 samples x 2 / 3 tokens
    # (pairs: each sample's query with its whole context, 2 x 8 + 4 x 1, 2 x 5 + 2 x 2, 2 x 5 + 2 x 3)
    assert steps == [DecodeStep(4, 4016, 32 * 12, 20), DecodeStep(2, 4016, 32 * 9, 14), DecodeStep(2, 4016, 32 * 11, 16)]
    # an MoE model's experts: the samples' rows pick them
    moe = toy_moe_config()
    assert workload_bytes(moe, ByteWidths.uniform(2), [3, 5], [2, 4], TOY_MOE_DECODE_WEIGHTS, n=2)[1] == round(
        2 * (3 * TOY_MOE_DECODE_WEIGHTS + decode_expert_elements(moe, [2, 2, 4, 4])))
    per_step = decode_steps(moe, ByteWidths.uniform(2), [3, 5], [2, 4], TOY_MOE_DECODE_WEIGHTS, n=2)
    assert sum(step.bytes for step in per_step) == pytest.approx(
        sum(workload_bytes(moe, ByteWidths.uniform(2), [3, 5], [2, 4], TOY_MOE_DECODE_WEIGHTS, n=2)), abs=1.0)


def test_a_shared_prefix_is_computed_once_and_read_once_a_step():
    """Prompts 3 and 5 whose first 2 tokens are one prefix (as the fewshot preset's exemplars). KV: request 1's
    step reads its own 1 + 1 token, request 2's steps 3 + 1, 3 + 2, 3 + 3, and each step the prefix once (3 steps):
    2 + 15 + 6 = 23 tokens x 32 bytes = 736 (800 without sharing: test_workload_bytes_by_hand). FLOPs: the prefix
    forwarded once (12 - 2 = 10 tokens through the layers), its 3 pairs once (46 - 3 = 43)."""
    cfg = toy_config(tied=False)
    weights = decode_weight_elements(cfg)
    assert workload_bytes(cfg, ByteWidths.uniform(2), [3, 5], [2, 4], weights, shared=2) == (736, 12048)
    steps = decode_steps(cfg, ByteWidths.uniform(2), [3, 5], [2, 4], weights, shared=2)
    # step 1: prefix 2 + own prompts 1 + 3 + 2 rows x 1; steps 2, 3: prefix 2 + own 3 + 2 / 3 tokens
    # (pairs: each row with the prefix too, 2 x 2 + 4 + 2 x 1, 2 + 3 + 2, 2 + 3 + 3)
    assert steps == [DecodeStep(2, 4016, 32 * 8, 10), DecodeStep(1, 4016, 32 * 7, 7), DecodeStep(1, 4016, 32 * 8, 8)]
    assert sum(step.kv_bytes for step in steps) == 736
    assert workload_flops(cfg, [3, 5], [2, 4], shared=2) == (10 * 2304 + 9600, 43 * 64)
    # with samples too: each request's own prompt once, the prefix once for all
    assert workload_bytes(cfg, ByteWidths.uniform(2), [3, 5], [2, 4], weights, n=2, shared=2)[0] == 32 * (
        (1 + 2 * 1) + (3 * 3 + 2 * (1 + 2 + 3)) + 3 * 2)
    assert workload_bytes(cfg, ByteWidths.uniform(2), [3, 5], [2, 4], weights, shared=0) == (800, 12048)
    with pytest.raises(ValueError, match="shared prefix of 4 tokens"):
        workload_flops(cfg, [3, 5], [2, 4], shared=4)


def test_fewshot_preset_puts_one_prefix_before_each_question():
    args = bench.parse_args(["--workload", "fewshot"])
    w = bench.workload_of(args)
    assert (w.num_seqs, w.min_input, w.max_input, w.min_output, w.max_output, w.shared_prefix) == (
        256, 50, 200, 50, 512, 1024)
    prompts, max_tokens = make_workload(replace(w, num_seqs=5), vocab_size=151936)
    assert all(p[:1024] == prompts[0][:1024] for p in prompts) and len({tuple(p[1024:]) for p in prompts}) == 5
    assert all(50 <= len(p) - 1024 <= 200 for p in prompts) and all(50 <= m <= 512 for m in max_tokens)
    # the questions and lengths are the draws of the same workload without the prefix
    plain_prompts, plain_tokens = make_workload(replace(w, num_seqs=5, shared_prefix=0), vocab_size=151936)
    assert [p[1024:] for p in prompts] == plain_prompts and max_tokens == plain_tokens
    assert bench.workload_of(bench.parse_args(["--workload", "fewshot", "--shared-prefix", "0"])).shared_prefix == 0


def test_roofline_picks_the_larger_term():
    mem = roofline(num_bytes=8e12, flops=1e15, bandwidth=4e12, peak_flops=1e15)
    assert (mem.memory_s, mem.compute_s, mem.seconds, mem.binding) == (2.0, 1.0, 2.0, "memory")
    comp = roofline(num_bytes=1e12, flops=3e15, bandwidth=4e12, peak_flops=1e15)
    assert (comp.seconds, comp.binding) == (3.0, "compute")


def test_device_limits_keep_the_highest_reading_of_each_and_show_every_probe():
    # A run heats the GPU: the probe after it reads lower bandwidth here and a higher GEMM peak there;
    # each limit keeps its own highest reading, and the report's row names every reading.
    before, after = (4.25e12, 7.93e14), (4.21e12, 8.03e14)
    limits = DeviceLimits.best_of([before, after], gpus=2)
    assert (limits.bandwidth, limits.gemm_peak, limits.gpus) == (4.25e12, 8.03e14, 2)
    name, text = limits.row()
    assert name == "HBM copy bandwidth / GEMM peak (the weights' format)"
    assert text == ("4.25 TB/s / 803 TFLOP/s x 2 GPUs "
                    "(the highest of the probes before and after the run: 4.25 / 793, 4.21 / 803)")
    assert DeviceLimits(1e12, 1e15).row()[1] == "1.00 TB/s / 1000 TFLOP/s"
    with pytest.raises(ValueError, match="at least one"):
        DeviceLimits.best_of([], gpus=1)


def test_percentile():
    assert percentile([4, 1, 3, 2], 50) == 2.5  # halfway between 2 and 3
    values = list(range(1, 102))  # 101 values: rank 99 of 0..100 is the value 100
    random.Random(0).shuffle(values)
    assert percentile(values, 99) == 100
    assert percentile(values, 0) == 1 and percentile(values, 100) == 101
    assert percentile([10, 20], 25) == 12.5
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_workload_presets_and_overrides():
    args = bench.parse_args(["--workload", "long", "--seed", "3"])
    assert (args.num_seqs, args.min_input, args.max_input, args.min_output, args.max_output, args.seed) == (
        1024, 100, 2048, 100, 512, 3)
    args = bench.parse_args(["--workload", "many"])
    assert (args.num_seqs, args.min_input, args.max_input, args.min_output, args.max_output, args.seed) == (
        2048, 50, 1024, 50, 512, 11)
    args = bench.parse_args(["--workload", "rollout"])
    assert (args.num_seqs, args.min_input, args.max_input, args.min_output, args.max_output, args.seed, args.n) == (
        64, 100, 1024, 100, 1024, 17, 8)
    assert bench.workload_of(bench.parse_args(["--workload", "rollout", "--n", "4"])).n == 4
    args = bench.parse_args(["--max-num-seqs", "64", "--max-num-batched-tokens", "8192"])
    assert (args.num_seqs, args.max_input, args.seed, args.n) == (256, 1024, 0, 1)
    kwargs = bench.engine_kwargs(args, "dummy")
    assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]) == (64, 8192)


def test_default_workload_is_nano_vllms():
    # nano-vllm's bench.py, as written there: global random, prompts first, then max_tokens.
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    assert make_workload(WORKLOADS["default"], vocab_size=151936) == (prompts, max_tokens)


def test_load_format_follows_safetensors(tmp_path):
    assert resolve_load_format("auto", str(tmp_path))[0] == "dummy"
    assert resolve_load_format("dummy", str(tmp_path))[0] == "dummy"
    (tmp_path / "model.safetensors").write_bytes(b"")
    fmt, line = resolve_load_format("auto", str(tmp_path))
    assert fmt == "auto" and "checkpoint" in line


def test_check_outputs_rejects_uncounted_tokens():
    def out(rid: int, n: int) -> RequestOutput:
        return RequestOutput(rid, None, [1], None, [CompletionOutput(0, "", [5] * n, None, None, "length")])

    runs.check_outputs({0: 3, 1: 2}, {0: out(0, 3), 1: out(1, 2)}, Counter({0: 3, 1: 2}))
    with pytest.raises(RuntimeError, match="returned 1 tokens, 2 counted"):
        runs.check_outputs({0: 3, 1: 2}, {0: out(0, 3), 1: out(1, 1)}, Counter({0: 3, 1: 2}))
    with pytest.raises(RuntimeError, match="never finished"):
        runs.check_outputs({0: 3, 1: 2}, {0: out(0, 3)}, Counter({0: 3}))
    with pytest.raises(RuntimeError, match="sampled"):
        runs.check_outputs({0: 3}, {0: out(0, 3)}, Counter({0: 2}))
    # n samples a request: each sample's length, the samples' count, and every token named by a step
    two = RequestOutput(0, None, [1], None, [CompletionOutput(i, "", [5] * 3, None, None, "length") for i in (0, 1)])
    runs.check_outputs({0: 3}, {0: two}, Counter({0: 3, 1: 3}), n=2)
    with pytest.raises(RuntimeError, match="returned 1 samples, 2 asked"):
        runs.check_outputs({0: 3}, {0: out(0, 3)}, Counter({0: 3, 1: 3}), n=2)
    with pytest.raises(RuntimeError, match="named 5 tokens for the 6 counted"):
        runs.check_outputs({0: 3}, {0: two}, Counter({0: 3, 1: 2}), n=2)
    short = RequestOutput(0, None, [1], None, [CompletionOutput(i, "", [5] * (3 - i), None, None, "length")
                                               for i in (0, 1)])
    with pytest.raises(RuntimeError, match="returned 2 tokens, 3 counted"):
        runs.check_outputs({0: 3}, {0: short}, Counter({0: 3, 1: 2}), n=2)


# ----- mixture-of-experts counting -----
# Toy MoE: the toy shape above with 4 experts of width 4, 2 per token; layer 0 sparse, layer 1
# dense (mlp_only_layers [1]).
#   attention per layer 192 (q 64, k 32, v 32, o 64); dense MLP 3 x 8 x 16 = 384;
#   router 4 x 8 = 32; one expert 3 x 8 x 4 = 96, four of them 384; norms 24 per layer
#   read in full per step: layer 0 192 + 32 + 24, layer 1 192 + 384 + 24, final norm 8, lm_head 800 -> 1656
TOY_MOE_DECODE_WEIGHTS = 1656
TOY_EXPERT = 96


def toy_moe_config() -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
        "norm_topk_prob": True, "mlp_only_layers": [1],
    })


def test_moe_decode_weights_leave_out_the_experts():
    cfg = toy_moe_config()
    assert decode_weight_elements(cfg) == TOY_MOE_DECODE_WEIGHTS
    assert expert_elements(cfg) == TOY_EXPERT
    with torch.device("meta"):
        model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == TOY_MOE_DECODE_WEIGHTS + 4 * TOY_EXPERT + TOY_EMBEDDING


def test_expected_experts_hit_by_enumeration():
    """The formula against the mean over every equally likely routing of B tokens (each picks
    K distinct of E experts)."""
    from itertools import combinations, product

    for experts, top_k, rows in [(5, 2, 3), (4, 1, 2), (6, 3, 2), (4, 4, 1)]:
        picks = list(combinations(range(experts), top_k))
        outcomes = [len(set().union(*routing)) for routing in product(picks, repeat=rows)]
        assert expected_experts_hit(experts, top_k, rows) == pytest.approx(sum(outcomes) / len(outcomes))
    assert expected_experts_hit(128, 8, 0) == 0
    assert expected_experts_hit(128, 8, 1) == pytest.approx(8)
    assert expected_experts_hit(128, 8, 512) == pytest.approx(128)


def test_decode_steps_by_hand_and_summing_to_the_memory_term():
    cfg = toy_config(tied=False)
    weights = decode_weight_elements(cfg)
    # As test_workload_bytes_by_hand: step 1 reads contexts 4 and 6, steps 2 and 3 contexts 7 and 8,
    # 32 bytes a token, and each step 2008 x 2 weight bytes.
    steps = decode_steps(cfg, ByteWidths.uniform(2), [3, 5], [2, 4], weights)
    assert steps == [DecodeStep(2, 4016, 32 * 10, 10), DecodeStep(1, 4016, 32 * 7, 7), DecodeStep(1, 4016, 32 * 8, 8)]
    rng = random.Random(3)
    prompts, outputs = [rng.randint(1, 50) for _ in range(40)], [rng.randint(1, 30) for _ in range(40)]
    for c, w in ((cfg, weights), (toy_moe_config(), TOY_MOE_DECODE_WEIGHTS)):
        kv, wb = workload_bytes(c, ByteWidths.uniform(2), prompts, outputs, w)
        per_step = decode_steps(c, ByteWidths.uniform(2), prompts, outputs, w)
        assert [step.rows for step in per_step] == decode_rows(outputs)
        assert sum(step.bytes for step in per_step) == pytest.approx(kv + wb, abs=1.0)  # experts rounded there


def test_phase_bound_by_hand():
    """Prompts 3 and 5, outputs 2 and 4 on the untied toy (test_workload_flops_by_hand: 1,152
    projection elements a token, an 800-element lm_head, 64 FLOPs a query-key pair).
    Prefill: 8 tokens x 2 x 1,152 + 2 lm_head rows x 1,600 + (6 + 15) pairs x 64 = 22,976 FLOPs.
    Decode steps of 2, 1, 1 rows: 3,904 projection FLOPs a row; contexts 10, 7, 8 tokens = 640,
    448, 512 attention FLOPs and 320, 224, 256 KV bytes; 4,016 weight bytes each."""
    cfg = toy_config(tied=False)
    weights = decode_weight_elements(cfg)
    args = (cfg, ByteWidths.uniform(2), [3, 5], decode_steps(cfg, ByteWidths.uniform(2), [3, 5], [2, 4], weights), weights)
    # FLOPs free: the prefill's weight read, then every step's bytes (the memory term + 4,016)
    assert phase_bound_s(*args, bandwidth=1.0, peak_flops=1e30) == pytest.approx(4016 + 3 * 4016 + 800)
    # bytes free: all FLOPs, the compute term (27,648 + 9,600 + 2,944)
    assert phase_bound_s(*args, bandwidth=1e30, peak_flops=1.0) == pytest.approx(40192)
    # both at 1 / s: each phase takes its larger side
    by_phase = 22976 + (7808 + 640) + (4016 + 448) + (4016 + 512)
    assert phase_bound_s(*args, bandwidth=1.0, peak_flops=1.0) == pytest.approx(by_phase)
    assert by_phase > roofline(800 + 3 * 4016, 40192, 1.0, 1.0).seconds
    # samples and a shared prefix: with bytes free the phases' FLOPs are the workload's, each sample's query
    # paired with its whole context (the prefix and prompt it reads once with the others included)
    steps = decode_steps(cfg, ByteWidths.uniform(2), [3, 5], [2, 4], weights, n=2, shared=2)
    assert phase_bound_s(cfg, ByteWidths.uniform(2), [3, 5], steps, weights, bandwidth=1e30, peak_flops=1.0,
                         shared=2) == pytest.approx(sum(workload_flops(cfg, [3, 5], [2, 4], n=2, shared=2)))
    rng = random.Random(5)
    for c, w in ((cfg, weights), (toy_moe_config(), TOY_MOE_DECODE_WEIGHTS)):
        prompts, outputs = [rng.randint(4, 50) for _ in range(30)], [rng.randint(1, 30) for _ in range(30)]
        for n, shared in ((1, 0), (3, 0), (2, 4)):
            kv, wb = workload_bytes(c, ByteWidths.uniform(2), prompts, outputs, w, n, shared)
            flops = sum(workload_flops(c, prompts, outputs, n, shared))
            steps = decode_steps(c, ByteWidths.uniform(2), prompts, outputs, w, n, shared)
            for bw, peak in ((1.0, 1.0), (1.0, 50.0), (20.0, 1.0)):
                bound = phase_bound_s(c, ByteWidths.uniform(2), prompts, steps, w, bw, peak, shared)
                assert bound >= roofline(kv + wb, flops, bw, peak).seconds * (1 - 1e-12)


def test_transformers_run_counts_every_token_and_is_warmed_up_as_ours(tmp_path):
    """--compare-hf's transformers run, on the CPU: prompts sorted by max_tokens into batches of 2,
    each row run to its batch's longest, n = 2 samples a prompt. max_tokens 2, 4, 3 -> batches (4, 3)
    and (2): 2 prompts x 2 samples x 4 + 1 x 2 x 2 = 20 tokens. Before them one untimed warm-up
    generate, as nanovllm's engine gets warm_up before its timed run, and the settings say so."""
    model = build_checkpoint(str(tmp_path / "tiny"))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16]]
    hf = runs.run_hf(model, prompts, [2, 4, 3], batch_size=2, sampling=WorkloadSampling(top_k=5), n=2, device="cpu")
    assert hf.generated_tokens == 20 and hf.seconds > 0
    assert hf.warmup_s > 0 and "untimed warm-up generate" in hf.settings
    assert "num_return_sequences=2" in hf.settings and "top_k=5" in hf.settings


def test_ttft_is_held_to_the_roofline_of_its_prefill():
    """A prefill must read every weight once as well as do its FLOPs: a short prompt's first token is
    bound by the weight read. Untied toy, prompt of 3 tokens: 8,896 FLOPs (test_workload_flops_by_hand)
    and 2,008 weight elements x 2 bytes = 4,016 bytes. At 1 byte/s and 1 FLOP/s the FLOPs bind (8,896 s);
    at 1,000 FLOP/s the weights do (4,016 s against 8.896 s of FLOPs)."""
    cfg = toy_config(tied=False)
    for peak, bound in ((1.0, 8896.0), (1000.0, 4016.0)):
        res = {}
        rows = ttft_rows({3: [8896.0, 9000.0, 10000.0]}, cfg, ByteWidths.uniform(2), TOY_DECODE_WEIGHTS,
                         DeviceLimits(bandwidth=1.0, gemm_peak=peak), res)
        assert res["ttft"][3]["flop_s"] == pytest.approx(8896.0 / peak)
        assert res["ttft"][3]["roofline_s"] == pytest.approx(bound)
        assert res["ttft"][3]["median_over_roofline"] == pytest.approx(9000.0 / bound)
        assert rows[1][1].endswith(f"median = {9000.0 / bound:.1f}x") and "roofline" in rows[1][0]
    # an MoE prompt also reads the experts its tokens pick: 3 tokens, 4 (1 - 1/2^3) = 3.5 of 96 elements
    res = {}
    rows = ttft_rows({3: [1.0]}, toy_moe_config(), ByteWidths.uniform(2), TOY_MOE_DECODE_WEIGHTS,
                     DeviceLimits(bandwidth=1.0, gemm_peak=1e30), res)
    assert res["ttft"][3]["roofline_s"] == pytest.approx(2 * (1656 + 3.5 * 96))
    # 1 s against a 3,984 s roofline: faster than physics allows, so the row says the run did less work
    assert rows[1][1].endswith(BEAT_ROOFLINE) and BEAT_ROOFLINE not in rows_of_bound(4016.0)


def rows_of_bound(median_s: float) -> str:
    """The TTFT row of the untied toy's 3-token prompt (roofline 4,016 s) at this median."""
    return ttft_rows({3: [median_s]}, toy_config(tied=False), ByteWidths.uniform(2), TOY_DECODE_WEIGHTS,
                     DeviceLimits(bandwidth=1.0, gemm_peak=1000.0), {})[1][1]


def test_a_run_faster_than_its_roofline_is_flagged():
    assert reached(1.0, 2.0) == "50.0 %" and reached(2.0, 2.0) == "100.0 %"
    assert reached(3.0, 2.0) == "150.0 %" + BEAT_ROOFLINE
    assert rows_of_bound(4015.0).endswith(BEAT_ROOFLINE) and not rows_of_bound(4017.0).endswith(BEAT_ROOFLINE)


def test_decode_buckets_sum_steps_by_rows():
    assert bucket_edges(256) == [8, 32, 128, 512] and bucket_edges(1) == [8] and bucket_edges(9) == [8, 32]
    assert sum_by_rows([1, 8, 9, 300, 40], [1.0, 2.0, 4.0, 8.0, 16.0], [8, 32, 128, 512]) == [
        (2, 3.0), (1, 4.0), (1, 16.0), (1, 8.0)]
    run = runs.EngineRun(decode_step_rows=[3, 3, 100], decode_step_s=[0.5, 0.5, 2.0])
    res = {}
    rows = decode_bucket_rows(run, [DecodeStep(3, 1.0, 0, 0), DecodeStep(100, 1.0, 2, 2), DecodeStep(100, 3.0, 0, 0)],
                              2.0, res)
    assert rows == [("decode-only steps of 1-8 rows: measured / memory floor", "2 steps 1.00 s / 1 steps 0.50 s (50%)"),
                    ("decode-only steps of 33-128 rows: measured / memory floor",
                     "1 steps 2.00 s / 2 steps 3.00 s (150%)")]
    assert [b["rows"] for b in res["decode_by_rows"]] == [[1, 8], [33, 128]]


def test_decode_rows_by_hand():
    # outputs 2 and 4: both decode at step 1, only the second at steps 2 and 3
    assert decode_rows([2, 4]) == [2, 1, 1]
    # one output token: no decode step
    assert decode_rows([1, 3, 3]) == [2, 2]
    assert decode_rows([1]) == []


def test_moe_workload_bytes_and_flops_by_hand():
    cfg = toy_moe_config()
    # Decode rows [2, 1, 1] (test above): 4 (1 - 1/2^2) = 3 experts, then 2 and 2 -> 7 experts x 96
    # elements x 1 sparse layer x 2 bytes = 1,344 bytes, on top of 3 steps x 1656 x 2 = 9,936.
    # KV as for the dense toy: 800 bytes.
    assert decode_expert_elements(cfg, [2, 4]) == pytest.approx(672)
    assert workload_bytes(cfg, ByteWidths.uniform(2), [3, 5], [2, 4], TOY_MOE_DECODE_WEIGHTS) == (800, 9936 + 1344)
    # FP8 linears (a mean width of 1.25 over the step's weights) with bf16 experts: 3 x 1656 x 1.25
    # = 6,210, the experts still 1,344; an FP8 KV cache halves the KV term.
    assert workload_bytes(cfg, ByteWidths(1, 1.25, 2), [3, 5], [2, 4], TOY_MOE_DECODE_WEIGHTS) == (400, 6210 + 1344)
    # A token goes through 2 x 192 attention + 384 dense MLP + 32 router + 2 x 96 experts = 992:
    # 12 tokens x 2 x 992 = 23,808; lm_head 9,600; attention pairs as for the dense toy, 2,944.
    assert token_linear_elements(cfg) == 992
    assert workload_flops(cfg, [3, 5], [2, 4]) == (23808 + 9600, 2944)
    # A dense model has no expert term.
    assert decode_expert_elements(toy_config(tied=False), [2, 4]) == 0
    assert expert_rows(toy_config(tied=False), [2, 4]) == []
    assert "E (1 - (1 - K/E)^B) of E = 4, K = 2" in expert_rows(cfg, [2, 4])[0][1]


def test_fp8_experts_count_at_their_stored_width():
    """bench's experts width: 4 experts, H = I = 256, FP8 per channel where the layer runs the
    MoE kernels (kernels=True: the CUDA layout): 786,432 one-byte weights (4 x 3 x 256 x 256) and
    3,072 float32 scales (4 x (512 + 256)) = 798,720 bytes / 786,432 = 1.015625; dequantized
    (kernels=False) or unquantized: the compute dtype's 4 bytes (float32 on CPU)."""
    from nanovllm.moe.layer import MoeExperts
    from nanovllm.quantization.checkpoint_config import resolve_quantization
    from nanovllm.quantization.config import quantization

    online = resolve_quantization("fp8", None, "test")
    with quantization(online):
        held = torch.nn.ModuleList([MoeExperts(4, 256, 256, "mlp.experts", kernels=True)])
        dequantized = torch.nn.ModuleList([MoeExperts(4, 256, 256, "mlp.experts", kernels=False)])
    assert bench.experts_width(held, 2) == 1.015625
    assert bench.experts_width(dequantized, 2) == 4
    assert bench.experts_width(torch.nn.Linear(2, 2), 2) == 2  # no experts: the compute width


def test_qwen3_30b_a3b_parameters_match_the_model_card():
    """Model card: 30.5B parameters, 29.9B non-embedding, 3.3B activated (each cut to 0.1B).
    By hand: attention 2048 x (4096 + 2 x 512) + 4096 x 2048 = 18,874,368; norms 2 x 2048 + 2 x 128;
    router 128 x 2048; experts 128 x 3 x 2048 x 768 = 603,979,776 -> 623,120,640 per layer; 48 layers,
    final norm 2048, embedding and lm_head 2 x 151,936 x 2048 = 622,329,856."""
    cfg = ModelConfig.from_pretrained(str(REPO / "benchmarks" / "configs" / "qwen3-30b-a3b"))
    embedding = 151_936 * 2048
    total = 48 * 623_120_640 + 2048 + 2 * embedding
    assert total == 30_532_122_624
    experts = 48 * 128 * expert_elements(cfg)
    assert decode_weight_elements(cfg) + experts + embedding == total
    active = decode_weight_elements(cfg) + embedding + 48 * 8 * expert_elements(cfg)
    assert int(total / 1e8) == 305 and int((total - 2 * embedding) / 1e8) == 299 and int(active / 1e8) == 33
    # per token through the layers: attention, router and 8 experts of each of the 48 layers
    assert token_linear_elements(cfg) == 48 * (18_874_368 + 128 * 2048 + 8 * 3 * 2048 * 768)


def test_small_moe_shape_is_what_bench_says():
    """benchmarks/roofline.py's docstring: 1.5B total, 0.46B active."""
    cfg = ModelConfig.from_pretrained(str(REPO / "benchmarks" / "configs" / "qwen3-moe-small"))
    moe = cfg.moe
    shape = (cfg.num_hidden_layers, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size)
    assert shape == (24, 64, 8, 256)
    total = decode_weight_elements(cfg) + 24 * 64 * expert_elements(cfg)  # tied: no extra embedding
    active = decode_weight_elements(cfg) + 24 * 8 * expert_elements(cfg)
    assert round(total / 1e9, 1) == 1.5 and round(active / 1e9, 2) == 0.46


def test_throughput_report_from_a_cpu_engine_and_injected_limits():
    """The throughput report from a run of the shipped default model on the CPU and device limits
    given as numbers (the probes need a GPU): every report row is built, the decode steps it sums
    by row count are the run's, and their memory floor sums to the memory term."""
    model = str(REPO / "nanovllm" / "default_model")
    args = bench.parse_args([f"--model={model}", "--num-seqs=6", "--min-input=5", "--max-input=20",
                             "--min-output=2", "--max-output=12", "--top-k=20", "--top-p=0.9", "--logprobs=2"])
    w = bench.workload_of(args)
    llm = cpu_llm(model, enforce_eager=True)
    try:
        cfg = llm.config.model_config
        prompts, max_tokens = make_workload(w, cfg.vocab_size)
        run = runs.run_engine(llm, prompts, max_tokens, args.sampling)
    finally:
        llm.exit()
    res = {}
    t = ThroughputRun(args.workload, w, args.sampling, cfg, ByteWidths.uniform(4), decode_weight_elements(cfg), [len(p) for p in prompts],
                      max_tokens, run, peak_mem_bytes=0)
    rows = dict(throughput_rows(t, DeviceLimits(bandwidth=1e12, gemm_peak=1e15), res))
    assert rows["workload"].endswith("T=0.6 top_k=20 top_p=0.9 logprobs=2") and res["sampling"] == {
        "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "logprobs": 2}
    assert rows["HBM copy bandwidth / GEMM peak (the weights' format)"] == "1.00 TB/s / 1000 TFLOP/s"
    assert "fraction of roofline reached" in rows and any(n.startswith("decode-only steps of") for n in rows)
    assert res["prefill_padding"] == 0 and rows["their graph padding"].startswith("0 tokens")  # eager: no buckets
    assert res["output_tokens"] == sum(max_tokens) and res["memory_s"] == pytest.approx(
        sum(workload_bytes(cfg, ByteWidths.uniform(4), t.prompt_lens, max_tokens, t.decode_weights)) / 1e12)
    buckets = res["decode_by_rows"]
    assert sum(b["steps"] for b in buckets) == res["decode_steps"]
    assert sum(b["floor_s"] for b in buckets) == pytest.approx(res["memory_s"])


def test_rollout_report_counts_every_sample_and_each_prompt_once():
    """A run of n = 2 samples a request on the CPU: every sample's tokens are made and counted, the
    memory term reads each prompt's KV once a step, the FLOPs prefill each prompt once."""
    model = str(REPO / "nanovllm" / "default_model")
    args = bench.parse_args([f"--model={model}", "--workload=rollout", "--num-seqs=3", "--n=2", "--min-input=5",
                             "--max-input=20", "--min-output=2", "--max-output=9"])
    w = bench.workload_of(args)
    llm = cpu_llm(model, enforce_eager=True)
    try:
        cfg = llm.config.model_config
        prompts, max_tokens = make_workload(w, cfg.vocab_size)
        run = runs.run_engine(llm, prompts, max_tokens, args.sampling, n=w.n)
    finally:
        llm.exit()
    assert run.decode_tokens + run.prefill_tokens >= sum(map(len, prompts)) + 2 * sum(m - 1 for m in max_tokens)
    res = {}
    lens = [len(p) for p in prompts]
    t = ThroughputRun(args.workload, w, args.sampling, cfg, ByteWidths.uniform(4), decode_weight_elements(cfg), lens,
                      max_tokens, run, peak_mem_bytes=0)
    rows = dict(throughput_rows(t, DeviceLimits(bandwidth=1e12, gemm_peak=1e15), res))
    assert rows["workload"].startswith("rollout: 3 requests x 2 samples") and res["output_tokens"] == 2 * sum(max_tokens)
    kv, weights = workload_bytes(cfg, ByteWidths.uniform(4), lens, max_tokens, t.decode_weights, n=2)
    assert res["memory_s"] == pytest.approx((kv + weights) / 1e12) and res["kv_bytes"] == kv
    assert (res["matmul_flops"], res["attention_flops"]) == workload_flops(cfg, lens, max_tokens, n=2)
    assert sum(b["floor_s"] for b in res["decode_by_rows"]) == pytest.approx(res["memory_s"])


def test_fewshot_report_counts_the_shared_prefix_once():
    """A fewshot run on the CPU: the engine's prefix cache serves the shared prefix (hits), the report's
    memory term and FLOPs count it once, and its workload row names it."""
    model = str(REPO / "nanovllm" / "default_model")
    args = bench.parse_args([f"--model={model}", "--workload=fewshot", "--num-seqs=3", "--shared-prefix=40",
                             "--min-input=5", "--max-input=20", "--min-output=2", "--max-output=9"])
    w = bench.workload_of(args)
    llm = cpu_llm(model, enforce_eager=True, kvcache_block_size=16)  # the prefix's first 32 tokens: 2 full blocks
    try:
        cfg = llm.config.model_config
        prompts, max_tokens = make_workload(w, cfg.vocab_size)
        run = runs.run_engine(llm, prompts, max_tokens, args.sampling)
        hits = llm.block_manager.num_prefix_hit_blocks
    finally:
        llm.exit()
    assert hits > 0
    res = {}
    lens = [len(p) for p in prompts]
    t = ThroughputRun(args.workload, w, args.sampling, cfg, ByteWidths.uniform(4), decode_weight_elements(cfg), lens,
                      max_tokens, run, peak_mem_bytes=0)
    rows = dict(throughput_rows(t, DeviceLimits(bandwidth=1e12, gemm_peak=1e15), res))
    assert rows["workload"].startswith("fewshot: 3 requests, prompts 40 shared tokens + 5-20")
    kv, _ = workload_bytes(cfg, ByteWidths.uniform(4), lens, max_tokens, t.decode_weights, shared=40)
    assert res["kv_bytes"] == kv < workload_bytes(cfg, ByteWidths.uniform(4), lens, max_tokens, t.decode_weights)[0]
    assert (res["matmul_flops"], res["attention_flops"]) == workload_flops(cfg, lens, max_tokens, shared=40)
    assert sum(b["floor_s"] for b in res["decode_by_rows"]) == pytest.approx(res["memory_s"])


def test_kernel_routes_flag_builds_the_engines_routes(capsys):
    """--kernel-routes: KernelRoutes' fields by name, the rest at their defaults, passed to LLM;
    an unknown field, a non-integer or a value KernelRoutes refuses stops the parse with its reason."""
    args = bench.parse_args(["--kernel-routes", "gemv_max_rows=1, skinny_max_rows=0"])
    assert args.routes == KernelRoutes(gemv_max_rows=1, skinny_max_rows=0)
    assert bench.engine_kwargs(args, "dummy")["kernel_routes"] == args.routes
    assert bench.parse_args([]).routes == KernelRoutes() == parse_kernel_routes("")
    # the A/B of the Triton logprobs pass against torch's (an on / off route), and of the radix select
    # (a row count above any batch turns it off)
    assert bench.parse_args(["--kernel-routes", "logprobs_kernel=off"]).routes == KernelRoutes(logprobs_kernel=False)
    assert parse_kernel_routes("logprobs_kernel=True, radix_min_rows=1000000") == KernelRoutes(radix_min_rows=10**6)
    assert parse_kernel_routes("moe_fp8_mma_min_tokens=None") == KernelRoutes(moe_fp8_mma_min_tokens=None)
    for bad, reason in (("gemv_rows=1", "radix_min_rows"), ("gemv_max_rows=two", "integer"),
                        ("logprobs_kernel=2", "takes one of true"), ("logprobs_kernel=", "takes one of true"),
                        ("skinny_max_rows", "field=value"), ("gemv_max_rows=1,gemv_max_rows=2", "twice"),
                        ("gemv_max_rows=0,norm_in_gemv_max_rows=1", "must not exceed")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--kernel-routes", bad])
        assert reason in capsys.readouterr().err


def test_compare_table_orders_and_figures():
    """compare.py: each bench's two runs alternate which tree goes first; a run's JSON becomes its
    rows (latency keys are strings in JSON); the table gives after / before, '-' where a run is missing."""
    assert [compare.run_order(i)[0] for i in range(4)] == ["before", "after", "before", "after"]
    latency, default = compare.SETS["1"][2], compare.SETS["1"][0]
    assert compare.figures(latency, {"decode_ms_per_token": {"1": 0.94, "8": 1.5, "32": 2.3}}) == {
        "qwen3-0.6b decode ms/token, batch 1": 0.94, "qwen3-0.6b decode ms/token, batch 8": 1.5,
        "qwen3-0.6b decode ms/token, batch 32": 2.3}
    assert compare.figures(default, None) == {"qwen3-0.6b default tok/s": None}
    score = compare.SETS["score"][0]
    assert compare.figures(score, {"throughput": 360000.0, "roofline_fraction": 0.583}) == {
        "qwen3-0.6b score, pair 1 tok/s": 360000.0, "qwen3-0.6b score, pair 1 % of roofline": pytest.approx(58.3)}
    assert compare.figures(score, None) == {"qwen3-0.6b score, pair 1 tok/s": None,
                                            "qwen3-0.6b score, pair 1 % of roofline": None}
    before = {"qwen3-0.6b default tok/s": 26000.0, "qwen3-0.6b decode ms/token, batch 1": 0.94, "x": 1.0}
    after = {"qwen3-0.6b default tok/s": 26520.0, "qwen3-0.6b decode ms/token, batch 1": 0.893}
    lines = compare.table(before, after).splitlines()
    assert lines[1].split() == ["qwen3-0.6b", "default", "tok/s", "26,000", "26,520", "1.020"]
    assert lines[2].split()[-3:] == ["0.940", "0.893", "0.950"] and lines[3].split() == ["x", "1.000", "-", "-"]
    every = compare.SETS["all"] + compare.SETS["score"]
    assert set(compare.SETS["all"]) == set(compare.SETS["1"]) | set(compare.SETS["2"])
    assert all((REPO / "benchmarks" / "configs" / b.model / "config.json").is_file() for b in every)
    assert len({b.label for b in every}) == len(every)


# ----- benchmarks/ as a whole -----
BENCHMARK_MODULES = sorted(p for p in (REPO / "benchmarks").rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import statement in the file ('import a.b' gives ('a.b', []))."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append(("." * node.level + (node.module or ""), [alias.name for alias in node.names]))
    return out


def test_benchmarks_hold_together():
    """Every module under benchmarks/ has a docstring; none imports bench.py; each imports its
    neighbours one way (absolute, benchmarks.<part>.<module>: no relative or bare sibling imports)
    and no private name of nanovllm; and the imports between them have no cycle."""
    names = {module_name(p): p for p in BENCHMARK_MODULES}
    siblings = {p.stem for p in BENCHMARK_MODULES} | {"bench"}
    graph = {}
    for name, path in names.items():
        assert ast.get_docstring(ast.parse(path.read_text())), f"{name} has no docstring"
        imports = imported_modules(path)
        for module, imported in imports:
            assert module.split(".")[0] not in siblings and not module.startswith("."), f"{name} imports {module}"
            if module.startswith("nanovllm"):
                assert not any(part.startswith("_") for part in module.split(".") + imported), f"{name}: {module}"
        graph[name] = {m for m, imported in imports for m in [m, *(f"{m}.{i}" for i in imported)] if m in names}
    for module, imported in imported_modules(REPO / "bench.py"):
        assert not module.startswith("nanovllm") or not any(i.startswith("_") for i in imported), module
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join(path + (name,))}"
        if name not in done:
            for dep in graph[name] - {name}:
                visit(dep, path + (name,))
            done.add(name)

    for name in graph:
        visit(name, ())


def test_every_benchmark_module_imports_from_the_repository_root():
    """`python -m benchmarks.<part>.<module>` finds what it imports: each module imports (on CPU,
    without running main) in one fresh interpreter started at the repository root."""
    names = [module_name(p) for p in BENCHMARK_MODULES]
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_no_benchmark_or_its_tests_rebind_what_they_measure():
    """No setattr, monkeypatch or module-constant assignment (`module.NAME = ...`) under
    benchmarks/, in bench.py or in these tests: A/B runs go through KernelRoutes."""
    for path in [*BENCHMARK_MODULES, REPO / "bench.py", REPO / "tests" / "test_bench.py",
                 REPO / "tests" / "test_variants.py"]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            assert not (isinstance(node, ast.Name) and node.id in ("setattr", "monkeypatch")), f"{path}: {node.id}"
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    assert not (isinstance(target, ast.Attribute) and target.attr.isupper()), (
                        f"{path}:{node.lineno} assigns {target.attr}")


def test_sampling_flags_are_checked_when_parsed(capsys):
    """--top-k / --top-p / the penalties go through SamplingParams' checks before any engine starts."""
    assert bench.parse_args([]).sampling == WorkloadSampling(0, 1.0)
    penalized = bench.parse_args(["--repetition-penalty", "1.1", "--presence-penalty", "0.5"]).sampling
    assert penalized == WorkloadSampling(0, 1.0, 1.1, 0.0, 0.5)
    assert penalized.params(7).repetition_penalty == 1.1 and "presence_penalty=0.5" in penalized.describe()
    assert penalized.params(7).logprobs is None and "logprobs" not in penalized.describe()
    scored = bench.parse_args(["--logprobs", "5"]).sampling
    assert scored == WorkloadSampling(logprobs=5) and scored.params(7).logprobs == 5
    assert scored.describe().endswith(" logprobs=5")
    for bad, words in ((["--top-p=1.5"], "top_p"), (["--top-p=0"], "top_p"), (["--top-k=-2"], "top_k"),
                       (["--presence-penalty=3"], "presence_penalty"),
                       (["--compare-hf", "--frequency-penalty=0.5"], "transformers' generate has"),
                       (["--compare-hf", "--logprobs=1"], "--logprobs (its run asks none)"),
                       (["--logprobs=-1"], "logprobs"),
                       (["--quantization", "fp8", "--tp", "2"], "rank 0's shard")):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert words in capsys.readouterr().err


@pytest.mark.parametrize("bad, words", [
    # counts below 1: an empty workload, empty prompts, no output token, no step to time
    ("--num-seqs 0", "argument --num-seqs: '0' is not a positive integer"),
    ("--min-input 0 --max-input 0", "argument --min-input: '0' is not a positive integer"),
    ("--min-output -3", "argument --min-output: '-3' is not a positive integer"),
    ("--max-output 0", "argument --max-output: '0' is not a positive integer"),
    ("--compare-hf --hf-num-seqs 0", "argument --hf-num-seqs: '0' is not a positive integer"),
    ("--compare-hf --hf-batch-size 0", "argument --hf-batch-size: '0' is not a positive integer"),
    ("--latency --latency-steps 0", "argument --latency-steps: '0' is not a positive integer"),
    ("--latency --latency-context 0", "argument --latency-context: '0' is not a positive integer"),
    ("--tp 0", "argument --tp: '0' is not a positive integer"),
    ("--max-num-seqs 0", "argument --max-num-seqs: '0' is not a positive integer"),
    ("--max-num-batched-tokens x", "argument --max-num-batched-tokens: 'x' is not a positive integer"),
    ("--max-model-len -1", "argument --max-model-len: '-1' is not a positive integer"),
    # lists of sizes
    ("--latency --latency-batch-sizes 1,x", "argument --latency-batch-sizes: '1,x' is not positive integers"),
    ("--latency --latency-batch-sizes 1,0", "argument --latency-batch-sizes: '1,0' is not positive integers"),
    ("--ttft --ttft-sizes ''", "argument --ttft-sizes: '' is not positive integers"),
    ("--ttft --ttft-sizes 128,,1000", "argument --ttft-sizes: '128,,1000' is not positive integers"),
    # empty ranges, the preset's bound included
    ("--min-input 500 --max-input 100", "--min-input 500 is above --max-input 100"),
    ("--min-output 9 --max-output 8", "--min-output 9 is above --max-output 8"),
    ("--workload score --min-output 2", "--min-output 2 is above --max-output 1"),
    ("--n 0", "argument --n: '0' is not a positive integer"),
    ("--workload score --n 2", "--prompt-logprobs scores greedily: no --top-k / --top-p / penalties, no --n"),
    ("--latency --n 2", "--latency ignores --n"),
    # flags the chosen run would ignore
    ("--latency --compare-hf", "--latency ignores --compare-hf"),
    ("--latency --top-k 5 --logprobs 3", "--latency ignores --logprobs, --top-k"),
    ("--latency --repetition-penalty 1.1 --frequency-penalty 0.5 --presence-penalty 0.5 --top-p 0.9",
     "--latency ignores --frequency-penalty, --presence-penalty, --repetition-penalty, --top-p"),
    ("--latency --workload long", "--latency ignores --workload"),
    ("--latency --prompt-logprobs 0", "--latency ignores --prompt-logprobs"),
    ("--latency --seed 3 --num-seqs 4", "--latency ignores --num-seqs, --seed"),
    ("--latency --ttft-sizes 5", "--latency ignores --ttft-sizes"),
    ("--ttft --workload score", "--ttft ignores --workload"),
    ("--ttft --compare-hf --hf-num-seqs 8", "--ttft ignores --compare-hf, --hf-num-seqs"),
    ("--ttft --max-input 200 --top-k 5", "--ttft ignores --max-input, --top-k"),
    ("--ttft --latency-steps 3", "--ttft ignores --latency-steps"),
    ("--hf-num-seqs 8", "the throughput run (no --latency, --ttft or --compare-hf) ignores --hf-num-seqs"),
    ("--hf-batch-size 8 --latency-batch-sizes 1", "ignores --hf-batch-size, --latency-batch-sizes"),
    ("--compare-hf --latency-context 64 --ttft-sizes 5", "--compare-hf ignores --latency-context, --ttft-sizes"),
])
def test_impossible_or_ignored_flags_stop_the_parse(bad, words, capsys):
    """Values no run can take, and flags the chosen run would not read, end the parse (argparse's
    usage line and a message naming the flag), before any engine starts."""
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(shlex.split(bad))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("usage: ") and words in err, err


def test_each_run_takes_its_own_flags():
    """What each run reads is accepted with it; a flag at its default value changes nothing, so any run
    takes it."""
    args = bench.parse_args([])
    assert (args.latency_batch_sizes, args.latency_context, args.latency_steps, args.ttft_sizes) == (
        (1, 8, 32), 1024, 128, (128, 1000))
    latency = bench.parse_args(["--latency", "--latency-batch-sizes", "1,2", "--latency-context=64",
                                "--latency-steps=1", "--max-num-seqs=8", "--tp=2", "--max-model-len=256",
                                "--kernel-routes=gemv_max_rows=1", "--json=x.json"])
    assert (latency.latency_batch_sizes, latency.latency_context, latency.latency_steps) == ((1, 2), 64, 1)
    ttft = bench.parse_args(["--ttft", "--ttft-sizes", "5, 6", "--seed", "-3", "--enforce-eager"])
    assert (ttft.ttft_sizes, ttft.seed) == ((5, 6), -3)
    hf = bench.parse_args(["--compare-hf", "--hf-num-seqs=8", "--hf-batch-size=4", "--workload=long", "--top-k=3",
                           "--top-p=0.9", "--repetition-penalty=1.1", "--num-seqs=1", "--min-input=1",
                           "--max-input=1", "--min-output=1", "--max-output=1"])
    assert (hf.hf_num_seqs, hf.hf_batch_size, hf.num_seqs, hf.min_input, hf.max_output) == (8, 4, 1, 1, 1)
    scored = bench.parse_args(["--workload=score", "--num-seqs=5", "--prompt-logprobs=2", "--min-input=1024"])
    assert (scored.num_seqs, scored.min_input, scored.max_input, scored.prompt_logprobs) == (5, 1024, 1024, 2)
    plain = bench.parse_args(["--logprobs=2", "--frequency-penalty=0.5", "--presence-penalty=0.5"])
    assert plain.sampling == WorkloadSampling(0, 1.0, 1.0, 0.5, 0.5, 2)
    for same in (["--latency", "--workload=default", "--top-k=0", "--seed=0", "--latency-batch-sizes=1,8,32"],
                 ["--ttft", "--hf-num-seqs=64", "--num-seqs=256"],
                 ["--latency-steps=128", "--ttft-sizes=128,1000", "--hf-batch-size=64"]):
        bench.parse_args(same)
