"""bench.py's roofline: the bytes and FLOPs any engine must move and do for a workload (numbers and
ModelConfig in, numbers out; no device).

Roofline: time >= max(bytes / copy bandwidth, FLOPs / bf16 GEMM peak), both probed in the same run
(benchmarks/harness/probes.py).
Bytes: each decode step reads every running sequence's whole KV context, and there are at least
max(max_tokens) - 1 steps, each reading every weight but an untied input embedding (only rows gathered).
FLOPs: 2 x linear weights x tokens through them: prompt and output tokens but the last output go through
the layers, one lm_head row per output token; attention 4 x heads x head_dim per layer and query-key
pair, each token seeing its causal prefix (prefill a triangle of its prompt, decode the whole context).

Mixture-of-experts models (benchmarks/configs/qwen3-30b-a3b: the published Qwen3-30B-A3B shape;
qwen3-moe-small: an invented 1.5B-total, 0.46B-active shape, Qwen3-0.6B's attention and vocabulary
with 64 experts of width 256 in each of 24 layers, 8 per token): a decode step reads in full every
weight but the experts, and of each sparse layer's experts only those its rows picked. Those are
counted as their expected number under uniform routing (random weights route near-uniformly):
B rows each picking K distinct of E experts miss a given expert with probability (1 - K/E)^B, so
they read E (1 - (1 - K/E)^B) experts. Step t's B is the number of requests still decoding at t
(all running from the start): the fewest expert reads of any schedule, as the count is concave in B.
FLOPs count the router and the K picked experts per token.

Scoring (--workload score, score_flops): prompts with prompt_logprobs and one output token each. The
lm_head runs at every prompt position (its logits give each prompt token's logprob): 2 x vocab x
hidden FLOPs per prompt token, not per output token. Bytes: the weights, read at least once (of an MoE
model's experts, the expected distinct ones all prompt tokens pick, as above).

Samples (bench.py --n, the rollout preset): a request of n samples is prefilled once and decodes n
sequences side by side (the same max_tokens) that share its prompt's KV blocks: a decode step must read
the prompt's KV once (an engine whose kernel reads it once for the n rows, as cascade attention does)
and each sample's own tokens; the weight term's expected experts count the samples' rows. FLOPs: one
prefill and n decodes (workload_flops).

A shared prefix (bench.py's fewshot preset: an evaluation's few-shot exemplars in front of every prompt,
`shared` tokens): computed once (prefix caching) and read once a decode step (as a kernel reading it once
for all rows would); each request's own tokens as before. With shared = 0 every count is as above.

Phase bound (phase_bound_s): the same schedule with the phases that wait on each other in turn
(every prefill, then each decode step's projections, then its attention), each at the roofline of
its own bytes and FLOPs; the roofline / this is the most of the roofline that schedule can reach.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanovllm.moe.layer import MoeExperts
from nanovllm.models.model_config import ModelConfig
from nanovllm.models.registry import build_model


def attention_linear_elements(cfg: ModelConfig) -> int:
    """Weight elements of one decoder layer's attention projections (q, k, v, o)."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size


def expert_elements(cfg: ModelConfig) -> int:
    """Weight elements of one expert of one sparse layer (gate, up, down)."""
    return 3 * cfg.hidden_size * cfg.moe.moe_intermediate_size


def token_linear_elements(cfg: ModelConfig) -> int:
    """Weight elements one token is multiplied through across the layers: the attention projections
    of each, the dense MLP of the dense layers, the router and K experts of the sparse ones."""
    sparse = len(cfg.sparse_layers())
    dense = cfg.num_hidden_layers - sparse
    total = cfg.num_hidden_layers * attention_linear_elements(cfg) + dense * 3 * cfg.hidden_size * cfg.intermediate_size
    if sparse:
        moe = cfg.moe
        total += sparse * (moe.num_experts * cfg.hidden_size + moe.num_experts_per_tok * expert_elements(cfg))
    return total


