"""What `generate` and `chat` return: vLLM's output classes, under vLLM's names and module path.

    out = llm.generate(["Hello"], params)[0]           # RequestOutput
    out.outputs[0].text, out.outputs[0].token_ids      # CompletionOutput (one per sample, n of them)
    out.outputs[0].logprobs[j][token].logprob          # Logprob(logprob, rank, decoded_token)
    out.prompt_logprobs[i][token].rank                 # entry 0 is None

Each output is also read as the dict nano-vllm's generate returned (a read-only Mapping), so code
written against it keeps working on the same object:

    out["text"], out["token_ids"], out["finish_reason"]        # the first completion's
    out["logprobs"], out["cumulative_logprob"]                  # when SamplingParams.logprobs is set
    out["prompt_logprobs"]                                      # when SamplingParams.prompt_logprobs is set
    out["outputs"]                                              # the n completions, when n > 1

In that view logprob entries are plain floats ({token_id: logprob}), as they were; two outputs
compare equal when their dict views do (the request id is not part of it). A RequestOutput's
`text`, `token_ids` and `finish_reason` attributes are its first completion's (nano-vllm's step API).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableSequence, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log probability (log_softmax of the raw logits), its rank over the whole
    vocabulary (1: the most likely; tied tokens share the worse rank) and its text (None when the
    request set detokenize=False)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FlatLogprobs(MutableSequence):
    """Logprobs read as a list of {token_id: Logprob}, stored as flat lists of plain numbers: a
    prompt's (`none_first`: entry 0 None, then one entry per later prompt token) or a completion's
    (one entry per generated token). A dict and a Logprob per item would be objects the garbage
    collector tracks: a scoring run's ~600,000 prompt tokens made its full passes the larger part of
    the host's time per step, and a completion asking logprobs=20 makes 21 Logprobs a token. An
    entry's dict is built when it is read (so editing it changes nothing stored), as vLLM's
    FlatLogprobs does.

    Every entry has 1 + k items (k: the request's prompt_logprobs or logprobs), the scored token
    first, then the k most likely ranked 1..k; a scored token among them takes its place there,
    once (its dict key keeps the first slot):

        none_first:  [None, items[0 : 1+k], items[1+k : 2(1+k)], ...]
        else:        [items[0 : 1+k], items[1+k : 2(1+k)], ...]

    The engine fills it with add_row / add_rows. A caller edits it as the list (vLLM's is one:
    append, extend, insert, item assignment, del, pop, +=): the first edit turns it into that
    list of dicts (`edited`), which it reads from from then on.
    """

    __slots__ = ("k", "none_first", "token_ids", "logprobs", "ranks", "decoded_tokens", "edited")

    def __init__(self, k: int, *, none_first: bool):
        self.k = k
        self.none_first = none_first
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        # one per item from the start (decoded_tokens[i] is token_ids[i]'s), set when outputs are built
        self.decoded_tokens: list[str] | None = None
        # the entries as a list once a caller edited them (the flat lists are then no longer read)
        self.edited: list[dict | None] | None = None

    def add_rows(self, token_ids: list[int], logprobs: list[float], ranks: list[int]) -> None:
        """Append whole entries: 1 + k items each, in the order the class docstring gives."""
        self._check_unedited()
        if not len(token_ids) == len(logprobs) == len(ranks) or len(token_ids) % (1 + self.k):
            raise ValueError(f"entries of {1 + self.k} items each expected, got {len(token_ids)} token ids, "
                             f"{len(logprobs)} logprobs, {len(ranks)} ranks")
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.ranks += ranks

    def add_row(self, token_id: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float]) -> None:
        """Append one entry: the scored token, then its row's k most likely (top_ids / top_logprobs, k long)."""
        self._check_unedited()
        if len(top_ids) != self.k or len(top_logprobs) != self.k:
            raise ValueError(f"an entry holds the {self.k} most likely tokens, got {len(top_ids)} ids and "
                             f"{len(top_logprobs)} logprobs")
        self.token_ids.append(token_id)
        self.token_ids += top_ids
        self.logprobs.append(logprob)
        self.logprobs += top_logprobs
        self.ranks.append(rank)
        self.ranks += range(1, self.k + 1)

    def copy(self) -> FlatLogprobs:
        """A snapshot: later appends to this one do not change it."""
        other = FlatLogprobs(self.k, none_first=self.none_first)
        other.token_ids, other.logprobs, other.ranks = list(self.token_ids), list(self.logprobs), list(self.ranks)
        other.decoded_tokens = None if self.decoded_tokens is None else list(self.decoded_tokens)
        other.edited = None if self.edited is None else list(self.edited)
        return other

    def _check_unedited(self) -> None:
        """The engine's appends go to the flat lists, which a caller's edit has left behind."""
        if self.edited is not None:
            raise RuntimeError("these logprobs were edited as a list: the engine appends no more entries to them")

    def _as_list(self) -> list[dict | None]:
        """The entries as the list a caller edits (made on the first edit)."""
        if self.edited is None:
            self.edited = list(self)
        return self.edited

    def __setitem__(self, index, value) -> None:
        self._as_list()[index] = value

    def __delitem__(self, index) -> None:
        del self._as_list()[index]

    def insert(self, index: int, value: dict | None) -> None:
        self._as_list().insert(index, value)

    def extend(self, values: Iterable[dict | None]) -> None:
        """As list.extend (one pass, not the ABC's append per entry)."""
        self._as_list().extend(list(values))

    def __len__(self) -> int:
        if self.edited is not None:
            return len(self.edited)
        return self.none_first + len(self.token_ids) // (1 + self.k)

    def __getitem__(self, index):
        if self.edited is not None:
            return self.edited[index]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"logprobs index {index} out of range for {n} entries")
        if self.none_first:
            if i == 0:
                return None
            i -= 1
        width = 1 + self.k
        a = i * width
        texts = self.decoded_tokens
        entry = {}
        for j in range(a, a + width):
            text = texts[j] if texts is not None and j < len(texts) else None
            entry[self.token_ids[j]] = Logprob(self.logprobs[j], self.ranks[j], text)
        return entry

    def floats(self) -> list[dict[int, float] | None]:
        """The entries with plain float values (nano-vllm's dict view), without Logprob objects."""
        if self.edited is not None:  # a caller's entries: Logprobs, or anything with a logprob, or floats
            return [None if e is None else {t: getattr(lp, "logprob", lp) for t, lp in e.items()} for e in self.edited]
        width, ids, lps = 1 + self.k, self.token_ids, self.logprobs
        if width == 1:
            entries = [{t: lp} for t, lp in zip(ids, lps)]
        else:
            entries = [dict(zip(ids[a : a + width], lps[a : a + width])) for a in range(0, len(ids), width)]
        return [None] + entries if self.none_first else entries

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # mutable, as the list it stands for

    def __add__(self, other: object) -> list:
        """Concatenated with a list (or another FlatLogprobs) as the list it stands for would be."""
        if not isinstance(other, (list, FlatLogprobs)):
            return NotImplemented
        return list(self) + list(other)

    def __radd__(self, other: object) -> list:
        if not isinstance(other, list):
            return NotImplemented
        return other + list(self)

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"


