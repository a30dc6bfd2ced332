"""Request intake: a request's SamplingParams checked against the model, and the Request built
from them and its checked prompt.

    checked = intake.check(params)                  # CheckedParams: a checked copy, rules, grammar
    prompt = intake.validator.validate(prompt, checked.params)
    request = intake.request(prompt, checked)       # fresh ids, a grammar matcher per sample

Invariants: `check` raises (TypeError / ValueError naming the bad value) before anything is
queued, and never changes the caller's SamplingParams (it works on `params.validated()`, the
engine's own copy). Every request's stop_token_ids gain the EOS ids other than the tokenizer's
(`eos.others`, vLLM's rule) unless it ignores EOS. Request and sequence ids come from one counter
and are never reused. `tokenizer` and `eos` change only through set_tokenizer, which also reaches
the holders of them that the intake owns or shares (the prompt validator, the grammar backend).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from nanovllm.config import Config
from nanovllm.engine.prompts import PreparedPrompt, PromptValidator
from nanovllm.engine.request import Request
from nanovllm.engine.request_rules import RequestRules, check_in_vocab
from nanovllm.engine.structured_outputs import GrammarBackend
from nanovllm.engine.text_stream import stream_decoder
from nanovllm.sampling_params import ALL_LOGPROBS, SamplingParams
from nanovllm.utils.generation_defaults import has_generation_config
from nanovllm.utils.tokenizer import EosTokens, load_eos_token_ids


class CheckedParams(NamedTuple):
    """A request's checked SamplingParams, its logits rules (None: it uses none) and its compiled
    structured-outputs grammar (None without structured_outputs)."""

    params: SamplingParams
    rules: RequestRules | None
    grammar: object | None


def eos_tokens(tokenizer, config: Config, generation_values: dict) -> EosTokens:
    """The model's EOS ids with `tokenizer`'s eos_token_id among them (generation_config.json's too,
    config.json's where the generation directory has no such file: vLLM's try_get_generation_config);
    an id outside the vocabulary is a ValueError."""
    model = config.model_config
    config_eos = () if has_generation_config(config.generation_dir) else model.eos_token_ids
    return load_eos_token_ids(tokenizer, config_eos, generation_values.get("eos_token_id"), model.vocab_size)


class RequestIntake:
    def __init__(self, config: Config, tokenizer, eos: EosTokens, kv_capacity_tokens: int,
                 grammars: GrammarBackend):
        self.config = config
        self.tokenizer = tokenizer  # None: no tokenizer loaded (prompts and bad words as token ids only)
        self.eos = eos
        self.validator = PromptValidator(tokenizer, config.model_config.vocab_size, config.max_model_len,
                                         kv_capacity_tokens)
        self.grammars = grammars  # shared with the step pipeline, which fills the grammars' token masks
        self._ids = itertools.count()

    def set_tokenizer(self, tokenizer, eos: EosTokens) -> None:
        """Check and tokenize later requests with `tokenizer`, whose EOS ids are `eos`."""
        self.tokenizer = self.validator.tokenizer = tokenizer
        self.eos = eos
        self.grammars.set_tokenizer(tokenizer, eos.all)

    def check(self, params: object) -> CheckedParams:
        """A checked copy of `params` as they are now (every SamplingParams check again, then the
        model's: token ids within the vocabulary, bad words tokenized, the structured-outputs
        grammar compiled), its logits rules and its compiled grammar (None without
        structured_outputs). Raises before anything is queued."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        checked = params.validated()
        keep = checked.truncate_prompt_tokens
        if keep is not None and keep > self.config.max_model_len:  # vLLM's LLM.generate refuses it too
            raise ValueError(f"SamplingParams.truncate_prompt_tokens={keep} is greater than max_model_len "
                             f"({self.config.max_model_len}): pass at most max_model_len, or -1 for it")
        if self.eos.others and not checked.ignore_eos:  # our copy: the caller's params stay as given
            checked.stop_token_ids = sorted(set(checked.stop_token_ids) | self.eos.others)
        vocab_size = self.config.model_config.vocab_size
        check_in_vocab("stop_token_ids", checked.stop_token_ids, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's rule: -1 is the vocabulary, capped by max_logprobs
            asked = getattr(checked, name)
            count = vocab_size if asked == ALL_LOGPROBS else asked
            if count is not None and count > self.config.logprobs_limit:
                raise ValueError(f"SamplingParams.{name}={asked} asks for {count} logprobs a token, more than the "
                                 f"{self.config.logprobs_limit} this engine allows: raise LLM(max_logprobs=...) "
                                 f"(-1: no cap)")
            setattr(checked, name, None if count is None else min(count, vocab_size))  # a cap past it: all
        if checked.stop and stream_decoder(self.tokenizer) is None:  # the text they are matched on cannot be made
            have = ("no tokenizer is loaded (the model directory has none, or skip_tokenizer_init=True)"
                    if self.tokenizer is None
                    else f"the model's is a {type(self.tokenizer).__name__}, which has no tokenizers backend")
            raise ValueError(f"SamplingParams.stop {checked.stop!r} needs a tokenizers-backed tokenizer (a "
                             f"tokenizer.json): {have}")
        rules = RequestRules.of(checked, self.eos.all, self.tokenizer, vocab_size)
        grammar = None
        if checked.structured_outputs is not None:
            grammar = self.grammars.compile(checked.structured_outputs)
        return CheckedParams(checked, rules, grammar)

    def request(self, prompt: PreparedPrompt, checked: CheckedParams) -> Request:
        """The Request of a prompt and params already checked (validator.validate, check): n
        samples under fresh ids, each with a matcher of the compiled grammar, if any."""
        params, rules, grammar = checked
        seq_ids = [next(self._ids) for _ in range(params.n)]
        request = Request.create(seq_ids[0], seq_ids, prompt.token_ids, params, rules, prompt.text,
                                 prompt.max_tokens, prompt.cache_salt)
        if grammar is not None:
            for seq in request.samples:
                seq.grammar = self.grammars.sample_grammar(grammar)
        return request
