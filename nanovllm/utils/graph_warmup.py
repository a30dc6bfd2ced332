"""Replay freshly captured CUDA graphs once at start-up.

A graph's first launch costs 0.3-0.5 ms more than the next ones on an H200 (the driver sets it
up on the device; benchmarks/graph_first_replay.py at f1ce559, BENCHMARKS.md), so without this the first
step of each size in a run pays that. The captured
staging buffers hold padding (slots -1, empty sequences, zero tiles), so a replay writes no
KV-cache entry: only the graphs' own output buffers change.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def replay_each_once(graphs: Iterable[torch.cuda.CUDAGraph]) -> None:
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize()
