"""Device timing shared by the probes and the kernel micro-benchmarks: per-call CUDA-event times,
triton.testing.do_bench medians, and CUDA graphs captured once and replayed, so the host's launch cost is not counted (as in the
engine's decode)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton


def event_times_ms(fn: Callable[[int], object], calls: int, warmup: int = 0) -> list[float]:
    """Device milliseconds of each of `calls` back-to-back calls fn(i), by CUDA events around each,
    after `warmup` untimed ones (fn gets the call's index, e.g. to rotate its operands)."""
    for i in range(warmup):
        fn(i)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for i, (start, end) in enumerate(events):
        start.record()
        fn(i)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def median_s(fn: Callable[[], object]) -> float:
    """Median seconds per call of fn, by triton.testing.do_bench (25 ms warm-up, 100 ms of calls)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of fn. fn first runs once on a side stream, outside the capture
    (Triton compiles there, lazy buffers appear)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_us(fn: Callable[[], object], replays: int = 10) -> float:
    """Mean microseconds per replay of a CUDA graph that captures one call of fn (after one
    untimed replay)."""
    graph = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / replays