def lm_head_elements(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden_size


def decode_weight_elements(cfg: ModelConfig) -> int:
    """Parameters a decode step reads in full: every parameter of the model of `cfg` (weights,
    biases, norms: whatever its family has), the lm_head included; not an untied input
    embedding, of which a step gathers only its tokens' rows (a tied one is the lm_head and
    counts once), nor the experts of an MoE model (decode_expert_elements counts those read).
    Counted on a model built on the meta device (no memory); call it before an engine sets up
    tensor parallelism, or the model would be one rank's shard."""
    with torch.device("meta"):
        model = build_model(cfg)
    total = sum(p.numel() for p in model.parameters())  # a tied weight is one parameter
    total -= sum(p.numel() for m in model.modules() if isinstance(m, MoeExperts) for p in m.parameters())
    if cfg.tie_word_embeddings:
        return total
    return total - cfg.vocab_size * cfg.hidden_size  # the input embedding


def expected_experts_hit(num_experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts `rows` tokens pick, each top_k distinct of num_experts uniformly
    at random: one token misses a given expert with probability C(E-1, K) / C(E, K) = 1 - K/E,
    all of them independently with (1 - K/E)^rows."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def per_sample(values: Sequence[int], n: int) -> list[int]:
    """`values` (one per request) repeated for each of the requests' n samples: the sequences that decode."""
    return [v for v in values for _ in range(n)]


def decode_rows(max_tokens: Sequence[int]) -> list[int]:
    """Rows of decode steps t = 1 .. max(max_tokens) - 1 when every request runs from the start:
    a request of n output tokens decodes at steps 1 .. n - 1."""
    ends = Counter(n - 1 for n in max_tokens)  # last decode step -> requests ending there
    rows, running = [], len(max_tokens) - ends[0]
    for t in range(1, max(max_tokens)):
        rows.append(running)
        running -= ends[t]
    return rows


def decode_expert_elements(cfg: ModelConfig, max_tokens: Sequence[int]) -> float:
    """Expert weight elements the workload's decode steps read (0 for a dense model): per step
    and sparse layer, the expected distinct experts of its rows (expected_experts_hit of
    decode_rows) times one expert's elements."""
    return sum(step_expert_elements(cfg, b) for b in decode_rows(max_tokens))


def step_expert_elements(cfg: ModelConfig, rows: int) -> float:
    """Expert weight elements one decode step of `rows` rows reads (0 for a dense model): per
    sparse layer, the expected distinct experts of its rows times one expert's elements."""
    if cfg.moe is None:
        return 0
    moe = cfg.moe
    hit = expected_experts_hit(moe.num_experts, moe.num_experts_per_tok, rows)
    return len(cfg.sparse_layers()) * expert_elements(cfg) * hit


@dataclass(frozen=True)
class ByteWidths:
    """Bytes of one stored element: of the KV cache (1 with kv_cache_dtype fp8), of the weights a
    decode step reads in full (with FP8 linears, the mean over them: stored bytes / elements) and
    of an MoE model's experts."""

    kv: int
    weights: float
    experts: float  # with FP8 experts, stored bytes (weights and scales) over elements

    @classmethod
    def uniform(cls, elem_bytes: int) -> "ByteWidths":
        return cls(elem_bytes, elem_bytes, elem_bytes)


def step_weight_bytes(cfg: ModelConfig, widths: ByteWidths, weight_elements: int, tokens: int) -> float:
    """Weight bytes a forward of `tokens` tokens (a decode step's rows, a prefill's prompt tokens) reads at
    least once: the `weight_elements` every token goes through, and an MoE model's expected distinct
    experts of its tokens (step_expert_elements), each at its stored width."""
    return weight_elements * widths.weights + step_expert_elements(cfg, tokens) * widths.experts


def kv_bytes_per_token(cfg: ModelConfig, kv_elem_bytes: int) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_elem_bytes


def decode_kv_tokens(prompt_len: int, max_tokens: int, n: int = 1) -> int:
    """Context tokens one request's decode steps must read: step t = 1 .. m-1 reads its prompt once and
    each of its n samples' t tokens (m = max_tokens)."""
    m = max_tokens
    return (m - 1) * prompt_len + n * m * (m - 1) // 2


def causal_pairs(prompt_len: int, max_tokens: int) -> int:
    """Query-key pairs of one request: its prompt and all but its last output token are forwarded,
    and token i (1-based) attends to tokens 1 .. i."""
    forwarded = prompt_len + max_tokens - 1
    return forwarded * (forwarded + 1) // 2


def check_shared(shared: int, prompt_lens: Sequence[int]) -> None:
    """ValueError unless a prefix of `shared` tokens fits inside every prompt."""
    if not 0 <= shared <= min(prompt_lens):
        raise ValueError(f"a shared prefix of {shared} tokens must be within every prompt "
                         f"(shortest {min(prompt_lens)})")


def workload_bytes(cfg: ModelConfig, widths: ByteWidths, prompt_lens: Sequence[int],
                   max_tokens: Sequence[int], weight_elements: int, n: int = 1, shared: int = 0) -> tuple[int, int]:
    """(KV bytes, weight bytes) that any engine must read for the workload's decode steps, each request
    decoding `n` samples (decode_kv_tokens), the first `shared` tokens of every prompt read once a step;
    weight_elements: what one decode step reads in full (decode_weight_elements); an MoE model's experts
    are added as decode_expert_elements counts them for the samples' rows (rounded to whole bytes)."""
    check_shared(shared, prompt_lens)
    steps = max(max_tokens) - 1
    kv_tokens = sum(decode_kv_tokens(p - shared, m, n) for p, m in zip(prompt_lens, max_tokens, strict=True))
    kv_tokens += shared * steps  # every step has a request running (the longest runs through the last)
    experts = round(decode_expert_elements(cfg, per_sample(max_tokens, n)) * widths.experts)
    return kv_tokens * kv_bytes_per_token(cfg, widths.kv), weight_elements * widths.weights * steps + experts


@dataclass(frozen=True)
class DecodeStep:
    """What one decode step of the roofline's schedule must read."""

    rows: int  # sequences decoding at this step
    weight_bytes: float  # every weight read in full, plus the expected experts its rows pick
    kv_bytes: int  # each running request's whole context (a prompt shared by samples or requests once)
    pairs: int  # query-key pairs: each row's query with every token of its context (shared ones too)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


def decode_steps(cfg: ModelConfig, widths: ByteWidths, prompt_lens: Sequence[int], max_tokens: Sequence[int],
                 weight_elements: int, n: int = 1, shared: int = 0) -> list[DecodeStep]:
    """Decode steps t = 1 .. max(max_tokens) - 1 as workload_bytes counts them (every request
    running from the start, its n samples as n rows): the weights read in full, an MoE model's
    expected experts of its rows, and each running request's context, its prompt once (the shared
    prefix once for all) and t tokens a sample. Their bytes sum to workload_bytes' two terms (experts up
    to its rounding)."""
    check_shared(shared, prompt_lens)
    ends_prompt = Counter()  # last decode step -> own prompt tokens of the requests ending there
    for p, m in zip(prompt_lens, max_tokens, strict=True):
        ends_prompt[m - 1] += p - shared
    prompt_sum = sum(prompt_lens) - shared * len(prompt_lens) - ends_prompt[0]  # of the requests decoding at t
    per_token = kv_bytes_per_token(cfg, widths.kv)
    steps = []
    for t, running in enumerate(decode_rows(max_tokens), start=1):
        rows = n * running
        steps.append(DecodeStep(rows, step_weight_bytes(cfg, widths, weight_elements, rows),
                                per_token * (shared + prompt_sum + rows * t),
                                rows * shared + n * prompt_sum + rows * t))
        prompt_sum -= ends_prompt[t]
    return steps


def attention_flops(cfg: ModelConfig, pairs: int) -> int:
    """FLOPs of `pairs` query-key pairs: q.k and p.v, 2 x 2 x head_dim a head and layer."""
    return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * pairs


def projection_flops(cfg: ModelConfig, tokens: int, logit_rows: int) -> int:
    """FLOPs of `tokens` tokens through the layers' projections and `logit_rows` lm_head rows."""
    return 2 * (token_linear_elements(cfg) * tokens + lm_head_elements(cfg) * logit_rows)


def workload_flops(cfg: ModelConfig, prompt_lens: Sequence[int], max_tokens: Sequence[int],
                   n: int = 1, shared: int = 0) -> tuple[int, int]:
    """(matmul FLOPs, attention FLOPs) of the workload's forwards, each request making `n` samples of its
    max_tokens: its prompt is forwarded once (its last position's logits give every sample's first
    token), then each sample forwards its other tokens::

        request (prompt p, max_tokens m):  p prompt tokens  ->  n samples x (m - 1) decode tokens
        lm_head rows                        1                   n x (m - 1)
        query-key pairs                     p (p + 1) / 2       n x (pairs of positions p + 1 .. p + m - 1)

    The first `shared` tokens of every prompt are forwarded once for all requests (their pairs too)."""
    check_shared(shared, prompt_lens)
    forwarded = shared * (1 - len(prompt_lens))
    logit_rows = 0
    pairs = causal_pairs(shared, 1) * (1 - len(prompt_lens))
    for p, m in zip(prompt_lens, max_tokens, strict=True):
        prefill = causal_pairs(p, 1)
        forwarded += p + n * (m - 1)
        logit_rows += 1 + n * (m - 1)
        pairs += prefill + n * (causal_pairs(p, m) - prefill)
    return projection_flops(cfg, forwarded, logit_rows), attention_flops(cfg, pairs)


def score_flops(cfg: ModelConfig, prompt_lens: Sequence[int]) -> tuple[int, int]:
    """(matmul FLOPs, attention FLOPs) of scoring prompts (prompt_logprobs, one output token each):
    every prompt token through the layers and through the lm_head, as logprobs of every prompt token
    need the logits of every position (position i's score token i + 1, the last one's sample the
    output token); each token attends to its causal prefix."""
    tokens = sum(prompt_lens)
    return projection_flops(cfg, tokens, tokens), attention_flops(cfg, sum(causal_pairs(p, 1) for p in prompt_lens))


def phase_bound_s(cfg: ModelConfig, widths: ByteWidths, prompt_lens: Sequence[int], steps: Sequence[DecodeStep],
                  weight_elements: int, bandwidth: float, peak_flops: float, shared: int = 0) -> float:
    """Seconds the roofline's own schedule takes when the phases that wait on each other run in
    turn, each at the roofline of its own bytes and FLOPs::

        every prefill        max(prompts' FLOPs / peak, weights / BW)
        then decode step t:
          projections        max((weights + experts) / BW, its rows' projection FLOPs / peak)
          + attention        max(its contexts' KV / BW, their attention FLOPs / peak)

    A step's attention needs its projections' q, k, v, and the next projection needs the
    attention's output: on one batch the two cannot overlap (two micro-batches on two streams
    could, each reading the weights again; the lanes probe measured no gain: BENCHMARKS.md). Every
    request decodes from step 1, as the roofline's weight term counts, so every prefill comes
    first (`steps`: decode_steps of the workload; `shared`: the prompts' common prefix, prefilled once).
    Never below the roofline: roofline / this is the most of the roofline that schedule can reach."""
    total = max(sum(workload_flops(cfg, prompt_lens, [1] * len(prompt_lens), shared=shared)) / peak_flops,
                weight_elements * widths.weights / bandwidth)
    for step in steps:
        total += max(step.weight_bytes / bandwidth, projection_flops(cfg, step.rows, step.rows) / peak_flops)
        total += max(step.kv_bytes / bandwidth, attention_flops(cfg, step.pairs) / peak_flops)
    return total


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> int:
    """FLOPs of one prompt's prefill that samples its first token."""
    return sum(workload_flops(cfg, [prompt_len], [1]))


@dataclass(frozen=True)
class Roofline:
    memory_s: float
    compute_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def binding(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def roofline(num_bytes: float, flops: float, bandwidth: float, peak_flops: float) -> Roofline:
    return Roofline(memory_s=num_bytes / bandwidth, compute_s=flops / peak_flops)
