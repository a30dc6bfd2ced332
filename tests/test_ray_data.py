"""nanovllm.ray_data on a local Ray cluster of CPU actors: LLMPredictor's rows against one in-process
engine's greedy tokens (text and token-id prompts, per-row sampling params, logprobs, other columns
kept, any order), a row's cache_salt reaching its prompt, per-row overrides as Ray's read_json hands them over, the same actors serving a
second round, a two-GPU actor running its engine tensor-parallel, a bad row failing the dataset with
the engine's message and the row, and `python -m nanovllm.ray_data` end to end (its output file
replaced only by a whole run; replicas the cluster's GPUs cannot hold refused at once, or with
--wait-for-nodes waiting for a node that joins later).

Ray's start-up is slow (seconds), so one cluster serves the whole module (and one xdist worker runs
it). It declares two GPUs that no engine uses (every engine here runs on the CPU): Ray assigns them
to an actor that asks, which is how a replica learns it should be tensor-parallel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from checkpoints import checkpoint_fixture, cpu_llm, make_prompts
from nanovllm import SamplingParams
from nanovllm.sampling_params import StructuredOutputsParams

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
import ray.cluster_utils  # noqa: E402
import ray.data  # noqa: E402
import ray.util  # noqa: E402

from nanovllm.ray_data import LLMPredictor  # noqa: E402
from nanovllm.ray_data.__main__ import NodeResources, check_resources, parse_args, write_jsonl  # noqa: E402
from nanovllm.ray_data.predictor import replica_tensor_parallel_size, row_overrides, sampling_params_of  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")

# Every engine of the module, in-process reference and actors alike: a small cache, short context.
LLM_KWARGS = {"device": "cpu", "max_model_len": 128, "kvcache_block_size": 16, "num_kvcache_blocks": 64}
SAMPLING = {"temperature": 0, "max_tokens": 6}
TEXTS = ["the quick brown fox", "paged attention stores keys", "a lazy dog", "prefix caching can share",
         "blocks of tokens", "the scheduler batches prefill", "until every sequence finishes"]
TOKEN_PROMPTS = make_prompts(seed=3, n=7, lo=3, hi=40)
# Per-row overrides of the token-id rows: their own lengths, logprobs in every other row.
ROW_SAMPLING = [{"max_tokens": 3 + i % 4, "logprobs": 2 if i % 2 == 0 else None} for i in range(len(TOKEN_PROMPTS))]
# The Ray cluster: CPUs for two single-CPU actors and the read_json task beside them (with two,
# the command's read waits for a CPU the actors hold: Ray Data never runs it); GPUs declared only
# (see the docstring).
CLUSTER_CPUS = 3
CLUSTER_GPUS = 2
# Object store of the test cluster: the rows are tiny (Ray's minimum is 75 MiB).
OBJECT_STORE_BYTES = 100 * 2**20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The shipped tiny model: its tokenizer has a chat template (the test checkpoints' has none).
DEFAULT_MODEL = os.path.join(REPO, "nanovllm", "default_model")
# Per-row overrides as JSON lines write them: lists, nested dicts whose keys differ from row to row
# (Arrow gives each row all of them), ints that other rows lack (Arrow makes them floats),
# logit_bias keyed by JSON's strings; a row without overrides.
SCHEMA = {"type": "object", "required": ["a"], "properties": {"a": {"type": "string", "minLength": 1, "maxLength": 3}}}
JSON_ROWS = [
    {"prompt": "a lazy dog", "sampling_params": {"structured_outputs": {"choice": ["yes", "no"]}}},
    {"prompt": "a lazy dog", "sampling_params": {"structured_outputs": {"json": SCHEMA}, "max_tokens": 3}},
    {"prompt": "a lazy dog", "sampling_params": {"logit_bias": {"42": 100.0}, "stop": ["x"]}},
    {"prompt": "blocks", "sampling_params": {"logit_bias": {"7": 1.5}, "allowed_token_ids": [7, 8]}},
    {"prompt": "blocks"},
]


@pytest.fixture(scope="module")
def cluster():
    """The module's Ray cluster; yields its address (RAY_ADDRESS for a second driver)."""
    ray.init(num_cpus=CLUSTER_CPUS, num_gpus=CLUSTER_GPUS, include_dashboard=False,
             object_store_memory=OBJECT_STORE_BYTES)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


ckpt = checkpoint_fixture("ray_ckpt")


@pytest.fixture(scope="module")
def reference(ckpt):
    """One in-process engine's outputs for TEXTS, TOKEN_PROMPTS, and TOKEN_PROMPTS with ROW_SAMPLING."""
    llm = cpu_llm(ckpt, **{k: v for k, v in LLM_KWARGS.items() if k != "device"})
    try:
        text = llm.generate(TEXTS, SamplingParams(**SAMPLING), use_tqdm=False)
        ids = llm.generate(TOKEN_PROMPTS, SamplingParams(**SAMPLING), use_tqdm=False)
        rows = llm.generate(TOKEN_PROMPTS, [SamplingParams(**{**SAMPLING, **r}) for r in ROW_SAMPLING], use_tqdm=False)
        return {"text": text, "ids": ids, "rows": rows}
    finally:
        llm.exit()


