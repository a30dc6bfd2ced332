"""Structured outputs through the engine (CPU, the shipped default model: a real byte-level BPE
tokenizer of 8,192 tokens).

Every constraint below has a bounded language (strings with maxLength, bounded integers, enums,
maxItems), so each completion must end by EOS where its grammar ends, well within max_tokens:
"stop" is checked, not hoped for. Outputs are checked by independent means: JSON parsed and
validated against its schema (jsonschema), regexes by re.fullmatch, choices by membership,
grammars by their own shape; greedy constrained tokens against transformers' logits masked by an
xgrammar matcher driven step by step (the library's own matcher and apply, compiled here, not the
engine's); unconstrained rows against a run without any constrained row.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar

from checkpoints import cpu_llm, load_reference
from nanovllm import SamplingParams
from nanovllm.engine.structured_outputs import GRAMMAR_CACHE_BYTES, accept_tokens, unenforced_keyword
from nanovllm.sampling_params import StructuredOutputsParams

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = str(ROOT / "nanovllm" / "default_model")
EOS = 0  # the default model's <|endoftext|>
MAX_TOKENS = 256  # above every bounded language's longest completion here

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["module", "class", "function"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "id", "kind", "tags"],
    "additionalProperties": False,
}
REGEX = r"(0|[1-9][0-9]{0,3})\.[0-9]{2} (USD|EUR)"
CHOICES = ["True", "False", "None"]
GRAMMAR = """root ::= "def " name "(" args? "):"
name ::= [a-z_] [a-z_0-9]? [a-z_0-9]? [a-z_0-9]? [a-z_0-9]?
args ::= name (", " name)?"""
GRAMMAR_SHAPE = r"def [a-z_][a-z_0-9]{0,4}\(([a-z_][a-z_0-9]{0,4}(, [a-z_][a-z_0-9]{0,4})?)?\):"

CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}
PROMPTS = ["def main():\n    data = ", "    return ", "import os\nx = "]


def check_text(kind: str, text: str) -> None:
    """`text` is a complete word of constraint `kind`'s language, by means independent of xgrammar."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(GRAMMAR_SHAPE, text), text


def constrained(kind: str, sampled: bool, **kwargs) -> SamplingParams:
    noise = {"temperature": 1.0, "seed": 3} if sampled else {"temperature": 0.0}
    return SamplingParams(structured_outputs=CONSTRAINTS[kind], **{"max_tokens": MAX_TOKENS, **noise, **kwargs})


FREE = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True)]


@pytest.fixture(scope="module")
def llm():
    engine = cpu_llm(MODEL_DIR, kvcache_block_size=16, max_model_len=512)
    yield engine
    engine.exit()


@pytest.fixture(scope="module")
def mixed(llm):
    """A batch of every constraint, greedy and sampled, between unconstrained rows: (params, outputs)."""
    params = [FREE[0]]
    for kind in CONSTRAINTS:
        params += [constrained(kind, False), constrained(kind, True)]
    params += [FREE[1]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    return prompts, params, llm.generate(prompts, params, use_tqdm=False)


def test_constrained_outputs_are_words_of_their_languages(mixed):
    _, params, outputs = mixed
    kinds = [kind for kind in CONSTRAINTS for _ in range(2)]
    for kind, out in zip(kinds, outputs[1:-1]):
        assert out["finish_reason"] == "stop" and out["token_ids"][-1] == EOS, (kind, out)
        check_text(kind, out["text"])
    assert outputs[2]["text"] != outputs[1]["text"]  # the sampled row is not the greedy one


def test_unconstrained_rows_equal_a_run_without_constrained_rows(llm, mixed):
    prompts, params, outputs = mixed
    alone = llm.generate([prompts[0], prompts[-1]], FREE, use_tqdm=False)
    assert [outputs[0]["token_ids"], outputs[-1]["token_ids"]] == [o["token_ids"] for o in alone]


def reference_grammars(tokenizer, vocab: int) -> dict:
    """Each constraint's grammar compiled by xgrammar here (not by the engine's backend)."""
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[EOS])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    return {
        "json": compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False),
        "regex": compiler.compile_regex(REGEX),
        "choice": compiler.compile_grammar("root ::= " + " | ".join(f'"{c}"' for c in CHOICES)),
        "grammar": compiler.compile_grammar(GRAMMAR),
    }


