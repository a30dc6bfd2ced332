"""LLM.chat (vLLM's meaning): conversations rendered by the chat template, tokenized without special
tokens, then generated.

Runs on the shipped default model (it has a chat template) on the CPU; a test checkpoint
(its tokenizer has no template) and a tokenizer-less directory give clear errors; a test tokenizer
that adds a BOS (as Llama 3's does) gets one BOS, not two; the template options vLLM takes.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from checkpoints import TinyShape, build_checkpoint, cpu_llm
from nanovllm import SamplingParams, TokensPrompt

MODEL_DIR = Path(__file__).resolve().parent.parent / "nanovllm" / "default_model"
GREEDY = SamplingParams(temperature=0, max_tokens=8)
FIRST = [{"role": "user", "content": "Write a function that reverses a list."}]
SECOND = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Read a config file."},
    {"role": "assistant", "content": "def read_config(path):\n    pass"},
    {"role": "user", "content": "Now parse it as JSON."},
]


@pytest.fixture(scope="module")
def llm():
    engine = cpu_llm(str(MODEL_DIR), kvcache_block_size=16, max_model_len=512, num_kvcache_blocks=64)
    yield engine
    engine.exit()


def rendered(llm, conversation) -> str:
    return llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def test_chat_equals_generate_on_the_rendered_prompt(llm):
    prompt = rendered(llm, FIRST)
    assert "reverses a list" in prompt
    [chat] = llm.chat(FIRST, GREEDY, use_tqdm=False)
    [plain] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert chat["token_ids"] == plain["token_ids"] and len(chat["token_ids"]) > 0
    assert chat == plain


def test_one_conversation_or_a_list_of_them(llm):
    assert len(llm.chat(FIRST, GREEDY, use_tqdm=False)) == 1
    both = llm.chat([FIRST, SECOND], GREEDY, use_tqdm=False)
    assert len(both) == 2
    expected = llm.generate([rendered(llm, FIRST), rendered(llm, SECOND)], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in both] == [o["token_ids"] for o in expected]
    # one SamplingParams per conversation, as generate() takes one per prompt
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    longer = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.chat([FIRST, SECOND], [short, longer], use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [2, 5]
    assert outs[0]["token_ids"] == both[0]["token_ids"][:2]


def test_an_empty_list_is_a_batch_of_no_conversations(llm):
    """vLLM's LLM.chat reads a list whose first item is a list as a batch (is_list_of: an empty list
    too), so chat([]) has no outputs, as generate([]); [[]] is one conversation of no messages,
    which no template renders (MALFORMED)."""
    assert llm.chat([], GREEDY, use_tqdm=False) == []
    assert llm.chat([]) == []  # the default params and progress bar
    assert llm.is_finished()
    assert len(llm.chat([FIRST], GREEDY, use_tqdm=False)) == 1


MALFORMED = [
    ("hello", TypeError, "messages must be a list"),
    ({"role": "user", "content": "hi"}, TypeError, "messages must be a list"),
    ([[]], ValueError, "conversation 0 is empty"),
    ((), ValueError, "conversation 0 is empty"),  # not a list: one conversation (vLLM's reading), of no messages
    ([{"content": "hi"}], ValueError, "has no 'role'"),
    ([{"role": "user", "content": 5}], TypeError, "'content' must be a str or a list of text parts, got int"),
    ([{"role": None, "content": "hi"}], TypeError, "'role' must be a str, got NoneType"),
    ([{"role": "user", "content": "hi"}, "oops"], TypeError, "conversation 0, message 1 must be a dict"),
    ([FIRST, "oops"], TypeError, "conversation 1 must be a list"),
    ([FIRST, [{"role": "user", "content": [3]}]], TypeError, "conversation 1, message 0: 'content' part 0 must be a str or a dict"),
    ([[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]], ValueError,
     "'content' part 0 has type 'image_url'; only text parts \\('text', 'input_text', 'output_text', 'refusal', "
     "'thinking'\\)"),
    ([[{"role": "user", "content": [{"type": "text", "text": 3}]}]], TypeError, "part 0 needs a str 'text', got 3"),
    # a lone surrogate in a content (or a role) reached the tokenizer: its 'TextEncodeInput must be Union' TypeError
    ([FIRST, [{"role": "user", "content": "the \udc80"}]], ValueError,
     "conversation 1 \\(as the chat template rendered it\\) holds a lone surrogate '.udc80'"),
]


@pytest.mark.parametrize("messages,exc,words", MALFORMED, ids=[repr(m)[:30] for m, _, _ in MALFORMED])
def test_malformed_messages_are_refused(llm, messages, exc, words):
    with pytest.raises(exc, match=words):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert llm.is_finished()  # nothing was queued


def test_model_without_chat_template_is_a_clear_error(tmp_path):
    path = build_checkpoint(str(tmp_path / "no-template"), TinyShape())
    llm = cpu_llm(path, kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=8)
    try:
        assert llm.tokenizer is not None and not llm.tokenizer.chat_template  # the test tokenizer has none
        with pytest.raises(ValueError, match=re.escape(repr(path)) + ".*no chat template"):
            llm.chat(FIRST, GREEDY, use_tqdm=False)
        assert llm.is_finished()
        assert llm.chat([], GREEDY, use_tqdm=False) == []  # nothing to render needs no template (vLLM's)
        assert len(llm.generate(["the quick brown fox"], GREEDY, use_tqdm=False)) == 1
    finally:
        llm.exit()


def test_model_without_tokenizer_is_a_clear_error(tmp_path):
    path = tmp_path / "config-only"
    path.mkdir()
    shutil.copy(os.path.join(MODEL_DIR, "config.json"), path / "config.json")
    llm = cpu_llm(str(path), load_format="dummy", kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=8)
    try:
        assert llm.tokenizer is None
        with pytest.raises(ValueError, match=re.escape(repr(str(path))) + ".*no tokenizer"):
            llm.chat(FIRST, GREEDY, use_tqdm=False)
    finally:
        llm.exit()


# ---------------------------------------------------------------- a tokenizer that adds a BOS (Llama 3's way)
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def bos_llm(tmp_path_factory):
    """A test checkpoint whose tokenizer prepends a BOS (<|endoftext|>, id 0) to every encode and
    whose chat template writes one too."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    path = build_checkpoint(str(tmp_path_factory.mktemp("bos") / "model"), TinyShape())
    backend = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    backend.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                            chat_template=BOS_TEMPLATE).save_pretrained(path)
    engine = cpu_llm(path, kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=32)
    yield engine
    engine.exit()