def predictor_kwargs(ckpt: str, **sampling) -> dict:
    return dict(model=ckpt, sampling_params={**SAMPLING, **sampling}, llm_kwargs=LLM_KWARGS)


def predicted(items: list[dict], ckpt: str, replicas: int, batch_size: int, **resources) -> dict[int, dict]:
    """The items through LLMPredictor actors on Ray Data (one CPU each unless `resources` say more),
    by their "id"; every id comes back once."""
    ds = ray.data.from_items(items).map_batches(
        LLMPredictor, fn_constructor_kwargs=predictor_kwargs(ckpt), compute=ray.data.ActorPoolStrategy(size=replicas),
        batch_size=batch_size, **{"num_cpus": 1, **resources})
    rows = ds.take_all()
    got = {int(r["id"]): r for r in rows}
    assert len(got) == len(rows) and sorted(got) == sorted(item["id"] for item in items)
    return got


def test_text_rows_match_one_engine_and_keep_their_columns(cluster, ckpt, reference):
    # 7 rows in batches of 2 over 2 actors: at least one actor serves several batches
    got = predicted([{"id": i, "prompt": p, "tag": f"t{i}"} for i, p in enumerate(TEXTS)], ckpt, 2, batch_size=2)
    for i, ref in enumerate(reference["text"]):
        row = got[i]
        assert (row["prompt"], row["tag"]) == (TEXTS[i], f"t{i}")
        assert list(row["generated_token_ids"]) == ref["token_ids"]
        assert (row["generated_text"], row["finish_reason"]) == (ref["text"], ref["finish_reason"])
        assert (row["num_input_tokens"], row["num_generated_tokens"]) == (len(ref.prompt_token_ids), len(ref["token_ids"]))
        assert "logprobs" not in row


def test_token_id_rows_with_their_own_sampling_params_and_logprobs(cluster, ckpt, reference):
    items = [{"id": i, "prompt_token_ids": p, "sampling_params": r} for i, (p, r) in enumerate(zip(TOKEN_PROMPTS, ROW_SAMPLING))]
    got = predicted(items, ckpt, 2, batch_size=3)
    for i, ref in enumerate(reference["rows"]):
        row = got[i]
        assert list(row["prompt_token_ids"]) == TOKEN_PROMPTS[i]
        assert list(row["generated_token_ids"]) == ref["token_ids"]
        assert len(ref["token_ids"]) == ROW_SAMPLING[i]["max_tokens"] or ref["finish_reason"] == "stop"
        if ROW_SAMPLING[i]["logprobs"] is None:
            assert row["logprobs"] is None and row["cumulative_logprob"] is None
            continue
        assert row["cumulative_logprob"] == pytest.approx(ref["cumulative_logprob"], abs=1e-4)
        assert len(row["logprobs"]) == len(ref["logprobs"])
        for entries, ref_entry in zip(row["logprobs"], ref["logprobs"]):
            assert [e["token_id"] for e in entries] == list(ref_entry)  # sampled token first, then the top 2
            assert [e["logprob"] for e in entries] == pytest.approx(list(ref_entry.values()), abs=1e-4)


def test_same_actors_serve_a_second_round(cluster, ckpt, reference):
    """Two LLMPredictor actors (plain Ray actors here) map the token-id batches twice: the second
    round, on engines that already served one, gives the same rows."""
    actor = ray.remote(num_cpus=1)(LLMPredictor)
    actors = [actor.remote(**predictor_kwargs(ckpt)) for _ in range(2)]
    try:
        pool = ray.util.ActorPool(actors)
        batches = [{"id": list(range(i, i + 2)), "prompt_token_ids": TOKEN_PROMPTS[i:i + 2]}
                   for i in range(0, len(TOKEN_PROMPTS), 2)]
        rounds = []
        for _ in range(2):
            outs = list(pool.map_unordered(lambda a, b: a.__call__.remote(b), batches))
            rounds.append({i: list(t) for out in outs for i, t in zip(out["id"], out["generated_token_ids"])})
        assert rounds[0] == rounds[1] == {i: ref["token_ids"] for i, ref in enumerate(reference["ids"])}
    finally:
        for a in actors:
            ray.kill(a)


def test_two_gpu_actor_runs_tensor_parallel(cluster, ckpt, reference):
    """An actor holding two (declared) GPUs builds a tensor-parallel engine of 2 ranks (on the CPU,
    over gloo), which gives the same greedy tokens."""
    actor = ray.remote(num_cpus=1, num_gpus=2)(LLMPredictor).remote(**predictor_kwargs(ckpt))
    try:
        assert ray.get(actor.__ray_call__.remote(lambda p: p.llm.config.tensor_parallel_size)) == 2
        out = ray.get(actor.__call__.remote({"prompt": TEXTS[:3]}))
        assert [list(t) for t in out["generated_token_ids"]] == [ref["token_ids"] for ref in reference["text"][:3]]
        ray.get(actor.__ray_call__.remote(lambda p: p.llm.exit()))
    finally:
        ray.kill(actor)


