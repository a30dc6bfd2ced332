"""Turns a scheduled step's `StepPlan` (engine/step_plan.py) into the flat tensors one forward needs.

slot of position p = block_table[p // block_size] * block_size + p % block_size.
Each step's integers travel in one pinned int32 array, one host-to-device copy:
a pure decode step as `decode_rows`, any other step as `VarlenLayout`; the step's sampling
values (sampling/batch.SamplingPack words) ride at its end (utils/host_to_device.with_words): a
`HostCopy`, built on the host before anything of the step is queued (ModelRunner.prepare).
Carried rows (engine/step_plan.py) get their input ids on the device: `fill_carried_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from nanovllm.engine.step_plan import StepPlan
from nanovllm.kernels.checks import PAD_SLOT
from nanovllm.kernels.decode_group_plan import GroupLimits, group_rows
from nanovllm.kernels.prefill_plan import build_query_tiles, takes_long_tiles
from nanovllm.utils.context import AttentionMetadata, LeadingDecodeRows, QueryTiles, RowGroups
from nanovllm.utils.host_to_device import aligned_count, to_device, with_words, words_view
from nanovllm.utils.ints import cdiv


# Columns of a packed decode row (see StepInputBuilder.decode_rows); the block table follows.
COL_INPUT, COL_POSITION, COL_SLOT, COL_CONTEXT, COL_MEMBERS, COL_SHARED = range(6)
DECODE_COLUMNS = 6


class VarlenSections(NamedTuple):
    """Named views of a packed prefill / mixed step (numpy on the host, torch on the device)."""

    input_ids: object  # [T]
    positions: object  # [T]
    slots: object  # [T]
    cu_seqlens_q: object  # [S + 1]
    cu_seqlens_k: object  # [S + 1]
    decode_lens: object  # [S]: context length of each leading decode row (0 past them)
    num_decode: object  # [1]
    tile_seq: object  # [C]
    tile_block: object  # [C]
    num_tiles: object  # [1]
    sample_rows: object  # [S]
    block_tables: object  # [S, width]


@dataclass(frozen=True)
class VarlenLayout:
    """Sections of a prefill / mixed step's packed int32 array, in VarlenSections' order:

        | ids | positions | slots | cu_q | cu_k | decode lens | num decode | tile seq | tile block | num tiles | sample rows | block tables |
          T     T           T       S+1    S+1    S             1            C          C            1           S             S x width

    T tokens, S sequences, C query tiles (0 when the attention backend takes no tile
    table); long_tiles: the table is at the long-context tile's height (StepInputBuilder.long_tiles).
    Each section starts 16-byte aligned (0-3 unused ints before it), so the kernels'
    pointer arguments are aligned alike at every step size: Triton compiles a kernel variant
    per pointer alignment, and eager steps of new sizes would otherwise compile mid-run.
    CUDA graphs use a fixed layout per token bucket; rows past the step are padding (slot -1,
    empty sequences, tiles past num_tiles and rows past num_decode never read)."""

    num_tokens: int
    num_seqs: int
    num_tiles: int
    width: int
    long_tiles: bool = False

    def _sizes(self) -> list[int]:
        """Element count of each section, in VarlenSections' order."""
        t, s, c = self.num_tokens, self.num_seqs, self.num_tiles
        return [t, t, t, s + 1, s + 1, s, 1, c, c, 1, s, s * self.width]

    @cached_property
    def _starts(self) -> list[int]:
        """Start of each section, and the end of the last one: each start 16-byte aligned
        (computed once per layout: size and split read it every step)."""
        starts = [0]
        for n in self._sizes():
            starts.append(aligned_count(starts[-1] + n, 4))
        return starts

    @property
    def size(self) -> int:
        return self._starts[-1]

    def split(self, flat) -> VarlenSections:
        """Views of `flat` (numpy or torch, 1-D, `size` long)."""
        out = [flat[a : a + n] for a, n in zip(self._starts, self._sizes())]
        out[-1] = out[-1].reshape(self.num_seqs, self.width)
        return VarlenSections(*out)