def test_an_empty_text_is_its_bos_where_the_tokenizer_adds_one(bos_llm):
    """vLLM refuses a prompt of no tokens, not an empty text: "" (or {"prompt": ""}) under a tokenizer
    that adds a BOS is the prompt [BOS], as vLLM's generate("") with Llama's; it was refused as an
    empty string. Without a BOS it is still refused (tests/test_reliability.py)."""
    outs = bos_llm.generate(["", {"prompt": ""}], GREEDY, use_tqdm=False)
    assert [(o.prompt, o.prompt_token_ids) for o in outs] == [("", [0]), ("", [0])]
    assert outs[0]["token_ids"] == bos_llm.generate([[0]], GREEDY, use_tqdm=False)[0]["token_ids"]


@pytest.mark.parametrize("keep", [1, 4, 9])
def test_truncate_prompt_tokens_keeps_a_text_prompts_bos(bos_llm, keep):
    """vLLM cuts a text prompt with truncate_prompt_tokens=k by its tokenizer's own truncation, from the
    left (it loads tokenizers with truncation_side="left"): the BOS the tokenizer adds stays, before the
    text's last k - 1 tokens. nanovllm kept the last k tokens, the BOS dropped. Token ids are cut as given."""
    text = "the quick brown fox jumps over a lazy dog"
    reference = copy.deepcopy(bos_llm.tokenizer)
    reference.truncation_side = "left"
    expected = reference.encode(text, truncation=True, max_length=keep)
    assert expected[0] == 0 and len(expected) == keep < len(reference.encode(text))
    params = SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=keep)
    whole = bos_llm.tokenizer.encode(text)
    outs = bos_llm.generate([text, {"prompt": text}, {"prompt_token_ids": whole}, expected],
                            [params, params, params, GREEDY], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [expected, expected, whole[-keep:], expected]
    assert outs[0].outputs[0].token_ids == outs[3].outputs[0].token_ids[:4]


def test_a_bos_adding_tokenizer_gives_one_bos(bos_llm):
    conversation = [{"role": "user", "content": "the quick brown fox"}]
    text = bos_llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|endoftext|>user:") and bos_llm.tokenizer.encode(text)[:2] == [0, 0]  # the trap
    [out] = bos_llm.chat(conversation, GREEDY, use_tqdm=False)
    assert out.prompt == text
    assert out.prompt_token_ids == bos_llm.tokenizer.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids[0] == 0 and out.prompt_token_ids[1] != 0
    [same] = bos_llm.generate([{"prompt_token_ids": out.prompt_token_ids}], GREEDY, use_tqdm=False)
    assert same == out


def test_chat_template_options(bos_llm):
    conversation = [{"role": "user", "content": "the lazy dog"}, {"role": "assistant", "content": "jumps over"}]
    def prompt(**kwargs):
        return bos_llm.chat(conversation, GREEDY, use_tqdm=False, **kwargs)[0].prompt
    assert prompt().endswith("assistant: jumps over\nassistant:")
    assert prompt(add_generation_prompt=False).endswith("assistant: jumps over\n")
    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith("<no-think>assistant:")
    assert prompt(add_generation_prompt=False, continue_final_message=True).endswith("assistant: jumps over")
    own = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    assert prompt(chat_template=own, add_generation_prompt=False) == "<user>the lazy dog<assistant>jumps over"
    with pytest.raises(ValueError, match="continue_final_message=True needs add_generation_prompt=False"):
        prompt(continue_final_message=True)
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        prompt(chat_template_kwargs=["enable_thinking"])
    with pytest.raises(TypeError, match="chat_template_kwargs keys must be str .*, got 1"):  # was 'keywords must be strings'
        prompt(chat_template_kwargs={1: True})
    with pytest.raises(TypeError, match="add_generation_prompt must be a bool"):
        prompt(add_generation_prompt="yes")
    # vLLM's merge: chat_template_kwargs over the named options (checked as merged)
    assert prompt(chat_template_kwargs={"add_generation_prompt": False}) == prompt(add_generation_prompt=False)
    assert prompt(chat_template_kwargs={"chat_template": own, "add_generation_prompt": False}) == (
        "<user>the lazy dog<assistant>jumps over")
    assert prompt(add_generation_prompt=False, chat_template_kwargs={"continue_final_message": True}).endswith(
        "assistant: jumps over")
    with pytest.raises(ValueError, match="continue_final_message=True needs add_generation_prompt=False"):
        prompt(chat_template_kwargs={"continue_final_message": True})
    with pytest.raises(ValueError, match="must not set 'tokenize'"):
        prompt(chat_template_kwargs={"tokenize": True})
    # tools reach the template, as vLLM's chat(tools=...)
    with_tools = ("{% for t in tools %}[{{ t['name'] }}]{% endfor %}"
                  "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert prompt(chat_template=with_tools, tools=[{"name": "search"}]) == "[search]the lazy dogjumps over"
    assert bos_llm.is_finished()


def test_content_as_text_parts(bos_llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "the quick"}, {"type": "input_text", "text": "brown fox"}]}]
    joined = [{"role": "user", "content": "the quick\nbrown fox"}]
    assert bos_llm.chat(parts, GREEDY, use_tqdm=False) == bos_llm.chat(joined, GREEDY, use_tqdm=False)
    assert bos_llm.chat(parts, GREEDY, use_tqdm=False)[0].prompt == bos_llm.chat(joined, GREEDY, use_tqdm=False)[0].prompt