def test_tensor_parallel_size_follows_the_actors_gpus():
    assert replica_tensor_parallel_size(4, None) == replica_tensor_parallel_size(4, 4) == 4
    assert replica_tensor_parallel_size(1, None) == replica_tensor_parallel_size(0, None) == 1
    assert replica_tensor_parallel_size(0, 2) == 2  # CPU engines: as given
    with pytest.raises(ValueError, match="tensor_parallel_size=2 but the actor holds 4 GPUs"):
        replica_tensor_parallel_size(4, 2)
    with pytest.raises(ValueError, match="pass num_gpus=2 to map_batches"):
        replica_tensor_parallel_size(1, 2)


def test_bad_row_fails_the_dataset_with_the_engines_message_and_the_row(cluster, ckpt):
    items = [{"id": 0, "prompt": "a lazy dog"}, {"id": 41, "prompt": ""}, {"id": 2, "prompt": "blocks"}]
    with pytest.raises(ray.exceptions.UserCodeException) as info:  # Ray Data's wrapper of the actor's error
        predicted(items, ckpt, 1, batch_size=8)
    assert "row 1 of the batch {'id': 41, 'prompt': ''}: prompt is an empty string" in str(info.value)


def test_guided_decoding_dicts_are_the_structured_outputs_as_in_vllms_ray_data(ckpt):
    """vLLM's Ray Data rows give the constraint as sampling_params' "guided_decoding" dict, which it
    makes the request's StructuredOutputsParams: the predictor's params and a row's overrides take it
    so (Arrow's integral floats in its schema as ints, as structured_outputs'), and the row follows
    it. It was refused as SamplingParams' guided_decoding, which takes None only."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]}
    assert sampling_params_of({"guided_decoding": {"choice": ["yes", "no"]}}).structured_outputs == \
        StructuredOutputsParams(choice=["yes", "no"])
    assert sampling_params_of({"guided_decoding": None}).structured_outputs is None
    as_arrow = {"guided_decoding": {"json": {**schema, "properties": {"a": {"type": "string", "maxLength": 3.0}}},
                                    "regex": None}, "max_tokens": None}
    assert row_overrides(as_arrow) == {"guided_decoding": {"json": schema}}
    with pytest.raises(ValueError, match="both 'guided_decoding' .* and 'structured_outputs': give one"):
        sampling_params_of({"guided_decoding": {"choice": ["a"]}, "structured_outputs": {"choice": ["b"]}})
    predictor = LLMPredictor(**predictor_kwargs(ckpt, max_tokens=16))
    try:
        out = predictor({"prompt": ["a lazy dog", "blocks"],
                         "sampling_params": [{"guided_decoding": {"choice": ["yes", "no"]}}, None]})
        assert out["generated_text"][0] in ("yes", "no") and out["finish_reason"][0] == "stop"
        with pytest.raises(TypeError, match=r"row 0 .*unexpected keyword argument 'jsn'"):
            predictor({"prompt": ["a"], "sampling_params": [{"guided_decoding": {"jsn": {}}}]})
    finally:
        predictor.llm.exit()


def test_rows_carry_vllms_generated_tokens_beside_generated_token_ids(ckpt):
    """A pipeline ported from vLLM's Ray Data processor reads `generated_tokens` (vLLM's name of the
    completion's ids; ours, generated_token_ids, stays): the row has both, equal, and an input column
    of that name is refused as the other output columns are. It was missing (a KeyError in the
    user's postprocess)."""
    predictor = LLMPredictor(**predictor_kwargs(ckpt))
    try:
        out = predictor({"prompt": ["a lazy dog", "blocks"]})
        assert [list(t) for t in out["generated_tokens"]] == [list(t) for t in out["generated_token_ids"]]
        with pytest.raises(ValueError, match=r"already has column\(s\) \['generated_tokens'\]"):
            predictor({"prompt": ["a"], "generated_tokens": [[1]]})
    finally:
        predictor.llm.exit()


def test_multimodal_inputs_of_vllms_ray_data_rows_are_refused_naming_the_row(ckpt):
    """A row holding what vLLM's Ray Data stage feeds the model beside the prompt (`multimodal_data`,
    older Ray's `image`) is refused naming the row: the engine is text-only. The image was dropped
    and the row answered from its text alone. None or an empty list (a row without images, Ray's
    fill of mixed rows) is no input, and the row is served."""
    predictor = LLMPredictor(**predictor_kwargs(ckpt))
    try:
        with pytest.raises(ValueError, match=r"row 1 of the batch .*: 'multimodal_data' holds .*text-only"):
            predictor({"prompt": ["a", "b"], "multimodal_data": [None, {"image": "http://x/a.png"}]})
        with pytest.raises(ValueError, match=r"row 0 of the batch .*: 'image' holds .*text-only"):
            predictor({"prompt": ["a"], "image": [np.array(["http://x/a.png"], dtype=object)]})
        plain_rows = predictor({"prompt": ["a lazy dog", "blocks"]})
        served = predictor({"prompt": ["a lazy dog", "blocks"], "multimodal_data": [None, None],
                            "image": [np.array([], dtype=object), None]})
        assert predictor({"prompt": ["a lazy dog"], "multimodal_data": [{"image": None}]})["generated_text"]
        assert [list(t) for t in served["generated_token_ids"]] == [list(t) for t in plain_rows["generated_token_ids"]]
    finally:
        predictor.llm.exit()


def test_a_rows_model_other_than_the_predictors_is_refused_naming_the_row(ckpt):
    """vLLM's Ray Data stage serves a row whose `model` differs from its own as that LoRA adapter;
    nanovllm serves no adapters, so such a row is refused naming the row. It was answered by the
    base model, the adapter dropped. A row naming the predictor's own model, or None, is served."""
    predictor = LLMPredictor(**predictor_kwargs(ckpt))
    try:
        with pytest.raises(ValueError, match=r"row 1 of the batch .*: 'model' is 'my-adapter'.*LoRA"):
            predictor({"prompt": ["a", "b"], "model": [ckpt, "my-adapter"]})
        served = predictor({"prompt": ["a lazy dog", "blocks"], "model": [ckpt, None]})
        assert [list(t) for t in served["generated_token_ids"]] == \
            [list(t) for t in predictor({"prompt": ["a lazy dog", "blocks"]})["generated_token_ids"]]
    finally:
        predictor.llm.exit()


def test_columns_all_none_in_a_block_read_as_none(cluster, ckpt, reference):
    """A column whose every row of a block is None (a file of text rows with "prompt_token_ids": null,
    no row salted or overriding) is Arrow's null type, which reaches the numpy batch as float NaNs:
    such a row read as holding two prompts, a NaN salt, NaN overrides. Each reads as None, and the
    row is served as the same row without those columns."""
    assert np.isnan(ray.data.from_items([{"a": None}]).take_batch()["a"]).all()  # Ray's form of such a column
    nulls = {c: None for c in ("prompt_token_ids", "messages", "cache_salt", "sampling_params", "model", "multimodal_data")}
    got = predicted([{"id": 0, "prompt": TEXTS[2], **nulls}], ckpt, 1, batch_size=4)
    assert list(got[0]["generated_token_ids"]) == reference["text"][2]["token_ids"]
    assert np.isnan(got[0]["prompt_token_ids"])  # the input columns come back as they were
    got = predicted([{"id": 1, "prompt": None, "prompt_token_ids": TOKEN_PROMPTS[0]}], ckpt, 1, batch_size=4)
    assert list(got[1]["generated_token_ids"]) == reference["ids"][0]["token_ids"]


def test_batch_and_parameter_errors_name_the_value(ckpt):
    with pytest.raises(ValueError, match="n=3 is not supported"):
        sampling_params_of({"n": 3})
    with pytest.raises(ValueError, match="prompt_logprobs=1 is not supported"):
        sampling_params_of(SamplingParams(prompt_logprobs=1))
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        sampling_params_of("greedy")
    predictor = LLMPredictor(**predictor_kwargs(ckpt))  # in this process: the driver holds no GPU
    try:
        with pytest.raises(ValueError, match=r"row 0 .*: a row needs exactly one of 'prompt' \(text\), "
                                             r"'prompt_token_ids' and 'messages' \(a conversation\), "
                                             r"got \['prompt', 'prompt_token_ids'\]"):
            predictor({"prompt": ["a"], "prompt_token_ids": [[1, 2]]})
        with pytest.raises(ValueError, match=r"row 0 .*got none"):
            predictor({"prompt": [None], "prompt_token_ids": [None]})
        with pytest.raises(ValueError, match=r"got columns \['text'\]"):
            predictor({"text": ["a"]})
        with pytest.raises(ValueError, match=r"already has column\(s\) \['finish_reason'\]"):
            predictor({"prompt": ["a"], "finish_reason": ["x"]})
        with pytest.raises(TypeError, match="row 0 of the batch .*prompt_token_ids must hold lists of token ids, got 'fox'"):
            predictor({"prompt_token_ids": ["fox"]})
        with pytest.raises(ValueError, match=r"row 1 of the batch \{'prompt': 'fox fox .*\.\.\.\}: prompt has \d+ tokens, more than max_model_len \(128\)"):
            predictor({"prompt": ["a lazy dog", "fox " * 200]})
        with pytest.raises(TypeError, match=r"row 0 of the batch .*: prompt must hold text, got \[1, 2\]"):
            predictor({"prompt": [[1, 2]]})
        with pytest.raises(TypeError, match=r"row 1 .*unexpected keyword argument 'max_token'"):
            predictor({"prompt": ["a", "b"], "sampling_params": [{}, {"max_token": 3}]})
        with pytest.raises(ValueError, match=r"row 0 .*: SamplingParams.top_p must be in \(0, 1\], got 2"):
            predictor({"prompt": ["a"], "sampling_params": [{"top_p": 2.0}]})
        with pytest.raises(ValueError, match=r"row 0 .*: LLMPredictor makes one completion per row: SamplingParams.n=2"):
            predictor({"prompt": ["a"], "sampling_params": [{"n": 2}]})
        # the engine's own checks of a row's overrides (max_logprobs, ids within the vocabulary) name the row too
        with pytest.raises(ValueError, match=r"row 1 .*: SamplingParams.logprobs=21 asks for 21 logprobs a token"):
            predictor({"prompt": ["a", "b"], "sampling_params": [{}, {"logprobs": 21}]})
        with pytest.raises(ValueError, match=r"row 0 .*stop_token_ids"):
            predictor({"prompt": ["a"], "sampling_params": [{"stop_token_ids": [10**6]}]})
        with pytest.raises(TypeError, match="LLMPredictor takes numpy batches"):
            predictor([{"prompt": "a"}])
        out = predictor({"prompt": ["a lazy dog"]})  # still serving after the refusals
        assert len(out["generated_token_ids"][0]) >= 1
        # JSON lines of both prompt kinds, some rows with overrides (Ray fills the others with None),
        # structured_outputs as a dict: each row as generate takes it alone
        ids = predictor.llm.tokenizer.encode("a lazy dog")
        greedy = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
        mixed = predictor({"prompt": ["a lazy dog", None, "a lazy dog"], "prompt_token_ids": [None, ids, None],
                           "sampling_params": [None, greedy, {"temperature": 0.0, "structured_outputs": {"choice": ["yes"]}}]})
        alone = [predictor.llm.generate(["a lazy dog"], predictor.params, use_tqdm=False)[0],
                 predictor.llm.generate([{"prompt_token_ids": ids}], SamplingParams(**greedy), use_tqdm=False)[0]]
        assert [list(t) for t in mixed["generated_token_ids"][:2]] == [o.outputs[0].token_ids for o in alone]
        assert mixed["generated_text"][2] == "yes"
    finally:
        predictor.llm.exit()


def test_cache_salt_column_reaches_each_rows_prompt(cluster, ckpt, tmp_path):
    """A `cache_salt` column (vLLM V1's prompt key, as vLLM's Ray Data rows carry it) as read_json
    hands it over (None in rows without one): a salted row's KV serves later prompts of its salt
    only, an unsalted row's serves unsalted ones; a salt that is not a non-empty str names its row.
    The predictor used to drop the column, so every row's blocks were unsalted."""
    long = list(range(1, 40))  # 2 full blocks of 16 before the block of its last token
    src = tmp_path / "salted.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": long, "cache_salt": "tenant-a"}) + "\n"
                   + json.dumps({"prompt_token_ids": long[::-1]}) + "\n")
    batch = next(iter(ray.data.read_json(str(src)).iter_batches(batch_size=2, batch_format="numpy")))
    assert batch["cache_salt"][1] is None
    predictor = LLMPredictor(**predictor_kwargs(ckpt))
    llm = predictor.llm
    greedy = SamplingParams(temperature=0, max_tokens=1)

    def cached(prompt) -> int:
        return llm.generate([prompt], greedy, use_tqdm=False)[0].num_cached_tokens

    try:
        out = predictor(batch)
        assert list(out["cache_salt"]) == ["tenant-a", None]  # kept as given
        assert [list(t) for t in out["generated_token_ids"]] == [
            o.outputs[0].token_ids for o in llm.generate([long, long[::-1]], predictor.params, use_tqdm=False)]
        assert cached({"prompt_token_ids": long, "cache_salt": "tenant-b"}) == 0
        assert cached({"prompt_token_ids": long, "cache_salt": "tenant-a"}) == 32  # the salted row's blocks
        assert cached({"prompt_token_ids": long[::-1], "cache_salt": "tenant-a"}) == 0
        assert cached(long[::-1]) == 32  # the unsalted row's blocks
        llm.reset_prefix_cache()
        predictor({"prompt": ["a lazy dog " * 6], "cache_salt": ["tenant-c"]})  # text rows too
        assert cached({"prompt": "a lazy dog " * 6, "cache_salt": "tenant-c"}) > 0
        assert cached("a lazy dog " * 6) == 0
        with pytest.raises(TypeError, match=r"row 1 of the batch \{'prompt': 'b', 'cache_salt': 7\}: .*cache_salt must be a str, got 7"):
            predictor({"prompt": ["a", "b"], "cache_salt": ["x", 7]})
        with pytest.raises(ValueError, match=r"row 0 of the batch \{'prompt': 'a', 'cache_salt': ''\}: .*cache_salt is an empty string"):
            predictor({"prompt": ["a"], "cache_salt": [""]})
    finally:
        llm.exit()


