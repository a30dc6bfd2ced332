"""Logprobs on the host: a step's logprob tensors, copied back, turned into vLLM's dicts.

Each scored row (a sampled token, or a prompt token given the ones before it) becomes
{token_id: Logprob} holding the scored token first and then the row's k most likely
tokens (k = 0: the scored token only), in descending logprob; the scored token appears
once even when it is among the k. Logprobs are log_softmax of the raw logits. Ranks are vLLM's:
the scored token's is counted over the vocabulary (sampling/row_logprobs.py), the k most likely
are ranked 1..k, and a scored token among them takes its place there (as vLLM's dict does).
Decoded tokens are filled in when the output is built (engine/detokenizer.py).

Both kinds are kept in the sequence's outputs.FlatLogprobs as flat lists of the same items: no
Python object per token. A step's sampled rows come out as `SampledRow`s (`sampled_rows`), which the
scheduler appends to their sequences with the tokens sampled; prompt logprobs, a whole prompt's
worth each, are appended here (`record_prompt_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanovllm.outputs import FlatLogprobs
from nanovllm.sampling.row_logprobs import RowLogprobs


@dataclass(frozen=True)
class HostLogprobs:
    """R sampled rows of one step that asked for logprobs, on the host. `rows`: which of the step's
    sampled rows each is; `top_ids` / `top_logprobs` hold the step's largest k."""

    rows: list[int]
    chosen: list[float]  # [R] logprob of the scored token
    ranks: list[int]  # [R] its rank in its row
    top_ids: list[list[int]]  # [R, k]
    top_logprobs: list[list[float]]  # [R, k]

    @classmethod
    def from_tensors(cls, rows: torch.Tensor, chosen: torch.Tensor, ranks: torch.Tensor,
                     top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> HostLogprobs:
        """From host tensors ([R], [R], [R], [R, k], [R, k]); one .tolist() each."""
        return cls(rows.tolist(), chosen.tolist(), ranks.tolist(), top_ids.tolist(),
                   top_logprobs.tolist())


class SampledRow(NamedTuple):
    """One sampled row's logprobs: the sampled token's and its rank, and the row's k most likely."""

    logprob: float
    rank: int
    top_ids: list[int]  # [k]
    top_logprobs: list[float]  # [k]


def sampled_rows(host: HostLogprobs, ks: list[int]) -> list[SampledRow]:
    """Each row's SampledRow, holding its request's `ks[i]` most likely of the step's largest k."""
    return [SampledRow(chosen, rank, ids[:k], lps[:k])
            for chosen, rank, ids, lps, k in zip(host.chosen, host.ranks, host.top_ids, host.top_logprobs, ks)]


def record_prompt_logprobs(spans: list[tuple[FlatLogprobs, int]], scored: RowLogprobs, targets: list[int]) -> None:
    """Append one step's prompt logprobs to the sequences that asked: `spans` holds each one's
    FlatLogprobs and its number of scored rows, in the plan's row order; `scored` the step's rows
    on the host (the top k of the step's largest k); `targets` each row's scored token. A few
    tensor operations and list copies per sequence, none per token."""
    chosen, ranks = scored.chosen.tolist(), scored.ranks.tolist()  # [R]
    a = 0
    for flat, n in spans:
        b, k = a + n, flat.k
        if k == 0:
            flat.add_rows(targets[a:b], chosen[a:b], ranks[a:b])
        else:  # each row: the scored token, then its k most likely at places 1..k
            ids = torch.cat([torch.tensor(targets[a:b]).unsqueeze(1), scored.top_ids[a:b, :k]], 1)  # [n, 1 + k]
            lps = torch.cat([scored.chosen[a:b, None], scored.top_logprobs[a:b, :k]], 1)  # [n, 1 + k]
            places = torch.arange(1, k + 1).expand(n, k)
            rks = torch.cat([scored.ranks[a:b, None], places], 1)  # [n, 1 + k]
            flat.add_rows(ids.flatten().tolist(), lps.flatten().tolist(), rks.flatten().tolist())
        a = b
