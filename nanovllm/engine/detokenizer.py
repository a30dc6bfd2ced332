"""Token ids to the text of outputs: completions (with the request's decode options) and the
`decoded_token` of logprob entries (each id decoded alone, as vLLM does, and remembered: a
vocabulary's worth of strings at most).

A completion's text is vLLM's incremental text (engine/text_stream.py: decoded after the end of
the prompt, no clean-up of spaces, nothing for a last token that ends inside a character), the text
stop strings are matched on while the request runs (engine/stop_strings.py). A tokenizer without
a tokenizers backend (transformers' Python ones) decodes the completion alone, less the U+FFFD of
tokens at its end that stop inside a character (vLLM's incremental text holds those back too).
"""

from __future__ import annotations

from nanovllm.engine.text_stream import REPLACEMENT, completion_text, stream_decoder
from nanovllm.outputs import FlatLogprobs
from nanovllm.sampling_params import SamplingParams


class Detokenizer:
    def __init__(self, tokenizer):
        self.set_tokenizer(tokenizer)

    def set_tokenizer(self, tokenizer) -> None:
        """Decode with `tokenizer` from now on (None: the model directory has none, texts stay
        empty); the token texts remembered for the old one are forgotten. In place: the step
        pipeline and llm_engine's output streams hold this object."""
        self.tokenizer = tokenizer
        self.decoder = stream_decoder(tokenizer)
        self._token_texts: dict[int, str] = {}

    def text(self, prompt_ids: list[int], token_ids: list[int], params: SamplingParams) -> str:
        """The text of completion `token_ids` after `prompt_ids` ("" with detokenize=False or
        without a tokenizer)."""
        if self.tokenizer is None or not params.detokenize:
            return ""
        if self.decoder is None:
            return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens,
                                         spaces_between_special_tokens=params.spaces_between_special_tokens,
                                         clean_up_tokenization_spaces=False).rstrip(REPLACEMENT)
        return completion_text(self.decoder, prompt_ids, token_ids, params.skip_special_tokens)

    def fill_decoded_tokens(self, entries: FlatLogprobs) -> None:
        """Give every item of `entries` its decoded_token (its id decoded alone, special tokens kept):
        those appended since the last call only, so a stream's outputs decode each token once."""
        if self.tokenizer is None:
            return
        if entries.decoded_tokens is None:
            entries.decoded_tokens = []
        known = self._token_texts.get  # a lookup per token (an empty text takes the slow way, also right)
        entries.decoded_tokens += [known(t) or self._token_text(t)
                                   for t in entries.token_ids[len(entries.decoded_tokens):]]

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text