def test_row_overrides_from_json_lines_through_arrow(cluster, ckpt, tmp_path):
    """The sampling_params column as read_json (Arrow) hands it to map_batches: numpy arrays at any
    depth, other rows' keys as None, ints as floats. Each row's overrides come back as its JSON
    line wrote them, and generate honours them."""
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for row in JSON_ROWS))
    batch = next(iter(ray.data.read_json(str(src)).iter_batches(batch_size=len(JSON_ROWS), batch_format="numpy")))
    assert batch["sampling_params"][4] is None and batch["sampling_params"][2]["logit_bias"]["7"] is None
    for row, arrow_row in zip(JSON_ROWS[:4], batch["sampling_params"]):
        overrides = row_overrides(arrow_row)
        assert json.dumps(overrides, sort_keys=True) == json.dumps(row["sampling_params"], sort_keys=True)  # ints stay ints
    # a directory of two files: a batch spanning them gives a row without overrides every other
    # row's dict fields, all None (not None itself)
    folder = tmp_path / "split"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps(row) + "\n" for row in JSON_ROWS[:3]))
    (folder / "b.jsonl").write_text("".join(json.dumps(row) + "\n" for row in JSON_ROWS[3:]))
    spanning = next(iter(ray.data.read_json(str(folder)).iter_batches(batch_size=len(JSON_ROWS), batch_format="numpy")))
    got = sorted(json.dumps({} if r is None else row_overrides(r), sort_keys=True) for r in spanning["sampling_params"])
    assert got == sorted(json.dumps(row.get("sampling_params", {}), sort_keys=True) for row in JSON_ROWS)
    predictor = LLMPredictor(**predictor_kwargs(ckpt))
    try:
        out = predictor(batch)
        assert out["generated_text"][0] in ("yes", "no")
        assert len(out["generated_token_ids"][1]) <= 3
        assert list(out["generated_token_ids"][2]) == [42] * SAMPLING["max_tokens"]  # the bias of token 42 applies
        assert set(out["generated_token_ids"][3]) <= {7, 8}
        alone = predictor.llm.generate(["blocks"], predictor.params, use_tqdm=False)[0]
        assert list(out["generated_token_ids"][4]) == alone.outputs[0].token_ids
    finally:
        predictor.llm.exit()


