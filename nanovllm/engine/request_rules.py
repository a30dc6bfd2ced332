"""What a request's SamplingParams change in its logits, resolved once when it is added: the
penalties, the biases, the allowed tokens, its bad words as token sequences, and the ids min_tokens
keeps out. The step builder (engine/rules_builder.py) turns them into each step's rules.

Bad words follow vLLM: each word is tokenized as it is (leading spaces stripped) and, when that
gives other first tokens of the same count, also after a space (a word inside a sentence); a
sequence's last token is masked wherever its other tokens are the last ones generated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from nanovllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestRules:
    """A request's logits rules. `penalties`: (repetition, frequency, presence), None when all are
    off; `allowed`: None when every token is allowed; `single_bans`: one-token bad words;
    `bad_sequences`: longer ones; `stop_ids`: EOS and stop ids, masked while fewer than
    `min_tokens` tokens are generated."""

    penalties: tuple[float, float, float] | None
    bias: tuple[tuple[int, float], ...]
    allowed: tuple[int, ...] | None
    single_bans: tuple[int, ...]
    bad_sequences: tuple[tuple[int, ...], ...]
    min_tokens: int
    stop_ids: tuple[int, ...]

    @property
    def penalties_only(self) -> bool:
        """Only penalties (a step then needs nothing but the sequence's slot and values)."""
        return (self.allowed is None and not self.bias and not self.single_bans and not self.bad_sequences
                and not self.min_tokens)

    @classmethod
    def of(cls, params: SamplingParams, eos_token_ids: frozenset[int], tokenizer,
           vocab_size: int) -> RequestRules | None:
        """The rules of checked `params` (None when it uses none). Token ids outside the
        vocabulary, bad words without a tokenizer, and allowed_token_ids that the other rules ban
        from the first token on (no token could be sampled: the sampler's fallback, token 0, came
        out) raise ValueError naming them."""
        if not params.uses_logits_rules:
            return None
        for name, ids in (("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            check_in_vocab(name, ids, vocab_size)
        sequences = bad_word_sequences(params.bad_words or [], tokenizer, vocab_size)
        penalties = (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
        rules = cls(
            penalties=None if penalties == (1.0, 0.0, 0.0) else penalties,
            bias=tuple((params.logit_bias or {}).items()),
            allowed=None if params.allowed_token_ids is None else tuple(dict.fromkeys(params.allowed_token_ids)),
            single_bans=tuple(dict.fromkeys(s[0] for s in sequences if len(s) == 1)),
            bad_sequences=tuple(s for s in sequences if len(s) > 1),
            min_tokens=params.min_tokens,
            stop_ids=tuple(sorted(eos_token_ids | set(params.stop_token_ids))),
        )
        rules.check_first_token_allowed()
        return rules

    def bans(self, token: int, token_ids: list[int], num_generated: int) -> bool:
        """Whether these rules ban `token` after a sequence's `token_ids` (prompt and completion), the
        last `num_generated` of them generated: a token outside `allowed`, a one-token bad word, the
        last token of a bad word whose other tokens end the completion, an EOS or stop id short of
        min_tokens. A sample of it means the row's logits were all -inf (the sampler's fallback, token
        0, came out). Rules that ban nothing (`can_ban`: penalties, biases) need not ask."""
        if self.allowed is not None and token not in self._allowed_set:
            return True
        if token in self.single_bans or (num_generated < self.min_tokens and token in self.stop_ids):
            return True
        return any(word[-1] == token and num_generated >= len(word) - 1
                   and token_ids[len(token_ids) - len(word) + 1:] == list(word[:-1]) for word in self.bad_sequences)

    @functools.cached_property
    def can_ban(self) -> bool:
        """Whether `bans` can be True: the rules restrict or ban tokens (not only penalties and biases)."""
        return self.allowed is not None or bool(self.single_bans or self.bad_sequences) or self.min_tokens > 0

    @functools.cached_property
    def _allowed_set(self) -> frozenset[int]:
        """`allowed` for O(1) membership (it may hold most of the vocabulary)."""
        return frozenset(self.allowed or ())

    def check_first_token_allowed(self) -> None:
        """ValueError when every allowed token is banned at the first token: a one-token bad word,
        or (min_tokens > 0) an EOS or stop id."""
        if self.allowed is None:
            return
        banned = set(self.single_bans) | (set(self.stop_ids) if self.min_tokens else set())
        if banned.issuperset(self.allowed):
            raise ValueError(f"SamplingParams.allowed_token_ids {list(self.allowed)!r:.200} leave no token to sample: "
                             f"each is a one-token bad word or (min_tokens={self.min_tokens}) an EOS or stop token id "
                             f"{sorted(banned)!r:.200}")


def check_in_vocab(name: str, token_ids: list[int], vocab_size: int) -> None:
    """ValueError naming the first of `token_ids` outside [0, vocab_size)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"SamplingParams.{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})")


def bad_word_sequences(words: list[str], tokenizer, vocab_size: int) -> list[tuple[int, ...]]:
    """The token sequences of `words` (vLLM's rule, module docstring)."""
    if not words:
        return []
    if tokenizer is None:
        raise ValueError("SamplingParams.bad_words needs a tokenizer, and none is loaded (the model directory has "
                         "none, or skip_tokenizer_init=True)")
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"SamplingParams.bad_words entry {word!r} gives no tokens")
        sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    for sequence in sequences:
        check_in_vocab("bad_words", list(sequence), vocab_size)
    return sequences
