"""Device probes, the one place the benchmarks measure the GPU's limits: HBM copy bandwidth (bench.py's
roofline and every kernel micro-benchmark's "% of copy") and dense bf16 GEMM peak, by CUDA events."""

from __future__ import annotations

import torch

from benchmarks.harness.stats import percentile
from benchmarks.harness.timing import event_times_ms

# Bytes moved by the copy that measures HBM bandwidth (well past the 60 MB L2).
BANDWIDTH_PROBE_BYTES = 2 * 2**30
# Square bf16 GEMM side for the compute probe: large enough to run at the tensor cores' peak.
GEMM_PROBE_N = 8192
# Operand pairs the GEMM probe cycles through (128 MiB each): no call finds its inputs in L2.
GEMM_PROBE_PAIRS = 3
# Untimed, then timed calls of each probe; the median of the timed ones is kept.
PROBE_WARMUP_CALLS = 3
PROBE_TIMED_CALLS = 10


def _median_seconds(fn) -> float:
    return percentile(event_times_ms(fn, PROBE_TIMED_CALLS, PROBE_WARMUP_CALLS), 50) / 1e3


def measure_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written; the buffers are
    freed on return."""
    src = torch.empty(BANDWIDTH_PROBE_BYTES // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda i: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return BANDWIDTH_PROBE_BYTES / seconds


def measure_gemm_peak() -> float:
    """Dense bf16 GEMM FLOP/s: an N x N x N matmul, operands rotated so none is cached; they are
    freed on return."""
    n = GEMM_PROBE_N
    pairs = [(torch.randn(n, n, dtype=torch.bfloat16, device="cuda"),
              torch.randn(n, n, dtype=torch.bfloat16, device="cuda")) for _ in range(GEMM_PROBE_PAIRS)]
    out = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    seconds = _median_seconds(lambda i: torch.matmul(*pairs[i % len(pairs)], out=out))
    del pairs, out
    torch.cuda.empty_cache()
    return 2 * n**3 / seconds


def measure_fp8_gemm_peak() -> float:
    """Dense float8 e4m3 GEMM FLOP/s (torch._scaled_mm, per-tensor scales, bf16 out, fast
    accumulation as the engine's rowwise FP8 matmuls run), probed like measure_gemm_peak: the peak
    an FP8-weight engine's matmul FLOPs are held against."""
    n = GEMM_PROBE_N
    one = torch.ones((), device="cuda")
    pairs = [(torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn),
              torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()) for _ in range(GEMM_PROBE_PAIRS)]
    seconds = _median_seconds(lambda i: torch._scaled_mm(*pairs[i % len(pairs)], one, one, out_dtype=torch.bfloat16,
                                                         use_fast_accum=True))
    del pairs
    torch.cuda.empty_cache()
    return 2 * n**3 / seconds
