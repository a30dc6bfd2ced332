"""vLLM's LLM methods beyond generation, as a text-generation engine has them: `set_tokenizer`
(the new tokenizer serves later requests end to end), `supported_tasks` and `llm_engine.get_supported_tasks()` (vLLM's tuple for a
generative model), `reset_mm_cache` (no multimodal cache: nothing to reset, no error), the pooling methods (vLLM's
ValueError on a generative model), `start_profile` / `stop_profile` (a torch.profiler trace in
$VLLM_TORCH_PROFILER_DIR, given to a subprocess)."""

from __future__ import annotations

import copy
import gzip
import json
import os
import re
import subprocess
import sys

import pytest

from checkpoints import TEST_VOCAB_SIZE, build_checkpoint, cpu_llm
from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = "the quick brown fox jumps over a lazy dog"
# The other tokenizer: another corpus (other merges, so other ids and texts), another EOS, a chat template.
OTHER_WORDS = "zebras quietly wander beyond distant hills where violet rivers meet golden meadows".split()
OTHER_EOS, OTHER_EOS_ID = "<|end|>", 1
ECHO_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("llm-methods")))


@pytest.fixture
def llm(ckpt):
    """A fresh engine per test: set_tokenizer changes it."""
    engine = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=128)
    yield engine
    engine.exit()


@pytest.fixture(scope="module")
def other_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TEST_VOCAB_SIZE, special_tokens=["<pad>", OTHER_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(OTHER_WORDS[i:] + OTHER_WORDS[:i]) for i in range(len(OTHER_WORDS))], trainer)
    other = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=OTHER_EOS)
    other.chat_template = ECHO_TEMPLATE
    assert other.eos_token_id == OTHER_EOS_ID
    return other


def test_set_tokenizer_tokenizes_prompts_and_decodes_outputs_with_the_new_one(llm, other_tokenizer):
    old = llm.get_tokenizer()
    assert old.encode(PROMPT) != other_tokenizer.encode(PROMPT)
    before = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert before.prompt_token_ids == old.encode(PROMPT)
    llm.set_tokenizer(other_tokenizer)
    assert llm.get_tokenizer() is other_tokenizer and llm.llm_engine.tokenizer is other_tokenizer
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    assert out.prompt_token_ids == other_tokenizer.encode(PROMPT)
    assert completion.text == other_tokenizer.decode(completion.token_ids)
    assert completion.text != old.decode(completion.token_ids)  # (the check above could not pass by chance)
    first = completion.logprobs[0][completion.token_ids[0]]
    assert first.decoded_token == other_tokenizer.decode([completion.token_ids[0]])
    # stop strings are matched on the new tokenizer's text
    stop = completion.text[3:6]
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert stopped.text == completion.text[:completion.text.index(stop)]
    # vLLM's step API decodes with it too
    engine = llm.llm_engine
    engine.add_request("r", PROMPT, GREEDY)
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[-1].outputs[0].text == completion.text


def test_set_tokenizer_brings_its_eos_and_chat_template(llm, other_tokenizer):
    forced = SamplingParams(temperature=0, max_tokens=3, logit_bias={OTHER_EOS_ID: 100.0})
    assert llm.generate([[5, 6, 7]], forced, use_tqdm=False)[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": PROMPT}], GREEDY, use_tqdm=False)
    llm.set_tokenizer(other_tokenizer)
    done = llm.generate([[5, 6, 7]], forced, use_tqdm=False)[0].outputs[0]
    assert (done.token_ids, done.finish_reason, done.stop_reason) == ([OTHER_EOS_ID], "stop", None)
    chat = llm.chat([{"role": "user", "content": PROMPT}], GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == other_tokenizer.encode(PROMPT + " ", add_special_tokens=False)


def test_set_tokenizer_refuses_what_it_cannot_use_and_changes_nothing(llm, other_tokenizer):
    old = llm.get_tokenizer()
    for bad in (None, "a/tokenizer/path", 3):
        with pytest.raises(TypeError, match="set_tokenizer takes a tokenizer"):
            llm.set_tokenizer(bad)
    too_large = copy.deepcopy(old)  # the model's own, its vocabulary full: a new EOS token lies past it
    too_large.add_special_tokens({"eos_token": "<new eos>"})
    assert too_large.eos_token_id >= TEST_VOCAB_SIZE
    with pytest.raises(ValueError, match=f"EOS token id {too_large.eos_token_id} .*outside the model's vocabulary"):
        llm.set_tokenizer(too_large)
    rid = llm.add_request(PROMPT, GREEDY)
    with pytest.raises(RuntimeError, match="set_tokenizer\\(\\) called while requests are pending"):
        llm.set_tokenizer(other_tokenizer)
    llm.abort_request(rid)
    assert llm.get_tokenizer() is old
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == old.encode(PROMPT)
    assert out.outputs[0].text == old.decode(out.outputs[0].token_ids)


def test_set_tokenizer_builds_structured_outputs_grammars_from_the_new_vocabulary(llm, other_tokenizer):
    from nanovllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=["zebras"]))
    assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text == "zebras"  # a grammar compiled first
    llm.set_tokenizer(other_tokenizer)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "zebras"
    assert out.token_ids[:-1] == other_tokenizer.encode("zebras")  # then EOS, the new tokenizer's
    assert out.token_ids[-1] == OTHER_EOS_ID


