"""bench_structured.py's workload on CPU: its schema must close within MAX_TOKENS even under random
weights (an unbounded "number" once let them write digits until max_tokens, so the H200 run measured
no closed JSON), the closed count it reports must count EOS endings, and a side's warm-up must leave
no timed prompt in the prefix cache."""

import json
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")

from benchmarks.engine.bench_structured import MAX_TOKENS, SCHEMA, closed_count, run_side
from benchmarks.harness.workloads import WORKLOADS, make_workload
from nanovllm import LLM, SamplingParams
from nanovllm.sampling_params import StructuredOutputsParams

MODEL_DIR = str(Path(__file__).resolve().parent.parent / "nanovllm" / "default_model")


@pytest.fixture(scope="module")
def outputs():
    llm = LLM(MODEL_DIR, load_format="dummy", max_num_seqs=8)
    try:
        spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        prompts = [[1, 2, 3, 4], [5, 6, 7], [9, 10, 11, 12, 13], [100, 200], [42] * 9, [7, 300, 7]]
        return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec),
                            use_tqdm=False)
    finally:
        llm.exit()


def test_random_weights_close_the_schema_within_max_tokens(outputs):
    assert closed_count(outputs) == len(outputs)
    for out in outputs:
        assert len(out.token_ids) < MAX_TOKENS
        value = json.loads(out.text)
        assert set(value) == set(SCHEMA["required"])
        for key, rule in SCHEMA["properties"].items():
            if rule.get("type") == "integer":
                assert isinstance(value[key], int) and rule["minimum"] <= value[key] <= rule["maximum"]
        assert len(value["name"]) <= SCHEMA["properties"]["name"]["maxLength"]
        assert value["kind"] in SCHEMA["properties"]["kind"]["enum"]


def test_closed_count_counts_eos_endings_only(outputs):
    assert closed_count(outputs[:2]) == 2
    truncated = type("Truncated", (), {"finish_reason": "length"})()
    assert closed_count([truncated, outputs[0]]) == 1


def test_a_sides_warm_up_leaves_its_timed_prompts_uncached():
    """run_side's warm-up compiles kernels (and the schema) on prompts of its own: none of the timed
    prompts (bench.py's default workload in the shipped model's vocabulary, those of at least one
    256-token block) finds its blocks in the prefix cache."""
    prompts, _ = make_workload(WORKLOADS["default"], vocab_size=8192)
    prompts = [p for p in prompts if len(p) >= 256][:5]
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)] * len(prompts)
    outs, seconds, steps = run_side(MODEL_DIR, "dummy", prompts, params, device="cpu")
    assert len(prompts) >= 4 and seconds > 0 and steps
    assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)
