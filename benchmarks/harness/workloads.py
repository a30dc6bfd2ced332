"""bench.py's workloads: nano-vllm's random prompts and output lengths, and the --workload presets (score:
prompt logprobs of random prompts, one output token each; rollout: n samples of each prompt, as RL
frameworks' group sampling asks them; fewshot: one prefix in front of every prompt, as an evaluation's
few-shot exemplars are)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from nanovllm import SamplingParams

# Largest token id used for random prompts (nano-vllm's bench draws ids in [0, 10000]).
PROMPT_ID_MAX = 10000
# A vocabulary size above every real one: make_workload's ids then go up to PROMPT_ID_MAX.
ANY_VOCAB = 10**9
# Sampling temperature of the throughput workload (nano-vllm's).
WORKLOAD_TEMPERATURE = 0.6


@dataclass(frozen=True)
class WorkloadSampling:
    """How the throughput workload samples: nano-vllm's temperature; top-k / top-p and the penalties
    off unless asked (bench.py --top-k / --top-p / --repetition-penalty / ...), for both nanovllm and
    transformers (which has no frequency or presence penalty: --compare-hf refuses those); logprobs
    (--logprobs K: each request asks the sampled token's and the K most likely) nanovllm only."""

    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None  # None: none asked

    def __post_init__(self):
        self.params(1)  # SamplingParams' own checks: a bad value fails here, before any engine starts

    def params(self, max_tokens: int, prompt_logprobs: int | None = None, n: int = 1) -> SamplingParams:
        """The run's parameters for a request of `n` samples; with `prompt_logprobs` a scoring request as
        lm-evaluation-harness's loglikelihood sends it (greedy, one sample; no filter or penalty: parse_args
        refuses them with it)."""
        if prompt_logprobs is not None:
            return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                  prompt_logprobs=prompt_logprobs, n=n)
        return SamplingParams(temperature=WORKLOAD_TEMPERATURE, top_k=self.top_k, top_p=self.top_p,
                              ignore_eos=True, max_tokens=max_tokens, repetition_penalty=self.repetition_penalty,
                              frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                              logprobs=self.logprobs, n=n)

    @property
    def transformers_can_run(self) -> bool:
        """Whether transformers' generate runs every setting (it has no frequency / presence penalty,
        and its run here asks no logprobs)."""
        return self.frequency_penalty == 0.0 and self.presence_penalty == 0.0 and self.logprobs is None

    def describe(self) -> str:
        penalties = "".join(f" {name}={value:g}" for name, value, off in (
            ("repetition_penalty", self.repetition_penalty, 1.0), ("frequency_penalty", self.frequency_penalty, 0.0),
            ("presence_penalty", self.presence_penalty, 0.0)) if value != off)
        logprobs = "" if self.logprobs is None else f" logprobs={self.logprobs}"
        return f"T={WORKLOAD_TEMPERATURE} top_k={self.top_k} top_p={self.top_p:g}{penalties}{logprobs}"


@dataclass(frozen=True)
class Workload:
    num_seqs: int
    min_input: int
    max_input: int
    min_output: int
    max_output: int
    seed: int
    # None: a throughput run; k: each request asks prompt_logprobs=k (the score preset: 0, scoring
    # prompts as lm-evaluation-harness's loglikelihood does, reported in prompt tokens per second)
    prompt_logprobs: int | None = None
    # samples per prompt (SamplingParams.n), each making its request's max_tokens: the prompt is
    # prefilled once and its samples decode side by side (the rollout preset: RL's group sampling)
    n: int = 1
    # tokens of one prefix in front of every prompt (min_input / max_input then bound what follows it):
    # the fewshot preset, an evaluation's few-shot exemplars before each question
    shared_prefix: int = 0


# --workload presets; an explicit flag overrides the preset's value.
WORKLOADS = {
    "default": Workload(num_seqs=256, min_input=100, max_input=1024, min_output=100, max_output=1024, seed=0),
    "long": Workload(num_seqs=1024, min_input=100, max_input=2048, min_output=100, max_output=512, seed=7),
    "many": Workload(num_seqs=2048, min_input=50, max_input=1024, min_output=50, max_output=512, seed=11),
    "score": Workload(num_seqs=1024, min_input=256, max_input=1024, min_output=1, max_output=1, seed=13,
                      prompt_logprobs=0),
    # 64 prompts x 8 samples: 512 sequences, the engine's default max_num_seqs (GRPO-style groups of 8)
    "rollout": Workload(num_seqs=64, min_input=100, max_input=1024, min_output=100, max_output=1024, seed=17, n=8),
    # 256 questions of 50-200 tokens after 1,024 tokens of exemplars (GSM8K's 8-shot prompt is ~900), answers
    # of 50-512 tokens
    "fewshot": Workload(num_seqs=256, min_input=50, max_input=200, min_output=50, max_output=512, seed=19,
                        shared_prefix=1024),
}


def make_workload(w: Workload, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's draws, in its order: all prompts, then all max_tokens; then the shared prefix's ids,
    put in front of every prompt."""
    rng = random.Random(w.seed)
    id_max = min(PROMPT_ID_MAX, vocab_size - 1)
    prompts = [[rng.randint(0, id_max) for _ in range(rng.randint(w.min_input, w.max_input))]
               for _ in range(w.num_seqs)]
    max_tokens = [rng.randint(w.min_output, w.max_output) for _ in range(w.num_seqs)]
    if w.shared_prefix:
        prefix = [rng.randint(0, id_max) for _ in range(w.shared_prefix)]
        prompts = [prefix + p for p in prompts]
    return prompts, max_tokens


def workload_prefix(name: str = "default", n: int | None = None) -> tuple[list[list[int]], list[int]]:
    """The first n prompts (all where n is None) of preset `name` and their max_tokens, for an engine
    whose vocabulary is not read first: ids stay at most PROMPT_ID_MAX, which every real vocabulary holds."""
    prompts, max_tokens = make_workload(WORKLOADS[name], vocab_size=ANY_VOCAB)
    return prompts[:n], max_tokens[:n]
