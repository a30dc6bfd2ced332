"""A request: one prompt, its SamplingParams and its n samples (sequences).

    request 7, n = 3:   seq 7 (sample 0) computes the prompt; in the step that completes it,
                        seq 8 and seq 9 fork from it: they share its full prompt blocks (ref
                        counts), get a copy of its partial last block, and sample their first
                        tokens from its last logits row (scheduler.Fork). Without free running
                        slots or blocks for the copies they queue behind it instead and find its
                        prompt blocks in the prefix cache.

Sample i samples with params.seed + i, as vLLM V1 seeds its child requests: with a seed the
samples differ from each other, the whole result repeats, and sample i is the completion a
request of n=1 seeded seed + i gives (so n samples split into n requests, as RL frameworks do,
keep their tokens). Sample 0 alone computes prompt logprobs. The request is finished when all
its samples are.
"""

from __future__ import annotations

from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.engine.request_rules import RequestRules
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stop_strings import cut_at_stop
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.validation import SEED_LIMIT


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request seeded with `seed`: seed + index (vLLM V1's child
    seeds), wrapping past the largest seed (2**64 - 1) to 0 where vLLM's torch.Generator would refuse it."""
    if seed is None:
        return None
    return (seed + index) % SEED_LIMIT


class Request:
    """Invariant: samples[i].request_id == request_id; they share one prompt and params."""

    def __init__(self, request_id: int, samples: list[Sequence], prompt: str | None = None):
        if not samples:
            raise ValueError(f"request {request_id} has no samples")
        self.request_id = request_id
        self.prompt = prompt  # the prompt's text when it was given as text
        self.samples = samples
        self.params = samples[0].params
        self.num_prompt_tokens = samples[0].num_prompt_tokens
        # Samples ended so far (the scheduler counts them as it ends them): is_finished in O(1),
        # not a walk over the n samples each time one ends (O(n^2) for one request of n samples).
        self.num_finished = 0

    @classmethod
    def create(cls, request_id: int, seq_ids: list[int], prompt_token_ids: list[int], params: SamplingParams,
               rules: RequestRules | None, prompt: str | None, max_tokens: int,
               cache_salt: str | None = None) -> Request:
        """A request of params.n fresh samples with the ids `seq_ids`, each generating at most
        `max_tokens` (params.max_tokens, or what max_model_len leaves: engine/prompts.py), its
        prefix-cache hits isolated by `cache_salt` (Sequence)."""
        if len(seq_ids) != params.n:
            raise ValueError(f"request {request_id}: {len(seq_ids)} sequence ids for n={params.n}")
        return cls(request_id, [
            Sequence(seq_id, prompt_token_ids, params, request_id=request_id, seed=sample_seed(params.seed, i),
                     wants_prompt_logprobs=i == 0, rules=rules, max_tokens=max_tokens, cache_salt=cache_salt)
            for i, seq_id in enumerate(seq_ids)
        ], prompt)

    @property
    def num_unfinished(self) -> int:
        """Samples not ended yet (vLLM V1 counts each as an unfinished child request)."""
        return len(self.samples) - self.num_finished

    @property
    def is_finished(self) -> bool:
        return self.num_unfinished == 0

    def output(self, detokenizer: Detokenizer) -> RequestOutput:
        """The finished request's output (vLLM's RequestOutput), texts decoded by `detokenizer`."""
        completions = [self.final_completion(index, detokenizer) for index in range(len(self.samples))]
        return self.with_completions(completions, detokenizer, finished=True)

    def final_completion(self, index: int, detokenizer: Detokenizer) -> CompletionOutput:
        """Finished sample `index`'s completion: its text without a stop token's, cut at a stop string."""
        params, seq = self.params, self.samples[index]
        shown = seq.completion_token_ids
        if seq.ended_on_stop_token and not params.include_stop_str_in_output:
            shown = shown[:-1]  # vLLM: the stop token (EOS or a stop_token_id) stays in token_ids only
        text = detokenizer.text(seq.prompt_token_ids, shown, params)
        stop_reason = seq.stop_token
        if seq.stopped_by_string:
            # a stop string counts once it ends past the first min_tokens tokens' text
            held = seq.completion_token_ids[: params.min_tokens]
            after = len(detokenizer.text(seq.prompt_token_ids, held, params))
            text, stop_reason = cut_at_stop(text, params.stop, params.include_stop_str_in_output, after)
        if seq.logprobs is not None and params.detokenize:
            detokenizer.fill_decoded_tokens(seq.logprobs)
        return CompletionOutput(index, text, seq.completion_token_ids,
                                seq.cumulative_logprob if seq.logprobs is not None else None, seq.logprobs,
                                seq.finish_reason.value if seq.finish_reason is not None else None, stop_reason)

    def with_completions(self, completions: list[CompletionOutput], detokenizer: Detokenizer, finished: bool,
                         prompt_logprobs: bool = True) -> RequestOutput:
        """The request's output holding `completions` (the prompt's logprobs unless prompt_logprobs=False)."""
        leader = self.samples[0]
        logprobs = leader.prompt_logprobs if prompt_logprobs else None
        if logprobs is not None and self.params.detokenize:
            detokenizer.fill_decoded_tokens(logprobs)
        return RequestOutput(self.request_id, self.prompt, leader.token_ids[: self.num_prompt_tokens], logprobs,
                             completions, finished=finished, num_cached_tokens=leader.num_cached_tokens)