@torch.no_grad()
def assert_masked_greedy(reference, grammar, prompt_ids: list[int], completion: list[int],
                         tolerance: float = 0.0) -> None:
    """Each token of a greedy constrained `completion` is the argmax (up to float ties: 1e-4, plus
    `tolerance` x the row's logit range for bf16) of `reference`'s logits with the mask of an
    xgrammar matcher of `grammar` advanced on the completion's tokens; the last token is EOS, where
    the matcher's grammar ends."""
    device = next(reference.parameters()).device
    logits = reference(torch.tensor([prompt_ids + completion], device=device)).logits[0].float().cpu()
    matcher = xgrammar.GrammarMatcher(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, logits.shape[-1])
    for step, token in enumerate(completion):
        matcher.fill_next_token_bitmask(bitmask)
        row = logits[len(prompt_ids) - 1 + step].clone()
        tol = 1e-4 + tolerance * (row.max() - row.min()).item()
        xgrammar.apply_token_bitmask_inplace(row.unsqueeze(0), bitmask)
        assert row[token].item() >= row.max().item() - tol, (step, token, row.argmax().item())
        assert matcher.accept_token(token), (step, token)
    assert matcher.is_terminated() and completion[-1] == EOS


def test_greedy_constrained_tokens_are_the_masked_argmax_of_transformers_logits(llm, mixed):
    prompts, params, outputs = mixed
    reference = load_reference(MODEL_DIR)
    grammars = reference_grammars(llm.tokenizer, reference.config.vocab_size)
    for i, kind in enumerate(CONSTRAINTS):
        assert_masked_greedy(reference, grammars[kind], llm.tokenizer.encode(prompts[1 + 2 * i]),
                             outputs[1 + 2 * i]["token_ids"])


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate([PROMPTS[0]], constrained("json", True, n=3), use_tqdm=False)[0]
    texts = [c["text"] for c in out["outputs"]]
    for c in out["outputs"]:
        assert c["finish_reason"] == "stop"
        check_text("json", c["text"])
    assert len(set(texts)) > 1


def test_choices_with_quotes_backslashes_newlines_and_unicode_are_matched_exactly(llm):
    choices = ['say "hi"', "back\\slash", "two\nlines", "tab\there", "ünï 😀"]
    compiled = llm.grammars.compile(StructuredOutputsParams(choice=choices))
    for choice in choices:
        matcher = llm.grammars.sample_grammar(compiled).matcher
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
        assert not llm.grammars.sample_grammar(compiled).matcher.accept_string(choice + "x"), choice
    params = SamplingParams(temperature=1.5, seed=1, n=8, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert {c["text"] for c in out["outputs"]} <= set(choices)
    assert all(c["finish_reason"] == "stop" for c in out["outputs"])


def test_json_object_and_whitespace(llm):
    """json_object: a JSON object (vLLM's {"type": "object"} schema); with any whitespace allowed
    (the default) a completion is still JSON valid against the schema."""
    outs = llm.generate(PROMPTS[:2], [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                       structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
        SamplingParams(temperature=0.7, seed=5, max_tokens=MAX_TOKENS,
                       structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA))),
    ], use_tqdm=False)
    assert isinstance(json.loads(outs[0]["text"]), dict)
    if outs[1]["finish_reason"] == "stop":  # any whitespace: the language is unbounded
        jsonschema.validate(json.loads(outs[1]["text"]), SCHEMA)
    else:
        assert outs[1]["text"].lstrip().startswith("{")


def test_stop_strings_and_max_tokens_cut_a_constrained_completion(llm):
    full = llm.generate([PROMPTS[0]], constrained("json", False), use_tqdm=False)[0]
    short = llm.generate([PROMPTS[0]], constrained("json", False, max_tokens=5), use_tqdm=False)[0]
    assert short["finish_reason"] == "length" and short["token_ids"] == full["token_ids"][:5]
    stopped = llm.generate([PROMPTS[0]], constrained("json", False, stop=['"id"']), use_tqdm=False)[0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == full["text"][: full["text"].index('"id"')]
    assert stopped["token_ids"] == full["token_ids"][: len(stopped["token_ids"])]


def test_ignore_eos_goes_on_unconstrained_after_the_grammar_ends(llm):
    """With ignore_eos the grammar's EOS does not end the request; past it the sample is
    unconstrained (vLLM's rule), up to max_tokens."""
    out = llm.generate([PROMPTS[1]], constrained("choice", False, ignore_eos=True, max_tokens=12),
                       use_tqdm=False)[0]
    tokens = out["token_ids"]
    assert out["finish_reason"] == "length" and len(tokens) == 12
    end = tokens.index(EOS)
    assert llm.tokenizer.decode(tokens[:end]) in CHOICES


@pytest.mark.parametrize("config", [
    {"overlap_scheduling": False},
    {"num_kvcache_blocks": 17, "max_num_batched_tokens": 24},  # preemption, chunked prompts in mixed steps
    {"mixed_steps": False, "enable_prefix_caching": False},
], ids=["no-overlap", "preemption", "prefill-only-steps"])
def test_outputs_are_the_same_under_other_schedules(mixed, config):
    """The same requests (greedy and seeded) give the same tokens without overlap scheduling, with
    preemption and recompute (a preempted sample's grammar keeps its place), and prefill-only steps."""
    prompts, params, outputs = mixed
    copies = 3  # the batch three times over: more than 17 blocks' worth of KV at once
    engine = cpu_llm(MODEL_DIR, kvcache_block_size=16, max_model_len=512, **config)
    try:
        again = engine.generate(prompts * copies, params * copies, use_tqdm=False)
        if "num_kvcache_blocks" in config:
            assert engine.scheduler.num_preemptions > 0
        assert engine.scheduler.num_constrained == 0
    finally:
        engine.exit()
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in outputs] * copies


