"""A completion's text as vLLM's incremental detokenizer makes it (engine/text_stream.py): decoded
after the end of the prompt, and a byte run that is not UTF-8 never an error. The reference is the full decode of prompt + completion less the prompt's, and for the
invalid-prefix case DecodeStream stepped by hand with vLLM's reset."""

from __future__ import annotations

import pytest
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizer

from checkpoints import TinyShape, build_checkpoint, cpu_llm
from nanovllm import SamplingParams
from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.engine.text_stream import PRIME_MAX_TOKENS, TextStream, completion_text, prompt_suffix, stream_decoder
from test_stop_strings import MODEL_DIR, TOKENIZERS, byte_fallback_tokenizer

PROMPTS = ["the quick brown fox jumps", "def f(x):\n    return 'héllo", "a", "日本語 🎉 done"]
COMPLETIONS = [" over the lazy dog", "d world' + x", "ll done", " 語 🎉🎉 fin"]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_completion_text_continues_the_prompt(name):
    """The text is what the completion adds to the prompt's full decode: a SentencePiece completion
    keeps the space its first word opens with (decoded alone, the decoder strips it)."""
    tokenizer = TOKENIZERS[name]()
    decoder = stream_decoder(tokenizer)
    for prompt, completion in zip(PROMPTS, COMPLETIONS):
        p, c = tokenizer.encode(prompt, add_special_tokens=False), tokenizer.encode(completion, add_special_tokens=False)
        whole, head = tokenizer.decode(p + c), tokenizer.decode(p)
        assert whole.startswith(head)
        assert completion_text(decoder, p, c, True) == whole[len(head):], (name, prompt)
        stream = TextStream(decoder, p, True)
        assert "".join(t for token in c if (t := stream.step(token)) is not None) == whole[len(head):]
    if name == "byte_fallback":
        p, c = tokenizer.encode("hello", add_special_tokens=False), tokenizer.encode(" done", add_special_tokens=False)
        assert completion_text(decoder, p, c, True).startswith(" ") and not tokenizer.decode(c).startswith("  ")


def test_a_prompt_that_ends_inside_a_character_stays_out_of_the_text():
    """A token-id prompt cut inside a character (an RL turn ended by max_tokens): the completion's
    text starts with the character its first token completes, never with the prompt's text (priming
    with DecodeStream's own prefill handed the whole prompt to the first step)."""
    tokenizer = TOKENIZERS["byte_level"]()
    decoder = stream_decoder(tokenizer)
    ids = tokenizer.encode("The capital is 日本", add_special_tokens=False)
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")  # the prompt ends inside 本
    prompt, completion = ids[:-1], ids[-1:] + tokenizer.encode(" ok", add_special_tokens=False)
    assert completion_text(decoder, prompt, completion, True) == "本 ok"
    stream = TextStream(decoder, prompt, True)
    assert [stream.step(t) for t in completion] == ["本", " ok"]


def test_prompt_suffix_is_vllms():
    """The shortest suffix of 4..23 tokens that decodes without U+FFFD; the whole of a short prompt."""
    tokenizer = TOKENIZERS["byte_level"]()
    decoder = stream_decoder(tokenizer)
    ids = tokenizer.encode("x " * 40, add_special_tokens=False)
    assert prompt_suffix(decoder, ids, True) == ids[-4:]
    assert prompt_suffix(decoder, ids[:3], True) == ids[:3]
    emoji = tokenizer.encode("🎉" * 30, add_special_tokens=False)
    got = prompt_suffix(decoder, emoji, True)
    assert "\ufffd" not in tokenizer.decode(got) and 4 <= len(got) < PRIME_MAX_TOKENS
    assert all("\ufffd" in tokenizer.decode(emoji[-n:]) for n in range(4, len(got)))


def reference_text(decoder, prompt: list[int], ids: list[int]) -> tuple[str, int]:
    """vLLM's recovery, by hand: the stream primed by stepping the (all-ASCII) prompt; a step that
    meets an invalid prefix starts a new, unprimed stream at that token. (text, resets)."""
    stream, pieces, resets = DecodeStream(skip_special_tokens=True), [], 0
    for token in prompt:
        stream.step(decoder, token)
    for token in ids:
        try:
            piece = stream.step(decoder, token)
        except Exception as e:
            assert str(e).startswith("Invalid prefix")
            stream, resets = DecodeStream(skip_special_tokens=True), resets + 1
            piece = stream.step(decoder, token)
        pieces.append(piece or "")
    return "".join(pieces), resets