def test_content_format_follows_the_template(bos_llm):
    """vLLM's chat_template_content_format: "auto" hands a template that loops over a message's
    content its text parts, any other template one string; "string" / "openai" force either."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "the quick"}, "brown fox"]},
             {"role": "assistant", "content": "jumps over"}]
    loops = "{% for m in messages %}{% for p in m.content %}({{ p['text'] }}){% endfor %}{% endfor %}"
    plain = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"

    def prompt(template, content_format="auto"):
        return bos_llm.chat(parts, GREEDY, use_tqdm=False, chat_template=template, add_generation_prompt=False,
                            chat_template_content_format=content_format)[0].prompt

    assert prompt(loops) == prompt(loops, "openai") == "(the quick)(brown fox)(jumps over)"
    filtered = "{% for m in messages %}{% for p in m['content'] | selectattr('text') %}({{ p.text }}){% endfor %}{% endfor %}"
    assert prompt(filtered) == "(the quick)(brown fox)(jumps over)"
    # a loop over a slice of the content is one over the content too (vLLM's detection; it got one string)
    sliced = "{% for m in messages %}{% for p in m['content'][:1] %}({{ p.text }}){% endfor %}{% endfor %}"
    texts = {"user": ["the quick", "brown fox"], "assistant": ["jumps over"]}
    as_parts = [{"role": role, "content": [{"type": "text", "text": t} for t in ts]} for role, ts in texts.items()]
    assert prompt(sliced) == bos_llm.tokenizer.apply_chat_template(as_parts, chat_template=sliced, tokenize=False)
    assert prompt(sliced) == "(the quick)(jumps over)"
    # a loop over a variable named `content` (set from the message's): vLLM's detection reads it as a loop
    # over the content too; it got one string, whose characters have no .text (the contents vanished)
    named = ("{% for m in messages %}{% set content = m.content %}"
             "{% for p in content %}({{ p.text }}){% endfor %}{% endfor %}")
    assert prompt(named) == bos_llm.tokenizer.apply_chat_template(as_parts, chat_template=named, tokenize=False)
    assert prompt(named) == "(the quick)(brown fox)(jumps over)"
    assert prompt(plain) == prompt(plain, "string") == "<the quick\nbrown fox><jumps over>"
    assert prompt(plain, "openai").startswith("<[{'type': 'text', 'text': 'the quick'}")
    with pytest.raises(ValueError, match="chat_template_content_format must be one of 'auto', 'string', 'openai'"):
        prompt(plain, "parts")
    # vLLM's positional order: ..., chat_template, chat_template_content_format, add_generation_prompt
    [out] = bos_llm.chat(parts, GREEDY, False, None, loops, "auto", False)
    assert out.prompt == "(the quick)(brown fox)(jumps over)"
    with pytest.raises(ValueError, match="mm_processor_kwargs=.*text models only"):
        bos_llm.chat(parts, GREEDY, use_tqdm=False, mm_processor_kwargs={"num_crops": 4})
    # an array was read for its truth: NumPy's 'truth value ... is ambiguous', naming neither argument nor value
    with pytest.raises(ValueError, match=r"mm_processor_kwargs=array\(\[1, 2\]\): nanovllm serves text models only"):
        bos_llm.chat(parts, GREEDY, use_tqdm=False, mm_processor_kwargs=np.array([1, 2]))
    assert bos_llm.is_finished()


def test_auto_content_format_reads_the_named_template_that_renders(bos_llm):
    """A tokenizer with named templates (a dict: "default", "tool_use"): "auto" detects the content
    format of the one transformers renders with, as vLLM resolves it (get_chat_template). The dict
    itself was read as no template ("string"), so a default template looping over a message's content
    got one string and rendered a part per character. Reference: transformers' rendering of the
    conversation with its contents as text parts."""
    loops = "{% for m in messages %}{% for p in m.content %}({{ p.text }}){% endfor %}{% endfor %}"
    plain = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    named = copy.deepcopy(bos_llm.tokenizer)
    named.chat_template = {"default": loops, "tool_use": plain}
    conversation = [{"role": "user", "content": "the quick"}, {"role": "assistant", "content": "brown fox"}]
    as_parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in conversation]
    original = bos_llm.get_tokenizer()
    bos_llm.set_tokenizer(named)
    try:
        [out] = bos_llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False)
        assert out.prompt == named.apply_chat_template(as_parts, tokenize=False) == "(the quick)(brown fox)"
        tools = [{"name": "search"}]
        [out] = bos_llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False, tools=tools)
        assert out.prompt == named.apply_chat_template(conversation, tools=tools, tokenize=False)
    finally:
        bos_llm.set_tokenizer(original)


@pytest.mark.parametrize("template,index,words", [
    # a template's own refusal (Qwen's and Llama's raise_exception), a syntax error, an undefined read
    ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System first? No.') }}{% endif %}", 1,
     "System first"),
    ("{% for m in messages %}", 0, "Unexpected end of template"),
    ("{{ messages[3]['content'] }}", 0, "no element 3"),
    # errors of the template's operations, not jinja2's (they were raised as they were, naming no conversation)
    ("{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + 1 }}{% endif %}", 1,
     "TypeError: can only concatenate str"),
    ("{{ 1 // (messages | length - 1) }}", 0, "ZeroDivisionError"),
], ids=["raise_exception", "syntax", "undefined", "type_error", "zero_division"])
def test_a_template_error_is_a_value_error_naming_the_conversation(bos_llm, template, index, words):
    """As vLLM turns them (jinja2's errors were raised as they were, not a ValueError; so were others)."""
    with pytest.raises(ValueError, match=f"conversation {index}: the chat template failed: .*{words}"):
        bos_llm.chat([FIRST, SECOND], GREEDY, use_tqdm=False, chat_template=template, add_generation_prompt=False)
    assert bos_llm.is_finished() and len(bos_llm.chat(FIRST, GREEDY, use_tqdm=False)) == 1


def test_a_template_given_serves_a_tokenizer_without_one(tmp_path):
    path = build_checkpoint(str(tmp_path / "plain"), TinyShape())
    llm = cpu_llm(path, kvcache_block_size=16, max_model_len=128, num_kvcache_blocks=8)
    try:
        [out] = llm.chat(FIRST, GREEDY, use_tqdm=False, chat_template="{{ messages[0]['content'] }}",
                         add_generation_prompt=False)
        assert out.prompt == FIRST[0]["content"]
    finally:
        llm.exit()



def test_tool_call_turns_without_content(bos_llm):
    """vLLM's message shapes: content None or left out (an assistant turn of tool calls) is "", bare
    strings are text parts, and other keys (tool_calls) reach the template."""
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                "{% for c in m.get('tool_calls', []) %}[{{ c.function.name }}]{% endfor %}{% endfor %}")
    calls = [{"role": "user", "content": ["the quick", "brown fox"]},
             {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "search"}}]},
             {"role": "tool", "content": "the lazy dog"},
             {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "open"}}]}]
    [out] = bos_llm.chat(calls, GREEDY, use_tqdm=False, chat_template=template, add_generation_prompt=False)
    assert out.prompt == "<user>the quick\nbrown fox<assistant>[search]<tool>the lazy dog<assistant>[open]"