def test_abort_a_constrained_request_mid_run(llm, mixed):
    """Aborting a constrained request under overlap scheduling (a step in flight holding it) leaves
    the others' tokens as they were; no constrained sample stays counted."""
    prompts, params, outputs = mixed
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    got: dict[int, list[int]] = {}
    for _ in range(6):
        for out in llm.step().finished:
            got[out.request_id] = out.token_ids
    victim = ids[1]  # the greedy json request: longer than six steps
    assert victim not in got
    llm.abort_request(victim)
    while not llm.is_finished():
        for out in llm.step().finished:
            got[out.request_id] = out.token_ids
    assert victim not in got
    assert [got[i] for i in ids if i != victim] == [o["token_ids"] for i, o in zip(ids, outputs) if i != victim]
    assert llm.scheduler.num_constrained == 0


def test_bad_structured_outputs_are_refused_and_the_engine_keeps_serving(llm, mixed):
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not JSON text"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(TypeError, match="JSON schema object"):
        StructuredOutputsParams(json=[1, 2])
    with pytest.raises(TypeError, match="non-empty list of strings"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(TypeError, match="non-empty list of strings"):
        StructuredOutputsParams(choice=["a", 1])
    with pytest.raises(TypeError, match="regex must be a non-empty string"):
        StructuredOutputsParams(regex=3)
    # lone surrogates: xgrammar's UnicodeEncodeError at the request, naming no field
    with pytest.raises(ValueError, match="StructuredOutputsParams.regex holds a lone surrogate '.udc80' at character 1"):
        StructuredOutputsParams(regex="a\udc80")
    with pytest.raises(ValueError, match="StructuredOutputsParams.choice entry holds a lone surrogate '.ud800'"):
        StructuredOutputsParams(choice=["yes", "\ud800"])
    with pytest.raises(ValueError, match="json_object must be True"):
        StructuredOutputsParams(json_object=False)
    with pytest.raises(TypeError, match="disable_any_whitespace must be a bool"):
        StructuredOutputsParams(regex="a", disable_any_whitespace="yes")
    with pytest.raises(TypeError, match="structured_outputs must be StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})
    # contents that do not compile are refused when the request arrives, naming the field
    bad = {"regex": StructuredOutputsParams(regex="(unclosed"),
           "json": StructuredOutputsParams(json={"type": "nonsense"}),
           "grammar": StructuredOutputsParams(grammar='root ::= undefined_rule')}
    good = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for name, spec in bad.items():
        with pytest.raises(ValueError, match=f"StructuredOutputsParams.{name} .* cannot be compiled"):
            llm.generate(PROMPTS[:2], [good, SamplingParams(structured_outputs=spec)], use_tqdm=False)
        with pytest.raises(ValueError, match=f"StructuredOutputsParams.{name}"):
            llm.add_request(PROMPTS[0], SamplingParams(structured_outputs=spec))
    assert llm.is_finished()
    prompts, params, outputs = mixed
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == [o["token_ids"] for o in outputs]


def test_vllms_other_options_are_taken_where_they_change_nothing(llm):
    """vLLM's StructuredOutputsParams also has disable_additional_properties, whitespace_pattern,
    structural_tag (and older releases disable_fallback); code that passes them at values asking
    for what xgrammar does anyway (every field of a vLLM params object, as dataclasses.asdict gives
    them) gets the same completion, and other values are refused naming the field. They were a
    TypeError 'unexpected keyword argument' whatever their value."""
    vllm_defaults = {"disable_additional_properties": False, "whitespace_pattern": None, "structural_tag": None,
                     "disable_fallback": False}
    plain = constrained("json", False)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, **vllm_defaults)
    strict = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, disable_additional_properties=True,
                                     disable_fallback=True)
    served = llm.generate([PROMPTS[0]] * 3, [plain] + [dataclasses.replace(plain, structured_outputs=s)
                                                    for s in (spec, strict)], use_tqdm=False)
    assert [o["token_ids"] for o in served[1:]] == [served[0]["token_ids"]] * 2
    check_text("json", served[0]["text"])
    assert spec.whitespace_pattern is None and spec.structural_tag is None  # read as vLLM's attributes
    with pytest.raises(ValueError, match=r"whitespace_pattern='\[ \]\?' is not supported: .*disable_any_whitespace"):
        StructuredOutputsParams(json=SCHEMA, whitespace_pattern="[ ]?")
    with pytest.raises(ValueError, match="structural_tag='{}' is not supported"):
        StructuredOutputsParams(structural_tag="{}")
    with pytest.raises(TypeError, match="disable_additional_properties must be a bool, got 'yes'"):
        StructuredOutputsParams(regex="a", disable_additional_properties="yes")
    with pytest.raises(TypeError, match="disable_fallback must be a bool, got 1"):
        StructuredOutputsParams(regex="a", disable_fallback=1)


