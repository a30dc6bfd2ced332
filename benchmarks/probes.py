"""Device probes for bench.py's roofline: HBM copy bandwidth and dense bf16 GEMM peak, timed by CUDA events."""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.stats import percentile

# Bytes moved by the copy that measures HBM bandwidth (well past the 60 MB L2).
BANDWIDTH_PROBE_BYTES = 2 * 2**30
# Square bf16 GEMM side for the compute probe: large enough to run at the tensor cores' peak.
GEMM_PROBE_N = 8192
# Operand pairs the GEMM probe cycles through (128 MiB each): no call finds its inputs in L2.
GEMM_PROBE_PAIRS = 3
# Untimed, then timed calls of each probe; the median of the timed ones is kept.
PROBE_WARMUP_CALLS = 3
PROBE_TIMED_CALLS = 10


def _median_event_seconds(fn: Callable[[int], object], calls: int) -> float:
    """Median over `calls` of fn()'s device time, by CUDA events (fn gets the call index)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(calls):
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return percentile(times, 50)


def _copy_seconds(n: int) -> float:
    """Median seconds of an n-byte device-to-device copy; its buffers are freed on return."""
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(PROBE_WARMUP_CALLS):
        dst.copy_(src)
    return _median_event_seconds(lambda i: dst.copy_(src), PROBE_TIMED_CALLS)


def measure_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = BANDWIDTH_PROBE_BYTES // 2
    seconds = _copy_seconds(n)
    torch.cuda.empty_cache()
    return 2 * n / seconds


def _gemm_seconds(n: int) -> float:
    """Median seconds of an n x n x n bf16 matmul, operands rotated; they are freed on return."""

    def operand() -> torch.Tensor:
        return torch.randn(n, n, dtype=torch.bfloat16, device="cuda")

    pairs = [(operand(), operand()) for _ in range(GEMM_PROBE_PAIRS)]
    out = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")

    def call(i: int) -> None:
        a, b = pairs[i % len(pairs)]
        torch.matmul(a, b, out=out)

    for i in range(PROBE_WARMUP_CALLS):
        call(i)
    return _median_event_seconds(call, PROBE_TIMED_CALLS)


def measure_gemm_peak() -> float:
    """Dense bf16 GEMM FLOP/s: an N x N x N matmul, operands rotated so none is cached."""
    n = GEMM_PROBE_N
    seconds = _gemm_seconds(n)
    torch.cuda.empty_cache()
    return 2 * n**3 / seconds
