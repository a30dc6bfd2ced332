"""bench.py on CPU: it refuses to run without CUDA, and its roofline counting (benchmarks/roofline.py) is right.

Expected values are worked out by hand below for a 2-layer toy shape, not by calling the
functions under test a second way; the parameter count is also checked against the real
model module built on the meta device.
"""

import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import bench  # noqa: E402
from checkpoints import cpu_llm  # noqa: E402
from benchmarks import runs  # noqa: E402
from benchmarks.roofline import (  # noqa: E402
    DecodeStep, decode_expert_elements, decode_rows, decode_steps, decode_weight_elements, expected_experts_hit,
    expert_elements, layer_linear_elements, phase_bound_s, prefill_flops, roofline, token_linear_elements, workload_bytes,
    workload_flops,
)
from benchmarks.stats import bucket_edges, percentile, sum_by_rows  # noqa: E402
from benchmarks.workloads import WORKLOADS, WorkloadSampling, make_workload  # noqa: E402
from nanovllm.engine.sequence import Completion, FinishReason, RequestOutput  # noqa: E402
from nanovllm.models.model_config import ModelConfig  # noqa: E402
from nanovllm.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from nanovllm.models.registry import build_model  # noqa: E402

# Toy shape: vocab 100, hidden 8, intermediate 16, 2 layers, 2 query heads, 1 kv head, head_dim 4.
#   per layer: q 8x8=64, k 8x4=32, v 32, o 8x8=64, gate 8x16=128, up 128, down 128  -> 576
#   norms per layer: 8 + 8 (input/post) + 4 + 4 (q/k)                                -> 24
#   lm_head 100x8 = 800; final norm 8; embedding 100x8 = 800
TOY_LAYER_LINEAR = 576
TOY_LM_HEAD = 800
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


def test_decode_weights_hand_count_and_model():
    untied, tied = toy_config(tied=False), toy_config(tied=True)
    assert layer_linear_elements(untied) == TOY_LAYER_LINEAR
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


def test_workload_bytes_by_hand():
    cfg = toy_config(tied=False)
    # Requests (prompt 3, 2 outputs) and (prompt 5, 4 outputs).
    # Decode reads: request 1 one step at context 4; request 2 steps at 6, 7, 8 -> 4 + 21 = 25 tokens.
    # KV per token: 2 (K, V) x 2 layers x 1 kv head x 4 dims x 2 bytes = 32 bytes -> 800 bytes.
    # Weights: at least 4 - 1 = 3 decode steps x 2008 elements x 2 bytes = 12,048 bytes.
    assert workload_bytes(cfg, 2, [3, 5], [2, 4], decode_weight_elements(cfg)) == (800, 12048)


def test_workload_flops_by_hand():
    cfg = toy_config(tied=False)
    # Through the layers: (3 + 2 - 1) + (5 + 4 - 1) = 12 tokens x 2 x 1152 = 27,648;
    # lm_head: one row per output token, 6 x 2 x 800 = 9,600.
    # Pairs: request 1 prefill 1+2+3 = 6, decode 4 -> 10; request 2 prefill 1+..+5 = 15,
    # decode 6+7+8 = 21 -> 36; 46 pairs x 4 x 2 heads x 4 dims x 2 layers = 2,944.
    assert workload_flops(cfg, [3, 5], [2, 4]) == (27648 + 9600, 2944)
    # Prefill of 3 tokens sampling one: 2 x 1152 x 3 + 2 x 800 + 6 pairs x 64 = 6912 + 1600 + 384.
    assert prefill_flops(cfg, 3) == 8896


def test_roofline_picks_the_larger_term():
    mem = roofline(num_bytes=8e12, flops=1e15, bandwidth=4e12, peak_flops=1e15)
    assert (mem.memory_s, mem.compute_s, mem.seconds, mem.binding) == (2.0, 1.0, 2.0, "memory")
    comp = roofline(num_bytes=1e12, flops=3e15, bandwidth=4e12, peak_flops=1e15)
    assert (comp.seconds, comp.binding) == (3.0, "compute")


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
    args = bench.parse_args(["--max-num-seqs", "64", "--max-num-batched-tokens", "8192"])
    assert (args.num_seqs, args.max_input, args.seed) == (256, 1024, 0)
    kwargs = bench.engine_kwargs(args, "dummy")
    assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]) == (64, 8192)


