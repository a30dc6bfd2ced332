"""The outputs `llm.llm_engine.step()` returns while a request runs, as its SamplingParams.output_kind
asks (vLLM's RequestOutputKind):

    CUMULATIVE   each step that adds to a request: every completion so far (token ids, text,
                 logprobs), finished=False; then the final output
    DELTA        the same steps, each completion only with what is new since the last output (and
                 only the completions with something new; the prompt's logprobs in the first, an
                 empty list in the later ones when asked for, else None: vLLM's pop of them)
    FINAL_ONLY   nothing until the final output

Texts grow as the final one will read: each sample's text is decoded incrementally (TextStream, as
stop strings are matched), and the last len(longest stop string) - 1 characters are held back while
it runs, unless include_stop_str_in_output (vLLM's rule): a stop string is never shown and then
taken back, so a DELTA's texts joined are the final text.

    text so far:  "The answer is 4# "          stop "###": hold back 2 characters
    shown:        "The answer is 4"            then finished: "The answer is 4" (cut at "###")
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.engine.request import Request
from nanovllm.engine.text_stream import TextStream
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import RequestOutputKind


@dataclass
class _Sent:
    """One sample's output so far: its text stream and what the caller was given."""

    stream: TextStream | None
    text: str = ""  # the text decoded so far (by `stream`)
    fed: int = 0  # completion tokens decoded into `text`
    tokens: int = 0  # completion tokens given
    chars: int = 0  # text characters given
    logprobs: int = 0  # logprobs entries given
    final: CompletionOutput | None = None  # its final completion, once finished (built once)
    finished: bool = False  # the final completion was given


@dataclass
class _Stream:
    """A request's outputs so far: whether they are deltas, and each sample's."""

    delta: bool
    samples: list[_Sent]


class OutputStreams:
    """Per running request (by engine id) that is not FINAL_ONLY: what its outputs gave so far.
    A step costs each request the work of its new tokens (and, CUMULATIVE, the copy of what it holds)."""

    def __init__(self, detokenizer: Detokenizer):
        self.detokenizer = detokenizer
        self._streams: dict[int, _Stream] = {}

    def running(self, request: Request) -> RequestOutput | None:
        """The output of a running request whose samples have new tokens (or a newly finished
        sample) since its last output; None when nothing is new, it has no token yet, or it is
        FINAL_ONLY."""
        stream = self._streams.get(request.request_id)
        if stream is None:
            kind = request.params.output_kind
            if kind is RequestOutputKind.FINAL_ONLY or not any(s.num_completion_tokens for s in request.samples):
                return None  # vLLM's first output comes with the first token
            stream = self._streams[request.request_id] = _Stream(
                kind is RequestOutputKind.DELTA, [self._new_sent(request, i) for i in range(len(request.samples))])
        sent, delta = stream.samples, stream.delta
        news = [not s.finished if seq.is_finished else seq.num_completion_tokens > s.tokens
                for seq, s in zip(request.samples, sent)]
        if not any(news):
            return None
        first = not any(s.tokens for s in sent)
        completions = []
        for index, (seq, s) in enumerate(zip(request.samples, sent)):
            if delta and not news[index]:
                continue
            if seq.is_finished:
                if s.final is None:
                    s.final = request.final_completion(index, self.detokenizer)
                completions.append(_rest(s.final, s) if delta else s.final)
                s.tokens, s.chars, s.finished = len(s.final.token_ids), len(s.final.text), True
                s.logprobs = 0 if s.final.logprobs is None else len(s.final.logprobs)
            else:
                completions.append(self._running_completion(request, index, s, delta))
        output = request.with_completions(completions, self.detokenizer, finished=False,
                                          prompt_logprobs=first or not delta)
        if delta and not first:
            output.prompt_logprobs = _given_prompt_logprobs(request.params.prompt_logprobs)
        return output

    def final(self, request_output: RequestOutput) -> RequestOutput:
        """A finished request's output as its kind gives it (DELTA: what its earlier outputs did not
        give); forgets the request."""
        stream = self._streams.pop(request_output.request_id, None)
        if stream is None or not stream.delta:
            return request_output
        rest = [_rest(completion, s) for completion, s in zip(request_output.outputs, stream.samples)
                if not s.finished]
        return RequestOutput(request_output.request_id, request_output.prompt, request_output.prompt_token_ids,
                             _given_prompt_logprobs(request_output.prompt_logprobs), rest, finished=True,
                             num_cached_tokens=request_output.num_cached_tokens)

    def forget(self, request_id: int) -> None:
        self._streams.pop(request_id, None)

    def _new_sent(self, request: Request, index: int) -> _Sent:
        decoder = self.detokenizer.decoder
        params = request.params
        usable = decoder is not None and self.detokenizer.tokenizer is not None and params.detokenize
        seq = request.samples[index]
        return _Sent(TextStream(decoder, seq.prompt_token_ids, params.skip_special_tokens) if usable else None)

    def _running_completion(self, request: Request, index: int, s: _Sent, delta: bool) -> CompletionOutput:
        """Sample `index`'s completion so far (DELTA: past what `s` says was given), its text held
        back before any stop string's start; `s` updated."""
        params, seq = request.params, request.samples[index]
        start, length = seq.num_prompt_tokens, seq.num_completion_tokens
        if s.stream is not None:
            s.text += "".join(p for p in map(s.stream.step, seq.token_ids[start + s.fed:]) if p is not None)
            s.fed = length
            text = s.text
        else:  # no tokenizers backend (or no text asked): decoded whole, a character cut short left out
            text = self.detokenizer.text(seq.prompt_token_ids, seq.token_ids[start:], params)
        shown = len(text)
        if params.stop and not params.include_stop_str_in_output:
            shown = max(s.chars, shown - (max(map(len, params.stop)) - 1))
        logprobs = seq.logprobs
        if logprobs is not None and params.detokenize:
            self.detokenizer.fill_decoded_tokens(logprobs)
        cumulative = seq.cumulative_logprob if logprobs is not None else None
        if delta:
            completion = CompletionOutput(index, text[s.chars:shown], seq.token_ids[start + s.tokens:], cumulative,
                                          None if logprobs is None else logprobs[s.logprobs:])
        else:
            completion = CompletionOutput(index, text[:shown], seq.token_ids[start:], cumulative,
                                          None if logprobs is None else logprobs.copy())
        s.tokens, s.chars, s.logprobs = length, shown, 0 if logprobs is None else len(logprobs)
        return completion


def _given_prompt_logprobs(asked: object) -> list | None:
    """A DELTA output's prompt logprobs once an earlier output gave them: [] when the request asked
    for them (`asked`: its prompt_logprobs setting or value, None when not asked), else None, as vLLM's
    pop_prompt_logprobs leaves them."""
    return None if asked is None else []


def _rest(completion: CompletionOutput, s: _Sent) -> CompletionOutput:
    """`completion` without what `s` says its earlier outputs gave."""
    return CompletionOutput(completion.index, completion.text[s.chars:], completion.token_ids[s.tokens:],
                            completion.cumulative_logprob,
                            None if completion.logprobs is None else completion.logprobs[s.logprobs:],
                            completion.finish_reason, completion.stop_reason)