def test_supported_tasks_are_vllms_for_a_generative_model(llm):
    assert llm.llm_engine.get_supported_tasks() == ("generate",)  # vLLM's LLMEngine method
    assert llm.supported_tasks == LLM.supported_tasks == ("generate",)  # vLLM's LLM attribute
    assert isinstance(llm.llm_engine.get_supported_tasks(), tuple)


def test_reset_mm_cache_has_nothing_to_reset_and_leaves_the_prefix_cache(llm):
    prompt = list(range(1, 40))  # two full KV blocks of 16
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert llm.reset_mm_cache() is None
    assert llm.llm_engine.reset_mm_cache() is None
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids


POOLING_CALLS = {  # as vLLM's callers pass them
    "encode": (["a text"],), "embed": (["a text"],), "classify": (["a text"],), "reward": (["a text"],),
    "score": ("a query", ["a document", "another"]),
}
# vLLM's sentence for each (code written against vLLM matches on it)
VLLM_SENTENCES = {"encode": r"LLM\.encode\(\) is only supported for pooling models",
                  "embed": "Embedding API is not supported by this model",
                  "classify": "Classification API is not supported by this model",
                  "score": r"LLM\.score\(\) is only supported for pooling models",
                  "reward": r"LLM\.reward\(\) is only supported for pooling models"}


@pytest.mark.parametrize("method", list(POOLING_CALLS))
def test_pooling_methods_refuse_at_the_call_and_the_engine_serves_on(llm, method):
    expected = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError) as refused:
        getattr(llm, method)(*POOLING_CALLS[method], use_tqdm=False)
    message = str(refused.value)
    assert re.match(VLLM_SENTENCES[method], message)
    assert f"LLM.{method}()" in message and "('generate',)" in message
    assert llm.is_finished()
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert getattr(LLM, method).__name__ == method


def test_get_metrics_refuses_by_name_on_both_apis_and_the_engine_serves_on(llm):
    """vLLM's LLM.get_metrics() / llm_engine.get_metrics() read its Prometheus registry, which
    nanovllm has none of: a NotImplementedError naming the method, not an AttributeError."""
    expected = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for call, name in ((llm.get_metrics, "LLM.get_metrics()"), (llm.llm_engine.get_metrics, "get_metrics()")):
        with pytest.raises(NotImplementedError, match=re.escape(name)):
            call()
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


# Run in a subprocess given VLLM_TORCH_PROFILER_DIR: it takes the variable away and back itself
# (start_profile reads it at the call), and prints what each misuse raised.
_PROFILE_SCRIPT = """
import json, os, sys
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", kvcache_block_size=16, max_model_len=128)
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
def raised(call):
    try:
        call()
    except RuntimeError as e:
        return str(e)
directory = os.environ.pop("VLLM_TORCH_PROFILER_DIR")
errors = {"unset": raised(llm.start_profile)}
os.environ["VLLM_TORCH_PROFILER_DIR"] = directory
errors["stop_unstarted"] = raised(llm.stop_profile)
llm.start_profile()
errors["start_started"] = raised(llm.start_profile)
profiled = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
llm.stop_profile()
errors["stop_stopped"] = raised(llm.stop_profile)
after = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
llm.start_profile()  # left recording: exit() ends it, writing its trace
llm.generate([[1, 2, 3]], params, use_tqdm=False)
llm.exit()
print(json.dumps({"errors": errors, "same_tokens": profiled == after}))
"""


def test_start_and_stop_profile_write_a_torch_trace_into_vllms_directory(ckpt, tmp_path):
    traces = tmp_path / "traces"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "VLLM_TORCH_PROFILER_DIR": str(traces)}
    done = subprocess.run([sys.executable, "-c", _PROFILE_SCRIPT, ckpt], capture_output=True, text=True, timeout=300,
                          env=env, cwd=root, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    errors = result["errors"]
    assert errors["unset"].startswith("Profiler is not enabled.") and "VLLM_TORCH_PROFILER_DIR" in errors["unset"]
    assert "stop_profile() called without start_profile()" in errors["stop_unstarted"]
    assert "start_profile() called while profiling" in errors["start_started"]
    assert "stop_profile() called without start_profile()" in errors["stop_stopped"]
    assert result["same_tokens"]
    written = sorted(traces.glob("*.pt.trace.json.gz"))
    assert len(written) == 2, list(traces.iterdir()) if traces.exists() else "no directory"  # the second at exit()
    with gzip.open(written[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(str(event.get("name", "")).startswith("aten::") for event in events)  # the forward's CPU ops
