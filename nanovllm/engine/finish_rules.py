"""Why a sample ends: the rules Scheduler.postprocess applies to each token it appends (vLLM's order).

    token just appended
      EOS (unless ignore_eos) or a stop_token_ids entry   -> STOP  (stop_token: the id, None for EOS)
      completes a stop string past the first min_tokens   -> STOP  (stopped_by_string)
      max_tokens or max_model_len reached                 -> LENGTH
      otherwise                                           -> the sample goes on

A token that ends a sample both by a stop and by its length ends it by the stop, and the text is cut
at a stop string the last allowed token completes (Request.final_completion). EOS and stop ids
cannot be sampled before min_tokens (the logits rules mask them: engine/request_rules.py), so only
stop strings are held back here; a stop string's text is fed to its matcher whatever min_tokens
says, so the search stays incremental. A sample whose grammar rejected every token ends apart
(postprocess). Plain functions over a Sequence: they run for every row of every step, and cost no
more calls than the scheduler's methods they were.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from nanovllm.engine.sequence import FinishReason, Sequence
from nanovllm.engine.stop_strings import StopStringMatcher


def watch_stop_strings(samples: list[Sequence], decoder: Tokenizer | None) -> None:
    """Give each of `samples` that has stop strings its incremental matcher (engine/stop_strings.py),
    decoding with `decoder` (LLMEngine refuses stop strings where it is None)."""
    for seq in samples:
        if seq.params.stop:
            seq.stop_matcher = StopStringMatcher(seq.params.stop, seq.prompt_token_ids,
                                                 seq.params.skip_special_tokens, decoder)


def ends_by_length(seq: Sequence, num_tokens: int, max_model_len: int) -> bool:
    """True if `seq` is done once it holds `num_tokens` tokens (max_tokens / max_model_len)."""
    return num_tokens - seq.num_prompt_tokens >= seq.max_tokens or num_tokens >= max_model_len


def finish_reason(seq: Sequence, token: int, eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
    """Why `token` (just appended) ends `seq`, if it does: EOS or a stop token id, then a stop
    string, then the length limits (vLLM's order: a stop completed by the last allowed token
    is a stop, and the text is cut at it). Records on `seq` which stop it was."""
    params = seq.params
    eos = not params.ignore_eos and token in eos_token_ids
    if eos or token in params.stop_token_ids:
        seq.ended_on_stop_token = True
        seq.stop_token = None if eos else token
        # with include_stop_str_in_output the stop token's text is the output's too: a stop string
        # it completes ends the request instead (vLLM's rule: stop_reason the string, text cut)
        seq.stopped_by_string = params.include_stop_str_in_output and _stop_string_completes(seq, token)
        return FinishReason.STOP
    if _stop_string_completes(seq, token):
        seq.stopped_by_string = True
        return FinishReason.STOP
    if ends_by_length(seq, len(seq), max_model_len):
        return FinishReason.LENGTH
    return None


def _stop_string_completes(seq: Sequence, token: int) -> bool:
    """Whether `token` completes one of seq's stop strings past the first min_tokens tokens (vLLM's
    rule; the text is fed whatever min_tokens says, so the search stays incremental)."""
    return (seq.stop_matcher is not None and seq.stop_matcher.feed(token)
            and seq.num_completion_tokens > seq.params.min_tokens)
