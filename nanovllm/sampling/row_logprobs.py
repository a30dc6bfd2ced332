"""Row logprobs, the contract both implementations keep (PyTorch here, Triton in
sampling/logprobs_kernel.py): for each scored row, the log_softmax at one token, that token's rank
in its row and the row's k most likely tokens. The sampler scores its asking rows with it, the
engine its prompt-logprob rows.

Rank (vLLM's): 1 + the number of other tokens whose logit is >= the token's, over the whole
vocabulary; so the argmax has rank 1 and tied tokens share the worse rank. Ranks are counted on
the raw logits, which order a row like its logprobs (log_softmax only shifts a row).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class RowLogprobs(NamedTuple):
    """The scored rows' logprobs, R of them, on the logits' device."""

    chosen: Tensor  # [R] float32: logprob of each row's token
    ranks: Tensor  # [R] int64: that token's rank in its row (1 = most likely)
    top_ids: Tensor  # [R, k] int64: the k most likely tokens, by descending logprob
    top_logprobs: Tensor  # [R, k] float32: their logprobs


def token_logprobs(logits: Tensor, token_ids: Tensor, k: int, rows: Tensor | None = None) -> RowLogprobs:
    """``log_softmax`` of rows `rows` ``[R]`` int64 (distinct, ascending; None: all) of `logits`
    ``[B, V]`` (any float dtype, computed in float32; not modified) at their `token_ids` ``[B]``
    int64, those tokens' ranks, and each such row's `k` most likely tokens (k = 0: empty
    ``[R, 0]``). Writes the ``[R, V]`` float32 logprobs once; the top k and the ranks are found
    on the raw logits, in their own (maybe narrower) dtype.
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {k!r}")
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor [rows, vocab], got {getattr(logits, 'shape', type(logits))}")
    batch, vocab = logits.shape
    if not 0 <= k <= vocab:
        raise ValueError(f"k must be in [0, vocab = {vocab}], got {k}")
    if not isinstance(token_ids, Tensor) or token_ids.dtype != torch.int64 or tuple(token_ids.shape) != (batch,):
        raise TypeError(f"token_ids must be an int64 tensor of shape ({batch},), got "
                        f"{getattr(token_ids, 'dtype', type(token_ids))} {tuple(getattr(token_ids, 'shape', ()))}")
    if rows is not None:
        if not isinstance(rows, Tensor) or rows.dtype != torch.int64 or rows.dim() != 1:
            raise TypeError(f"rows must be a 1-D int64 tensor, got {getattr(rows, 'dtype', type(rows))}")
        if rows.shape[0] < batch:  # distinct rows: B of them are all rows, in order
            logits, token_ids = logits.index_select(0, rows), token_ids.index_select(0, rows)
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [R, V]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [R]
    ranks = (logits >= logits.gather(1, token_ids.unsqueeze(1))).sum(dim=-1)  # [R] int64
    top_ids = _top_ids(logits, k)  # [R, k]
    return RowLogprobs(chosen, ranks, top_ids, logprobs.gather(1, top_ids))


def _top_ids(logits: Tensor, k: int) -> Tensor:
    """``[R, k]`` int64: each row's k largest logits' ids, by descending logit and the lower id first
    among equal ones (the Triton pass's order: a stable descending sort's first k), so a row's list
    is the first k of its list for any larger k. torch.topk alone picks tied ids as its k falls."""
    if k == 0:
        return torch.empty((logits.shape[0], 0), dtype=torch.int64, device=logits.device)
    vocab = logits.shape[1]
    kth = logits.topk(k, dim=-1, sorted=True).values[:, -1:]  # [R, 1]
    # every token above the k-th value is listed (fewer than k), then the lowest ids tied with it
    lower_first = torch.arange(vocab, 0, -1, dtype=torch.int32, device=logits.device)  # [V]
    score = torch.where(logits > kth, vocab + 1, torch.where(logits == kth, lower_first, 0))  # [R, V] int32
    ids = score.topk(k, dim=-1).indices.sort(dim=-1).values  # [R, k] ascending
    order = logits.gather(1, ids).sort(dim=-1, descending=True, stable=True).indices
    return ids.gather(1, order)
