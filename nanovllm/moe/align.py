"""Triton MoE alignment: the (token, slot) pairs of a top-k routing grouped by expert into blocks,
the layout the grouped GEMMs of moe/grouped_gemm.py read.

Each (token t, slot k) is a pair p = t * K + k. `moe_align` groups the T*K pairs by expert
(a counting sort, stable: an expert's pairs keep ascending p) into blocks of BLOCK_M rows,
each block holding pairs of one expert and padded with the invalid pair T*K::

    topk_ids [T=3, K=2]   pairs              sorted_pair_ids [P] (BLOCK_M = 4)      block_expert
     t0: [3, 1]           p0:e3  p1:e1       block 0:  p3  .   .   .                0
     t1: [1, 0]    ->     p2:e1  p3:e0  ->   block 1:  p1  p2  p5  .                1
     t2: [3, 1]           p4:e3  p5:e1       block 2:  p0  p4  .   .                3
                                             block 3:  .   .   .   .  (unused)      (any valid id)
                                             num_used_blocks = [3]                  . = T*K (padding)

Invariants: every pair appears exactly once in sorted_pair_ids; blocks b < num_used_blocks hold
pairs of expert block_expert[b] only (then padding), ordered by expert; blocks past it hold only
padding. Rows P = round_up(T*K + min(E, T*K) * (BLOCK_M - 1), BLOCK_M) bound every routing,
so shapes depend on (T, K, E, BLOCK_M) only and no host sync is needed (CUDA-graph capturable).
Alignment is three launches, one program per slice of the pairs (<= MAX_SLICES) in the first and
last: per-slice expert counts, each program also filling a share of sorted_pair_ids with padding;
one program scanning the counts (per-slice offsets, each expert's first row, num_used_blocks); a
per-slice scatter of the pairs to their rows, each program also writing a share of block_expert.
Program s owns blocks [s * share, (s + 1) * share): their padding rows in the first launch, their
block_expert entries in the last. Stream order puts the fill before the scatter's stores; the scan
does no per-block or per-row work, as its single program would walk them one dependent step at a time.

The grouped MoE kernels need this device-side sort to run inside CUDA graphs at all. Moving the fill
and the block table out of the scan (H200, `bench_moe_align`, E=128, top-8, fused_moe's block_m):
T=256 13.8 -> 8.9 us, T=2048 26.3 -> 15.9, T=8192 61.6 -> 29.7; with the one-read activation
quantization and the one-kernel slot sum (moe/grouped_gemm.py), the Qwen3-30B-A3B FP8 decode step
(256 rows) went from 16.99 to 16.14 ms (BENCHMARKS.md, fifteenth session); bench.py's figure after
them: moe/grouped_gemm.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.checks import MIN_DOT_DIM
from nanovllm.utils.ints import next_pow2
from nanovllm.utils.validation import check_int, check_pow2

# Expert tables live in registers as [rows >= 16, next_pow2(E)] tiles: past 512 they crowd out.
MAX_EXPERTS = 512
# Elements of one alignment tile ([pairs or slices, experts] int32): 32 registers a thread at 4 warps.
ALIGN_TILE_ELEMS = 4096
ALIGN_WARPS = 4
# Most slices (programs of the count and scatter kernels, rows the scan program walks): about one
# wave of an H200's 132 SMs; more pairs make each slice several chunks long.
MAX_SLICES = 128
# Padding rows a count program stores per step: 8 int32 a thread at 4 warps.
FILL_ROWS = 1024


@dataclass(frozen=True)
class MoeAlignment:
    sorted_pair_ids: torch.Tensor  # [P] int32, pair p = t * K + k; padding = T * K
    block_expert: torch.Tensor  # [P / block_m] int32: the expert of each block (any valid id past the used ones)
    num_used_blocks: torch.Tensor  # [1] int32, on the device

    @property
    def block_m(self) -> int:
        return self.sorted_pair_ids.numel() // max(1, self.block_expert.numel())


@triton.jit
def _expert_ids(ids_ptr, pairs, n_pairs, num_experts):
    """Experts of `pairs`; -1 (matching no expert) past n_pairs or out of [0, num_experts)."""
    ids = tl.load(ids_ptr + pairs, mask=pairs < n_pairs, other=-1).to(tl.int32)
    return tl.where((ids >= 0) & (ids < num_experts), ids, -1)


@triton.jit(do_not_specialize=["n_pairs", "chunks"])
def _count_kernel(ids_ptr, counts_ptr, sorted_ptr, n_pairs, num_experts, chunks, n_rows, share_rows,
                  SLICE: tl.constexpr, BLOCK_E: tl.constexpr, FILL: tl.constexpr):
    """counts[s, e]: pairs of expert e among slice s's `chunks` x SLICE pairs; and padding (n_pairs)
    in the sorted rows [s * share_rows, (s + 1) * share_rows) below n_rows."""
    s = tl.program_id(0)
    for r0 in range(0, share_rows, FILL):
        mine = r0 + tl.arange(0, FILL)  # [FILL], rows of this program's share
        r = s * share_rows + mine
        tl.store(sorted_ptr + r, tl.zeros([FILL], dtype=tl.int32) + n_pairs, mask=(mine < share_rows) & (r < n_rows))
    experts = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c in range(chunks):
        ids = _expert_ids(ids_ptr, (s * chunks + c) * SLICE + tl.arange(0, SLICE), n_pairs, num_experts)
        total += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)  # [SLICE, BLOCK_E] -> [BLOCK_E]
    tl.store(counts_ptr + s * BLOCK_E + experts, total)


@triton.jit(do_not_specialize=["n_slices"])
def _scan_kernel(counts_ptr, offsets_ptr, base_ptr, num_used_ptr, n_slices,
                 BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
    """offsets[s, e]: pairs of expert e in slices before s; base[e]: expert e's first sorted row
    (the blocks of experts before it, times BLOCK_M); num_used: the blocks of all experts."""
    experts = tl.arange(0, BLOCK_E)
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s0 in range(0, n_slices, ROWS):
        s = s0 + tl.arange(0, ROWS)
        tile = s[:, None] * BLOCK_E + experts[None, :]  # [ROWS, BLOCK_E]
        c = tl.load(counts_ptr + tile, mask=(s < n_slices)[:, None], other=0)
        tl.store(offsets_ptr + tile, tl.cumsum(c, axis=0) - c + totals[None, :], mask=(s < n_slices)[:, None])
        totals += tl.sum(c, axis=0)
    blocks = (totals + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)  # [BLOCK_E]: expert e owns blocks [end - blocks, end)
    tl.store(base_ptr + experts, (block_end - blocks) * BLOCK_M)
    tl.store(num_used_ptr, tl.sum(blocks, axis=0))


@triton.jit(do_not_specialize=["n_pairs", "chunks", "n_blocks", "share_blocks"])
def _scatter_kernel(ids_ptr, offsets_ptr, base_ptr, sorted_ptr, block_expert_ptr, n_pairs, num_experts, chunks,
                    n_blocks, share_blocks, SLICE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each pair of slice s to its sorted row: its expert's first row + pairs of that expert
    before it (in earlier slices: offsets; earlier in this slice: a running count). And the
    experts of blocks [s * share_blocks, (s + 1) * share_blocks) below n_blocks."""
    s = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    base = tl.load(base_ptr + experts)  # [BLOCK_E]
    # Block b's owner: the last expert starting at or before it (experts without pairs start where
    # the next does, so they come first); past the used blocks all start before b: clamped.
    for b0 in range(0, share_blocks, SLICE):
        mine = b0 + tl.arange(0, SLICE)  # [SLICE], blocks of this program's share
        b = s * share_blocks + mine
        owner = tl.sum((base[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1) - 1  # [SLICE, BLOCK_E] -> [SLICE]
        tl.store(block_expert_ptr + b, tl.minimum(owner, num_experts - 1), mask=(mine < share_blocks) & (b < n_blocks))
    next_row = base + tl.load(offsets_ptr + s * BLOCK_E + experts)  # [BLOCK_E]
    for c in range(chunks):
        pairs = (s * chunks + c) * SLICE + tl.arange(0, SLICE)
        ids = _expert_ids(ids_ptr, pairs, n_pairs, num_experts)
        hits = (ids[:, None] == experts[None, :]).to(tl.int32)  # [SLICE, BLOCK_E], one 1 a row at most
        row = tl.sum(hits * (tl.cumsum(hits, axis=0) - 1 + next_row[None, :]), axis=1)
        tl.store(sorted_ptr + row, pairs, mask=ids >= 0)
        next_row += tl.sum(hits, axis=0)


def check_ids(topk_ids, num_experts: int) -> None:
    """topk_ids [T, K] int32/int64, contiguous, K >= 1, for num_experts in [1, MAX_EXPERTS]; the id range
    is read on the CPU only. A TypeError / ValueError naming the argument otherwise."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be an int32/int64 tensor, got {getattr(topk_ids, 'dtype', type(topk_ids))}")
    if topk_ids.dim() != 2 or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be 2-D [T, K] with K >= 1, got shape {tuple(topk_ids.shape)}")
    if not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous, got strides {topk_ids.stride()}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be an int in [1, {MAX_EXPERTS}], got {num_experts!r}")
    # Range checks read the data: free on the CPU, a host sync on CUDA (not done there: a pair of an
    # id outside [0, E) is dropped and its token's output row is undefined).
    if topk_ids.device.type == "cpu" and topk_ids.numel() and not (
            0 <= int(topk_ids.min()) and int(topk_ids.max()) < num_experts):
        raise ValueError(f"topk_ids must lie in [0, {num_experts}), got [{int(topk_ids.min())}, {int(topk_ids.max())}]")


def aligned_blocks(n_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of block_m rows that hold any routing of n_pairs pairs over num_experts experts."""
    return triton.cdiv(n_pairs + min(num_experts, n_pairs) * (block_m - 1), block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, max_slices: int = MAX_SLICES) -> MoeAlignment:
    """Group the pairs of topk_ids [T, K] (contiguous int32/int64) by expert into blocks of
    block_m rows (a power of two >= 16); see the module docstring for the layout. `max_slices`
    bounds the count / scatter programs (fewer: each slice walks more chunks of pairs)."""
    check_ids(topk_ids, num_experts)
    check_pow2("block_m", block_m, MIN_DOT_DIM)
    check_int("max_slices", max_slices, 1)
    dev, n_pairs = topk_ids.device, topk_ids.numel()
    n_blocks = aligned_blocks(n_pairs, num_experts, block_m)
    n_rows = n_blocks * block_m
    sorted_ids = torch.empty(n_rows, dtype=torch.int32, device=dev)  # [P]
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)  # [P / block_m]
    if n_pairs == 0:
        return MoeAlignment(sorted_ids, block_expert, torch.zeros(1, dtype=torch.int32, device=dev))
    num_used = torch.empty(1, dtype=torch.int32, device=dev)  # the scan's store
    block_e = next_pow2(num_experts)
    rows = max(MIN_DOT_DIM, ALIGN_TILE_ELEMS // block_e)  # pairs per chunk, slices per scan step, blocks per table step
    chunks = triton.cdiv(triton.cdiv(n_pairs, rows), max_slices)  # per slice
    n_slices = triton.cdiv(n_pairs, rows * chunks)
    share = triton.cdiv(n_blocks, n_slices)  # blocks per program: padded by count, labelled by scatter
    ids = topk_ids.view(-1)  # [T * K]
    counts = torch.empty((n_slices, block_e), dtype=torch.int32, device=dev)
    offsets = torch.empty_like(counts)  # [slices, BLOCK_E]
    base = torch.empty(block_e, dtype=torch.int32, device=dev)  # first sorted row of each expert
    _count_kernel[(n_slices,)](ids, counts, sorted_ids, n_pairs, num_experts, chunks, n_rows, share * block_m,
                               SLICE=rows, BLOCK_E=block_e, FILL=FILL_ROWS, num_warps=ALIGN_WARPS)
    _scan_kernel[(1,)](counts, offsets, base, num_used, n_slices,
                       BLOCK_E=block_e, BLOCK_M=block_m, ROWS=rows, num_warps=ALIGN_WARPS)
    _scatter_kernel[(n_slices,)](ids, offsets, base, sorted_ids, block_expert, n_pairs, num_experts, chunks,
                                 n_blocks, share, SLICE=rows, BLOCK_E=block_e, BLOCK_M=block_m, num_warps=ALIGN_WARPS)
    return MoeAlignment(sorted_ids, block_expert, num_used)
