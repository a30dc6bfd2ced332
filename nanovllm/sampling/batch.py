"""A step's sampling settings as device tensors: SamplingPack packs them on the host into int64
words that ride the step's one host-to-device copy; SamplingBatch is the device view the Sampler
reads (sampling/sampler.py). Also the noise key of a seeded request's row (`row_key`).

    words: | keys B | top_ks B or 0 | logprob rows R | temperatures B, top_ps B or 0, min_ps B or 0 |
             int64 .................................  float32, two a word ......................

Each part starts at a 16-byte boundary (its length padded: int64 parts to even, float32 parts to
multiples of 4), so the sampler's kernels see the same pointer alignment every step (see
utils/host_to_device.ALIGN_BYTES). Parts no row uses are left out (length 0) and read as None, so
the sampler skips their work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from nanovllm.sampling_params import TOP_K_OFF, SamplingParams
from nanovllm.utils.host_to_device import PackLayout, to_device

# Noise keys are int64 tensor values: non-negative, 63 bits.
KEY_BITS = 63
@dataclass(frozen=True)
class LogprobRows:
    """The rows of a batch that ask for logprobs.

    rows: ``[R]`` int64 on the device, distinct and ascending (R == B: every row).
    k: most alternatives any of them asks for, capped at the vocabulary (known on the host);
        every one of the R rows gets this many, a row that asked for fewer keeps its first ones.
    """

    rows: Tensor
    k: int


@dataclass(frozen=True)
class SamplingBatch:
    """Per-step sampling tensors for the B rows of a batch.

    temperatures: ``[B]`` float32; 0 marks a greedy row (SamplingParams.greedy: temperature 0, or
        top_k 1).
    keys: ``[B]`` int64 noise keys in [0, 2**63) (seeded rows: see ``row_key``).
    top_ks: ``[B]`` int64 (off rows hold the vocab size), or None when no row uses top-k.
    top_ps: ``[B]`` float32 (off rows hold 1.0), or None when no row uses top-p.
    min_ps: ``[B]`` float32 (off rows hold 0.0), or None when no row uses min-p.
    logprobs: the rows that ask for logprobs, or None when none does.
    all_greedy: every row is greedy (the sampler only takes the argmax).
    max_top_k: largest top_k in use (0 when top_ks is None); lets the sampler use
        ``torch.topk`` instead of a full sort.
    top_p_within_top_k: every row using top-p uses top-k too (vacuously true without top-p
        rows), so each top-p row's candidates lie among its max_top_k largest probabilities.
    top_k_on_sampled_rows: every non-greedy row uses top-k (false without top-k rows), so every
        token the batch can sample lies among its row's max_top_k largest values.

    The tensors are views of one device buffer, filled by one host-to-device copy.
    """

    temperatures: Tensor
    keys: Tensor
    top_ks: Tensor | None
    top_ps: Tensor | None
    min_ps: Tensor | None
    logprobs: LogprobRows | None
    all_greedy: bool
    max_top_k: int = 0
    top_p_within_top_k: bool = True
    top_k_on_sampled_rows: bool = False

    @classmethod
    def build(cls, params: Sequence[SamplingParams], keys: Sequence[int], device: torch.device,
              vocab_size: int) -> SamplingBatch:
        """The batch of rows sampled with `params` and noise `keys` (one per row, in [0, 2**63)),
        in its own host-to-device copy (the engine's steps carry it in their input copy instead:
        SamplingPack.words travel with the step's integers)."""
        pack = SamplingPack.of(params, keys, vocab_size)
        return pack.unpack(to_device(pack.words, device))


@dataclass(frozen=True)
class SamplingPack:
    """A batch's sampling values on the host, packed as int64 words for one host-to-device copy:

        | keys B | top_ks B or 0 | logprob rows R | temperatures B, top_ps B or 0, min_ps B or 0: float32, two a word |

    `unpack` turns the copied words into a SamplingBatch of views (no further copy)."""

    words: np.ndarray  # [n] int64, n <= max_words(B)
    int_sizes: tuple[int, int, int]  # keys, top_ks, logprob rows
    float_sizes: tuple[int, int, int]  # temperatures, top_ps, min_ps
    logprobs_k: int  # alternatives the logprob rows ask for (0 when R = 0)
    all_greedy: bool
    max_top_k: int
    top_p_within_top_k: bool
    top_k_on_sampled_rows: bool

    @staticmethod
    def max_words(rows: int) -> int:
        """Words any batch of `rows` rows packs into (3 ints and 3 floats a row, padded)."""
        return PackLayout.of((rows,) * 3, (rows,) * 3).num_words

    @classmethod
    def of(cls, params: Sequence[SamplingParams], keys: Sequence[int], vocab_size: int) -> SamplingPack:
        batch = len(params)
        if len(keys) != batch:
            raise ValueError(f"got {len(keys)} keys for {batch} rows")
        if batch and (min(keys) < 0 or max(keys) >= 1 << KEY_BITS):
            raise ValueError(f"keys must be in [0, 2**63), got {min(keys)} .. {max(keys)}")
        greedy = [p.greedy for p in params]
        # Settings of greedy rows are irrelevant: they are stored as "off".
        temperatures = [0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_ks = [vocab_size if g or p.top_k in TOP_K_OFF else min(p.top_k, vocab_size)
                  for p, g in zip(params, greedy)]
        top_ps = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
        min_ps = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        use_top_k = any(k < vocab_size for k in top_ks)
        int_parts = [keys, top_ks if use_top_k else [], logprob_rows]
        float_parts = [temperatures, top_ps if any(p < 1.0 for p in top_ps) else [],
                       min_ps if any(m > 0.0 for m in min_ps) else []]
        int_sizes = tuple(len(part) for part in int_parts)
        float_sizes = tuple(len(part) for part in float_parts)
        return cls(
            PackLayout.of(int_sizes, float_sizes).pack(int_parts, float_parts), int_sizes, float_sizes,
            logprobs_k=min(vocab_size, max(params[i].logprobs for i in logprob_rows)) if logprob_rows else 0,
            all_greedy=all(greedy),
            max_top_k=max(k for k in top_ks if k < vocab_size) if use_top_k else 0,
            top_p_within_top_k=all(k < vocab_size for k, p in zip(top_ks, top_ps) if p < 1.0),
            # greedy rows hold top_k = vocab_size: the rows left at the vocabulary are the greedy ones
            top_k_on_sampled_rows=use_top_k and top_ks.count(vocab_size) == greedy.count(True),
        )

    def unpack(self, words: Tensor) -> SamplingBatch:
        """The batch as views of `words` (this pack's words, copied to the device)."""
        if words.dtype != torch.int64 or words.shape[0] != self.words.shape[0]:
            raise ValueError(f"expected {self.words.shape[0]} int64 words, got {words.dtype} {tuple(words.shape)}")
        (keys, top_ks, rows), (temperatures, top_ps, min_ps) = PackLayout.of(self.int_sizes,
                                                                             self.float_sizes).split(words)
        if keys is None:  # an empty batch
            keys, temperatures = words[:0], words[:0].view(torch.float32)
        return SamplingBatch(
            temperatures=temperatures,
            keys=keys,
            top_ks=top_ks,
            top_ps=top_ps,
            min_ps=min_ps,
            logprobs=LogprobRows(rows, self.logprobs_k) if rows is not None else None,
            all_greedy=self.all_greedy,
            max_top_k=self.max_top_k,
            top_p_within_top_k=self.top_p_within_top_k,
            top_k_on_sampled_rows=self.top_k_on_sampled_rows,
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
