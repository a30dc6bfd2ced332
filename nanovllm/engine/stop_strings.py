"""Stop strings, checked on the newly decoded text of each step (not the whole completion).

The completion is detokenized incrementally: each step decodes only the tokens since
the last emitted text, plus the tokens before them that the tokenizer needs to join
pieces (a word's leading space, a UTF-8 character split over byte-level tokens):

    completion ids:  [ .......... | prefix .. read | new ]
    text so far:     emitted up to `read`; decode(prefix..end) - decode(prefix..read) = delta

A stop string that spans steps is found because the search covers the last
len(longest stop) - 1 characters before the delta as well. Text is decoded with the request's
options (skip_special_tokens, ...). Output text is cut at the first stop string of the full decode
once the request ends (before it, or after it with include_stop_str_in_output; Request.output).
"""

from __future__ import annotations

# A decode that ends in this character stopped inside a multi-byte character: wait for more tokens.
REPLACEMENT_CHAR = "\ufffd"


class StopStringMatcher:
    def __init__(self, stops: list[str], decode_options: dict):
        self.stops = stops
        self.decode_options = decode_options  # tokenizer.decode keywords of the request
        self.keep = max(map(len, stops)) - 1  # characters a match can reach back before the delta
        self.tail = ""  # the last `keep` characters of the emitted text
        self.prefix = 0  # completion tokens [prefix, read) give context for the next decode
        self.read = 0  # completion tokens [0, read) are emitted as text

    def feed(self, tokenizer, completion_ids: list[int]) -> bool:
        """Decode the completion's new tokens; True once a stop string appears in the text."""
        before = tokenizer.decode(completion_ids[self.prefix : self.read], **self.decode_options)
        now = tokenizer.decode(completion_ids[self.prefix :], **self.decode_options)
        if len(now) <= len(before) or now.endswith(REPLACEMENT_CHAR):
            return False  # nothing printable yet
        window = self.tail + now[len(before) :]
        self.prefix, self.read = self.read, len(completion_ids)
        self.tail = window[len(window) - self.keep :] if self.keep else ""
        return any(s in window for s in self.stops)


def cut_at_stop(text: str, stops: list[str], include: bool = False, after: int = 0) -> tuple[str, str | None]:
    """(text up to its first stop string ending past character `after`, that string): the text ends
    before it, or after it when `include`; (text, None) if none occurs. Among stops found at the same
    place the first listed wins. `after`: the length of the text of the first min_tokens tokens."""
    hits = [(i, n, stop) for n, stop in enumerate(stops) if (i := text.find(stop, max(0, after - len(stop) + 1))) >= 0]
    if not hits:
        return text, None
    index, _, stop = min(hits)
    return text[: index + len(stop) if include else index], stop
