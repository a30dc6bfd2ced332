"""The fused MoE benchmarks' shared case (benchmarks/kernels/bench_moe*.py, moe_prefill_sweep.py): Qwen3-30B-A3B's
expert shape, uniform routings, the expert weights in bf16 and FP8, bytes and FLOPs of a call, CUDA-graph timing of a
list of calls on different routings, and the fp32 check every timed kernel passes first.

Routing is uniform: top-8 of torch.randn router logits per token. A timed CUDA graph holds one call per routing, so
at small batches the experts change between calls and come from HBM (the weights are 1.2 GB, L2 is 50 MB). Times are
medians of REPEATS replays (CUDA events) after WARMUP.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from benchmarks.harness.timing import capture, event_times_ms

E, K, H, I = 128, 8, 2048, 768  # Qwen3-30B-A3B: experts, experts per token, hidden, expert intermediate
# experts, top-k, hidden, expert intermediate. tiny: a CPU smoke test under the interpreter
# (H and I whole 128-blocks, so block scales take their per-step path as at 30B).
SHAPES = {"30b-a3b": (E, K, H, I), "tiny": (4, 2, 256, 128)}
ROUTINGS = 8  # calls (routings) per timed graph
WARMUP, REPEATS = 5, 50
# check(): largest error relative to the reference's largest magnitude. bf16 activations round g, u,
# act and the output once each; W8A8 rounds hidden and act to e4m3 too (3 mantissa bits: a few % of
# the largest output, measured up to ~8% at H=200); a wrong kernel (a scale dropped or misplaced) is off by O(1).
CHECK_TOLERANCE = 3e-2
W8A8_CHECK_TOLERANCE = 0.15


def bf16_experts(gen: torch.Generator, experts: int = E, hidden: int = H,
                 inter: int = I) -> tuple[torch.Tensor, torch.Tensor]:
    """Random stacked experts on gen's device: (w13 [E, 2I, H], w2 [E, H, I]) in bf16, each entry normal
    with std 1 / sqrt(its fan-in), so the outputs keep the activations' scale."""
    w13 = (torch.randn(experts, 2 * inter, hidden, device=gen.device, generator=gen) * hidden ** -0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device=gen.device, generator=gen) * inter ** -0.5).bfloat16()
    return w13, w2


def expert_bytes(distinct: float, hidden: int = H, inter: int = I, elem_size: int = 2) -> float:
    """Weight bytes of `distinct` experts: w13 (2I x H) and w2 (H x I)."""
    return distinct * 3 * hidden * inter * elem_size


def moe_flops(tokens: int, top_k: int = K, hidden: int = H, inter: int = I) -> int:
    """2 flops per multiply-add: gate_up T*K x 2I x H, down T*K x H x I."""
    return 6 * tokens * top_k * hidden * inter


def tiles_name(tiles) -> str:
    """m<block_m> gu<n>x<k>w<warps>s<stages> d<...>: a MoeTiles in one short word per GEMM."""
    def gemm(t) -> str:
        return f"{t.block_n}x{t.block_k}w{t.num_warps}s{t.num_stages}"
    return f"m{tiles.block_m} gu{gemm(tiles.gate_up)} d{gemm(tiles.down)}"


def graph_ms(calls: list[Callable[[], object]]) -> float:
    """Median ms per call of `calls`, captured together in one CUDA graph (compiled first, outside),
    over REPEATS replays after WARMUP."""
    graph = capture(lambda: [fn() for fn in calls])
    ms = statistics.median(event_times_ms(lambda i: graph.replay(), REPEATS, WARMUP)) / len(calls)
    del graph
    return ms


def routings(tokens: int, gen: torch.Generator, experts: int = E, top_k: int = K,
             count: int = ROUTINGS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (weights [T, K] float32, ids [T, K] int64), renormalised top-K of a softmax."""
    out = []
    for _ in range(count):
        probs = torch.softmax(torch.randn(tokens, experts, device=gen.device, generator=gen), dim=-1)
        weights, ids = probs.topk(top_k, dim=-1)
        out.append(((weights / weights.sum(-1, keepdim=True)).contiguous(), ids.contiguous()))
    return out


def check(out, hidden, w13, w2, weights, ids, what: str = "fused_moe", tolerance: float = CHECK_TOLERANCE) -> None:
    """Stop on a wrong kernel: `out` [T, H] (what the kernel gave for this routing) against an fp32
    loop over the experts w13 / w2 (FP8 ones: their dequantized values), within `tolerance` of
    the reference's largest magnitude."""
    ref = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = (hidden[tok].float() @ w13[e].float().T).chunk(2, dim=-1)
        ref.index_add_(0, tok, (torch.nn.functional.silu(gate) * up) @ w2[e].float().T * weights[tok, slot, None])
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    if err > tolerance:
        raise SystemExit(f"{what}: relative error {err:.2e} against the fp32 reference")


def fp8_experts(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked experts w [E, N, K] -> (float8_e4m3fn [E, N, K], float32 scales as the kernels take
    them: [E, N] per channel or [E, ceil(N/128), ceil(K/128)] per block, the dequantized weights in
    w's dtype), quantized one expert at a time as the loader does (quantization/fp8.py)."""
    from nanovllm.quantization.config import CHANNEL
    from nanovllm.quantization.fp8 import dequantize_weight, quantize_weight

    pairs = [quantize_weight(x, mode) for x in w]  # mode: CHANNEL / BLOCK's value
    q = torch.stack([qx for qx, _ in pairs])
    scales = torch.stack([sx.view(-1) if mode == CHANNEL else sx for _, sx in pairs])  # channel: [N, 1] -> [N]
    return q, scales, torch.stack([dequantize_weight(qx, sx, mode) for qx, sx in pairs]).to(w.dtype)


def stored_bytes(distinct: float, tensors: tuple[torch.Tensor, ...]) -> float:
    """Bytes a call reads from `distinct` experts of the stacked `tensors` ([E, ...] each: weights
    and any scales), at their stored widths."""
    return distinct * sum(t.numel() * t.element_size() for t in tensors) / tensors[0].shape[0]