def test_a_model_without_a_tokenizer_refuses_structured_outputs(tmp_path):
    shutil.copy(Path(MODEL_DIR) / "config.json", tmp_path / "config.json")
    engine = cpu_llm(str(tmp_path), load_format="dummy", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=8)
    try:
        with pytest.raises(ValueError, match="structured outputs need the model's tokenizer"):
            engine.generate([[5, 6, 7]], SamplingParams(structured_outputs=CONSTRAINTS["choice"]), use_tqdm=False)
        assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0]["token_ids"]
    finally:
        engine.exit()


MISSING_LIBRARY = f"""
import sys
sys.modules["xgrammar"] = None  # Python's own spelling of "this module is not installed"
from nanovllm import LLM, SamplingParams
from nanovllm.sampling_params import StructuredOutputsParams
llm = LLM({MODEL_DIR!r}, device="cpu", kvcache_block_size=16, max_model_len=128)
assert llm.generate(["x = "], SamplingParams(max_tokens=3), use_tqdm=False)[0]["token_ids"]
try:
    llm.generate(["x = "], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"])), use_tqdm=False)
except ImportError as e:
    print("ImportError:", e)
assert llm.generate(["x = "], SamplingParams(max_tokens=3), use_tqdm=False)[0]["token_ids"]
llm.exit()
"""

NOT_IMPORTED = """
import sys
import nanovllm
from nanovllm.sampling_params import StructuredOutputsParams
StructuredOutputsParams(json={"type": "object"})
print("xgrammar imported:", "xgrammar" in sys.modules)
"""


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_without_xgrammar_a_structured_request_says_how_to_install_it():
    out = run_python(MISSING_LIBRARY)
    assert "ImportError: structured outputs need the xgrammar package" in out
    assert "pip install 'nanovllm[structured]'" in out


def test_import_nanovllm_does_not_import_xgrammar():
    assert "xgrammar imported: False" in run_python(NOT_IMPORTED)


def test_logits_rules_apply_to_constrained_rows_and_the_mask_wins(llm):
    """logit_bias reaches a constrained row (it picks the favoured choice) but cannot bring back a
    token the grammar forbids (a larger bias on one)."""
    forbidden = llm.tokenizer.encode(" x")[-1]
    for choice in CHOICES:
        favoured = llm.tokenizer.encode(choice)[0]
        out = llm.generate([PROMPTS[0]], constrained("choice", False, logit_bias={favoured: 50.0, forbidden: 100.0}),
                           use_tqdm=False)[0]
        assert out["text"] == choice and out["finish_reason"] == "stop", (choice, out)


@torch.no_grad()
def test_greedy_penalized_constrained_tokens_are_the_masked_penalized_argmax(llm):
    """Penalties and a grammar on one row: each greedy token is the argmax of transformers' logits
    masked by an xgrammar matcher, then penalized by vLLM's rules (repetition over prompt and
    output, presence and frequency over the output), computed here in float32."""
    rep, presence, frequency = 1.3, 0.5, 0.4
    params = constrained("json", False, repetition_penalty=rep, presence_penalty=presence,
                         frequency_penalty=frequency)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    check_text("json", out["text"])
    reference = load_reference(MODEL_DIR)
    grammar = reference_grammars(llm.tokenizer, reference.config.vocab_size)["json"]
    prompt_ids, completion = llm.tokenizer.encode(PROMPTS[0]), out["token_ids"]
    logits = reference(torch.tensor([prompt_ids + completion])).logits[0].float()
    matcher = xgrammar.GrammarMatcher(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, logits.shape[-1])
    for step, token in enumerate(completion):
        matcher.fill_next_token_bitmask(bitmask)
        row = logits[len(prompt_ids) - 1 + step].clone()
        xgrammar.apply_token_bitmask_inplace(row.unsqueeze(0), bitmask)
        seen = torch.tensor(sorted(set(prompt_ids + completion[:step])))
        row[seen] = torch.where(row[seen] > 0, row[seen] / rep, row[seen] * rep)
        counts = torch.bincount(torch.tensor(completion[:step], dtype=torch.int64), minlength=row.shape[0])
        row -= frequency * counts + presence * (counts > 0)
        assert row[token].item() >= row.max().item() - 1e-4, (step, token, row.argmax().item())
        assert matcher.accept_token(token), (step, token)
    assert matcher.is_terminated()