@pytest.fixture(scope="module")
def byte_fallback_llm(tmp_path_factory):
    path = build_checkpoint(str(tmp_path_factory.mktemp("byte-fallback") / "model"), TinyShape())
    tokenizer = byte_fallback_tokenizer()
    tokenizer.save_pretrained(path)
    engine = cpu_llm(path, kvcache_block_size=16, max_model_len=128)
    yield engine
    engine.exit()


def test_bytes_that_are_not_utf8_never_raise(byte_fallback_llm):
    """'2' then the byte 0xAF then a word: decoded together the '2' turns into U+FFFD, and
    DecodeStream raised "Invalid prefix" out of generate() (losing the whole batch), from the stop
    matcher and from the output's text alike. Now the stream starts again there, as vLLM's does."""
    llm = byte_fallback_llm
    vocab = llm.tokenizer.get_vocab()
    bias = {vocab["<0x32>"]: 30.0, vocab["<0xAF>"]: 30.0, vocab["▁d"]: 30.0, vocab["o"]: 30.0}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True, logit_bias=bias, stop=stop)
              for s in range(12) for stop in (None, ["zzz"])]
    outs = llm.generate(["hello world"] * len(params), params, use_tqdm=False)
    decoder = stream_decoder(llm.tokenizer)
    prompt = llm.tokenizer.encode("hello world")
    resets = 0
    for out in outs:
        text, reset = reference_text(decoder, prompt, out.outputs[0].token_ids)
        assert out.outputs[0].text == text
        resets += reset
    assert resets > 0  # the workload does meet the invalid prefixes that used to raise


def test_shipped_tokenizer_texts_equal_decode():
    """Byte-level BPE: the continuation is the completion decoded alone (no priming effect)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    decoder = stream_decoder(tokenizer)
    p = tokenizer.encode("the quick brown")
    c = tokenizer.encode(" fox jumps over")
    assert completion_text(decoder, p, c, True) == tokenizer.decode(c)


def test_only_a_stop_token_is_left_out_of_the_text():
    """A sample that ended on EOS or a stop id shows its text without that token; one that ended
    otherwise with finish "stop" (its grammar and rules left no token allowed: no token appended)
    keeps its last token's text (it was dropped as if it were a stop token)."""
    from transformers import AutoTokenizer

    from nanovllm.engine.detokenizer import Detokenizer
    from nanovllm.engine.request import Request
    from nanovllm.engine.sequence import FinishReason

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    completion = tokenizer.encode(" the dog", add_special_tokens=False)
    texts = {}
    for on_stop_token in (False, True):
        request = Request.create(0, [0], tokenizer.encode("hello"), SamplingParams(max_tokens=8), rules=None,
                                 prompt=None, max_tokens=8)
        seq = request.samples[0]
        seq.token_ids += completion
        seq.finish_reason, seq.ended_on_stop_token = FinishReason.STOP, on_stop_token
        texts[on_stop_token] = request.output(Detokenizer(tokenizer)).outputs[0].text
    assert texts == {False: tokenizer.decode(completion), True: tokenizer.decode(completion[:-1])}


class PythonByteTokenizer(PreTrainedTokenizer):
    """A tokenizer without a tokenizers backend (transformers' Python one): one token per UTF-8 byte."""

    @property
    def vocab_size(self) -> int:
        return 256

    def get_vocab(self) -> dict[str, int]:
        return {chr(0x100 + b): b for b in range(256)} | self.added_tokens_encoder

    def _tokenize(self, text: str) -> list[str]:
        return [chr(0x100 + b) for b in text.encode()]

    def _convert_token_to_id(self, token: str) -> int:
        return ord(token) - 0x100

    def _convert_id_to_token(self, index: int) -> str:
        return chr(0x100 + index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(ord(t) - 0x100 for t in tokens).decode(errors="replace")


def test_a_python_tokenizers_text_never_ends_inside_a_character():
    """Without a tokenizers backend the completion is decoded whole: tokens that end inside a character
    (max_tokens cut it) add no text, as in vLLM's incremental text, where the final text ended with
    U+FFFD (the running outputs already left it out)."""
    tokenizer = PythonByteTokenizer()
    assert stream_decoder(tokenizer) is None
    ids = tokenizer.encode("ab 日本", add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer)
    texts = [detokenizer.text([], ids[:k], SamplingParams()) for k in range(1, len(ids) + 1)]
    assert texts == ["a", "ab", "ab ", "ab ", "ab ", "ab 日", "ab 日", "ab 日", "ab 日本"]
