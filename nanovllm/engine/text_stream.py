"""A completion's text as vLLM's incremental detokenizer makes it: tokenizers' DecodeStream, primed
with the end of the prompt, stepped over the completion's tokens.

Priming matters where a token's text depends on the one before it: a SentencePiece (Metaspace)
tokenizer drops the leading space of a text's first word and WordPiece writes a word's
continuation as "##ed", so the completion decoded alone ("Paris.") differs from its text after the
prompt (" Paris."). vLLM primes with the shortest prompt suffix of PRIME_MIN_TOKENS ..
PRIME_MAX_TOKENS - 1 tokens that decodes without a U+FFFD (a suffix that starts inside a character
would give one), else the whole prompt; so does this. For byte-level BPE (Qwen, Llama 3) the text
equals the completion decoded alone.

    prompt  ... | p-4 p-3 p-2 p-1 |  c0 c1 c2 ...     (primed: its text is not output)
                  suffix             completion -> text

A token that ends inside a character (a UTF-8 character split over byte tokens) adds nothing
until the character is complete. DecodeStream raises on a byte run that is not UTF-8 followed by
a token that changes how it decodes ("Invalid prefix"); the stream then starts again from that
token, unprimed, as vLLM does.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# vLLM's priming window: suffixes of PRIME_MIN_TOKENS .. PRIME_MAX_TOKENS - 1 prompt tokens.
PRIME_MIN_TOKENS = 4
PRIME_MAX_TOKENS = 24
# What decode gives for bytes that do not (yet) form a UTF-8 character.
REPLACEMENT = "\ufffd"
# DecodeStream's error when the text so far no longer starts with what it already returned.
INVALID_PREFIX = "Invalid prefix encountered"


def _invalid_prefix(error: Exception) -> bool:
    """Whether DecodeStream raised `error` for an invalid prefix (the one error a stream recovers from)."""
    return str(error).startswith(INVALID_PREFIX)


def stream_decoder(tokenizer) -> Tokenizer | None:
    """The tokenizers.Tokenizer a DecodeStream steps through: the one behind a transformers
    tokenizer (None for a tokenizer without one, e.g. transformers' Python-backend tokenizers,
    or no tokenizer at all)."""
    return getattr(tokenizer, "backend_tokenizer", None)


def prompt_suffix(decoder: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The prompt tokens a stream is primed with (vLLM's rule, module docstring)."""
    if len(prompt_ids) <= PRIME_MIN_TOKENS:
        return list(prompt_ids)
    for n in range(PRIME_MIN_TOKENS, min(len(prompt_ids) + 1, PRIME_MAX_TOKENS)):
        suffix = prompt_ids[-n:]
        if REPLACEMENT not in decoder.decode(suffix, skip_special_tokens=skip_special_tokens):
            return suffix
    return list(prompt_ids)


class TextStream:
    """The text of tokens appended one at a time after a prompt (`step`)."""

    def __init__(self, decoder: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self.decoder = decoder
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # primed by stepping, as vLLM primes: DecodeStream's own prefill would hand the text of a
        # prompt that ends inside a character to the first completion step
        for token_id in prompt_suffix(decoder, prompt_ids, skip_special_tokens):
            self.step(token_id)

    def step(self, token_id: int) -> str | None:
        """The text `token_id` completes (None while it ends inside a character)."""
        try:
            return self.stream.step(self.decoder, token_id)
        except Exception as e:  # tokenizers raises a plain Exception
            if not _invalid_prefix(e):
                raise
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self.stream.step(self.decoder, token_id)


def completion_text(decoder: Tokenizer, prompt_ids: list[int], token_ids: list[int], skip_special_tokens: bool) -> str:
    """The text of `token_ids` after `prompt_ids`, as a TextStream stepped over them gives it: in one
    call into tokenizers when that text holds no U+FFFD (the usual case: every byte run is UTF-8, so
    no step could have met an invalid prefix, and the last token completes its character), else
    token by token."""
    if not token_ids:
        return ""
    try:
        text = TextStream(decoder, prompt_ids, skip_special_tokens).stream.step(decoder, token_ids)
    except Exception as e:  # tokenizers raises a plain Exception
        if not _invalid_prefix(e):
            raise
        text = None
    if text is not None and REPLACEMENT not in text:
        return text
    stream = TextStream(decoder, prompt_ids, skip_special_tokens)
    return "".join(piece for t in token_ids if (piece := stream.step(t)) is not None)