def test_structured_outputs_edited_after_construction_are_checked_when_added(llm):
    """The engine re-checks (and copies) a request's StructuredOutputsParams when it is added, as
    every other SamplingParams field: bad edits are refused, later edits do not reach it."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(regex="a"))
    params.structured_outputs.regex = 3
    with pytest.raises(TypeError, match="regex must be a non-empty string"):
        llm.add_request(PROMPTS[0], params)
    params.structured_outputs = StructuredOutputsParams(choice=CHOICES)
    params.structured_outputs.regex = "x"
    with pytest.raises(ValueError, match="got regex, choice"):
        llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert llm.is_finished()
    params.structured_outputs.regex = None
    request_id = llm.add_request(PROMPTS[0], params)
    params.structured_outputs.choice = ["nothing of the kind"]
    finished = []
    while not llm.is_finished():
        finished += llm.step().finished
    assert [o.request_id for o in finished] == [request_id] and finished[0].outputs[0].text in CHOICES


def test_accept_tokens_advances_each_grammar_and_marks_a_token_its_mask_forbids(llm):
    compiled = llm.grammars.compile(StructuredOutputsParams(choice=["ab", "cd"]))
    ab, zz = (llm.tokenizer.encode(text, add_special_tokens=False) for text in ("ab", "zz"))
    first, ended, refused = (llm.grammars.sample_grammar(compiled) for _ in range(3))
    assert ended.matcher.accept_string("cd") and ended.matcher.accept_token(sorted(llm.eos_token_ids)[0])
    accept_tokens([first, ended], [ab[0], zz[0]])  # the ended grammar is skipped, not refused
    for token in ab[1:]:
        accept_tokens([first], [token])
    assert first.matcher.is_completed() and ended.ended and not first.ended
    assert not (first.rejected or ended.rejected or refused.rejected)
    accept_tokens([refused, first], [zz[0], llm.tokenizer.eos_token_id])
    assert refused.rejected and not first.rejected and first.ended


def test_a_row_whose_rules_leave_its_grammar_nothing_ends_alone(llm, caplog):
    """allowed_token_ids disjoint from the grammar's tokens, or min_tokens banning the EOS that is all
    a finished choice allows: nothing of the row's mask is left, so its sample ends there (with the
    tokens it has, a warning logged); the other rows of the batch are those of a run without it."""
    alone = llm.generate([PROMPTS[1]], FREE[0], use_tqdm=False)[0].outputs[0].token_ids
    firsts = {llm.tokenizer.encode(c, add_special_tokens=False)[0] for c in CHOICES}
    disjoint = [t for t in range(100, 200) if t not in firsts][:3]
    with caplog.at_level(logging.WARNING, logger="nanovllm.engine.scheduler"):
        none_left, short, free = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], [
            constrained("choice", False, allowed_token_ids=disjoint),
            constrained("choice", True, min_tokens=MAX_TOKENS - 1),
            FREE[0]], use_tqdm=False)
    assert none_left.outputs[0].token_ids == [] and none_left.outputs[0].finish_reason == "stop"
    assert short.outputs[0].text in CHOICES and short.outputs[0].finish_reason == "stop"
    assert free.outputs[0].token_ids == alone
    assert sorted(r.getMessage().split(":")[0] for r in caplog.records if "leave no token allowed" in r.getMessage()) == [
        f"request {none_left.request_id}", f"request {short.request_id}"]
    assert llm.generate([PROMPTS[1]], FREE[0], use_tqdm=False)[0].outputs[0].token_ids == alone


@pytest.mark.parametrize("rule", ["min_tokens", "allowed_token_ids", "bad_words"])
def test_an_eos_the_rules_ban_ends_no_constrained_row(llm, caplog, rule):
    """Once a choice is complete its grammar allows only EOS, which min_tokens (short of it), an
    allowed_token_ids without it, or a bad word ending in it bans: nothing is left, and the row ends
    with its choice and a warning, without the EOS (vLLM's rules: no EOS before min_tokens, none outside
    allowed_token_ids), though on this model the sampler's pick from an all -inf row is the EOS (token 0),
    which the grammar takes."""
    choice_ids = {t for c in CHOICES for t in llm.tokenizer.encode(c, add_special_tokens=False)}
    extra = {"min_tokens": {"min_tokens": MAX_TOKENS - 1},
             "allowed_token_ids": {"allowed_token_ids": sorted(choice_ids)},
             "bad_words": {"bad_words": [llm.tokenizer.decode([EOS])]}}[rule]
    if rule == "bad_words":
        assert llm.tokenizer.encode(extra["bad_words"][0], add_special_tokens=False) == [EOS]
    with caplog.at_level(logging.WARNING, logger="nanovllm.engine.scheduler"):
        out = llm.generate([PROMPTS[0]], constrained("choice", False, **extra), use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES and EOS not in out.token_ids and out.finish_reason == "stop", out
    assert [r for r in caplog.records if "leave no token allowed" in r.getMessage()]


def test_the_grammar_cache_is_bounded_and_released_at_exit(tmp_path):
    """vLLM's xgrammar cache limit (512 MiB): distinct schemas used to stay compiled for the engine's
    life (~310 KiB each at a 151,936-token vocabulary). exit() drops the compiler with its cache."""
    engine = cpu_llm(MODEL_DIR, kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=16)
    try:
        params = [SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(
            json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}))
            for i in range(3)]
        engine.generate(["x"] * 3, params, use_tqdm=False)
        compiler = engine.grammars.compiler
        assert compiler.cache_limit_bytes == GRAMMAR_CACHE_BYTES
        assert 0 < compiler.get_cache_size_bytes() <= GRAMMAR_CACHE_BYTES
    finally:
        engine.exit()
    assert engine.grammars.compiler is None and engine.grammars.filler is None


# Schemas with a keyword xgrammar 0.2.9 compiles without enforcing it (the grammar accepts the violating
# instance): (schema, a violating instance the grammar would accept, the keyword named in the refusal).
UNENFORCED = [
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}, [1, 1], "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1], "contains"),
    ({"type": "number", "multipleOf": 0.5}, 0.3, "multipleOf"),
    ({"type": "string", "format": "regex"}, "(unclosed", "format"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "abcdef", "maxLength"),
    ({"not": {"type": "integer"}}, 1, "not"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, 9, "if"),
    ({"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]}, 9, "allOf"),
    ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i", "minimum": 5}, 1, "minimum"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, {"a": 1}, "dependentRequired"),
    ({"type": "object", "properties": {"t": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     {"t": [1, 1]}, "uniqueItems"),
]


@pytest.mark.parametrize("schema,violating,keyword", UNENFORCED, ids=[u[2] + str(i) for i, u in enumerate(UNENFORCED)])
def test_a_schema_keyword_xgrammar_would_not_enforce_is_refused(llm, schema, violating, keyword):
    """vLLM's xgrammar backend refuses such schemas (has_xgrammar_unsupported_json_features; its auto mode
    moves them to another backend): compiled as they are, the output could break the schema unnoticed."""
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(violating, schema, format_checker=jsonschema.FormatChecker())  # it breaks the schema...
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema))
    assert xgrammar.testing._is_grammar_accept_string(grammar, json.dumps(violating))  # ...and xgrammar allows it
    for spec in (StructuredOutputsParams(json=schema), StructuredOutputsParams(json=json.dumps(schema))):
        refusal = rf"StructuredOutputsParams.json .*: {keyword}( '\w+')? at #\S* is not enforced by xgrammar"
        with pytest.raises(ValueError, match=refusal):
            llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert llm.is_finished()


def test_schemas_xgrammar_enforces_are_served(llm):
    """Keywords xgrammar enforces are not refused, nor properties that merely share a keyword's name."""
    schemas = [
        {"type": "integer", "multipleOf": 7, "minimum": 10, "maximum": 30},
        {"type": "string", "format": "date"},
        {"type": "string", "pattern": "^[a-c]{2}$"},
        {"allOf": [{"type": "integer", "maximum": 5, "minimum": 0}]},
        {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": False, "maxItems": 2},
        {"$defs": {"i": {"type": "integer", "minimum": 0, "maximum": 9}}, "$ref": "#/$defs/i", "title": "digit"},
        {"type": "object", "properties": {"not": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "format": {"enum": ["x", "y"]}},
         "required": ["not", "format"], "additionalProperties": False},
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
              for s in schemas]
    for schema, out in zip(schemas, llm.generate([PROMPTS[0]] * len(schemas), params, use_tqdm=False)):
        assert out["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)


# Lark grammars, as vLLM's xgrammar backend reads them (a grammar with no `::=` outside comments is Lark:
# xgrammar's compile_lark), each with a regex its language is exactly.
LARK = {
    'start: "yes" | "no"': r"yes|no",
    '// a comment: root ::= "x"\n?start: pair\npair: NAME "=" DIGIT\nNAME: /[a-z]{1,4}/\n%import common.DIGIT':
        r"[a-z]{1,4}=[0-9]",
}


def test_lark_grammars_are_served_as_vllm_serves_them(llm):
    """vLLM's xgrammar backend compiles a grammar with no `::=` rule as Lark (start rule `start`);
    they were refused as EBNF ("Unexpected character: ':'")."""
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(grammar=g))
              for g in LARK]
    for shape, out in zip(LARK.values(), llm.generate([PROMPTS[2]] * len(LARK), params, use_tqdm=False)):
        assert out["finish_reason"] == "stop" and re.fullmatch(shape, out["text"]), out
    refusals = {"begin: undefined_rule": "line 1, column 1: no start rule found",  # the reason, not its caret line
                "start: foo": "line 1, column 8: unknown name 'foo'"}
    for grammar, reason in refusals.items():
        with pytest.raises(ValueError, match=rf"StructuredOutputsParams.grammar '{grammar}' cannot be compiled "
                                             rf"\(as Lark: no rule is written with ::=\): Lark error at {reason}$"):
            llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputsParams(grammar=grammar)),
                         use_tqdm=False)
    assert llm.is_finished()


