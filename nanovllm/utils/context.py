"""Per-forward attention metadata, passed to every attention layer through one scoped context.

The model runner wraps each forward in `with attention_context(meta):`; the attention
layers read it with `get_attention_metadata()`. The context is reset on exit, even on
exceptions, so metadata can never leak from one step into the next.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Flat-batch attention inputs (all sequences' tokens stacked on one axis).

    Prefill / mixed (is_prefill=True): cu_seqlens_q/k `[num_seqs + 1]` int32 (cumulative
    query tokens / key tokens per sequence), max_seqlen_q/k host ints (upper bounds),
    block_tables `[num_seqs, max_blocks]` int32 when keys are read from the cache, else
    None (keys are exactly this step's tokens); query_tiles = (tile_seq [C], tile_block [C],
    num_tiles [1]) int32 for the Triton prefill kernel (see kernels/prefill_attention.py),
    else None.
    Decode: context_lens `[batch]` int32 (tokens incl. the new one), block_tables.
    Both: slot_mapping `[num_tokens]` (cache slot per new token; < 0 = padding, skipped).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    query_tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


_current: contextvars.ContextVar[AttentionMetadata | None] = contextvars.ContextVar(
    "nanovllm_attention_metadata", default=None
)


@contextlib.contextmanager
def attention_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    token = _current.set(meta)
    try:
        yield meta
    finally:
        _current.reset(token)


def get_attention_metadata() -> AttentionMetadata:
    meta = _current.get()
    if meta is None:
        raise RuntimeError("attention layer called outside `with attention_context(...)`")
    return meta