def test_default_workload_is_nano_vllms():
    # nano-vllm's bench.py, as written there: global random, prompts first, then max_tokens.
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    assert make_workload(WORKLOADS["default"], vocab_size=151936) == (prompts, max_tokens)


def test_load_format_follows_safetensors(tmp_path):
    assert bench.resolve_load_format("auto", str(tmp_path))[0] == "dummy"
    assert bench.resolve_load_format("dummy", str(tmp_path))[0] == "dummy"
    (tmp_path / "model.safetensors").write_bytes(b"")
    fmt, line = bench.resolve_load_format("auto", str(tmp_path))
    assert fmt == "auto" and "checkpoint" in line


def test_check_outputs_rejects_uncounted_tokens():
    def out(rid: int, n: int) -> RequestOutput:
        return RequestOutput(rid, [1], [Completion([5] * n, "", FinishReason.LENGTH)])

    runs.check_outputs({0: 3, 1: 2}, {0: out(0, 3), 1: out(1, 2)}, Counter({0: 3, 1: 2}))
    with pytest.raises(RuntimeError, match="returned 1 tokens, 2 counted"):
        runs.check_outputs({0: 3, 1: 2}, {0: out(0, 3), 1: out(1, 1)}, Counter({0: 3, 1: 2}))
    with pytest.raises(RuntimeError, match="never finished"):
        runs.check_outputs({0: 3, 1: 2}, {0: out(0, 3)}, Counter({0: 3}))
    with pytest.raises(RuntimeError, match="sampled"):
        runs.check_outputs({0: 3}, {0: out(0, 3)}, Counter({0: 2}))


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
    steps = decode_steps(cfg, 2, [3, 5], [2, 4], weights)
    assert steps == [DecodeStep(2, 4016, 32 * 10), DecodeStep(1, 4016, 32 * 7), DecodeStep(1, 4016, 32 * 8)]
    rng = random.Random(3)
    prompts, outputs = [rng.randint(1, 50) for _ in range(40)], [rng.randint(1, 30) for _ in range(40)]
    for c, w in ((cfg, weights), (toy_moe_config(), TOY_MOE_DECODE_WEIGHTS)):
        kv, wb = workload_bytes(c, 2, prompts, outputs, w)
        per_step = decode_steps(c, 2, prompts, outputs, w)
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
    args = (cfg, 2, [3, 5], decode_steps(cfg, 2, [3, 5], [2, 4], weights), weights)
    # FLOPs free: the prefill's weight read, then every step's bytes (the memory term + 4,016)
    assert phase_bound_s(*args, bandwidth=1.0, peak_flops=1e30) == pytest.approx(4016 + 3 * 4016 + 800)
    # bytes free: all FLOPs, the compute term (27,648 + 9,600 + 2,944)
    assert phase_bound_s(*args, bandwidth=1e30, peak_flops=1.0) == pytest.approx(40192)
    # both at 1 / s: each phase takes its larger side
    by_phase = 22976 + (7808 + 640) + (4016 + 448) + (4016 + 512)
    assert phase_bound_s(*args, bandwidth=1.0, peak_flops=1.0) == pytest.approx(by_phase)
    assert by_phase > roofline(800 + 3 * 4016, 40192, 1.0, 1.0).seconds
    rng = random.Random(5)
    for c, w in ((cfg, weights), (toy_moe_config(), TOY_MOE_DECODE_WEIGHTS)):
        prompts, outputs = [rng.randint(1, 50) for _ in range(30)], [rng.randint(1, 30) for _ in range(30)]
        kv, wb = workload_bytes(c, 2, prompts, outputs, w)
        flops = sum(workload_flops(c, prompts, outputs))
        for bw, peak in ((1.0, 1.0), (1.0, 50.0), (20.0, 1.0)):
            steps = decode_steps(c, 2, prompts, outputs, w)
            assert phase_bound_s(c, 2, prompts, steps, w, bw, peak) >= roofline(kv + wb, flops, bw, peak).seconds


