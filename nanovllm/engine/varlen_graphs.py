"""Prefill and mixed steps under CUDA graphs: two graphs per token bucket.

A step of T tokens (decode rows and prefill chunks together) replays a graph of the
smallest bucket >= T: the bucket's mixed graph when the step has decode rows, else its
prefill graph, which leaves out the decode kernel's launch. That launch is sized by the
bucket's sequence cap (Hkv x cap programs that exit at once when there are no decode rows):
leaving it out took Qwen3-0.6B's 1,000-token first token from 3.65 to 3.53 ms (H200, BENCHMARKS.md,
twenty-seventh session). Each bucket has its own staging buffer, packed as
`VarlenLayout(bucket, seq cap, tile cap, width)` and read by both of its graphs:

    tokens:  | step's T tokens ............ | padding (slot -1, never attended) |
    seqs:    | step's sequences | empty sequences (cu_seqlens repeat their end)   |
    tiles:   | num_tiles query tiles | never read (the kernel stops at num_tiles) |

so the whole forward, attention included, has fixed shapes and grids: the Triton
prefill kernel walks the step's query tiles from a table (kernels/prefill_attention.py).
A replay costs one host-to-device copy, the carried-token gather and the graph launch,
whatever the number of layers. Every graph writes its hidden states into one buffer of the
largest bucket's rows (as the decode graphs do), so the graphs' pool holds no output per graph.
Steps above the largest bucket (at most MAX_VARLEN_GRAPH_TOKENS) run eagerly.
"""

from __future__ import annotations

import torch

from nanovllm.engine.step_inputs import HostCopy, StepInputBuilder, VarlenLayout, fill_carried_ids
from nanovllm.engine.step_plan import StepPlan
from nanovllm.kernels.checks import PAD_SLOT
from nanovllm.sampling.batch import SamplingPack
from nanovllm.utils.context import attention_context
from nanovllm.utils.graph_warmup import replay_each_once
from nanovllm.utils.host_to_device import copy_into, words_offset

# Smallest bucket: below this many tokens a step costs the same padded (weights dominate).
MIN_BUCKET = 16
# Steps of this many tokens and more are compute-bound: a token's FLOPs (2 per weight) outgrow
# its share of the weight reads (2 bytes per weight) past ~190 tokens on an H200 in bf16 (its
# measured ~790 TFLOP/s over ~4.2 TB/s; other GPUs differ a little, the threshold is shared), so
# padding costs its share of FLOPs there. From this size on, buckets step by a quarter of the
# power of two below them (a step pads by at most 25%), and the scheduler may trim a mixed step
# down to one of them instead of padding (`fill_sizes`).
COMPUTE_BOUND_TOKENS = 256
# Prefill / mixed steps up to this many tokens replay CUDA graphs (larger ones run eagerly:
# their device time hides the host's); bounds the graphs' start-up time and memory.
MAX_VARLEN_GRAPH_TOKENS = 16384


