"""Stop strings, checked on the newly decoded text of each step (not the whole completion).

The completion is detokenized incrementally by tokenizers' DecodeStream: each token appended
yields the text it completes, or None while it ends inside a character (a UTF-8 character split
over byte-level tokens). DecodeStream keeps the few tokens before the new ones that decoding needs
to join pieces (a word's leading space, a split character), the way vLLM's and TGI's incremental
detokenizers do. It replaced a Python version of the same algorithm (two `tokenizer.decode` calls a
token): feed() took 10.0 us a token, now 1.2 us (the shipped model's tokenizer, 2,000 tokens of
stdlib code, CPU), with the same text for byte-level BPE (multi-byte characters split over tokens) and byte
fallback, `skip_special_tokens` on and off. `spaces_between_special_tokens` changes nothing there:
transformers 5's tokenizers-backed decode ignores it too. The text equals `tokenizer.decode` for
BPE tokenizers (every supported family) under transformers 5; where transformers cleans up spaces
around punctuation (its `clean_up_tokenization_spaces`: non-BPE tokenizers, or any under transformers
4), the stream does not, and a stop string that holds such a space is judged on the stream's text.

A stop string that spans steps is found because the search covers the last
len(longest stop) - 1 characters before the new text as well; only a match that ends in the new
text counts, so an occurrence already seen (one the first min_tokens tokens held, which did not end
the request) is not found again while it sits in that tail. Output text is cut at the first stop
string of the full decode once the request ends (before it, or after it with
include_stop_str_in_output; Request.output).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


def stream_decoder(tokenizer) -> Tokenizer | None:
    """The tokenizers.Tokenizer a DecodeStream steps through: the one behind a transformers
    tokenizer (None for a tokenizer without one, e.g. transformers' Python-backend tokenizers,
    or no tokenizer at all)."""
    return getattr(tokenizer, "backend_tokenizer", None)


class StopStringMatcher:
    def __init__(self, stops: list[str], skip_special_tokens: bool, decoder: Tokenizer):
        self.stops = stops
        self.decoder = decoder
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.keep = max(map(len, stops)) - 1  # characters a match can reach back before the new text
        self.tail = ""  # the last `keep` characters of the text so far

    def feed(self, token_id: int) -> bool:
        """Decode the token just appended to the completion; True once a stop string appears in the text."""
        text = self.stream.step(self.decoder, token_id)
        if text is None:
            return False  # nothing printable yet
        window = self.tail + text
        new_from = len(self.tail)  # a match must end past this character, in the new text
        self.tail = window[-self.keep :] if self.keep else ""
        return any(window.find(s, max(0, new_from - len(s) + 1)) >= 0 for s in self.stops)


def cut_at_stop(text: str, stops: list[str], include: bool = False, after: int = 0) -> tuple[str, str | None]:
    """(text up to its first stop string ending past character `after`, that string): the text ends
    before it, or after it when `include`; (text, None) if none occurs. Among stops found at the same
    place the first listed wins. `after`: the length of the text of the first min_tokens tokens."""
    hits = [(i, n, stop) for n, stop in enumerate(stops) if (i := text.find(stop, max(0, after - len(stop) + 1))) >= 0]
    if not hits:
        return text, None
    index, _, stop = min(hits)
    return text[: index + len(stop) if include else index], stop
