"""Token ids to the text of outputs: completions (with the request's decode options) and the
`decoded_token` of logprob entries (each id decoded alone, as vLLM does, and remembered: a
vocabulary's worth of strings at most). The text decoded token by token while a request runs (for
stop strings) is tokenizers' DecodeStream's (engine/stop_strings.py)."""

from __future__ import annotations

from collections.abc import Iterable

from nanovllm.outputs import FlatLogprobs, Logprob
from nanovllm.sampling_params import SamplingParams


def decode_options(params: SamplingParams) -> dict:
    """The tokenizer.decode keywords of a request."""
    return {"skip_special_tokens": params.skip_special_tokens,
            "spaces_between_special_tokens": params.spaces_between_special_tokens}


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None: the model directory has no tokenizer (texts stay empty)
        self._token_texts: dict[int, str] = {}

    def text(self, token_ids: list[int], params: SamplingParams) -> str:
        """The completion's text ("" with detokenize=False or without a tokenizer)."""
        if self.tokenizer is None or not params.detokenize:
            return ""
        return self.tokenizer.decode(token_ids, **decode_options(params))

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