def test_decode_buckets_sum_steps_by_rows():
    assert bucket_edges(256) == [8, 32, 128, 512] and bucket_edges(1) == [8] and bucket_edges(9) == [8, 32]
    assert sum_by_rows([1, 8, 9, 300, 40], [1.0, 2.0, 4.0, 8.0, 16.0], [8, 32, 128, 512]) == [
        (2, 3.0), (1, 4.0), (1, 16.0), (1, 8.0)]
    run = runs.EngineRun(decode_step_rows=[3, 3, 100], decode_step_s=[0.5, 0.5, 2.0])
    res = {}
    rows = bench.decode_bucket_rows(run, [DecodeStep(3, 1.0, 0), DecodeStep(100, 1.0, 2), DecodeStep(100, 3.0, 0)], 2.0, res)
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
    assert workload_bytes(cfg, 2, [3, 5], [2, 4], TOY_MOE_DECODE_WEIGHTS) == (800, 9936 + 1344)
    # A token goes through 2 x 192 attention + 384 dense MLP + 32 router + 2 x 96 experts = 992:
    # 12 tokens x 2 x 992 = 23,808; lm_head 9,600; attention pairs as for the dense toy, 2,944.
    assert token_linear_elements(cfg) == 992
    assert workload_flops(cfg, [3, 5], [2, 4]) == (23808 + 9600, 2944)
    # A dense model has no expert term.
    assert decode_expert_elements(toy_config(tied=False), [2, 4]) == 0
    assert bench.expert_rows(toy_config(tied=False), [2, 4]) == []
    assert "E (1 - (1 - K/E)^B) of E = 4, K = 2" in bench.expert_rows(cfg, [2, 4])[0][1]


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


def test_throughput_report_runs_end_to_end_on_a_cpu_engine(monkeypatch):
    """bench.throughput_rows on the shipped default model on the CPU (the probes and torch's CUDA
    memory counter stubbed: they need a GPU): every report row is built, the decode steps it
    sums by row count are the run's, and their memory floor sums to the memory term."""
    model = str(REPO / "nanovllm" / "default_model")
    args = bench.parse_args([f"--model={model}", "--num-seqs=6", "--min-input=5", "--max-input=20",
                             "--min-output=2", "--max-output=12", "--top-k=20", "--top-p=0.9"])
    monkeypatch.setattr(bench, "measure_bandwidth", lambda: 1e12)
    monkeypatch.setattr(bench, "measure_gemm_peak", lambda: 1e15)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
    llm = cpu_llm(model, enforce_eager=True)
    res = {}
    try:
        rows, llm = bench.throughput_rows(args, llm, {}, res, decode_weight_elements(llm.config.model_config))
    finally:
        llm.exit()
    assert dict(rows)["workload"].endswith("T=0.6 top_k=20 top_p=0.9") and res["sampling"] == {"top_k": 20, "top_p": 0.9}
    names = [name for name, _ in rows]
    assert "fraction of roofline reached" in names and any(n.startswith("decode-only steps of") for n in names)
    assert res["prefill_padding"] == 0 and dict(rows)["their graph padding"].startswith("0 tokens")  # eager: no buckets
    buckets = res["decode_by_rows"]
    assert sum(b["steps"] for b in buckets) == res["decode_steps"]
    assert sum(b["floor_s"] for b in buckets) == pytest.approx(res["memory_s"])


def test_sampling_flags_are_checked_when_parsed(capsys):
    """--top-k / --top-p go through SamplingParams' checks before any engine starts."""
    assert bench.parse_args([]).sampling == WorkloadSampling(0, 1.0)
    for bad in (["--top-p=1.5"], ["--top-p=0"], ["--top-k=-2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert "top_" in capsys.readouterr().err
