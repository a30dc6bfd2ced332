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

from nanovllm.engine.request_rules import RequestRules
from nanovllm.engine.stop_strings import StopStringMatcher
from nanovllm.engine.structured_outputs import SampleGrammar
from nanovllm.outputs import FlatLogprobs
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
    logprobs: one {token_id: Logprob} per completion token (stored flat: outputs.FlatLogprobs) when
    params.logprobs is set.
    prompt_logprobs: [None, {...}, ...] (stored flat: outputs.FlatLogprobs) filled up to len ==
    num_prompt_tokens while the prompt is first computed, when params.prompt_logprobs is set (sample 0 only).
    max_tokens: most tokens it may generate (params.max_tokens, or the room under max_model_len
    when that is None: engine/prompts.py resolves it).
    rules: what its request changes in its logits (None: nothing); counts_slot: its row of the
    penalties' token counts while it holds one (engine/rules_builder.py).
    cache_salt: its prompt's vLLM cache_salt (None: none): it shares prefix-cache blocks only with
    sequences of the same salt (BlockManager._block_hashes)."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, *, request_id: int,
                 seed: int | None, max_tokens: int, wants_prompt_logprobs: bool = False,
                 rules: RequestRules | None = None, cache_salt: str | None = None):
        self.seq_id = seq_id
        self.request_id = request_id
        self.seed = seed
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        # Prompt tokens the prefix cache held at its first allocation (None before it).
        self.num_cached_tokens: int | None = None
        self.block_table: list[int] = []
        # Full blocks whose chained hash has been published to the prefix cache.
        self.num_hashed_blocks = 0
        # Chained hash of each leading full block computed so far (see BlockManager._block_hashes).
        self.block_hashes: list[int] = []
        self.cache_salt = cache_salt
        self.logprobs: FlatLogprobs | None = (
            FlatLogprobs(params.logprobs, none_first=False) if params.logprobs is not None else None)
        self.cumulative_logprob = 0.0
        wants = wants_prompt_logprobs and params.prompt_logprobs is not None
        self.prompt_logprobs: FlatLogprobs | None = (
            FlatLogprobs(params.prompt_logprobs, none_first=True) if wants else None)
        # Prompt positions p whose next-token logprobs are booked in a step (p < this).
        self.num_prompt_logprobs_booked = 0
        # Incremental stop-string search (set by the engine when params.stop is not empty).
        self.stop_matcher: StopStringMatcher | None = None
        self.stopped_by_string = False
        self.stop_token: int | None = None  # the stop_token_ids entry that ended it
        self.ended_on_stop_token = False  # its last token is EOS or a stop_token_ids entry
        self.rules = rules
        self.counts_slot: int | None = None
        # Where this sample stands in its grammar (set by the engine when params.structured_outputs is set).
        self.grammar: SampleGrammar | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions remain whose logprobs are asked for and not booked yet."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs_booked < self.num_prompt_tokens - 1
