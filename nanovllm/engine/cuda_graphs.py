"""Decode under CUDA graphs: one graph per batch size, sharing one memory pool.

Captured sizes: 1..gemv_max_rows (KernelRoutes: 2), 8, then multiples of 16 up to min(max_num_seqs, 512),
and the rows at which a layer switches kernels (KernelRoutes.linear_row_limits: 16, and 32 and 192 with FP8 layers). A step
of batch b replays the smallest graph >= b; rows past b are padding (slot -1, so
nothing is stored; context length 0). The graph's block table is as wide as a
sequence of max_model_len tokens, and every entry is rewritten on each replay.
Inputs arrive in one pinned host-to-device copy into a staging buffer.
"""

from __future__ import annotations

import torch

from nanovllm.engine.step_inputs import (
    COL_CONTEXT, COL_INPUT, COL_MEMBERS, COL_POSITION, COL_SHARED, COL_SLOT, DECODE_COLUMNS, HostCopy,
    fill_carried_ids,
)
from nanovllm.kernels.checks import PAD_SLOT
from nanovllm.sampling.batch import SamplingPack
from nanovllm.utils.context import AttentionMetadata, RowGroups, attention_context
from nanovllm.utils.graph_warmup import replay_each_once
from nanovllm.utils.host_to_device import copy_into, words_offset

# Above this batch size decode runs eagerly (graph memory grows with the batch).
MAX_GRAPH_BATCH = 512
# Batches up to the routes' gemv_max_rows get their own graphs (their projections run as the Triton GEMV).
# Above that cuBLAS runs 3-7 row GEMMs no faster than 8 rows, and at times much slower
# (Qwen3-0.6B's o_proj: 12.8 us at 4 rows, 5.8 us at 8; benchmarks/kernels/bench_gemm.py, H200), so
# the next graph holds this many rows.
PADDED_GRAPH_BATCH = 8
# From 16 on, sizes step by this much.
GRAPH_BATCH_STEP = 16


def graph_batch_sizes(max_num_seqs: int, gemv_max_rows: int, row_limits: tuple[int, ...] = ()) -> list[int]:
    """The decode graphs' batch sizes (the module docstring); `row_limits` among them, so a padded
    replay runs the kernels of an eager step of its own rows."""
    limit = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [b for b in range(1, gemv_max_rows + 1) if b < limit] + [min(PADDED_GRAPH_BATCH, limit)]
    sizes += list(range(GRAPH_BATCH_STEP, limit + 1, GRAPH_BATCH_STEP)) + [n for n in row_limits if n < limit]
    return sorted(set(sizes + [limit]))


class DecodeGraphs:
    """Graphs read one staging buffer, [max_batch, DECODE_COLUMNS + width] int32, laid out
    as StepInputBuilder.decode_rows; each graph starts by unpacking it into the model's
    input buffers, so a replay costs one host-to-device copy."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, gemv_max_rows: int,
                 row_limits: tuple[int, ...] = (), grouped: bool = False):
        """grouped: decode attention takes the rows' groups (StepInputBuilder.group_limits is set)."""
        self.sizes = graph_batch_sizes(max_num_seqs, gemv_max_rows, row_limits)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        cols = DECODE_COLUMNS + max_blocks_per_seq
        # The staging rows, then room for the step's sampling words (copied with the rows; see run).
        self.buffer = torch.zeros(words_offset(n * cols) + 2 * SamplingPack.max_words(n), dtype=torch.int32,
                                  device=device)
        self.staging = self.buffer[: n * cols].view(n, cols)
        self.staging[:, COL_SLOT] = PAD_SLOT
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), PAD_SLOT, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.groups = (RowGroups(torch.zeros(n, dtype=torch.int32, device=device),
                                 torch.zeros(n, dtype=torch.int32, device=device)) if grouped else None)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture(model)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False, slot_mapping=self.slot_mapping[:b],
            context_lens=self.context_lens[:b], block_tables=self.block_tables[:b],
            decode_groups=None if self.groups is None else RowGroups(self.groups.members[:b], self.groups.shared[:b]),
        )

    def _forward(self, model: torch.nn.Module, b: int) -> None:
        rows = self.staging[:b]
        self.input_ids[:b].copy_(rows[:, COL_INPUT])
        self.positions[:b].copy_(rows[:, COL_POSITION])
        self.slot_mapping[:b].copy_(rows[:, COL_SLOT])
        self.context_lens[:b].copy_(rows[:, COL_CONTEXT])
        self.block_tables[:b].copy_(rows[:, DECODE_COLUMNS:])
        if self.groups is not None:
            self.groups.members[:b].copy_(rows[:, COL_MEMBERS])
            self.groups.shared[:b].copy_(rows[:, COL_SHARED])
        self.hidden[:b] = model(self.input_ids[:b], self.positions[:b])

    @torch.inference_mode()
    def _capture(self, model: torch.nn.Module) -> None:
        pool = None
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with attention_context(self._meta(b)):
                self._forward(model, b)  # warm-up, also compiles
                with torch.cuda.graph(graph, pool):
                    self._forward(model, b)
            if pool is None:
                pool = graph.pool()
            self.graphs[b] = graph
            torch.cuda.synchronize()
        replay_each_once(self.graphs.values())

    def padded_size(self, batch_size: int) -> int | None:
        """The captured size a batch replays (the smallest >= batch_size), or None if none fits."""
        return next((s for s in self.sizes if s >= batch_size), None)

    def run(self, copy: HostCopy, batch_size: int, carried_from: torch.Tensor | None,
            num_carried: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay for a decode batch; returns (hidden states [batch_size, hidden], the step's
        sampling words on the device or None), views.

        copy: StepInputBuilder.decode_rows for padded_size(batch_size) rows, then the step's
        sampling words (one copy): they land past the rows this graph reads, in staging rows of
        larger graphs or the buffer's tail, which each replay's copy rewrites before it reads them.
        carried_from: the previous step's sampled tokens; the input column of the first
        num_carried rows holds rows of it."""
        size = self.padded_size(batch_size)
        copy_into(self.buffer[: copy.array.shape[0]], copy.array)
        if num_carried:
            fill_carried_ids(self.staging[:num_carried, COL_INPUT], carried_from)
        self.graphs[size].replay()
        return self.hidden[:batch_size], copy.device_words(self.buffer)
