"""Time GPU work as the engine's decode runs it: captured once in a CUDA graph, then replayed,
so the host's launch cost is not counted."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_us(fn: Callable[[], object], replays: int = 10) -> float:
    """Mean microseconds per replay of a CUDA graph that captures one call of fn. fn first runs
    once on a side stream, outside the capture (Triton compiles there, lazy buffers appear)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / replays
