"""Token sampler: one batched pass turns a step's logits into next-token ids (and logprobs).

Each row of a batch may be greedy, plain temperature sampling, or filtered by
top-k / top-p / min-p, seeded or not; all rows go through the same tensor ops.

Pipeline (vLLM's order), all in float32:

0. Only in a step where some request asks for them: its logits rules (allowed_token_ids,
   bad_words, min_tokens, logit_bias, then the penalties) on a float32 copy of the logits
   (sampling/logits_rules.py); greedy rows take the argmax of the result.
1. ``scaled = logits / T`` (greedy rows use T = 1 and are swapped for the argmax at the end).
2. ``probs = softmax(scaled)``.
3. min-p: probabilities below ``min_p * max_prob`` get 0, before top-k / top-p, so top-p's mass
   is the min-p survivors' (vLLM V1's order: min-p is a logits processor ahead of its top-k /
   top-p sampler).
4. top-k / top-p (only when some row uses them, known on the host): the sorted
   probabilities (only torch.topk's max_top_k largest when every top-p row also uses
   top-k; on CUDA, for a large batch that would sort, a Triton radix select on the float
   bits instead: sampling/radix_filter.py) give each row a *threshold* value; top-k's is the k-th largest
   probability, top-p's is the probability at the end of the smallest sorted
   prefix whose mass (within the top-k survivors) reaches top_p. Tokens with a
   probability strictly below the threshold get probability 0. Tokens tied with
   the threshold are all kept, so equal probabilities are always treated alike.
5. Gumbel-max: ``argmax(log probs + G)`` with ``G`` i.i.d. standard Gumbel picks token i
   with probability ``probs[i] / sum(probs)``, so no renormalisation is needed. A batch
   with no top-k/top-p/min-p row goes straight from the logits to tokens
   (``argmax(logits / T + G)``, steps 1-2 folded in). On CUDA a batch filtered by top-p /
   min-p alone (no top-k row) goes from the logits to the same tokens in one kernel that walks
   the Gumbel-max candidates down until one passes the filters (sampling/candidate_walk.py),
   with no threshold computed; a batch whose every sampled row uses a small top-k (with or without
   top-p / min-p) in two launches that take each row's top K values and sample among them
   (sampling/topk_sample.py; KernelRoutes.topk_kernel_max_k).

Noise source: one, on every device. Each row has a 64-bit key (a seeded request's from
``row_key(seed, position)``, the others from the engine's RNG) and its noise is Philox of
(key, column) (sampling/gumbel_torch.py defines it): the Triton kernel ``gumbel_sample``
draws it on CUDA, its PyTorch twin ``torch_gumbel_sample`` elsewhere, bit for bit alike.
The sampler picks the implementation once, from the device it is built on
(kernel_path.uses_triton). So a seeded row's tokens do not depend on the rest of the
batch, and given the same logits they are the same on either device (the uniforms are
identical; the kernel's log (libdevice's) might round differently from torch's, which could
only change a float32 near-tie).

Token masks (structured outputs): a batch may come with a TokenMask (sampling/token_mask.py) whose
rows get -inf at every token their grammar forbids, in place, before anything else reads the
logits, so the logits rules (penalties etc.), greedy, sampling, filters and logprobs all see the
masked logits (vLLM applies the grammar bitmask before its sampler too; the rules keep -inf at
-inf, so this is the same as masking after them). A batch without one does no mask work.

Logprobs: rows whose request asks for them (``SamplingParams.logprobs``) get
``log_softmax`` of their raw logits (before penalties, temperature and filters, as vLLM's default;
the engine's logprobs_mode may ask for the processed ones or logits instead: sampling/logprobs_mode.py),
float32: the sampled token's (and its rank) and the k most likely tokens'. They cost one pass over
those rows only (on CUDA the Triton kernel sampling/logprobs_kernel.py: row normalisers, rank and
top k in one read of the logits, for k up to its MAX_K; elsewhere, and for larger k,
sampling/row_logprobs.token_logprobs: a log_softmax and a top-k); a batch where no row asks does no
logprob work at all.

No op reads a device value back to the host: every branch is decided by the
Python-side flags of :class:`SamplingBatch`, whose tensors are views of :class:`SamplingPack`'s
words (sampling/batch.py); the engine copies those with the step's inputs (one
host-to-device copy per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from nanovllm.layers.kernel_path import KernelRoutes, construction_device, current_routes, uses_triton
from nanovllm.sampling.batch import SamplingBatch
from nanovllm.sampling.gumbel_torch import torch_gumbel_sample
from nanovllm.sampling.logits_rules import StepRules
from nanovllm.sampling.logprobs_mode import LogprobsMode, processed_logits
from nanovllm.sampling.row_logprobs import RowLogprobs, token_logprobs
from nanovllm.sampling.token_mask import TokenMask, apply_token_mask

_DEFAULT_TOPK_MAX_K = KernelRoutes().topk_max_k


class TokenLogprobs(NamedTuple):
    """Logprobs (log_softmax of the raw logits, float32; or what the LogprobsMode says) of the R
    batch rows that asked for them."""

    rows: Tensor  # [R] int64: which batch rows, ascending
    sampled: Tensor  # [R] float32: logprob of each row's sampled token
    ranks: Tensor  # [R] int64: its rank in the row (sampling/row_logprobs.py)
    top_ids: Tensor  # [R, k] int64: the k most likely tokens (k = LogprobRows.k), by descending logprob
    top_logprobs: Tensor  # [R, k] float32: their logprobs


@dataclass(frozen=True)
class SamplerOutput:
    """What one sampler pass returns."""

    tokens: Tensor  # [B] int64: one sampled token per row
    logprobs: TokenLogprobs | None  # None: no row asked for logprobs (and none were computed)


def takes_topk_path(batch: SamplingBatch, topk_max_k: int) -> bool:
    """Whether the torch path's thresholds come from torch.topk (every top-p row bounded by a
    top-k of at most topk_max_k) rather than a full sort of each row."""
    return batch.top_ks is not None and batch.max_top_k <= topk_max_k and batch.top_p_within_top_k


def takes_topk_kernel(batch: SamplingBatch, vocab: int, topk_kernel_max_k: int, topk_kernel_max_vocab: int) -> bool:
    """Whether a filtered batch is sampled by the Triton top-k kernel (sampling/topk_sample.py):
    every sampled row uses a top_k of at most topk_kernel_max_k (0: never), and the vocabulary fits."""
    return (batch.top_k_on_sampled_rows and batch.max_top_k <= topk_kernel_max_k
            and batch.max_top_k < vocab <= topk_kernel_max_vocab)


def uses_radix(rows: int, batch: SamplingBatch, radix_min_rows: int | None, topk_max_k: int) -> bool:
    """Whether a batch of `rows` takes the radix select for its thresholds: a sampler that has it
    (radix_min_rows not None: CUDA), enough rows, and no torch.topk path."""
    return radix_min_rows is not None and rows >= radix_min_rows and not takes_topk_path(batch, topk_max_k)


def top_k_top_p_threshold(probs: Tensor, batch: SamplingBatch, topk_max_k: int = _DEFAULT_TOPK_MAX_K) -> Tensor:
    """``[B, 1]`` float32: tokens with probability below it are filtered by top-k/top-p (PyTorch:
    the CPU path, and the reference of the radix select)."""
    top_ks, top_ps = batch.top_ks, batch.top_ps
    vocab = probs.shape[-1]
    if takes_topk_path(batch, topk_max_k):
        return _threshold_from_top(probs, batch)

    sorted_probs = probs.sort(dim=-1, descending=True).values
    if top_ks is not None:
        kth = sorted_probs.gather(-1, (top_ks.clamp(1, vocab) - 1).unsqueeze(-1))
    else:
        kth = torch.zeros_like(sorted_probs[:, :1])
    if top_ps is None:
        return kth
    # top-p over the top-k survivors: keep sorted position i while the mass before
    # it is < top_p * (mass of the survivors). Position 0 always qualifies.
    # The cumulative sum is non-decreasing, so the kept positions form a prefix:
    # position 0 plus every i >= 1 whose preceding mass inclusive[i - 1] < limit.
    survivors = torch.where(sorted_probs >= kth, sorted_probs, 0.0)
    inclusive = survivors.cumsum(dim=-1)
    limit = top_ps.unsqueeze(-1) * inclusive[:, -1:]
    num_kept = 1 + (inclusive[:, :-1] < limit).sum(dim=-1, keepdim=True)
    # top_p 1.0 (off) keeps everything, whatever the rounding of the sum.
    num_kept = torch.where(top_ps.unsqueeze(-1) >= 1.0, vocab, num_kept)
    pth = sorted_probs.gather(-1, num_kept - 1)
    return torch.maximum(kth, pth)


def _threshold_from_top(probs: Tensor, batch: SamplingBatch) -> Tensor:
    """``top_k_top_p_threshold`` from the max_top_k largest probabilities of each row (torch.topk),
    when every top-p row also uses top-k. The sort's first max_top_k positions, with the same
    float32 cumulative sums; the survivors (>= kth) past them can only be ties of kth:

        sorted row   | top (kmax values)             | ties of kth | the rest (< kth) |
        survivors    | x >= kth, cumsum `inclusive`  | counted     | 0                |

    their mass joins the total, and a limit reached only among them makes kth the threshold."""
    top_ks, top_ps, kmax = batch.top_ks, batch.top_ps, batch.max_top_k
    top = probs.topk(kmax, dim=-1, sorted=True).values  # [B, kmax] descending
    kth = top.gather(-1, (top_ks.clamp(max=kmax) - 1).unsqueeze(-1))  # [B, 1]
    # Rows with top_k off hold the vocab size (> kmax): keep everything (top-p is off there too).
    kth = torch.where(top_ks.unsqueeze(-1) > kmax, 0.0, kth)
    if top_ps is None:
        return kth
    survivors = torch.where(top >= kth, top, 0.0)
    inclusive = survivors.cumsum(dim=-1)  # [B, kmax]
    ties_past_top = (probs >= kth).sum(dim=-1, keepdim=True) - (top >= kth).sum(dim=-1, keepdim=True)
    limit = top_ps.unsqueeze(-1) * (inclusive[:, -1:] + ties_past_top * kth)
    num_kept = 1 + (inclusive[:, :-1] < limit).sum(dim=-1, keepdim=True)  # [B, 1] in [1, kmax]
    pth = torch.where(top_ps.unsqueeze(-1) >= 1.0, 0.0, top.gather(-1, num_kept - 1))
    return torch.maximum(kth, pth)


class Sampler(torch.nn.Module):
    """Samples one token id per row of ``logits`` following a :class:`SamplingBatch`, and the
    logprobs of the rows that ask for them."""

    def __init__(self, logprobs_mode: LogprobsMode = LogprobsMode.RAW_LOGPROBS) -> None:
        super().__init__()
        self.logprobs_mode = logprobs_mode
        # The noise implementation of the device this sampler is built on (kernel_path's rule):
        # the Triton kernel on CUDA, its PyTorch twin elsewhere; both draw the same noise.
        # Likewise the logprobs: one Triton pass on CUDA (unless routes.logprobs_kernel is off), torch's
        # log_softmax and top-k elsewhere (same contract; the engine's prompt logprobs use it too).
        triton_path = uses_triton(construction_device())
        routes = current_routes()
        self.topk_max_k = routes.topk_max_k
        # Rows from which top-k/top-p thresholds come from the Triton radix select (CUDA only;
        # None: always the PyTorch path).
        self.radix_min_rows: int | None = routes.radix_min_rows if triton_path else None
        self.gumbel_sample = torch_gumbel_sample
        self.token_logprobs = token_logprobs
        # The largest k token_logprobs serves (None: every k); past it, torch's path (logprobs_of).
        self.token_logprobs_max_k: int | None = None
        self.walk_sample = None
        self.topk_sample = None
        # Batches the Triton top-k kernel samples (takes_topk_kernel): none off CUDA.
        self.topk_kernel_max_k = 0
        self.topk_kernel_max_vocab = 0
        # One top_k per list length the kernel serves (topk_sample.top_k_per_list): the engine's warm-up
        # samples with each, so every compiled variant is built there.
        self.topk_list_ks: tuple[int, ...] = ()
        self.apply_token_mask = apply_token_mask
        if triton_path:  # Triton is present on this path
            from nanovllm.sampling.candidate_walk import walk_sample
            from nanovllm.sampling.gumbel_max import gumbel_sample
            from nanovllm.sampling.logprobs_kernel import MAX_K, LogprobsWorkspace, row_logprobs
            from nanovllm.sampling.token_mask_kernel import triton_apply_token_mask

            self.gumbel_sample = gumbel_sample
            self.apply_token_mask = triton_apply_token_mask
            if routes.logprobs_kernel:
                # one scratch for this sampler's launches (one stream): a call allocates only its outputs
                self.token_logprobs = partial(row_logprobs, workspace=LogprobsWorkspace())
                self.token_logprobs_max_k = MAX_K
            # Batches filtered by top-p / min-p alone: one kernel walks Gumbel-max candidates
            # (sampling/candidate_walk.py), the same tokens as the threshold path without its passes.
            self.walk_sample = walk_sample
            # Batches whose every sampled row uses a small top-k (with or without top-p / min-p):
            # the top K values of each row in two launches (sampling/topk_sample.py).
            from nanovllm.sampling import topk_sample

            self.topk_sample = topk_sample.topk_sample
            self.topk_kernel_max_k = min(routes.topk_kernel_max_k, topk_sample.MAX_K)
            self.topk_kernel_max_vocab = topk_sample.MAX_VOCAB
            self.topk_list_ks = topk_sample.top_k_per_list(self.topk_kernel_max_k)

    def logprobs_of(self, logits: Tensor, tokens: Tensor, k: int, rows: Tensor | None = None) -> RowLogprobs:
        """The RowLogprobs of `rows` of `logits` at `tokens` with each row's k most likely tokens
        (row_logprobs.token_logprobs' contract): token_logprobs where it serves k, torch's path past it."""
        if self.token_logprobs_max_k is not None and k > self.token_logprobs_max_k:
            return token_logprobs(logits, tokens, k, rows)
        return self.token_logprobs(logits, tokens, k, rows)

    def threshold(self, probs: Tensor, batch: SamplingBatch) -> Tensor:
        """Each row's top-k/top-p threshold [B, 1]: the radix select (sampling/radix_filter.py)
        where the torch path would sort whole rows of a batch of radix_min_rows or more, the torch
        path otherwise. The same thresholds (top-p within float32 rounding of its partial sums),
        except 0.0 where neither filter is on (the same tokens kept)."""
        if uses_radix(probs.shape[0], batch, self.radix_min_rows, self.topk_max_k):
            from nanovllm.sampling.radix_filter import top_k_top_p_threshold as radix_threshold

            return radix_threshold(probs, batch.top_ks, batch.top_ps)
        return top_k_top_p_threshold(probs, batch, self.topk_max_k)

    def forward(self, logits: Tensor, batch: SamplingBatch, rules: StepRules | None = None,
                token_mask: TokenMask | None = None) -> SamplerOutput:
        """``logits`` ``[B, V]`` (any float dtype; not modified, but for the rows of `token_mask`,
        masked in place) -> ``[B]`` int64 token ids and the logprobs of ``batch.logprobs``'s rows.
        `token_mask`: the constrained rows' allowed tokens (structured outputs), applied first, so
        logprobs, greedy and sampling all see it. `rules`: the step's logits rules (penalties,
        biases, masks: sampling/logits_rules.py), applied to a float32 copy of the masked logits
        before sampling; the logprobs stay those of the (masked) raw logits. Every rule keeps -inf
        at -inf, so masking before the rules samples the same tokens as masking after them."""
        if token_mask is not None:
            self.apply_token_mask(logits, token_mask)
        ruled = logits if rules is None else rules.apply(logits)
        tokens = self._sample(ruled, batch)  # [B]
        if batch.logprobs is None:
            return SamplerOutput(tokens, None)
        rows = batch.logprobs.rows  # [R], read in place: the rows that do not ask cost nothing
        mode = self.logprobs_mode
        scored_logits = processed_logits(ruled, batch, tokens, self.threshold) if mode.processed else logits
        scored = self.logprobs_of(scored_logits, tokens, batch.logprobs.k, rows)
        if mode.logits:  # the same ranks and top tokens, their logits reported (read where they are)
            scored = RowLogprobs(scored_logits[rows, tokens[rows]].float(), scored.ranks, scored.top_ids,  # [R]
                                 scored_logits[rows.unsqueeze(1), scored.top_ids].float())  # [R, k]
        return SamplerOutput(tokens, TokenLogprobs(rows, *scored))

    def _sample(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """``[B]`` int64 token ids."""
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        if logits.dtype == torch.float64:  # the noise implementations read float16/bfloat16/float32
            logits = logits.to(torch.float32)
        filtered = batch.top_ks is not None or batch.top_ps is not None or batch.min_ps is not None
        if not filtered:
            return self.gumbel_sample(logits, batch.keys, batch.temperatures)  # greedy rows: T = 0
        if self.walk_sample is not None and batch.top_ks is None:
            return self.walk_sample(logits, batch.keys, batch.temperatures, batch.top_ps, batch.min_ps)
        if takes_topk_kernel(batch, logits.shape[-1], self.topk_kernel_max_k, self.topk_kernel_max_vocab):
            return self.topk_sample(logits, batch.keys, batch.temperatures, batch.top_ks, batch.max_top_k,
                                    batch.top_ps, batch.min_ps)
        greedy_ids = logits.argmax(dim=-1)
        is_greedy = batch.temperatures == 0.0  # top_k 1 rows too: build stores them with T = 0
        safe_t = torch.where(is_greedy, 1.0, batch.temperatures).unsqueeze(-1)
        # bf16/fp16 logits divided by a float32 tensor give a fresh float32 tensor
        # in one pass (the caller's logits, maybe a CUDA graph's buffer, stay as they are).
        probs = torch.softmax(logits / safe_t, dim=-1)

        if batch.min_ps is not None:  # first: top-k / top-p then rank and weigh the survivors only
            probs.masked_fill_(probs < batch.min_ps.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True), 0.0)
        if batch.top_ks is not None or batch.top_ps is not None:
            probs.masked_fill_(probs < self.threshold(probs, batch), 0.0)
        sampled = self.gumbel_sample(probs, batch.keys, is_probs=True)
        return torch.where(is_greedy, greedy_ids, sampled)
