"""Stop strings, checked on the newly decoded text of each step (not the whole completion).

The completion is detokenized incrementally as vLLM does it (engine/text_stream.py: tokenizers'
DecodeStream primed with the end of the prompt): each token appended yields the text it completes,
or None while it ends inside a character. feed() costs about 1.2 us a token (the shipped model's
tokenizer, CPU), against 10 us for the Python version it replaced. The text is the one the request's
output returns (engine/detokenizer.py), so a stop string found here is found there too. Stop
strings need a tokenizers-backed tokenizer (transformers' fast ones: every supported family).

A stop string that spans steps is found because the search covers the last
len(longest stop) - 1 characters before the new text as well; only a match that ends in the new
text counts, so an occurrence already seen (one the first min_tokens tokens held, which did not end
the request) is not found again while it sits in that tail. Output text is cut at the first stop
string of the full text once the request ends (before it, or after it with
include_stop_str_in_output; Request.output): when several end in the text of the step that ended
it, the first of them in `stop`'s order, wherever the others start (vLLM's check_stop_strings).
"""

from __future__ import annotations

from tokenizers import Tokenizer

from nanovllm.engine.text_stream import TextStream


class StopStringMatcher:
    def __init__(self, stops: list[str], prompt_ids: list[int], skip_special_tokens: bool, decoder: Tokenizer):
        self.stops = stops
        self.stream = TextStream(decoder, prompt_ids, skip_special_tokens)
        self.keep = max(map(len, stops)) - 1  # characters a match can reach back before the new text
        self.tail = ""  # the last `keep` characters of the text so far

    def feed(self, token_id: int) -> bool:
        """Decode the token just appended to the completion; True once a stop string appears in the text."""
        text = self.stream.step(token_id)
        if text is None:
            return False  # nothing printable yet
        window = self.tail + text
        new_from = len(self.tail)  # a match must end past this character, in the new text
        self.tail = window[-self.keep :] if self.keep else ""
        return any(window.find(s, max(0, new_from - len(s) + 1)) >= 0 for s in self.stops)


def cut_at_stop(text: str, stops: list[str], include: bool = False, after: int = 0) -> tuple[str, str | None]:
    """(text up to the first of `stops`, in their order, that occurs ending past character `after`,
    that string): the text ends before its first such occurrence, or after it when `include`;
    (text, None) if none occurs. `text` is that of a request a stop string ended, so every stop
    found here ends in the text of its last step, and the first listed is the one vLLM takes (not
    the one starting first). `after`: the length of the text of the first min_tokens tokens."""
    for stop in stops:
        index = text.find(stop, max(0, after - len(stop) + 1))
        if index >= 0:
            return text[: index + len(stop) if include else index], stop
    return text, None
