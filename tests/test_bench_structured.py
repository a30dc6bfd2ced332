"""bench_structured.py's workload on CPU: its schema must close within MAX_TOKENS even under random
weights (an unbounded "number" once let them write digits until max_tokens, so the H200 run measured
no closed JSON), and the closed count it reports must count EOS endings."""

import json

import pytest

pytest.importorskip("xgrammar")

from benchmarks.engine.bench_structured import MAX_TOKENS, SCHEMA, closed_count
from nanovllm import LLM, SamplingParams
from nanovllm.sampling_params import StructuredOutputsParams

DEFAULT_MODEL = "nanovllm/default_model"


@pytest.fixture(scope="module")
def outputs():
    llm = LLM(DEFAULT_MODEL, load_format="dummy", max_num_seqs=8)
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
