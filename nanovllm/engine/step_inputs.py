"""Turns a scheduled step into the flat tensors one forward needs.

A `StepPlan` is the step without Sequence objects (small, picklable: tensor-parallel
workers receive it). For each sequence it holds the tokens to compute this step and
the position of the first one:

    prefill chunk [start, end) of each sequence (start = num_computed_tokens):
      seq A: cached |#######|  new |....|        q: 4 tokens, k: 11 tokens
      seq B:                  new |......|      q: 6 tokens, k: 6 tokens
      input_ids = [A4 | B6], cu_seqlens_q = [0, 4, 10], cu_seqlens_k = [0, 11, 17]
    decode: one token per sequence (its newest), context_len = start + 1 = len(seq).
    carried decode: the newest token is still on the device (the previous step's
      sample at row carried_rows[i]); its position is len(seq) on the host.

slot of position p = block_table[p // block_size] * block_size + p % block_size.
Host arrays are built with numpy and copied from pinned memory without blocking
(a decode step packs everything into one int32 array: one copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.engine.scheduler import ScheduledBatch, StepKind
from nanovllm.engine.sequence import Sequence
from nanovllm.utils.context import AttentionMetadata


@dataclass(frozen=True)
class StepPlan:
    kind: StepKind
    new_token_ids: list[list[int]]  # per sequence: the tokens computed this step
    starts: list[int]  # per sequence: position of its first new token
    block_tables: list[list[int]]  # per sequence: ceil((start + len(new)) / block_size) block ids
    sampled: list[bool]  # per sequence: a token is sampled after this step
    # Carried decode only: per sequence, the row of its input token among the previous
    # step's sampled tokens (new_token_ids is then empty: the host does not know them yet).
    carried_rows: list[int] | None = None

    @classmethod
    def from_batch(cls, batch: ScheduledBatch, previous_sampled: list[Sequence] | None = None) -> "StepPlan":
        """`previous_sampled`: the sequences sampled by the previous step, in row order
        (needed when `batch` is carried)."""
        if batch.carried:
            if previous_sampled is None:
                raise ValueError("a carried batch needs the previous step's sampled sequences")
            row = {s.seq_id: i for i, s in enumerate(previous_sampled)}
            return cls(
                kind=batch.kind,
                new_token_ids=[],
                starts=[len(s) for s in batch.seqs],
                block_tables=[s.block_table for s in batch.seqs],
                sampled=[True] * len(batch.seqs),
                carried_rows=[row[s.seq_id] for s in batch.seqs],
            )
        starts = [s.num_computed_tokens for s in batch.seqs]
        return cls(
            kind=batch.kind,
            new_token_ids=[s.token_ids[a : a + n] for s, a, n in zip(batch.seqs, starts, batch.num_new_tokens)],
            starts=starts,
            block_tables=[s.block_table for s in batch.seqs],
            sampled=[a + n == len(s) for s, a, n in zip(batch.seqs, starts, batch.num_new_tokens)],
        )


# Columns of a packed decode row (see StepInputBuilder.decode_rows); the block table follows.
COL_INPUT, COL_POSITION, COL_SLOT, COL_CONTEXT = range(4)
DECODE_COLUMNS = 4


def sampled_positions(plan: StepPlan) -> list[int]:
    """Position of the token each sampled sequence of `plan` samples (in row order)."""
    if plan.carried_rows is not None:
        return [start + 1 for start in plan.starts]
    return [start + len(ids) for start, ids, sampled in zip(plan.starts, plan.new_token_ids, plan.sampled) if sampled]


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampled] int64: rows of the hidden states to turn into logits


class StepInputBuilder:
    def __init__(self, block_size: int, device: torch.device, decode_table_width: int):
        self.block_size = block_size
        self.device = device
        self.pin = device.type == "cuda"
        # Decode block tables always span max_model_len, as the CUDA graphs' do: the split-K
        # decode kernel sizes its splits from this width, so eager and graph decode compute
        # in the same order and give identical tokens.
        self.decode_table_width = decode_table_width

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if self.pin:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    @staticmethod
    def block_table_array(block_tables: list[list[int]]) -> np.ndarray:
        """[num_seqs, longest table] int32, each row a block table padded with zeros (never read)."""
        width = max(len(bt) for bt in block_tables)
        out = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, bt in enumerate(block_tables):
            out[i, : len(bt)] = bt
        return out

    def prefill(self, plan: StepPlan) -> StepInputs:
        bs = self.block_size
        lens = np.fromiter(map(len, plan.new_token_ids), dtype=np.int64, count=len(plan.starts))
        starts = np.asarray(plan.starts, dtype=np.int64)
        ends = starts + lens
        cu_q = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(ends)]).astype(np.int32)
        # position of every new token: its sequence's start + its offset within the chunk
        seq_of_token = np.repeat(np.arange(len(lens)), lens)
        positions = starts[seq_of_token] + np.arange(int(cu_q[-1])) - cu_q[:-1][seq_of_token]
        tables = self.block_table_array(plan.block_tables)
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        needs_block_table = bool((starts > 0).any())
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self.to_device(slots),
            cu_seqlens_q=self.to_device(cu_q),
            cu_seqlens_k=self.to_device(cu_k),
            max_seqlen_q=int(lens.max()),
            max_seqlen_k=int(ends.max()),
            block_tables=self.to_device(tables) if needs_block_table else None,
        )
        sample_rows = (cu_q[1:] - 1)[np.asarray(plan.sampled, dtype=bool)].astype(np.int64)
        return StepInputs(
            input_ids=self.to_device(np.fromiter((t for ids in plan.new_token_ids for t in ids), dtype=np.int64,
                                                 count=int(cu_q[-1]))),
            positions=self.to_device(positions),
            meta=meta,
            sample_indices=self.to_device(sample_rows),
        )

    def decode_rows(self, plan: StepPlan, num_rows: int) -> np.ndarray:
        """A decode step packed for one host-to-device copy: [num_rows, DECODE_COLUMNS + width]
        int32, one row per sequence (rows past the batch are padding: slot -1, context 0):

            | input id | position | slot | context len | block table (width entries, 0-padded) |

        For a carried step the input-id column holds the row of the sequence's input among
        the previous step's samples (see `gather_carried_ids`)."""
        bs, n = self.block_size, len(plan.starts)
        out = np.zeros((num_rows, DECODE_COLUMNS + self.decode_table_width), dtype=np.int32)
        positions = np.asarray(plan.starts, dtype=np.int64)
        if plan.carried_rows is not None:
            out[:n, COL_INPUT] = plan.carried_rows
        else:
            out[:n, COL_INPUT] = [ids[0] for ids in plan.new_token_ids]
        out[:n, COL_POSITION] = positions
        out[:n, COL_SLOT] = [bt[p // bs] * bs + p % bs for bt, p in zip(plan.block_tables, plan.starts)]
        out[n:, COL_SLOT] = -1
        out[:n, COL_CONTEXT] = positions + 1
        for i, bt in enumerate(plan.block_tables):
            out[i, DECODE_COLUMNS : DECODE_COLUMNS + len(bt)] = bt
        return out

    def decode(self, plan: StepPlan, previous_tokens: torch.Tensor | None) -> StepInputs:
        """Eager decode inputs; `previous_tokens` [num_prev] int64: the previous step's
        samples on the device (carried steps read their input ids from it; the model runner
        checks it is there)."""
        n = len(plan.starts)
        rows = self.to_device(self.decode_rows(plan, n))  # [n, DECODE_COLUMNS + width] int32
        input_ids = rows[:, COL_INPUT].long()
        if plan.carried_rows is not None:
            input_ids = gather_carried_ids(previous_tokens, input_ids)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=rows[:, COL_SLOT].long(),
            context_lens=rows[:, COL_CONTEXT].contiguous(),
            block_tables=rows[:, DECODE_COLUMNS:].contiguous(),
        )
        return StepInputs(
            input_ids=input_ids,
            positions=rows[:, COL_POSITION].long(),
            meta=meta,
            sample_indices=torch.arange(n, device=self.device),
        )


def gather_carried_ids(previous_tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Input ids of a carried step: previous_tokens[rows], on the device (no host sync)."""
    return previous_tokens.index_select(0, rows.long())