def test_tool_call_arguments_reach_the_template_as_dicts(bos_llm):
    """vLLM's message parsing: an assistant's tool call arguments, a JSON string in OpenAI's format,
    reach the template as the dict tool templates render with `tojson` (Llama 3.1's), whatever else a
    JSON string holds as it holds it (an array, a number: vLLM's json.loads), {} for a string that is
    not JSON or for None, a list given kept; an empty tool_calls list is dropped (the template takes
    its plain assistant path). The caller's messages are left as they were."""
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m.tool_calls is defined %}"
                "{% for c in m.tool_calls %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
                "{% else %}.{% endif %}{% endfor %}")
    calls = [{"role": "user", "content": "the weather?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "a", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
                 {"id": "b", "type": "function", "function": {"name": "time", "arguments": "not json"}},
                 {"id": "c", "type": "function", "function": {"name": "now", "arguments": None}},
                 {"id": "d", "type": "function", "function": {"name": "list", "arguments": {"n": 2}}},
                 {"id": "e", "type": "function", "function": {"name": "array", "arguments": "[1, 2]"}},
                 {"id": "f", "type": "function", "function": {"name": "number", "arguments": "42"}},
                 {"id": "g", "type": "function", "function": {"name": "given", "arguments": [3]}}]},
             {"role": "tool", "tool_call_id": "a", "content": "sunny"},
             {"role": "assistant", "content": "sunny", "tool_calls": []}]
    given = copy.deepcopy(calls)
    [out] = bos_llm.chat(calls, GREEDY, use_tqdm=False, chat_template=template, add_generation_prompt=False)
    assert out.prompt == ('<user>the weather?.<assistant>[weather {"city": "Paris"}][time {}][now {}][list {"n": 2}]'
                          "[array [1, 2]][number 42][given [3]]<tool>sunny.<assistant>sunny.")
    assert calls == given