def test_messages_rows_are_rendered_with_the_chat_template(cluster, tmp_path):
    """A `messages` column (vLLM's Ray Data chat rows: one conversation per row) as read_json hands it
    over, beside text rows: each conversation rendered by the checkpoint's chat template, as
    LLM.chat renders it; a malformed conversation names its row."""
    conversations = [[{"role": "user", "content": "Reverse a list."}],
                     [{"role": "system", "content": "You write Python.", "name": "sys"},  # Arrow gives the others "name": None
                      {"role": "user", "content": "Read a config file."}]]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"id": i, "messages": c}) + "\n" for i, c in enumerate(conversations))
                   + json.dumps({"id": 2, "prompt": "a lazy dog"}) + "\n")
    batch = next(iter(ray.data.read_json(str(src)).iter_batches(batch_size=3, batch_format="numpy")))
    predictor = LLMPredictor(model=DEFAULT_MODEL, sampling_params=SAMPLING, llm_kwargs=LLM_KWARGS)
    try:
        out = predictor(batch)
        chats = predictor.llm.chat(conversations, SamplingParams(**SAMPLING), use_tqdm=False)
        alone = predictor.llm.generate(["a lazy dog"], SamplingParams(**SAMPLING), use_tqdm=False)
        assert [list(t) for t in out["generated_token_ids"]] == [o.outputs[0].token_ids for o in chats + alone]
        with pytest.raises(ValueError, match=r"row 1 of the batch .*: conversation 0, message 0 has no 'role'"):
            predictor({"messages": [[{"role": "user", "content": "hi"}], [{"content": "hi"}]]})
        with pytest.raises(ValueError, match=r"row 1 of the batch .*: conversation 0 is empty"):  # a row is one
            predictor({"messages": [[{"role": "user", "content": "hi"}], []]})
        with pytest.raises(ValueError, match=r"row 0 .*got \['prompt', 'messages'\]"):
            predictor({"prompt": ["a"], "messages": [[{"role": "user", "content": "hi"}]]})
    finally:
        predictor.llm.exit()