def token_buckets(max_tokens: int, row_limits: tuple[int, ...] = ()) -> list[int]:
    """16, 32, 64, 128, 256, 320, 384, 448, 512, 640, ... up to max_tokens (always included), and
    each of `row_limits` (the rows at which a layer switches kernels: KernelRoutes.linear_row_limits)
    from MIN_BUCKET on, so a step replays a bucket whose layers run the kernels of an eager step of
    its own tokens (FP8's 192: steps of 129-192 tokens replay 192, W8A8 like their eager run, not 256)."""
    sizes, p = [], MIN_BUCKET
    while p < max_tokens:
        sizes.append(p)
        if p >= COMPUTE_BOUND_TOKENS:
            sizes += [p * 5 // 4, p * 3 // 2, p * 7 // 4]
        p *= 2
    sizes += [n for n in row_limits if n >= MIN_BUCKET]
    return sorted({s for s in sizes if s < max_tokens}) + [max_tokens]


class VarlenGraphs:
    """Graphs of the model's forward for prefill / mixed steps; capture is largest first,
    sharing one memory pool (the graphs never run at once)."""

    def __init__(self, model: torch.nn.Module, builder: StepInputBuilder, max_tokens: int, max_num_seqs: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, row_limits: tuple[int, ...] = ()):
        if builder.query_tile_rows is None:
            raise ValueError("varlen CUDA graphs need an attention backend that takes a query-tile table")
        self.builder = builder
        self.buckets = token_buckets(max_tokens, row_limits)  # row_limits: KernelRoutes.linear_row_limits
        self.layouts: dict[int, VarlenLayout] = {}
        self.buffers: dict[int, torch.Tensor] = {}  # per bucket: staging (the layout) + sampling words
        self.staging: dict[int, torch.Tensor] = {}
        # every graph's output: [max_tokens, hidden], rows [0, bucket) written by a replay
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (bucket, has decode rows)
        for t in self.buckets:
            seqs = min(t, max_num_seqs)
            self.layouts[t] = VarlenLayout(t, seqs, builder.tile_capacity(t, seqs), builder.table_width)
        self._capture(model, device)

    def _max_seqlen_k(self) -> int:
        return self.builder.table_width * self.builder.block_size

    @torch.inference_mode()
    def _capture(self, model: torch.nn.Module, device: torch.device) -> None:
        pool = None
        for t in reversed(self.buckets):
            layout = self.layouts[t]
            # the layout, then room for the step's sampling words (copied with it; see run)
            buffer = torch.zeros(words_offset(layout.size) + 2 * SamplingPack.max_words(layout.num_seqs),
                                 dtype=torch.int32, device=device)
            staging = buffer[: layout.size]
            layout.split(staging).slots.fill_(PAD_SLOT)  # slots: an empty step writes nothing
            for mixed in (True, False):
                inputs = self.builder.varlen_inputs(staging, layout, t, self._max_seqlen_k(), layout.num_seqs,
                                                    with_decode_rows=mixed)
                graph = torch.cuda.CUDAGraph()
                with attention_context(inputs.meta):
                    if mixed:  # warm-up (also compiles); the prefill graph runs a subset of its kernels
                        model(inputs.input_ids, inputs.positions)
                    with torch.cuda.graph(graph, pool):
                        self.hidden[:t] = model(inputs.input_ids, inputs.positions)  # [t, hidden]
                if pool is None:
                    pool = graph.pool()
                self.graphs[t, mixed] = graph
                torch.cuda.synchronize(device)
            self.buffers[t], self.staging[t] = buffer, staging
        replay_each_once(self.graphs.values())

    @property
    def fill_sizes(self) -> tuple[int, ...]:
        """The compute-bound buckets: padding a step up to one of them costs its share of FLOPs."""
        return tuple(t for t in self.buckets if t >= COMPUTE_BOUND_TOKENS)

    def bucket(self, num_tokens: int) -> int | None:
        """The bucket a step of num_tokens tokens replays, or None if it is too large."""
        return next((t for t in self.buckets if t >= num_tokens), None)

    def run(self, plan: StepPlan, bucket: int, copy: HostCopy,
            carried_from: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay for `plan`; returns (the hidden states of its sampled rows [num_sampled, hidden],
        the step's sampling words on the device or None). copy: the plan packed as the bucket's
        layout (`layouts[bucket]`), then its sampling words, which land in the buffer's tail;
        carried_from: the previous step's sampled tokens when the plan has carried rows."""
        layout, staging, buffer = self.layouts[bucket], self.staging[bucket], self.buffers[bucket]
        copy_into(buffer[: copy.array.shape[0]], copy.array)
        if plan.carried_rows:  # the input-id section leads the layout
            fill_carried_ids(staging[: len(plan.carried_rows)], carried_from)
        self.graphs[bucket, plan.num_decode > 0].replay()
        sample_rows = layout.split(staging).sample_rows[: sum(plan.sampled)]
        return self.hidden.index_select(0, sample_rows), copy.device_words(buffer)

    def every_hidden(self, bucket: int) -> torch.Tensor:
        """The last replay's hidden states of every token of `bucket` [bucket, hidden]: the step's
        tokens in its order, then padding; overwritten by the next replay of any graph."""
        return self.hidden[:bucket]
