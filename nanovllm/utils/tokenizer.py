"""Tokenizer and EOS ids of a checkpoint directory."""

from __future__ import annotations

import os
from dataclasses import dataclass

# Files whose presence means the directory ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# How a git-lfs pointer file starts (what a clone without git-lfs holds in place of a large file).
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def has_tokenizer(path: str) -> bool:
    """Whether directory `path` ships a tokenizer (one of TOKENIZER_FILES)."""
    return any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


def _lfs_pointers(path: str) -> list[str]:
    """The tokenizer files of `path` that are git-lfs pointers (a clone without git-lfs)."""
    pointers = []
    for name in TOKENIZER_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                if f.read(len(_LFS_POINTER)) == _LFS_POINTER:
                    pointers.append(name)
    return pointers


def load_tokenizer(path: str):
    """transformers' AutoTokenizer for `path`, or None when the directory has no tokenizer
    (e.g. a bare config.json for load_format="dummy"; prompts must then be token ids). A tokenizer
    that cannot be loaded is a ValueError naming the directory (and a git-lfs pointer among its
    files): transformers' errors name neither (a JSONDecodeError "Expecting value: line 1 column 1")."""
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # tokenizers raises a bare Exception for a tokenizer.json it cannot parse
        pointers = _lfs_pointers(path)
        why = (f"{', '.join(pointers)} is a git-lfs pointer, not the file (a clone without git-lfs?)" if pointers
               else f"{type(e).__name__}: {e}")
        raise ValueError(f"the tokenizer in {path!r} could not be loaded: {why}") from e


def _as_ids(value, source: str) -> set[int]:
    """An eos_token_id (None, an id or a list of them) as a set of ids; ValueError naming `source` otherwise."""
    ids = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise ValueError(f"{source} must be a token id or a list of them, got {value!r}")
    return set(ids)


@dataclass(frozen=True)
class EosTokens:
    """A checkpoint's EOS ids. `primary`, the tokenizer's eos_token_id (None without a tokenizer),
    ends a request with stop_reason None; the others (generation_config.json's, or config.json's where
    there is no such file, e.g. Qwen's <|endoftext|> beside its tokenizer's <|im_end|>) end it as stop_token_ids do, with
    stop_reason the id: vLLM adds them to each request's stop_token_ids (unless ignore_eos)."""

    primary: int | None
    all: frozenset[int]  # primary included

    @property
    def others(self) -> frozenset[int]:
        return self.all - {self.primary}

    @property
    def ending(self) -> frozenset[int]:
        """The ids that end a request with stop_reason None (the scheduler's): `primary`, if any."""
        return frozenset() if self.primary is None else frozenset({self.primary})


def load_eos_token_ids(tokenizer, config_eos: tuple[int, ...], generation_eos, vocab_size: int) -> EosTokens:
    """Every EOS id of the tokenizer, `config_eos` (config.json's, given only where there is no
    generation_config.json) and `generation_eos`, the eos_token_id (an int, a list or None) of the
    generation_config.json that LLM(generation_config=...) reads (vLLM's rule).
    An id outside the model's vocabulary [0, vocab_size) is a ValueError naming where it came from
    (every request would take it among its stop_token_ids, which the engine checks against it)."""
    generation = "generation_config.json's eos_token_id"
    sources = {"config.json's eos_token_id": set(config_eos), generation: _as_ids(generation_eos, generation)}
    primary = None
    if tokenizer is not None:
        sources["the tokenizer's eos_token_id"] = _as_ids(tokenizer.eos_token_id, "the tokenizer's eos_token_id")
        if isinstance(tokenizer.eos_token_id, int):
            primary = tokenizer.eos_token_id
    for source, ids in sources.items():
        bad = sorted(t for t in ids if not 0 <= t < vocab_size)
        if bad:
            raise ValueError(f"EOS token id {bad[0]} ({source}) is outside the model's vocabulary [0, {vocab_size}) "
                             "(vocab_size in config.json)")
    return EosTokens(primary, frozenset().union(*sources.values()))
