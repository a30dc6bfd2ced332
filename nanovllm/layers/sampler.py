"""Token sampler: one batched pass turns a step's logits into next-token ids.

Each row of a batch may be greedy, plain temperature sampling, or filtered by
top-k / top-p / min-p, seeded or not; all rows go through the same tensor ops.

Pipeline (vLLM's order), all in float32:

1. ``scaled = logits / T`` (greedy rows use T = 1 and are swapped for the argmax at the end).
2. ``probs = softmax(scaled)``.
3. top-k / top-p (only when some row uses them, known on the host): the sorted
   probabilities give each row a *threshold* value; top-k's is the k-th largest
   probability, top-p's is the probability at the end of the smallest sorted
   prefix whose mass (within the top-k survivors) reaches top_p. Tokens with a
   probability strictly below the threshold get probability 0. Tokens tied with
   the threshold are all kept, so equal probabilities are always treated alike.
4. min-p: probabilities below ``min_p * max_prob`` get 0 (folded into the same threshold).
5. Exponential race (Gumbel-max): ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d.
   picks token i with probability ``probs[i] / sum(probs)``, so no renormalisation
   is needed. The noise comes from one of two sources:
   - per-row keys (CUDA): the Triton kernel `gumbel_sample` derives each row's noise
     from its 64-bit key (Philox); a batch with no top-k/top-p/min-p row goes
     straight from the logits to tokens in that one kernel (steps 1-2 fused).
   - torch generators (CPU): unseeded rows share one batched draw from the default
     RNG; each seeded row draws its own ``[V]`` noise from its own generator.
   Either way a seeded row's tokens do not depend on the rest of the batch.

No op reads a device value back to the host: every branch is decided by the
Python-side flags of :class:`SamplingBatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from nanovllm.kernels import gumbel_sample
from nanovllm.sampling_params import TOP_K_OFF, SamplingParams
from nanovllm.utils.host_to_device import to_device

# Largest top_k served by torch.topk instead of a full sort when no row uses top-p.
_TOPK_PATH_MAX_K = 1024


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``, owned by one request."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class SamplingBatch:
    """Per-step sampling tensors for the B rows of a batch.

    temperatures: ``[B]`` float32; 0 marks a greedy row (temperature 0 or top_k 1).
    top_ks: ``[B]`` int64 (off rows hold the vocab size), or None when no row uses top-k.
    top_ps: ``[B]`` float32 (off rows hold 1.0), or None when no row uses top-p.
    min_ps: ``[B]`` float32 (off rows hold 0.0), or None when no row uses min-p.
    generators: one entry per row (None: default RNG), or None when no row is seeded.
    keys: ``[B]`` int64 noise keys (see ``row_key``), or None: noise from ``generators``.
    all_greedy: every row is greedy (the sampler only takes the argmax).
    max_top_k: largest top_k in use (0 when top_ks is None); lets the sampler use
        ``torch.topk`` instead of a full sort when no row uses top-p.
    """

    temperatures: Tensor
    top_ks: Tensor | None
    top_ps: Tensor | None
    min_ps: Tensor | None
    generators: tuple[torch.Generator | None, ...] | None
    all_greedy: bool
    max_top_k: int = 0
    keys: Tensor | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device,
        vocab_size: int,
        keys: Sequence[int] | None = None,
    ) -> SamplingBatch:
        """Builds the tensors from Python values: one copy per tensor, no device sync.
        With `keys` (one per row, in [0, 2**63)) the noise comes from them, not `generators`."""
        if len(generators) != len(params):
            raise ValueError(f"got {len(generators)} generators for {len(params)} rows")
        if keys is not None and len(keys) != len(params):
            raise ValueError(f"got {len(keys)} keys for {len(params)} rows")
        device = torch.device(device)
        greedy = [p.greedy for p in params]
        temperatures = [0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        # Settings of greedy rows are irrelevant: they are stored as "off".
        top_ks = [
            vocab_size if g or p.top_k in TOP_K_OFF else min(p.top_k, vocab_size)
            for p, g in zip(params, greedy)
        ]
        top_ps = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
        min_ps = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
        gens = tuple(None if g else gen for gen, g in zip(generators, greedy))
        use_top_k = any(k < vocab_size for k in top_ks)
        return cls(
            temperatures=to_device(temperatures, device, torch.float32),
            top_ks=to_device(top_ks, device, torch.int64) if use_top_k else None,
            top_ps=to_device(top_ps, device, torch.float32) if any(p < 1.0 for p in top_ps) else None,
            min_ps=to_device(min_ps, device, torch.float32) if any(m > 0.0 for m in min_ps) else None,
            generators=gens if any(gen is not None for gen in gens) else None,
            all_greedy=all(greedy),
            max_top_k=max(k for k in top_ks if k < vocab_size) if use_top_k else 0,
            keys=to_device(keys, device, torch.int64) if keys is not None and not all(greedy) else None,
        )


# splitmix64's multipliers (Steele et al.): a bijective mix, so distinct (seed, position) pairs
# give well-spread keys.
_MIX_GAMMA, _MIX_1, _MIX_2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = 2**64 - 1


def row_key(seed: int, position: int) -> int:
    """Noise key of a seeded request's row: a function of its seed and the position of the
    token being sampled only, so it repeats whatever the batch (and after a recompute)."""
    z = (seed * _MIX_GAMMA + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX_1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX_2) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: fits int64


def _top_k_top_p_threshold(probs: Tensor, batch: SamplingBatch) -> Tensor:
    """``[B, 1]`` float32: tokens with probability below it are filtered by top-k/top-p."""
    top_ks, top_ps = batch.top_ks, batch.top_ps
    vocab = probs.shape[-1]
    if top_ps is None and top_ks is not None and batch.max_top_k <= _TOPK_PATH_MAX_K:
        # Only top-k: the k-th largest value among the max_top_k largest.
        kmax = batch.max_top_k
        top = probs.topk(kmax, dim=-1, sorted=True).values
        kth = top.gather(-1, (top_ks.clamp(max=kmax) - 1).unsqueeze(-1))
        # Rows with top_k off hold the vocab size (> kmax): keep everything.
        return torch.where(top_ks.unsqueeze(-1) > kmax, 0.0, kth)

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


def _exponential_noise(like: Tensor, generators: tuple[torch.Generator | None, ...] | None) -> Tensor:
    """``Exp(1)`` noise shaped like ``like``; seeded rows use their own generator."""
    noise = torch.empty_like(like)
    if generators is None or any(g is None for g in generators):
        noise.exponential_()
    if generators is not None:
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
    # A zero draw would turn a filtered token's 0 / 0 into NaN, which argmax picks.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


class Sampler(torch.nn.Module):
    """Samples one token id per row of ``logits`` following a :class:`SamplingBatch`."""

    def forward(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """``logits`` ``[B, V]`` (any float dtype; not modified) -> ``[B]`` int64 token ids."""
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        filtered = batch.top_ks is not None or batch.top_ps is not None or batch.min_ps is not None
        if batch.keys is not None and not filtered and logits.dtype != torch.float64:
            return gumbel_sample(logits, batch.keys, batch.temperatures)  # greedy rows: T = 0
        greedy_ids = logits.argmax(dim=-1)
        temperatures = batch.temperatures
        is_greedy = temperatures == 0.0
        if batch.top_ks is not None:
            is_greedy = is_greedy | (batch.top_ks == 1)
        safe_t = torch.where(is_greedy, 1.0, temperatures).unsqueeze(-1)
        # bf16/fp16 logits divided by a float32 tensor give a fresh float32 tensor
        # in one pass (the caller's logits, maybe a CUDA graph's buffer, stay as they are).
        if logits.dtype == torch.float64:
            logits = logits.to(torch.float32)
        probs = torch.softmax(logits / safe_t, dim=-1)

        threshold: Tensor | None = None
        if batch.top_ks is not None or batch.top_ps is not None:
            threshold = _top_k_top_p_threshold(probs, batch)
        if batch.min_ps is not None:
            # The top token survives top-k/top-p, so the max is unchanged by them.
            min_p_th = batch.min_ps.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
            threshold = min_p_th if threshold is None else torch.maximum(threshold, min_p_th)
        if threshold is not None:
            probs.masked_fill_(probs < threshold, 0.0)

        if batch.keys is not None:
            sampled = gumbel_sample(probs, batch.keys, is_probs=True)
        else:
            probs.div_(_exponential_noise(probs, batch.generators))
            sampled = probs.argmax(dim=-1)
        return torch.where(is_greedy, greedy_ids, sampled)
