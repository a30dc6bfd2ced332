"""StopStringMatcher (tokenizers' DecodeStream fed one token at a time) finds a stop string at the
token that completes it in the full decode, `tokenizer.decode(ids[:k])` being the reference: for
byte-level BPE (the shipped model's tokenizer, Qwen / Llama 3 style) and byte fallback
(Llama 2 style), characters split over tokens, special tokens kept or skipped. Also the completion
text of tokens that end inside a character (Detokenizer.text)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from checkpoints import whole_text
from nanovllm import SamplingParams
from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.engine.stop_strings import StopStringMatcher
from nanovllm.engine.text_stream import stream_decoder

MODEL_DIR = Path(__file__).resolve().parent.parent / "nanovllm" / "default_model"
# Multi-byte characters (2, 3 and 4 UTF-8 bytes) that the tokenizers split over several tokens.
TEXT = "def f(x):\n    return 'héllo wörld' + x  # 日本語 🎉🎉 <|im_end|> done <|im_end|>tail = a + b + c + d + e"


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama 2 style tokenizer: "▁" for spaces, a few letters and merges, every other character
    as its UTF-8 bytes (<0xNN> tokens), and a decoder that strips the leading space."""
    letters = "abcdefghijklmnopqrstuvwxyz▁'():#+\n"
    vocab = {"<unk>": 0} | {f"<0x{b:02X}>": 1 + b for b in range(256)}
    vocab |= {c: len(vocab) + i for i, c in enumerate(letters)}
    merges = [("▁", "d"), ("o", "n"), ("e", "l"), ("el", "l"), ("▁", "x")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   additional_special_tokens=["<|im_end|>"])


TOKENIZERS = {"byte_level": lambda: AutoTokenizer.from_pretrained(MODEL_DIR), "byte_fallback": byte_fallback_tokenizer}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


def first_stop_step(matcher: StopStringMatcher, ids: list[int]) -> int | None:
    """The 1-based count of tokens fed when the matcher first reports a stop."""
    return next((k for k, token in enumerate(ids, 1) if matcher.feed(token)), None)


@pytest.mark.parametrize("skip", [False, True])
def test_stop_found_at_the_token_that_completes_it(tokenizer, skip):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert any(len(tokenizer.decode([t])) == 0 or "\ufffd" in tokenizer.decode([t]) for t in ids)  # split chars
    stops = ["日本", "語 🎉", "🎉🎉", "é", "<|im_end|>", "done", "ld' + x", "f(x"]
    found = 0
    for stop in stops:
        expected = next((k for k in range(1, len(ids) + 1)
                         if stop in tokenizer.decode(ids[:k], skip_special_tokens=skip)), None)
        got = first_stop_step(StopStringMatcher([stop, "zzzz"], [], skip, stream_decoder(tokenizer)), ids)
        assert got == expected, (stop, skip)
        found += expected is not None
    # every stop but the one made of a skipped special token's text occurs
    assert found == len(stops) - skip
    assert ("<|im_end|>" in full) != skip


@pytest.mark.parametrize("stop", ["b + c + d + e", "return 'héllo wörld' + x"])
def test_stop_spanning_many_steps(tokenizer, stop):
    """A stop string spread over many tokens, each with less text than the stop, is found at the
    token that completes it (the text kept from earlier steps is the stop's length - 1: an earlier
    version cut it shorter, and missed these)."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert first_stop_step(StopStringMatcher([stop], [], False, stream_decoder(tokenizer)), ids) == next(
        k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))


def test_no_stream_decoder_without_a_tokenizers_backend():
    assert stream_decoder(None) is None
    assert isinstance(stream_decoder(AutoTokenizer.from_pretrained(MODEL_DIR)), Tokenizer)


def test_a_stop_already_found_is_not_found_again(tokenizer):
    """A short stop string inside the tail kept for a longer one (a match the first min_tokens tokens
    held, which did not end the request) is reported at the token that completes it and not at the
    tokens after it; its next occurrence is reported again."""
    ids = tokenizer.encode("a fin b c d e fig", add_special_tokens=False)
    matcher = StopStringMatcher(["fi", "z" * 20], [], skip_special_tokens=True,
                                decoder=stream_decoder(tokenizer))
    reported = [k for k, token in enumerate(ids, 1) if matcher.feed(token)]
    expected = [k for k in range(1, len(ids) + 1)
                if tokenizer.decode(ids[:k]).count("fi") > tokenizer.decode(ids[: k - 1]).count("fi")]
    assert len(expected) == 2 and reported == expected


def test_text_of_tokens_ending_inside_a_character(tokenizer):
    """max_tokens may cut a character split over tokens: the text is that of the tokens before it
    (vLLM's incremental text), never a trailing U+FFFD; whole characters are decoded as always."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detokenizer, params = Detokenizer(tokenizer), SamplingParams()
    cut = 0
    for k in range(1, len(ids) + 1):
        want = whole_text(tokenizer, ids[:k], skip_special_tokens=True)
        cut += want != tokenizer.decode(ids[:k], skip_special_tokens=True)
        assert detokenizer.text([], ids[:k], params) == want, k
    assert cut >= 3  # the text splits characters (2-, 3- and 4-byte ones)
