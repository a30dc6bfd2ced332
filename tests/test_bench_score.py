"""bench.py --workload score on CPU: the preset and its flags, the FLOPs its roofline counts (worked
out by hand for test_bench.py's 2-layer toy shape: the lm_head at every prompt position), the check
that every prompt got its logprobs, and the whole scoring report from a CPU engine's run with
injected device limits."""

from pathlib import Path

import pytest

import bench
from benchmarks.harness import runs
from benchmarks.harness.report import DeviceLimits, ThroughputRun, score_rows
from benchmarks.harness.roofline import ByteWidths, decode_weight_elements, score_flops, workload_flops
from benchmarks.harness.workloads import WORKLOADS, WorkloadSampling, make_workload
from nanovllm.models.model_config import ModelConfig
from nanovllm.outputs import CompletionOutput, RequestOutput
from checkpoints import cpu_llm

REPO = Path(__file__).resolve().parent.parent


def toy_config() -> ModelConfig:
    """test_bench.py's toy shape: vocab 100, hidden 8, intermediate 16, 2 layers, 2 query heads,
    1 kv head, head_dim 4; untied."""
    return ModelConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "tie_word_embeddings": False,
    })


def test_score_flops_by_hand():
    cfg = toy_config()
    # Linears a token goes through: per layer q 8x8 = 64, k 8x4 = 32, v 32, o 64, gate 8x16 = 128,
    # up 128, down 128 -> 576; two layers 1152. lm_head 100 x 8 = 800.
    # Prompts of 3 and 5 tokens scored: 8 tokens through the layers, 8 x 2 x 1152 = 18,432, and
    # through the lm_head at every position, 8 x 2 x 800 = 12,800.
    # Pairs: 1+2+3 = 6 and 1+..+5 = 15 -> 21 x 4 x 2 heads x 4 dims x 2 layers = 1,344.
    assert score_flops(cfg, [3, 5]) == (18432 + 12800, 1344)
    # the throughput count of the same requests has one lm_head row per output token: 2 x 2 x 800
    assert workload_flops(cfg, [3, 5], [1, 1]) == (18432 + 3200, 1344)


def test_score_preset_and_its_flags(capsys):
    args = bench.parse_args(["--workload", "score"])
    assert (args.num_seqs, args.min_input, args.max_input, args.min_output, args.max_output, args.prompt_logprobs) == (
        1024, 256, 1024, 1, 1, 0)
    params = args.sampling.params(1, args.prompt_logprobs)
    assert (params.temperature, params.max_tokens, params.prompt_logprobs) == (0.0, 1, 0)
    assert bench.workload_of(args).prompt_logprobs == 0
    assert bench.parse_args(["--workload", "score", "--prompt-logprobs", "5"]).prompt_logprobs == 5
    assert bench.parse_args([]).prompt_logprobs is None  # throughput presets do not score
    prompts, max_tokens = make_workload(WORKLOADS["score"], vocab_size=151936)
    assert len(prompts) == 1024 and all(256 <= len(p) <= 1024 for p in prompts) and set(max_tokens) == {1}
    for bad, words in ((["--workload", "score", "--top-k", "20"], "scores greedily"),
                       (["--prompt-logprobs", "0", "--compare-hf"], "scores greedily"),
                       (["--prompt-logprobs", "21"], "prompt_logprobs"),
                       (["--prompt-logprobs", "-1"], "prompt_logprobs")):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert words in capsys.readouterr().err


