"""One request as the engine tracks it: its tokens, KV blocks and progress.

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
from nanovllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # needs (more) prefill; may hold blocks when partially prefilled
    RUNNING = "running"  # prompt fully computed, decoding
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached


class Sequence:
    """Mutable per-request state, owned by the scheduler."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams):
        self.seq_id = seq_id
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
        # Incremental stop-string search (set by the engine when params.stop is not empty).
        self.stop_matcher: StopStringMatcher | None = None
        self.stopped_by_string = False

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(frozen=True)
class RequestOutput:
    """What a finished request returns."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason.value}
