"""Stop strings, checked on the newly decoded text of each step (not the whole completion).

The completion is detokenized incrementally: each step decodes only the tokens since
the last emitted text, plus the tokens before them that the tokenizer needs to join
pieces (a word's leading space, a UTF-8 character split over byte-level tokens):

    completion ids:  [ .......... | prefix .. read | new ]
    text so far:     emitted up to `read`; decode(prefix..end) - decode(prefix..read) = delta

A stop string that spans steps is found because the search covers the last
len(longest stop) - 1 characters before the delta as well. Output text is cut at the
first stop string of the full decode once the request ends (see LLMEngine._output).
"""

from __future__ import annotations

# A decode that ends in this character stopped inside a multi-byte character: wait for more tokens.
REPLACEMENT_CHAR = "\ufffd"


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self.keep = max(map(len, stops)) - 1  # characters a match can reach back before the delta
        self.tail = ""  # the last `keep` characters of the emitted text
        self.prefix = 0  # completion tokens [prefix, read) give context for the next decode
        self.read = 0  # completion tokens [0, read) are emitted as text

    def feed(self, tokenizer, completion_ids: list[int]) -> bool:
        """Decode the completion's new tokens; True once a stop string appears in the text."""
        before = tokenizer.decode(completion_ids[self.prefix : self.read], skip_special_tokens=True)
        now = tokenizer.decode(completion_ids[self.prefix :], skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith(REPLACEMENT_CHAR):
            return False  # nothing printable yet
        window = self.tail + now[len(before) :]
        self.prefix, self.read = self.read, len(completion_ids)
        self.tail = window[len(window) - self.keep :] if self.keep else ""
        return any(s in window for s in self.stops)


def cut_at_stop(text: str, stops: list[str]) -> str:
    """text up to (not including) its first stop string; text itself if none occurs."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else text