def test_scoring_with_more_than_one_output_token_is_refused(capsys):
    """The scoring report counts prompt tokens and the FLOPs of prefill only (score_flops: no decode
    step), so a scoring run whose requests decode (--prompt-logprobs on the default workload, outputs of
    100-1,024 tokens) would time ~144k output tokens of decode against a roofline without them. It is
    refused; with one output token a request it runs."""
    for bad in (["--prompt-logprobs", "0"], ["--workload", "score", "--max-output", "2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert "one output token" in capsys.readouterr().err
    ok = bench.parse_args(["--prompt-logprobs", "0", "--min-output", "1", "--max-output", "1"])
    assert (ok.prompt_logprobs, ok.max_output) == (0, 1)


def test_score_memory_term_reads_the_experts_the_prompts_pick():
    """An MoE model's scoring reads, besides the weights every token goes through, each expert some
    prompt token picked (at least once). test_bench.py's toy MoE: 4 experts of 3 x 8 x 4 = 96 elements,
    2 a token, one sparse layer; 1,656 other elements. Prompts of 3 and 5 tokens: 8 tokens, each missing
    a given expert with probability 1 - 2/4, so 4 (1 - 1/2^8) = 3.984375 experts expected = 382.5 elements.
    At 2 bytes: 1,656 x 2 + 382.5 x 2 = 4,077 bytes."""
    cfg = ModelConfig.from_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
        "norm_topk_prob": True, "mlp_only_layers": [1],
    })
    assert decode_weight_elements(cfg) == 1656
    w = WORKLOADS["score"]
    t = ThroughputRun("score", w, WorkloadSampling(), cfg, ByteWidths.uniform(2), 1656, [3, 5], [1, 1],
                      runs.EngineRun(wall_s=1.0, prefill_steps=1), peak_mem_bytes=0)
    res = {}
    score_rows(t, DeviceLimits(bandwidth=1.0, gemm_peak=1e30), res)
    assert res["weight_bytes"] == pytest.approx(4077)
    assert res["memory_s"] == pytest.approx(4077)


def test_check_prompt_logprobs_rejects_missing_entries():
    def out(rid: int, entries: list | None) -> RequestOutput:
        return RequestOutput(rid, None, [1, 2, 3], entries, [CompletionOutput(0, "", [5], None, None, "length")])

    runs.check_prompt_logprobs({0: 3}, {0: out(0, [None, {2: -1.0}, {3: -2.0}])})
    with pytest.raises(RuntimeError, match="2 entries for 3 prompt tokens"):
        runs.check_prompt_logprobs({0: 3}, {0: out(0, [None, {2: -1.0}])})
    with pytest.raises(RuntimeError, match="None entries"):
        runs.check_prompt_logprobs({0: 3}, {0: out(0, None)})


def test_score_report_from_a_cpu_engine_and_injected_limits():
    """The scoring report of a run of the shipped model on the CPU: every prompt's logprobs came
    back (run_engine checks), its tokens are the rate's, and the compute term is score_flops at
    the injected peak."""
    model = str(REPO / "nanovllm" / "default_model")
    args = bench.parse_args([f"--model={model}", "--workload=score", "--num-seqs=5", "--min-input=5",
                             "--max-input=40", "--prompt-logprobs=2"])
    w = bench.workload_of(args)
    llm = cpu_llm(model, enforce_eager=True, max_num_batched_tokens=64)  # chunks: prompts span steps
    try:
        cfg = llm.config.model_config
        prompts, max_tokens = make_workload(w, cfg.vocab_size)
        run = runs.run_engine(llm, prompts, max_tokens, args.sampling, w.prompt_logprobs)
    finally:
        llm.exit()
    lens = [len(p) for p in prompts]
    t = ThroughputRun(args.workload, w, args.sampling, cfg, ByteWidths.uniform(4), decode_weight_elements(cfg), lens,
                      max_tokens, run, peak_mem_bytes=0)
    res = {}
    rows = dict(score_rows(t, DeviceLimits(bandwidth=1e12, gemm_peak=1e15), res))
    assert rows["prompt tokens / wall"].startswith(f"{sum(lens)} / ") and res["input_tokens"] == sum(lens)
    assert res["compute_s"] == pytest.approx(sum(score_flops(cfg, lens)) / 1e15)
    assert res["lm_head_flops"] == 2 * cfg.vocab_size * cfg.hidden_size * sum(lens)
    assert run.prefill_steps > 1 and res["roofline_fraction"] == pytest.approx(res["roofline_s"] / run.wall_s)
    assert "prompt_logprobs=2" in rows["workload"] and "fraction of roofline reached" in rows
