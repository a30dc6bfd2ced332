"""Decode under CUDA graphs: one graph per batch size, sharing one memory pool.

Captured sizes: 1, 2, 4, 8, then multiples of 16 up to min(max_num_seqs, 512). A step
of batch b replays the smallest graph >= b; rows past b are padding (slot -1, so
nothing is stored; context length 0). The graph's block table is as wide as a
sequence of max_model_len tokens, and every entry is rewritten on each replay.
"""

from __future__ import annotations

import numpy as np
import torch

from nanovllm.utils.context import AttentionMetadata, attention_context

# Above this batch size decode runs eagerly (graph memory grows with the batch).
MAX_GRAPH_BATCH = 512
# Small batches get their own graphs; from here on sizes step by this much.
GRAPH_BATCH_STEP = 16


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    limit = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [b for b in (1, 2, 4, 8) if b <= limit]
    sizes += list(range(GRAPH_BATCH_STEP, limit + 1, GRAPH_BATCH_STEP))
    if sizes[-1] < limit:
        sizes.append(limit)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        # Pinned host staging of one replay's block table, so the copy is one non-blocking DMA.
        self.host_block_tables = torch.zeros_like(self.block_tables, device="cpu").pin_memory()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture(model)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False, slot_mapping=self.slot_mapping[:b],
            context_lens=self.context_lens[:b], block_tables=self.block_tables[:b],
        )

    @torch.inference_mode()
    def _capture(self, model: torch.nn.Module) -> None:
        pool = None
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with attention_context(self._meta(b)):
                self.hidden[:b] = model(self.input_ids[:b], self.positions[:b])  # warm-up, also compiles
                with torch.cuda.graph(graph, pool):
                    self.hidden[:b] = model(self.input_ids[:b], self.positions[:b])
            if pool is None:
                pool = graph.pool()
            self.graphs[b] = graph
            torch.cuda.synchronize()

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch

    def run(self, arrays: dict[str, np.ndarray], block_tables: np.ndarray) -> torch.Tensor:
        """Replay for a decode batch; returns hidden states [batch, hidden] (a view)."""
        b = len(arrays["input_ids"])
        size = next(s for s in self.sizes if s >= b)
        self.slot_mapping[b:size].fill_(-1)
        self.context_lens[b:size].zero_()
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            getattr(self, name)[:b].copy_(torch.from_numpy(arrays[name]), non_blocking=True)
        staging = self.host_block_tables[:size]
        staging.zero_()
        staging[:b, : block_tables.shape[1]] = torch.from_numpy(block_tables)
        self.block_tables[:size].copy_(staging, non_blocking=True)
        self.graphs[size].replay()
        return self.hidden[:b]