def test_every_text_part_type_vllm_reads(bos_llm):
    """vLLM reads these content parts as text: "text", the Responses API's "input_text" and
    "output_text" (key "text"), OpenAI's assistant "refusal" (key "refusal") and "thinking" (key
    "thinking"); a history holding a refusal was refused."""
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "the quick"}]},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"},
                                               {"type": "output_text", "text": "brown"},
                                               {"type": "refusal", "refusal": "no fox"}]}]
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    [out] = bos_llm.chat(parts, GREEDY, use_tqdm=False, chat_template=template, add_generation_prompt=False)
    assert out.prompt == "<the quick><hmm\nbrown\nno fox>"
    with pytest.raises(TypeError, match="part 0 needs a str 'refusal', got 3"):
        bos_llm.chat([{"role": "assistant", "content": [{"type": "refusal", "refusal": 3}]}], GREEDY, use_tqdm=False)


def test_tokenization_kwargs_as_generate_takes_them(bos_llm):
    """vLLM's LLM.chat takes tokenization_kwargs (before mm_processor_kwargs); as generate, None or
    {} (the rendered text is tokenized without special tokens, nothing else); others are refused."""
    conversation = [{"role": "user", "content": "the quick brown fox"}]
    [plain] = bos_llm.chat(conversation, GREEDY, use_tqdm=False)
    assert bos_llm.chat(conversation, GREEDY, use_tqdm=False, tokenization_kwargs=None) == [plain]
    assert bos_llm.chat(conversation, GREEDY, False, None, None, "auto", True, False, None, None, {}, None) == [plain]
    with pytest.raises(ValueError, match="tokenization_kwargs=.*truncation"):
        bos_llm.chat(conversation, GREEDY, use_tqdm=False, tokenization_kwargs={"truncation": True})
    assert bos_llm.is_finished()
    # vLLM 0.17's spelling of SamplingParams.truncate_prompt_tokens: the rendered prompt's last tokens
    [cut] = bos_llm.chat(conversation, GREEDY, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 2})
    [want] = bos_llm.generate([TokensPrompt(prompt_token_ids=plain.prompt_token_ids[-2:])], GREEDY, use_tqdm=False)
    assert (cut.prompt_token_ids, cut.outputs[0].token_ids) == (plain.prompt_token_ids[-2:], want.outputs[0].token_ids)


