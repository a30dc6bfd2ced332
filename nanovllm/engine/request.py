"""A request: one prompt, its SamplingParams and its n samples (sequences).

    request 7, n = 3:   seq 7 (sample 0) computes the prompt; in the step that completes it,
                        seq 8 and seq 9 fork from it: they share its full prompt blocks (ref
                        counts), get a copy of its partial last block, and sample their first
                        tokens from its last logits row (scheduler.Fork). Without free running
                        slots or blocks for the copies they queue behind it instead and find its
                        prompt blocks in the prefix cache.

Sample 0 samples with params.seed; sample i > 0 with a seed derived from (seed, i), so
with a seed the samples differ from each other and the whole result repeats. Sample 0
alone computes prompt logprobs. The request is finished when all its samples are.
"""

from __future__ import annotations

import xxhash

from nanovllm.engine.sequence import Completion, RequestOutput, Sequence
from nanovllm.engine.stop_strings import cut_at_stop
from nanovllm.sampling_params import SamplingParams

# Seeds are int64 tensor values downstream (noise keys): keep derived ones non-negative, 63 bits.
_SEED_MASK = 2**63 - 1


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request seeded with `seed` (sample 0 keeps it)."""
    if seed is None or index == 0:
        return seed
    return xxhash.xxh64_intdigest(index.to_bytes(8, "little"), seed=seed & (2**64 - 1)) & _SEED_MASK


class Request:
    """Invariant: samples[i].request_id == request_id; they share one prompt and params."""

    def __init__(self, request_id: int, samples: list[Sequence]):
        if not samples:
            raise ValueError(f"request {request_id} has no samples")
        self.request_id = request_id
        self.samples = samples
        self.params = samples[0].params
        self.num_prompt_tokens = samples[0].num_prompt_tokens
        # Samples ended so far (the scheduler counts them as it ends them): is_finished in O(1),
        # not a walk over the n samples each time one ends (O(n^2) for one request of n samples).
        self.num_finished = 0

    @classmethod
    def create(cls, request_id: int, seq_ids: list[int], prompt_token_ids: list[int],
               params: SamplingParams) -> Request:
        """A request of params.n fresh samples with the ids `seq_ids`."""
        if len(seq_ids) != params.n:
            raise ValueError(f"request {request_id}: {len(seq_ids)} sequence ids for n={params.n}")
        return cls(request_id, [
            Sequence(seq_id, prompt_token_ids, params, request_id=request_id, seed=sample_seed(params.seed, i),
                     wants_prompt_logprobs=i == 0)
            for i, seq_id in enumerate(seq_ids)
        ])

    @property
    def is_finished(self) -> bool:
        return self.num_finished == len(self.samples)

    def output(self, tokenizer) -> RequestOutput:
        """The finished request's output; texts decoded with `tokenizer` (None: empty texts)."""
        completions = []
        for seq in self.samples:
            text = ""
            if tokenizer is not None:
                text = tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)
                if seq.stopped_by_string:
                    text = cut_at_stop(text, self.params.stop)
            completions.append(Completion(
                seq.completion_token_ids, text, seq.finish_reason, seq.logprobs,
                seq.cumulative_logprob if seq.logprobs is not None else None,
            ))
        leader = self.samples[0]
        return RequestOutput(self.request_id, leader.token_ids[: self.num_prompt_tokens], completions,
                             leader.prompt_logprobs)
