"""Token ids to the text of outputs: completions (with the request's decode options) and the
`decoded_token` of logprob entries (each id decoded alone, as vLLM does, and remembered: a
vocabulary's worth of strings at most). The text decoded token by token while a request runs (for
stop strings) is tokenizers' DecodeStream's (engine/stop_strings.py)."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers.decoders import DecodeStream

from nanovllm.engine.stop_strings import stream_decoder
from nanovllm.outputs import FlatLogprobs, Logprob
from nanovllm.sampling_params import SamplingParams

# What decode gives for bytes that do not (yet) form a UTF-8 character.
REPLACEMENT = "\ufffd"


def decode_options(params: SamplingParams) -> dict:
    """The tokenizer.decode keywords of a request."""
    return {"skip_special_tokens": params.skip_special_tokens,
            "spaces_between_special_tokens": params.spaces_between_special_tokens}


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None: the model directory has no tokenizer (texts stay empty)
        self._token_texts: dict[int, str] = {}

    def text(self, token_ids: list[int], params: SamplingParams) -> str:
        """The completion's text ("" with detokenize=False or without a tokenizer). Tokens that end
        inside a character (max_tokens cut it) add nothing, as in vLLM's incremental text, instead of
        a trailing U+FFFD."""
        if self.tokenizer is None or not params.detokenize:
            return ""
        text = self.tokenizer.decode(token_ids, **decode_options(params))
        if text.endswith(REPLACEMENT):
            text = self.tokenizer.decode(token_ids[: len(token_ids) - self._held(token_ids, params)],
                                         **decode_options(params))
        return text

    def _held(self, token_ids: list[int], params: SamplingParams) -> int:
        """How many of the last tokens an incremental decode still holds (they end inside a character)."""
        decoder = stream_decoder(self.tokenizer)
        if decoder is None:
            return 0
        stream, held = DecodeStream(skip_special_tokens=params.skip_special_tokens), 0
        for token_id in token_ids:
            held = 0 if stream.step(decoder, token_id) is not None else held + 1
        return held

    def fill_decoded_tokens(self, entries: Iterable[dict[int, Logprob] | None] | FlatLogprobs) -> None:
        """Set every entry's decoded_token (its id decoded alone, special tokens kept)."""
        if self.tokenizer is None:
            return
        if isinstance(entries, FlatLogprobs):
            known = self._token_texts.get  # a lookup per token (an empty text takes the slow way, also right)
            entries.decoded_tokens = [known(t) or self._token_text(t) for t in entries.token_ids]
            return
        for entry in entries:
            if entry is None:
                continue
            for token_id, logprob in entry.items():
                logprob.decoded_token = self._token_text(token_id)

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text
