"""Per-forward attention metadata, passed to every attention layer through one scoped context.

The model runner wraps each forward in `with attention_context(meta):`; the attention
layers read it with `get_attention_metadata()`. The context is reset on exit, even on
exceptions, so metadata can never leak from one step into the next.
"""

from __future__ import annotations

import contextvars
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanovllm.utils.scoped import scoped


@dataclass(frozen=True)
class AttentionMetadata:
    """Flat-batch attention inputs (all sequences' tokens stacked on one axis).

    Prefill / mixed (is_prefill=True): cu_seqlens_q/k `[num_seqs + 1]` int32 (cumulative
    query tokens / key tokens per sequence), max_seqlen_q/k host ints (upper bounds),
    block_tables `[num_seqs, max_blocks]` int32 when keys are read from the cache, else
    None (keys are exactly this step's tokens). With the Triton backend a prefill / mixed step
    has query_tiles (the prefill kernel's table of its chunks' query tiles) and, when it may
    hold decode rows, decode_rows (its leading one-token rows, for the decode kernel); other
    backends get neither.
    Decode: context_lens `[batch]` int32 (tokens incl. the new one), block_tables, and with the
    Triton backend decode_groups (rows sharing a prompt prefix: kernels/decode_groups.py).
    Both: slot_mapping `[num_tokens]` (cache slot per new token; < 0 = padding, skipped).
    calibrate_kv_scales: this forward sets an FP8 cache's scales from its K/V before writing
    them (the first prefill step after start-up; layers/attention.py).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    query_tiles: QueryTiles | None = None
    decode_rows: LeadingDecodeRows | None = None
    decode_groups: RowGroups | None = None
    calibrate_kv_scales: bool = False


@dataclass(frozen=True)
class QueryTiles:
    """Query tiles of the prefill chunks, heaviest first (kernels/prefill_attention.py): tile t
    covers query block tile_block[t] of sequence tile_seq[t], for t < num_tiles[0]. int32.
    long: the tiles are the long-context tile's (the kernel's `long_tiles`; kernels/prefill_plan.py)."""

    tile_seq: torch.Tensor  # [C]
    tile_block: torch.Tensor  # [C]
    num_tiles: torch.Tensor  # [1]
    long: bool = False


@dataclass(frozen=True)
class LeadingDecodeRows:
    """Sequences [0, num_rows[0]) of a mixed step are decode rows: one query each, at token
    row i for sequence i, attending over context_lens[i] cached tokens. int32."""

    context_lens: torch.Tensor  # [capacity]
    num_rows: torch.Tensor  # [1]


class RowGroups(NamedTuple):
    """A decode step's rows in groups sharing a prompt prefix (kernels/decode_groups.py), int32 [batch]
    each: members[b] > 0 leads rows b .. b + members[b] - 1, which share keys [0, shared[b]); 0: led by
    an earlier row."""

    members: torch.Tensor
    shared: torch.Tensor


_current: contextvars.ContextVar[AttentionMetadata | None] = contextvars.ContextVar(
    "nanovllm_attention_metadata", default=None
)


def attention_context(meta: AttentionMetadata) -> AbstractContextManager[AttentionMetadata]:
    """The forward run inside this block reads `meta` (get_attention_metadata); reset on exit."""
    return scoped(_current, meta)


def get_attention_metadata() -> AttentionMetadata:
    meta = _current.get()
    if meta is None:
        raise RuntimeError("attention layer called outside `with attention_context(...)`")
    return meta


def in_decode_step() -> bool:
    """Whether the forward running now is a pure decode step (False outside any forward, e.g. a
    layer called on its own): for layers whose kernel choice depends on the step's kind."""
    meta = _current.get()
    return meta is not None and not meta.is_prefill