@pytest.mark.parametrize("schema", [
    {"type": "object", "required": ["a"]},
    {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["a", "b"]},
    {"type": "object", "required": ["a"], "additionalProperties": True},
    {"type": "array", "items": {"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False}},
], ids=["no-properties", "one-undeclared", "additional-true", "nested"])
def test_a_required_property_the_schema_does_not_declare_is_refused(llm, schema):
    """xgrammar (0.2.9) drops a `required` name that `properties` does not declare: `{}` was served as
    valid against {"type": "object", "required": ["a"]}. Refused, as the other keywords it does not enforce."""
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema))
    violating = [{}] if schema["type"] == "array" else {"b": 1} if "properties" in schema else {}
    assert xgrammar.testing._is_grammar_accept_string(grammar, json.dumps(violating))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(violating, schema)
    with pytest.raises(ValueError, match=r"StructuredOutputsParams.json .*: required 'a' \(not in properties\) at "
                                         r"#\S* is not enforced by xgrammar"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)),
                     use_tqdm=False)
    assert llm.is_finished()


@pytest.mark.parametrize("schema,violating,keyword", [
    ({"anyOf": ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True},)}, [1, 1], "uniqueItems"),
    ({"type": "object", "required": ("a",)}, {}, "required 'a'"),
], ids=["anyOf-tuple", "required-tuple"])
def test_a_schema_dict_with_tuples_is_checked_as_the_json_xgrammar_compiles(llm, schema, violating, keyword):
    """A schema dict may hold tuples where JSON has arrays (json.dumps writes them so, and xgrammar
    compiles that text): the keywords xgrammar would not enforce are found in them too. They were
    looked for in lists only, so these schemas compiled and the violating instance could be served."""
    text = json.dumps(schema)
    assert xgrammar.testing._is_grammar_accept_string(xgrammar.Grammar.from_json_schema(text), json.dumps(violating))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(violating, json.loads(text))
    with pytest.raises(ValueError, match=f"StructuredOutputsParams.json .*: {keyword}.* is not enforced by xgrammar"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)),
                     use_tqdm=False)
    assert llm.is_finished()