def test_a_conversation_ending_with_the_assistants_message_is_continued_as_in_rays_chat_stage():
    """Ray Data's chat-template stage opens the assistant's turn only after a user message: a row whose
    conversation ends with an assistant message (a prefill) is rendered with continue_final_message,
    so the completion continues that message. It was closed and a new assistant turn opened (LLM.chat's
    defaults), so the prefill was lost. Checked against transformers' rendering with Ray's flags."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    prefill = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    asked = [{"role": "user", "content": "Name a color."}]
    predictor = LLMPredictor(model=DEFAULT_MODEL, sampling_params=SAMPLING, llm_kwargs=LLM_KWARGS)
    try:
        out = predictor({"messages": [prefill, asked]})
        expected = [tok.apply_chat_template(prefill, tokenize=False, add_generation_prompt=False,
                                            continue_final_message=True),
                    tok.apply_chat_template(asked, tokenize=False, add_generation_prompt=True)]
        assert expected[0].endswith("The color is")
        alone = predictor.llm.generate(expected, SamplingParams(**SAMPLING), use_tqdm=False)
        assert [list(t) for t in out["generated_token_ids"]] == [o.outputs[0].token_ids for o in alone]
        assert list(out["num_input_tokens"]) == [len(o.prompt_token_ids) for o in alone]
    finally:
        predictor.llm.exit()


def test_without_sampling_params_the_engines_defaults_apply(ckpt, tmp_path):
    """LLMPredictor(sampling_params=None) and the command with no sampling flag sample with the
    checkpoint's generation_config, as generate(prompts) does."""
    path = tmp_path / "with_defaults"
    shutil.copytree(ckpt, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7, "max_new_tokens": 5}))
    predictor = LLMPredictor(model=str(path), llm_kwargs=LLM_KWARGS)
    try:
        assert predictor.params == predictor.llm.get_default_sampling_params()
        assert (predictor.params.temperature, predictor.params.top_k, predictor.params.max_tokens) == (0.3, 7, 5)
    finally:
        predictor.llm.exit()


