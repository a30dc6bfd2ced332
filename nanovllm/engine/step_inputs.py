"""Turns a scheduled batch into the flat tensors one forward needs.

Prefill of chunk [start, end) of each sequence (start = num_computed_tokens):

    seq A: cached |#######|  new |....|        q: 4 tokens, k: 11 tokens
    seq B:                  new |......|      q: 6 tokens, k: 6 tokens
    input_ids = [A4 | B6], cu_seqlens_q = [0, 4, 10], cu_seqlens_k = [0, 11, 17]

Decode: one token per sequence (its newest), context_len = len(seq).
slot of position p = block_table[p // block_size] * block_size + p % block_size.
Host arrays are built with numpy and copied with one non-blocking copy each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.utils.context import AttentionMetadata


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampled] int64: rows of the hidden states to turn into logits


class StepInputBuilder:
    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self.pin = device.type == "cuda"

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if self.pin:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def block_table_array(self, block_tables: list[list[int]], width: int | None = None) -> np.ndarray:
        """[num_seqs, width] int32, each row a block table padded with zeros (never read)."""
        width = width or max(len(bt) for bt in block_tables)
        out = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, bt in enumerate(block_tables):
            out[i, : len(bt)] = bt
        return out

    def prefill(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.block_size
        ids, positions, slots = [], [], []
        cu_q, cu_k, sample_rows = [0], [0], []
        needs_block_table = False
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            pos = np.arange(start, end, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            ids.append(np.asarray(seq.token_ids[start:end], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end)
            needs_block_table |= start > 0
            if end == len(seq):
                sample_rows.append(cu_q[-1] - 1)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self.to_device(np.concatenate(slots)),
            cu_seqlens_q=self.to_device(np.asarray(cu_q, dtype=np.int32)),
            cu_seqlens_k=self.to_device(np.asarray(cu_k, dtype=np.int32)),
            max_seqlen_q=max(batch.num_new_tokens),
            max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:])),
            block_tables=(
                self.to_device(self.block_table_array([s.block_table for s in batch.seqs]))
                if needs_block_table
                else None
            ),
        )
        return StepInputs(
            input_ids=self.to_device(np.concatenate(ids)),
            positions=self.to_device(np.concatenate(positions)),
            meta=meta,
            sample_indices=self.to_device(np.asarray(sample_rows, dtype=np.int64)),
        )

    def decode_arrays(self, batch: ScheduledBatch) -> dict[str, np.ndarray]:
        """Host arrays of a decode step (the CUDA-graph path copies them into its buffers)."""
        bs = self.block_size
        seqs = batch.seqs
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        last_blocks = np.fromiter((s.block_table[-1] for s in seqs), dtype=np.int64, count=len(seqs))
        return {
            "input_ids": np.fromiter((s.token_ids[-1] for s in seqs), dtype=np.int64, count=len(seqs)),
            "positions": lens - 1,
            "slot_mapping": last_blocks * bs + (lens - 1) % bs,
            "context_lens": lens.astype(np.int32),
        }

    def decode(self, batch: ScheduledBatch) -> StepInputs:
        arrays = self.decode_arrays(batch)
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.to_device(arrays["slot_mapping"]),
            context_lens=self.to_device(arrays["context_lens"]),
            block_tables=self.to_device(self.block_table_array([s.block_table for s in batch.seqs])),
        )
        n = len(batch.seqs)
        return StepInputs(
            input_ids=self.to_device(arrays["input_ids"]),
            positions=self.to_device(arrays["positions"]),
            meta=meta,
            sample_indices=torch.arange(n, device=self.device),
        )