def test_a_schema_that_is_not_json_data_is_refused_naming_the_field():
    """A dict holding a set (or NaN) is no JSON schema: it was json.dumps' TypeError at the request,
    naming no field (or xgrammar's parse error of the NaN that json.dumps wrote)."""
    with pytest.raises(TypeError, match=r"StructuredOutputsParams.json is not JSON data \(.*set.*\): \{'enum': \{1\}\}"):
        StructuredOutputsParams(json={"enum": {1}})
    with pytest.raises(TypeError, match=r"StructuredOutputsParams.json is not JSON data \(.*\): "
                                        r"\{'type': 'number', 'maximum': nan\}"):
        StructuredOutputsParams(json={"type": "number", "maximum": float("nan")})
    # JSON text holding a lone surrogate (not its \\ud800 escape): xgrammar's UnicodeEncodeError at the request
    with pytest.raises(ValueError, match=r"StructuredOutputsParams.json holds a lone surrogate '.ud800' at character 11"):
        StructuredOutputsParams(json='{"enum": ["\ud800"]}')


@pytest.mark.parametrize("ref", ["https://example.com/s.json", "other.json#/$defs/a", "#anchor"])
def test_a_ref_xgrammar_cannot_resolve_is_refused(llm, ref):
    """xgrammar (0.2.9) resolves only '#' and '#/...' references; any other $ref it compiles as any JSON
    value (a logged warning): `[0]` was served for {"$ref": "https://example.com/s.json"}."""
    grammar = xgrammar.Grammar.from_json_schema(json.dumps({"type": "object", "properties": {"a": {"$ref": ref}}}))
    assert xgrammar.testing._is_grammar_accept_string(grammar, '{"a": [0]}')
    for schema, where in (({"$ref": ref}, "#"), ({"type": "object", "properties": {"a": {"$ref": ref}}}, "#/properties/a")):
        with pytest.raises(ValueError, match=rf"StructuredOutputsParams.json .*: \$ref '{re.escape(ref)}' \(xgrammar "
                                             rf"resolves only '#' and '#/\.\.\.'\) at {re.escape(where)} is not enforced"):
            llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)),
                         use_tqdm=False)
    assert llm.is_finished()