def test_jsonl_command_end_to_end(cluster, ckpt, reference, tmp_path):
    """`python -m nanovllm.ray_data` in a second process, joining this cluster through RAY_ADDRESS:
    one output file, its lines in the input's order, other fields kept."""
    src, dst = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(TEXTS)))
    dst.write_text('{"an": "earlier run"}\n')  # replaced whole
    cmd = [sys.executable, "-m", "nanovllm.ray_data", "--model", ckpt, "--input", str(src), "--output", str(dst),
           "--replicas", "2", "--gpus-per-replica", "0", "--batch-size", "3", "--temperature", "0",
           "--max-tokens", str(SAMPLING["max_tokens"]), "--llm-kwargs", json.dumps(LLM_KWARGS)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "RAY_ADDRESS": cluster},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(len(TEXTS)))
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl", "prompts.jsonl"]  # no temporary file left
    for row, ref in zip(rows, reference["text"]):
        assert row["generated_token_ids"] == ref["token_ids"]
        assert (row["generated_text"], row["finish_reason"]) == (ref["text"], ref["finish_reason"])


def test_failed_jsonl_run_leaves_an_earlier_file_as_it_was(cluster, tmp_path):
    def fail_at_id_2(batch: dict) -> dict:  # local: Ray ships it by value (workers cannot import this module)
        if 2 in batch["id"]:
            raise ValueError("row id 2 fails")
        return batch

    dst = tmp_path / "out.jsonl"
    dst.write_text('{"an": "earlier run"}\n')
    failing = ray.data.from_items([{"id": i} for i in range(4)]).map_batches(fail_at_id_2, batch_size=1)
    with pytest.raises(Exception, match="row id 2 fails"):
        write_jsonl(failing, str(dst))
    assert dst.read_text() == '{"an": "earlier run"}\n' and os.listdir(tmp_path) == ["out.jsonl"]
    assert write_jsonl(ray.data.from_items([{"id": i} for i in range(2)]), str(dst)) == 2
    assert dst.read_text() == '{"id": 0}\n{"id": 1}\n' and os.listdir(tmp_path) == ["out.jsonl"]


