"""Token ids to the text of outputs: completions (with the request's decode options) and the
`decoded_token` of logprob entries (each id decoded alone, as vLLM does, and remembered: a
vocabulary's worth of strings at most). The text decoded token by token while a request runs (for
stop strings) is tokenizers' DecodeStream's (engine/stop_strings.py)."""

from __future__ import annotations

from collections.abc import Iterable

from nanovllm.outputs import Logprob
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

    def fill_decoded_tokens(self, entries: Iterable[dict[int, Logprob] | None]) -> None:
        """Set every entry's decoded_token (its id decoded alone, special tokens kept)."""
        if self.tokenizer is None:
            return
        texts = self._token_texts
        for entry in entries:
            if entry is None:
                continue
            for token_id, logprob in entry.items():
                text = texts.get(token_id)
                if text is None:
                    text = texts[token_id] = self.tokenizer.decode([token_id])
                logprob.decoded_token = text