# One {token_id: Logprob} per generated token: the sampled token first, then the k most likely.
SampleLogprobs = list[dict[int, Logprob]] | FlatLogprobs
# One entry per prompt token; entry 0 is None (nothing precedes the first token).
PromptLogprobs = list[dict[int, Logprob] | None] | FlatLogprobs


def _floats(entries: list[dict[int, Logprob] | None] | FlatLogprobs) -> list[dict[int, float] | None]:
    """Entries with plain float values (nano-vllm's dict view)."""
    if isinstance(entries, FlatLogprobs):
        return entries.floats()
    return [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in entries]


class _DictView(Mapping):
    """A read-only dict view of an output: `_view()` builds its keys and values (from the current
    attributes, once per call below)."""

    def _view(self) -> dict:
        raise NotImplementedError

    def __getitem__(self, key: str):
        return self._view()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._view())

    def __len__(self) -> int:
        return len(self._view())

    def __contains__(self, key: object) -> bool:
        return key in self._view()

    def get(self, key: str, default=None):
        return self._view().get(key, default)

    def keys(self):
        return self._view().keys()

    def items(self):
        return self._view().items()

    def values(self):
        return self._view().values()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _DictView):
            return self._view() == other._view()
        return self._view() == dict(other.items()) if isinstance(other, Mapping) else NotImplemented


@dataclass(eq=False)
class CompletionOutput(_DictView):
    """One sample of a request.

    finish_reason: "stop" (EOS, a stop token id or a stop string), "length" (max_tokens or
        max_model_len) or "abort"; None while unfinished.
    stop_reason: the stop string or stop token id that ended it; None for EOS and length.
    cumulative_logprob / logprobs: None unless SamplingParams.logprobs is set.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: None = None  # no LoRA adapters

    def finished(self) -> bool:
        return self.finish_reason is not None

    def _view(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason}
        if self.logprobs is not None:
            out["logprobs"] = _floats(self.logprobs)
            out["cumulative_logprob"] = self.cumulative_logprob
        return out


@dataclass(eq=False)
class RequestOutput(_DictView):
    """A request's result: its prompt (the text when it was given as text, else None), the prompt's
    token ids (after truncate_prompt_tokens), its logprobs when asked for, and its n completions."""

    # vLLM's str of a counter from generate / chat; the caller's under llm.llm_engine (vLLM's engine
    # API); the engine's int id from nano-vllm's step API (llm.add_request / llm.step)
    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # vLLM's order from here on too, for callers that build one positionally
    metrics: None = None  # vLLM's per-request stats: none are kept (vLLM V1 leaves it None too)
    lora_request: None = None  # no LoRA adapters
    # vLLM's encoder-decoder fields: decoder-only models
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    kv_transfer_params: None = None  # vLLM's disaggregated-serving field: one process

    # nano-vllm's step-API shortcuts (StepResult.finished): the first completion's.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def _view(self) -> dict:
        out = self.outputs[0]._view()
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = _floats(self.prompt_logprobs)
        if len(self.outputs) > 1:
            out["outputs"] = self.outputs
        return out