def test_jsonl_output_writes_missing_and_non_finite_numbers_as_null(cluster, tmp_path):
    """A number column some input lines lack comes out of map_batches' numpy batches as NaN (Arrow's
    numpy conversion of nulls); the single-file writer writes it, and any other NaN / infinity, as
    JSON's null, as Ray Data's write_json does: `NaN` and `Infinity` are not JSON."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"id": 0, "score": 1}\n{"id": 1}\n')
    ds = ray.data.read_json(str(src)).map_batches(lambda b: {**b, "lp": [[-float("inf"), 0.5]] * len(b["id"])})
    assert write_jsonl(ds, str(dst)) == 2

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    rows = [json.loads(line, parse_constant=refuse) for line in dst.read_text().splitlines()]
    assert [(r["id"], r["score"], r["lp"]) for r in rows] == [(0, 1, [None, 0.5]), (1, None, [None, 0.5])]


def test_replicas_the_clusters_gpus_cannot_hold_are_refused(cluster, ckpt, tmp_path):
    """check_resources against each node's CPUs and GPUs (a replica's are on one node; one CPU more
    for reading and writing); the command, on this cluster of 3 CPUs and 2 GPUs, stops at once
    (instead of Ray waiting forever) and names --gpus-per-replica 0."""
    check_resources(2, 1, [NodeResources(2, 1), NodeResources(2, 1)])
    check_resources(4, 0.5, [NodeResources(5, 2)])
    check_resources(2, 0, [NodeResources(3, 0)])  # CPU engines
    for replicas, gpus, nodes in [(1, 1, [NodeResources(4, 0)]), (1, 1, []), (2, 2, [NodeResources(4, 1)] * 2),
                                  (3, 1, [NodeResources(8, 2)])]:
        with pytest.raises(ValueError, match=rf"--replicas {replicas} --gpus-per-replica {gpus:g} .*"
                                             r"pass --gpus-per-replica 0 to run the engines on CPUs"):
            check_resources(replicas, gpus, nodes)
    # CPU engines: one CPU each and one for Ray Data's reads (the README's 2-replica example on 2 CPUs waited forever)
    for replicas, gpus, nodes in [(2, 0, [NodeResources(2, 0)]), (2, 1, [NodeResources(2, 2)]), (1, 0, [])]:
        with pytest.raises(ValueError, match=r"1 CPU each, one more for reading and writing|room for"):
            check_resources(replicas, gpus, nodes)
    # CPU engines: fewer replicas is the one way out (there is no --gpus-per-replica below 0 to lower it to)
    with pytest.raises(ValueError, match=r"room for 1 replica\(s\)\. Lower --replicas \(on an autoscaling"):
        check_resources(2, 0, [NodeResources(2, 0)])
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "a"}) + "\n")
    cmd = [sys.executable, "-m", "nanovllm.ray_data", "--model", ckpt, "--input", str(src),
           "--output", str(tmp_path / "out.jsonl"), "--replicas", "3", "--llm-kwargs", json.dumps(LLM_KWARGS)]
    proc = subprocess.run(cmd, check=False, cwd=REPO, env={**os.environ, "RAY_ADDRESS": cluster},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ValueError: --replicas 3 --gpus-per-replica 1 needs 3 replica(s)" in proc.stderr, proc.stderr[-3000:]
    assert "have 3 CPU(s) and 2 GPU(s): room for 2 replica(s)" in proc.stderr
    assert os.listdir(tmp_path) == ["prompts.jsonl"]


def test_wait_for_nodes_lets_replicas_wait_for_a_node_an_autoscaler_adds(ckpt, reference, tmp_path):
    """--wait-for-nodes on a cluster of its own: the command asks for a GPU replica that the head
    node (no GPUs) cannot hold, waits instead of refusing, and finishes once a GPU node joins, as an
    autoscaler would add it."""
    head = ray.cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": 0, "object_store_memory": OBJECT_STORE_BYTES})
    try:
        src = tmp_path / "prompts.jsonl"
        src.write_text(json.dumps({"prompt": TEXTS[0]}) + "\n")
        cmd = [sys.executable, "-m", "nanovllm.ray_data", "--model", ckpt, "--input", str(src),
               "--output", str(tmp_path / "out.jsonl"), "--replicas", "1", "--wait-for-nodes", "--temperature", "0",
               "--max-tokens", str(SAMPLING["max_tokens"]), "--llm-kwargs", json.dumps(LLM_KWARGS)]
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "RAY_ADDRESS": head.address},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            waiting = next((line for line in proc.stdout if "(pending: 1 CPU, 1 GPU)" in line), None)
            assert waiting is not None, "the command ended without waiting for the GPU replica"
            head.add_node(num_cpus=2, num_gpus=1, object_store_memory=OBJECT_STORE_BYTES)
            log = proc.communicate(timeout=300)[0]
        finally:
            proc.kill()
        assert proc.returncode == 0, log[-3000:]
    finally:
        head.shutdown()
    (row,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert row["generated_token_ids"] == reference["text"][0]["token_ids"]


def test_command_refuses_bad_flags_before_ray_starts():
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--input", "i", "--output", "o.jsonl", "--temperature", "-1"])
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--input", "i", "--output", "o.jsonl", "--replicas", "0"])
    with pytest.raises(SystemExit):  # a single-file output whose folder does not exist
        parse_args(["--model", "m", "--input", "i", "--output", "no/such/folder/o.jsonl"])
    with pytest.raises(SystemExit):  # another format's name: the output is JSON lines only
        parse_args(["--model", "m", "--input", "i", "--output", "out.parquet"])
    args = parse_args(["--model", "m", "--input", "i", "--output", "o.jsonl", "--stop", "x", "y", "--ignore-eos",
                       "--max-tokens", "9", "--llm-kwargs", '{"max_model_len": 64}'])
    assert args.sampling_params == SamplingParams(stop=["x", "y"], ignore_eos=True, max_tokens=9)
    assert args.llm_kwargs == {"max_model_len": 64}
    # every field's flag takes its kind: lists, --no-<bool> for a field whose default is True, JSON objects
    args = parse_args(["--model", "m", "--input", "i", "--output", "o.jsonl", "--bad-words", "foo", "bar",
                       "--allowed-token-ids", "1", "2", "--no-skip-special-tokens", "--logit-bias", '{"3": 2.5}',
                       "--structured-outputs", '{"choice": ["yes", "no"]}', "--top-p", "0.5"])
    assert args.sampling_params == SamplingParams(
        bad_words=["foo", "bar"], allowed_token_ids=[1, 2], skip_special_tokens=False, logit_bias={3: 2.5},
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), top_p=0.5)
    assert parse_args(["--model", "m", "--input", "i", "--output", "o.jsonl"]).sampling_params is None
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--input", "i", "--output", "o.jsonl", "--logit-bias", "[1]"])


def test_import_nanovllm_never_imports_ray_and_missing_ray_says_how_to_install():
    """In a fresh interpreter: `import nanovllm` leaves ray unimported; with ray made unimportable
    (a None entry in sys.modules: Python's own way to block an import), nanovllm.ray_data's
    ImportError gives the install command."""
    code = ("import sys, nanovllm; from nanovllm import LLM, SamplingParams\n"
            "assert 'ray' not in sys.modules, 'import nanovllm imported ray'\n"
            "sys.modules['ray'] = None\n"
            "try:\n    import nanovllm.ray_data\nexcept ImportError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'nanovllm[ray]'" in proc.stdout