def test_tool_results_reach_the_template_as_one_string(bos_llm):
    """vLLM (since its tool-content normalization) hands a tool message's content to the template as
    one string (text parts joined with newlines) under the "openai" content format too: tool
    templates render `m.content` as a string (clients such as Claude Code send tool results as parts)."""
    loops = ("{% for m in messages %}{% if m.content is string %}<{{ m.content }}>"
             "{% else %}{% for p in m.content %}({{ p.text }}){% endfor %}{% endif %}{% endfor %}")
    conversation = [{"role": "user", "content": [{"type": "text", "text": "the weather?"}]},
                    {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "weather"}}]},
                    {"role": "tool", "content": [{"type": "text", "text": "sunny"}, "warm"]},
                    {"role": "tool", "content": None}]
    for content_format in ("auto", "openai"):
        [out] = bos_llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=loops, add_generation_prompt=False,
                             chat_template_content_format=content_format)
        assert out.prompt == "(the weather?)<sunny\nwarm><>"


# The message loop of Llama 3.1's chat template (its tool-call branch is taken for any message holding the key).
LLAMA31_MESSAGES = (
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- if not message.tool_calls | length == 1 %}{{- raise_exception('only single tool-calls') }}{%- endif %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + tool_call.name + '(' }}"
    "{%- for name, value in tool_call.arguments | items %}{{ name }}={{ value }};{%- endfor %}"
    "{{- ')<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}")


def test_tool_calls_as_vllm_hands_them_to_llama31(bos_llm):
    """vLLM's _postprocess_messages on Llama 3.1's template: tool_calls that are not a list of
    function-call dicts are refused naming the message and call (they reached the template as given,
    where vLLM's parsing fails on them unnamed)."""
    def render(conversation):
        return bos_llm.tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=LLAMA31_MESSAGES)

    def chat(conversation):
        [out] = bos_llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=LLAMA31_MESSAGES,
                             add_generation_prompt=False)
        return out.prompt

    def call(arguments):
        return {"id": "a", "type": "function", "function": {"name": "weather", "arguments": arguments}}

    user = {"role": "user", "content": "the weather?"}
    assert chat([user, {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}')]}]) == render(
        [user, {"role": "assistant", "content": "", "tool_calls": [call({"city": "Paris"})]}])
    for calls, exc, words in (("weather", TypeError, "tool_calls must be a list"),
                              (["weather"], TypeError, "tool call 0 must be a dict"),
                              ([{"type": "custom", "custom": {"name": "w"}}], ValueError, "tool call 0 .*'function'"),
                              ([{"type": "function"}], ValueError, "tool call 0 .*'function'")):
        with pytest.raises(exc, match=f"conversation 0, message 1: {words}"):
            chat([user, {"role": "assistant", "content": None, "tool_calls": calls}])
    assert bos_llm.is_finished()