@dataclass(frozen=True)
class HostCopy:
    """A step's one host-to-device copy, built on the host: int32 `array` holding the step's packed
    inputs, then its sampling words (int64, `num_words` of them, 0 for none) from index `words_at`."""

    array: np.ndarray
    words_at: int
    num_words: int

    @classmethod
    def of(cls, ints: np.ndarray, words: np.ndarray | None) -> HostCopy:
        array, words_at = with_words(ints, words)
        return cls(array, words_at, 0 if words is None else words.shape[0])

    def device_words(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The sampling words in `flat`, the device array this copy landed in (None without words)."""
        return words_view(flat, self.words_at, self.num_words) if self.num_words else None


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int32/int64
    positions: torch.Tensor  # [num_tokens] int32/int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampled]: rows of the hidden states to turn into logits
    sampling_words: torch.Tensor | None = None  # [n] int64: the step's SamplingPack words, if given


class StepInputBuilder:
    def __init__(self, block_size: int, device: torch.device, decode_table_width: int,
                 query_tile_rows: int | None = None, group_limits: GroupLimits | None = None,
                 long_tile_rows: int | None = None):
        """query_tile_rows: the Triton prefill kernel's query tile height when the attention
        backend is ours (then a mixed step's decode rows go to the decode kernel and its
        prefill chunks to the prefill kernel's tile table), else None (every row is a
        varlen chunk, decode rows of length 1). long_tile_rows: the height of its long-context
        tile where steps may take it (`long_tiles`), else None. group_limits: with the Triton decode
        kernel, what bounds a decode step's groups of rows sharing a prefix (kernels/decode_groups.py);
        None: no groups."""
        self.block_size = block_size
        self.device = device
        # Block tables always span max_model_len, as the CUDA graphs' do: the split-K decode
        # kernel sizes its splits from this width, so eager and graph decode compute in the
        # same order and give identical tokens.
        self.table_width = decode_table_width
        self.query_tile_rows = query_tile_rows
        self.long_tile_rows = long_tile_rows
        self.group_limits = group_limits

    # ----- prefill and mixed steps -----
    def tile_capacity(self, num_tokens: int, num_seqs: int) -> int:
        """Query tiles that any step of at most this many tokens and sequences can need."""
        if self.query_tile_rows is None:
            return 0
        return cdiv(num_tokens, self.query_tile_rows) + num_seqs

    def long_tiles(self, plan: StepPlan) -> bool:
        """Whether the plan's prefill chunks take the long-context tile (kernels/prefill_plan.takes_long_tiles,
        from the chunks' query rows and longest key span; decode rows do not count)."""
        d = plan.num_decode
        if self.long_tile_rows is None or d == len(plan.starts):
            return False
        chunk_rows = plan.num_new_tokens[d:]
        return takes_long_tiles(sum(chunk_rows), max(a + n for a, n in zip(plan.starts[d:], chunk_rows)))

    def exact_layout(self, plan: StepPlan) -> VarlenLayout:
        n = len(plan.starts)
        return VarlenLayout(plan.num_tokens, n, self.tile_capacity(plan.num_tokens, n), self.table_width,
                            self.long_tiles(plan))

    def varlen_array(self, plan: StepPlan, layout: VarlenLayout) -> np.ndarray:
        """The plan packed as `layout` (which must hold it). Input ids of carried rows hold
        their source row among the previous step's samples."""
        bs, n = self.block_size, len(plan.starts)
        flat = np.zeros(layout.size, dtype=np.int32)
        v = layout.split(flat)
        lens = np.asarray(plan.num_new_tokens, dtype=np.int64)
        starts = np.asarray(plan.starts, dtype=np.int64)
        total = plan.num_tokens
        q_ends = np.cumsum(lens)
        v.cu_seqlens_q[1 : n + 1] = q_ends
        v.cu_seqlens_q[n + 1 :] = total  # padding sequences are empty
        v.cu_seqlens_k[1 : n + 1] = np.cumsum(starts + lens)
        v.cu_seqlens_k[n + 1 :] = v.cu_seqlens_k[n]
        seq_of_token = np.repeat(np.arange(n), lens)
        pos = starts[seq_of_token] + np.arange(total) - (q_ends - lens)[seq_of_token]
        for i, bt in enumerate(plan.block_tables):
            v.block_tables[i, : len(bt)] = bt
        v.input_ids[:total] = plan.token_ids
        v.input_ids[: len(plan.carried_rows)] = plan.carried_rows
        v.positions[:total] = pos
        v.slots[:total] = v.block_tables[seq_of_token, pos // bs].astype(np.int64) * bs + pos % bs
        v.slots[total:] = PAD_SLOT
        sampled = np.asarray(plan.sampled, dtype=bool)
        v.sample_rows[: int(sampled.sum())] = (q_ends - 1)[sampled]
        if layout.num_tiles:
            d = plan.num_decode  # decode rows: the decode kernel's; chunks: the tile table's
            v.decode_lens[:d] = starts[:d] + 1
            v.num_decode[0] = d
            chunk_lens = lens.copy()
            chunk_lens[:d] = 0
            rows = self.long_tile_rows if layout.long_tiles else self.query_tile_rows
            seqs, blocks = build_query_tiles(chunk_lens, rows, starts + lens)  # long tiles: fewer, within C
            v.tile_seq[: len(seqs)] = seqs
            v.tile_block[: len(blocks)] = blocks
            v.num_tiles[0] = len(seqs)
        return flat

    def varlen_inputs(self, staging: torch.Tensor, layout: VarlenLayout, max_seqlen_q: int, max_seqlen_k: int,
                      num_sampled: int, with_decode_rows: bool) -> StepInputs:
        """Views of a device array packed as `layout` (see varlen_array). with_decode_rows: whether
        the step may have leading decode rows; without, the attention layers launch no decode kernel."""
        v = layout.split(staging)
        tiles = leading = None
        if layout.num_tiles:
            tiles = QueryTiles(v.tile_seq, v.tile_block, v.num_tiles, layout.long_tiles)
            if with_decode_rows:
                leading = LeadingDecodeRows(v.decode_lens, v.num_decode)
        meta = AttentionMetadata(
            is_prefill=True, slot_mapping=v.slots, cu_seqlens_q=v.cu_seqlens_q, cu_seqlens_k=v.cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, block_tables=v.block_tables,
            query_tiles=tiles, decode_rows=leading,
        )
        return StepInputs(v.input_ids, v.positions, meta, v.sample_rows[:num_sampled])

    def varlen_copy(self, plan: StepPlan, layout: VarlenLayout, words: np.ndarray | None = None) -> HostCopy:
        """The copy of a prefill / mixed step packed as `layout`, with the step's sampling `words` (int64)."""
        return HostCopy.of(self.varlen_array(plan, layout), words)

    def varlen(self, plan: StepPlan, copy: HostCopy, previous_tokens: torch.Tensor | None) -> StepInputs:
        """Eager inputs of a prefill / mixed step from its `copy` at its exact size
        (`varlen_copy(plan, exact_layout(plan), words)`); the words arrive as `sampling_words`."""
        layout = self.exact_layout(plan)
        flat = to_device(copy.array, self.device)
        ends = [a + n for a, n in zip(plan.starts, plan.num_new_tokens)]
        inputs = self.varlen_inputs(flat[: layout.size], layout, max(plan.num_new_tokens), max(ends),
                                    sum(plan.sampled), with_decode_rows=plan.num_decode > 0)
        if plan.carried_rows:
            fill_carried_ids(inputs.input_ids[: len(plan.carried_rows)], previous_tokens)
        return replace(inputs, sampling_words=copy.device_words(flat))

    # ----- pure decode steps -----
    def decode_rows(self, plan: StepPlan, num_rows: int) -> np.ndarray:
        """A decode step packed for one host-to-device copy: [num_rows, DECODE_COLUMNS + width]
        int32, one row per sequence (rows past the batch are padding: slot -1, context 0):

            | input id | position | slot | context len | members | shared | block table (width entries, 0-padded) |

        members / shared: the rows' groups (kernels/decode_groups.py); a padding row is a row on its own
        (its output 0, as without groups); 0 without group_limits.
        Carried rows hold in the input-id column the row of their input among the previous
        step's samples (see `fill_carried_ids`)."""
        bs, n = self.block_size, len(plan.starts)
        out = np.zeros((num_rows, DECODE_COLUMNS + self.table_width), dtype=np.int32)
        positions = np.asarray(plan.starts, dtype=np.int64)
        out[:n, COL_INPUT] = plan.token_ids
        out[: len(plan.carried_rows), COL_INPUT] = plan.carried_rows
        out[:n, COL_POSITION] = positions
        out[:n, COL_SLOT] = [bt[p // bs] * bs + p % bs for bt, p in zip(plan.block_tables, plan.starts)]
        out[n:, COL_SLOT] = PAD_SLOT
        out[:n, COL_CONTEXT] = positions + 1
        for i, bt in enumerate(plan.block_tables):
            out[i, DECODE_COLUMNS : DECODE_COLUMNS + len(bt)] = bt
        if self.group_limits is not None:
            out[:n, COL_MEMBERS], out[:n, COL_SHARED] = group_rows(
                out[:n, DECODE_COLUMNS:], positions + 1, bs, self.group_limits.cap(n))
            out[n:, COL_MEMBERS] = 1
        return out

    def decode_groups(self, rows: torch.Tensor) -> RowGroups | None:
        """The groups of device rows packed as decode_rows ([batch, DECODE_COLUMNS + width]), or None."""
        if self.group_limits is None:
            return None
        return RowGroups(rows[:, COL_MEMBERS].contiguous(), rows[:, COL_SHARED].contiguous())

    def decode(self, plan: StepPlan, copy: HostCopy, previous_tokens: torch.Tensor | None) -> StepInputs:
        """Eager decode inputs from the step's `copy` (`HostCopy.of(decode_rows(plan, n), words)`, n
        its batch size); `previous_tokens` [num_prev] int64: the previous step's samples on the device
        (carried rows read their input ids from it)."""
        n = len(plan.starts)
        flat = to_device(copy.array, self.device)
        rows = flat[: n * (DECODE_COLUMNS + self.table_width)].view(n, -1)  # [n, DECODE_COLUMNS + width] int32
        input_ids = rows[:, COL_INPUT]
        if plan.carried_rows:
            fill_carried_ids(input_ids[: len(plan.carried_rows)], previous_tokens)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=rows[:, COL_SLOT].contiguous(),
            context_lens=rows[:, COL_CONTEXT].contiguous(),
            block_tables=rows[:, DECODE_COLUMNS:].contiguous(),
            decode_groups=self.decode_groups(rows),
        )
        return StepInputs(
            input_ids=input_ids.contiguous(),
            positions=rows[:, COL_POSITION].contiguous(),
            meta=meta,
            sample_indices=torch.arange(n, device=self.device),
            sampling_words=copy.device_words(flat),
        )


def fill_carried_ids(ids: torch.Tensor, previous_tokens: torch.Tensor) -> None:
    """Carried rows' input ids, in place on the device (no host sync): ids arrive holding rows
    of previous_tokens (the previous step's samples) and leave holding those tokens."""
    ids.copy_(previous_tokens.index_select(0, ids))
