"""LLM.chat (vLLM's meaning): conversations rendered by the chat template, then generated.

Runs on the shipped default model (it has a chat template) on the CPU; a test checkpoint
(its tokenizer has no template) and a tokenizer-less directory give clear errors.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from checkpoints import TinyShape, build_checkpoint, cpu_llm
from nanovllm import SamplingParams

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


MALFORMED = [
    ("hello", TypeError, "messages must be a list"),
    ({"role": "user", "content": "hi"}, TypeError, "messages must be a list"),
    ([], ValueError, "messages is empty"),
    ([[]], ValueError, "conversation 0 is empty"),
    ([{"role": "user"}], ValueError, "conversation 0, message 0 has no 'content'"),
    ([{"content": "hi"}], ValueError, "has no 'role'"),
    ([{"role": "user", "content": 5}], TypeError, "'content' must be a str or a list of text parts, got int"),
    ([{"role": None, "content": "hi"}], TypeError, "'role' must be a str, got NoneType"),
    ([{"role": "user", "content": "hi"}, "oops"], TypeError, "conversation 0, message 1 must be a dict"),
    ([FIRST, "oops"], TypeError, "conversation 1 must be a list"),
    ([FIRST, [{"role": "user", "content": ["part"]}]], TypeError, "conversation 1, message 0: 'content' part 0 must be a dict"),
    ([[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]], ValueError,
     "'content' part 0 has type 'image_url'; only 'text' parts"),
    ([[{"role": "user", "content": [{"type": "text", "text": 3}]}]], TypeError, "part 0 needs a str 'text', got 3"),
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