# Constraints beside anyOf / oneOf / allOf, which xgrammar (0.2.9) compiles alone, dropping their siblings:
# (schema, a violating instance the grammar accepts, the sibling named, the combinator).
BESIDE_COMBINATOR = [
    ({"type": "string", "anyOf": [{"maxLength": 2}, {"pattern": "^a+$"}]}, 1, "type", "anyOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, [0], "type", "anyOf"),
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}], "required": ["a"]}, {}, "required", "oneOf"),
    ({"allOf": [{"type": "integer"}], "minimum": 5}, 1, "minimum", "allOf"),
]


@pytest.mark.parametrize("schema,violating,sibling,combinator", BESIDE_COMBINATOR,
                         ids=[f"{b[2]}-{b[3]}" for b in BESIDE_COMBINATOR])
def test_a_constraint_beside_anyof_oneof_or_allof_is_refused(llm, schema, violating, sibling, combinator):
    """xgrammar drops every sibling of anyOf / oneOf / allOf, as of a $ref: 1 was served for
    {"type": "string", "anyOf": [...]}. Refused naming the sibling; pydantic's siblings (title, default,
    description, examples, discriminator) constrain nothing and are served."""
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(violating, schema)
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema))
    assert xgrammar.testing._is_grammar_accept_string(grammar, json.dumps(violating))
    with pytest.raises(ValueError, match=rf"StructuredOutputsParams.json .*: {sibling} beside {combinator} at # is not "
                                         "enforced by xgrammar"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
    assert llm.is_finished()
    pydantic_shaped = {  # pydantic 2's model_json_schema() of Optional, Union and discriminated-union fields
        "$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}},
        "type": "object",
        "properties": {"a": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}], "default": None,
                             "description": "d", "title": "A"},
                       "e": {"anyOf": [{"type": "integer"}, {"type": "string"}], "examples": [1], "title": "E"},
                       "pet": {"oneOf": [{"$ref": "#/$defs/Cat"}], "discriminator": {"propertyName": "kind"},
                               "title": "Pet"}},
        "required": ["pet"]}
    assert unenforced_keyword(pydantic_shaped) is None


# Regexes with an escape of a letter that xgrammar (0.2.9) reads as the letter itself, where Python's re reads an
# anchor (\A, \Z) and PCRE an anchor, a class, a quote or a code point: (regex, text xgrammar takes, the escape).
LITERAL_ESCAPES = [(r"\Aab\Z", "AabZ", r"\A"), (r"ab\Z", "abZ", r"\Z"), (r"[a-c]+\z", "abz", r"\z"),
                   (r"\Qa.b\E", "Qa.bE", r"\Q"), (r"x\hy", "xhy", r"\h"), (r"a\Rb", "aRb", r"\R"),
                   (r"[\A-C]", "B", r"\A")]


@pytest.mark.parametrize("regex,taken,escape", LITERAL_ESCAPES, ids=[e[0] for e in LITERAL_ESCAPES])
def test_a_regex_escape_xgrammar_reads_as_its_letter_is_refused(llm, regex, taken, escape):
    """`\\Aab\\Z` was served as "AabZ": xgrammar reads an escape it does not know as the escaped letter.
    Refused naming the escape; the escapes it knows (classes, control characters, code points) and an
    escaped backslash before a letter are served."""
    assert xgrammar.testing._is_grammar_accept_string(xgrammar.Grammar.from_regex(regex), taken)
    with pytest.raises(ValueError, match=rf"StructuredOutputsParams.regex .*: {re.escape(escape)} is no escape "
                                         "xgrammar knows: it would match"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex)), use_tqdm=False)
    schema = {"type": "string", "pattern": regex}  # a schema's pattern goes through the same regex converter
    with pytest.raises(ValueError, match=rf"StructuredOutputsParams.json .*: pattern escape '{re.escape(re.escape(escape))}' "
                                         r"at # is not enforced by xgrammar"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
    assert llm.is_finished()
    known = r"^\d\D\w\W\s\S\t\n\r\f\v\x41\u00e9\U0001F600[\d\w\-\\]\\A$"
    assert llm.grammars.compile(StructuredOutputsParams(regex=known)) is not None
