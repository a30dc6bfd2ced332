"""One sample of a request as the engine tracks it: its tokens, KV blocks and progress.
A request with SamplingParams.n = N has N sequences (engine/request.py); they share the
prompt's KV blocks through the prefix cache.

    token_ids:  [ prompt ........ | completion ... ]
                 ^0               ^num_prompt_tokens
    KV scheduled: [0, num_computed_tokens)  (booked when a step is scheduled; == len(token_ids)
                  while the token sampled by that step is still on the device)

Invariant once allocated: len(block_table) >= ceil(num_computed_tokens / block_size).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nanovllm.engine.stop_strings import StopStringMatcher
from nanovllm.engine.structured_outputs import SampleGrammar
from nanovllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # needs (more) prefill; may hold blocks when partially prefilled
    RUNNING = "running"  # prompt fully computed, decoding
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # dropped by abort_request / an interrupt (never returned in an output)


class Sequence:
    """Mutable per-sample state, owned by the scheduler.

    seed: the sampling seed of this sample (None: unseeded); sample 0 of a request uses
    params.seed, the others seeds derived from it (engine/request.py).
    logprobs: one {token_id: logprob} per completion token when params.logprobs is set.
    prompt_logprobs: [None, {...}, ...] filled up to len == num_prompt_tokens while the
    prompt is first computed, when params.prompt_logprobs is set (sample 0 only)."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: int | None = None, seed: int | None = None, wants_prompt_logprobs: bool = False):
        self.seq_id = seq_id
        self.request_id = seq_id if request_id is None else request_id
        self.seed = params.seed if seed is None else seed
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Full blocks whose chained hash has been published to the prefix cache.
        self.num_hashed_blocks = 0
        # Chained hash of each leading full block computed so far (see BlockManager._block_hashes).
        self.block_hashes: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if wants_prompt_logprobs and params.prompt_logprobs is not None else None)
        # Prompt positions p whose next-token logprobs are booked in a step (p < this).
        self.num_prompt_logprobs_booked = 0
        # Incremental stop-string search (set by the engine when params.stop is not empty).
        self.stop_matcher: StopStringMatcher | None = None
        self.stopped_by_string = False
        # Where this sample stands in its grammar (set by the engine when params.structured_outputs is set).
        self.grammar: SampleGrammar | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions remain whose logprobs are asked for and not booked yet."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs_booked < self.num_prompt_tokens - 1


@dataclass(frozen=True)
class Completion:
    """One finished sample: its tokens, text and, when asked for, their logprobs."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[dict[int, float]] | None = None  # one dict per token (SamplingParams.logprobs)
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs

    def as_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason.value}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
            out["cumulative_logprob"] = self.cumulative_logprob
        return out


@dataclass(frozen=True)
class RequestOutput:
    """What a finished request returns: its n completions (the first one's fields are the
    request's own, as in vLLM) and the prompt's logprobs when asked for."""

    request_id: int
    prompt_token_ids: list[int]
    completions: list[Completion]
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def finish_reason(self) -> FinishReason:
        return self.completions[0].finish_reason

    def as_dict(self) -> dict:
        """{"text", "token_ids", "finish_reason"} of the first completion, its "logprobs" and
        "cumulative_logprob" when asked for, "prompt_logprobs" when asked for, and "outputs"
        (every completion's dict) when the request has more than one."""
        out = self.completions[0].as_dict()
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        if len(self.completions) > 1:
            out["outputs"] = [c.as_dict() for c in self.completions]
        return out
