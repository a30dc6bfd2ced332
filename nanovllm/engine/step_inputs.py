"""Turns a scheduled step into the flat tensors one forward needs.

A `StepPlan` is the step without Sequence objects (small, picklable: tensor-parallel
workers receive it). For each sequence it holds the tokens to compute this step and
the position of the first one:

    prefill chunk [start, end) of each sequence (start = num_computed_tokens):
      seq A: cached |#######|  new |....|        q: 4 tokens, k: 11 tokens
      seq B:                  new |......|      q: 6 tokens, k: 6 tokens
      input_ids = [A4 | B6], cu_seqlens_q = [0, 4, 10], cu_seqlens_k = [0, 11, 17]
    decode: one token per sequence (its newest), context_len = start + 1 = len(seq).

slot of position p = block_table[p // block_size] * block_size + p % block_size.
Host arrays are built with numpy and copied with one non-blocking copy each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.engine.scheduler import ScheduledBatch, StepKind
from nanovllm.utils.context import AttentionMetadata


@dataclass(frozen=True)
class StepPlan:
    kind: StepKind
    new_token_ids: list[list[int]]  # per sequence: the tokens computed this step
    starts: list[int]  # per sequence: position of its first new token
    block_tables: list[list[int]]  # per sequence: ceil((start + len(new)) / block_size) block ids
    sampled: list[bool]  # per sequence: a token is sampled after this step

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> "StepPlan":
        starts = [s.num_computed_tokens for s in batch.seqs]
        return cls(
            kind=batch.kind,
            new_token_ids=[s.token_ids[a : a + n] for s, a, n in zip(batch.seqs, starts, batch.num_new_tokens)],
            starts=starts,
            block_tables=[s.block_table for s in batch.seqs],
            sampled=[a + n == len(s) for s, a, n in zip(batch.seqs, starts, batch.num_new_tokens)],
        )


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
    def block_table_array(block_tables: list[list[int]], width: int | None = None) -> np.ndarray:
        """[num_seqs, width] int32, each row a block table padded with zeros (never read)."""
        width = width or max(len(bt) for bt in block_tables)
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

    def decode_arrays(self, plan: StepPlan) -> dict[str, np.ndarray]:
        """Host arrays of a decode step (the CUDA-graph path copies them into its buffers)."""
        bs = self.block_size
        n = len(plan.starts)
        positions = np.asarray(plan.starts, dtype=np.int64)
        last_blocks = np.fromiter((bt[-1] for bt in plan.block_tables), dtype=np.int64, count=n)
        return {
            "input_ids": np.fromiter((ids[0] for ids in plan.new_token_ids), dtype=np.int64, count=n),
            "positions": positions,
            "slot_mapping": last_blocks * bs + positions % bs,
            "context_lens": (positions + 1).astype(np.int32),
        }

    def decode(self, plan: StepPlan) -> StepInputs:
        arrays = self.decode_arrays(plan)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.to_device(arrays["slot_mapping"]),
            context_lens=self.to_device(arrays["context_lens"]),
            block_tables=self.to_device(self.block_table_array(plan.block_tables, self.decode_table_width)),
        )
        return StepInputs(
            input_ids=self.to_device(arrays["input_ids"]),
            positions=self.to_device(arrays["positions"]),
            meta=meta,
            sample_indices=torch.arange(len(plan.starts), device=self.device),
        )
