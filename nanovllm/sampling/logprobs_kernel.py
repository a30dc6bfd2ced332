"""Triton logprobs: log_softmax at one token per row, that token's rank in its row and each row's
k most likely tokens, in one read of the logits (no [rows, vocab] float32 log_softmax written, no
full-row top-k), one launch.

Grid (R, C): program (r, c) reads columns [c * BLOCK, (c + 1) * BLOCK) of logits row rows[r] once,
as a [G, S] tile (G groups of S adjacent columns), and publishes its chunk's max m, sum of
exp(x - m) s, count n of logits >= the row token's and K best keys to a workspace; the last of the
row's C programs to arrive combines:

    chunk tile [G, S] --max per group--> group maxima [G] --K rounds--> the K best groups
    reload those groups [K_PAD, S] (cache hits) --K rounds--> the chunk's K best keys -> workspace
    arrival counter of row r += 1; the program that brings it to C (the last) then computes
        lse = M + log(sum_c s[c] * exp(m[c] - M)),  M = max_c m[c]
        chosen[r] = x[rows[r], token[rows[r]]] - lse;  rank[r] = sum_c n[c]  (1 for the argmax)
        top k = the k best of the C * K keys - lse

The chunk's K best keys lie in its K best groups (ranked by (group max, -group index)): every
group ranked above the group of a top-K element holds a key above that element's (its first
column at its max), and at most K - 1 keys are above a top-K element's. So the K rounds of
max run over G group maxima and K * S reloaded values, not over the BLOCK values.

A key (sampling/sort_keys.py) packs a logit and its column into one int64 that orders like
(logit, -column), so each round (best key, mask it out) is one reduction, and among equal logits the lower token id
ranks first. Logits are read in their dtype and computed on in float32; offsets are int64.

Scratch: [R] int32 arrival counters, which must be 0 at launch, and an int64 workspace
    [R, C, K] chunk keys | [R, C, 4] 32-bit (m, s as float32, n as int32, unused) in 2 R C int64 slots
that is written before it is read. A LogprobsWorkspace keeps both across calls on one stream (the
combining program sets its row's counter back to 0), so a call allocates only its outputs.

Measured end to end (H200, 2026-12-03, 6dcadc1, BENCHMARKS.md "tenth"): `bench.py --logprobs 5` on
Qwen3-0.6B 18,089 tok/s against 16,903 with `--kernel-routes logprobs_kernel=off` (torch's path on
CUDA): +7.0%. Kept (kernel alone: k=5 at 256 rows 0.686 ms in torch -> 0.068 ms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.checks import LOG2E as _LOG2E_VALUE, MAX_GRID_YZ, check_float_dtype
from nanovllm.sampling.row_logprobs import RowLogprobs
from nanovllm.sampling.sort_keys import NO_KEY, key_column, key_value, pack_key
from nanovllm.utils.ints import next_pow2
from nanovllm.utils.validation import check_pow2

# Kernels read module globals only as constexprs (compiled Triton refuses plain floats).
LOG2E = tl.constexpr(_LOG2E_VALUE)

# The largest k the sampler sends here (LLM(max_logprobs=...) may allow more): vLLM's default cap, the k
# measured and tested at serving size; each of the K rounds is a reduction, so a larger k takes torch's top-k.
MAX_K = 20
# Columns per program, by the largest k it serves: each of a program's K rounds is a reduction over its
# K best groups' keys, so a larger k takes fewer, wider programs. At k <= 5, 4,096 columns: 38 programs a
# row at a 151,936-token vocabulary, 32 values a thread at NUM_WARPS = 4 (the whole tile in registers: one
# read of the logits). Measured (H100, 16,384 rows of that vocabulary in bf16; BENCHMARKS.md, sixty-third
# session): k = 10 at 8,192 columns 1.56x and k = 20 at 16,384 2.03x 4,096's speed; k <= 5 fastest at 4,096.
# End to end, Qwen3-0.6B scoring with prompt_logprobs=20: 288,733 against 247,969 prompt tok/s (+16%).
COLUMNS_BY_K = ((5, 4096), (10, 8192), (MAX_K, 16384))
NUM_WARPS = 4
# Columns per group: one 64-byte bf16 run, so a reloaded group is two full 32-byte sectors and
# the group max is mostly in-thread; G = BLOCK / GROUP group maxima (128 at 4,096 columns) enter the K rounds.
GROUP = 32


def chunk_columns(k: int) -> int:
    """Columns per program for a call whose largest k is `k` (COLUMNS_BY_K; past its last k, the widest)."""
    return next((cols for top, cols in COLUMNS_BY_K if k <= top), COLUMNS_BY_K[-1][1])


# 32-bit words of workspace per (row, chunk) for its statistics (m, s, n, one unused: two int64 slots).
STATS = tl.constexpr(4)


@triton.jit
def _best_keys(keys, K: tl.constexpr, K_PAD: tl.constexpr):
    """The K best of `keys` (any shape; distinct but for NO_KEY), best first, as [K_PAD] (NO_KEY past K)."""
    slot = tl.arange(0, K_PAD)
    best_keys = tl.full([K_PAD], NO_KEY, tl.int64)
    for i in tl.static_range(K):
        best = tl.max(keys)
        best_keys = tl.where(slot == i, best, best_keys)
        keys = tl.where(keys == best, NO_KEY, keys)  # one key leaves (NO_KEY stays NO_KEY)
    return best_keys


@triton.jit
def _logprobs_kernel(x_ptr, rows_ptr, tokens_ptr, counter_ptr, work_ptr, chosen_ptr, rank_ptr, top_id_ptr,
                     top_lp_ptr, vocab, stride_x,
                     HAS_ROWS: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr,
                     S: tl.constexpr, C_PAD: tl.constexpr, KEYS_PAD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    num_rows = tl.num_programs(0).to(tl.int64)
    num_chunks = tl.num_programs(1)
    row = tl.load(rows_ptr + r) if HAS_ROWS else r
    x_row = x_ptr + row * stride_x
    counter = counter_ptr + r
    keys_ptr = work_ptr + r * num_chunks * K  # this row's [C, K] chunk keys
    # this row's [C, 4] (m, s, n, unused) 32-bit words, in the int64 slots after all keys
    stats_ptr = (work_ptr + num_rows * num_chunks * K).to(tl.pointer_type(tl.float32)) + r * num_chunks * STATS
    counts_ptr = stats_ptr.to(tl.pointer_type(tl.int32)) + 2  # n of chunk c at counts_ptr + STATS * c
    slot = tl.arange(0, K_PAD)
    lane = tl.arange(0, S)
    group = tl.arange(0, BLOCK // S)
    start = chunk * BLOCK
    cols = start + group[:, None] * S + lane[None, :]  # [G, S]
    x = tl.load(x_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)  # [G, S]
    token = tl.load(tokens_ptr + row)
    x_token = tl.load(x_row + token).to(tl.float32)
    # the rank counts logits >= the token's (vLLM's rank: ties count against it); padding never does
    n_at_least = tl.sum(((x >= x_token) & (cols < vocab)).to(tl.int32))
    group_max = tl.max(x, axis=1)  # [G]
    m = tl.max(group_max, axis=0)
    # a chunk of -inf logits (masked tokens) adds nothing: shifted by 0, not by -inf (NaN), exp2(-inf) = 0
    s = tl.sum(tl.exp2((x - tl.where(m == float("-inf"), 0.0, m)) * LOG2E))
    if K > 0:
        # groups past the vocabulary rank last; picked anyway (under K valid groups), they add NO_KEY
        group_keys = tl.where(start + group * S < vocab, pack_key(group_max, group), NO_KEY)  # [G]
        picked = _best_keys(group_keys, K, K_PAD)  # [K_PAD]
        has = picked != NO_KEY
        firsts = start + tl.where(has, key_column(picked), 0).to(tl.int32) * S  # [K_PAD] first column of each
        sub = firsts[:, None] + lane[None, :]  # [K_PAD, S]
        ok = has[:, None] & (sub < vocab)
        xs = tl.load(x_row + sub, mask=ok, other=0.0).to(tl.float32)  # [K_PAD, S] same values as x's
        cand = tl.where(ok, pack_key(xs, sub), NO_KEY)
        tl.store(keys_ptr + chunk * K + slot, _best_keys(cand, K, K_PAD), mask=slot < K)
    tl.store(stats_ptr + STATS * chunk, m)
    tl.store(stats_ptr + STATS * chunk + 1, s)
    tl.store(counts_ptr + STATS * chunk, n_at_least)
    # Publish, then count: the scalar atomic is issued by one thread, so the barrier first orders
    # every thread's workspace stores before it (CTA scope) and its release (GPU scope) then makes
    # them visible to whichever program acquires the counter after it.
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_chunks - 1:  # the row's last chunk
        # The acquire covers the issuing thread; this barrier orders every thread's loads below
        # after it, so they read the other programs' stores (not stale cache lines).
        tl.debug_barrier()
        c = tl.arange(0, C_PAD)
        c_ok = c < num_chunks
        ms = tl.load(stats_ptr + STATS * c, mask=c_ok, other=float("-inf"))  # [C_PAD]
        ss = tl.load(stats_ptr + STATS * c + 1, mask=c_ok, other=0.0)  # [C_PAD]
        ns = tl.load(counts_ptr + STATS * c, mask=c_ok, other=0)  # [C_PAD]
        row_max = tl.max(ms, axis=0)
        lse = row_max + tl.log(tl.sum(ss * tl.exp2((ms - row_max) * LOG2E), axis=0))
        tl.store(chosen_ptr + r, x_token - lse)
        tl.store(rank_ptr + r, tl.sum(ns, axis=0).to(tl.int64))
        if K > 0:
            j = tl.arange(0, KEYS_PAD)
            keys = tl.load(keys_ptr + j, mask=j < num_chunks * K, other=NO_KEY)  # [KEYS_PAD]
            top = _best_keys(keys, K, K_PAD)  # [K_PAD]: at least K real keys (k <= vocab)
            tl.store(top_id_ptr + r * K + slot, key_column(top), mask=slot < K)
            tl.store(top_lp_ptr + r * K + slot, key_value(top) - lse, mask=slot < K)
        tl.store(counter, 0)  # every other program of the row has counted: ready for the next call


class LogprobsWorkspace:
    """row_logprobs' scratch kept across the calls of one stream (the Sampler's): grows to the
    largest call. Invariant between calls: every counter is 0 (new ones are zeroed; a call's
    combining programs reset theirs)."""

    def __init__(self) -> None:
        self.counters: torch.Tensor | None = None  # [>= R] int32
        self.work: torch.Tensor | None = None  # [>= R * C * (K + 2)] int64, no invariant

    def take(self, rows: int, work_numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(counters, work) holding at least `rows` and `work_numel` entries on `device`. Inside a
        CUDA-graph capture, fresh ones of this call only: a zero fill captured into a graph runs at
        each replay, not now, so a kept buffer would hold garbage for the eager calls before it."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return (torch.zeros(rows, dtype=torch.int32, device=device),
                    torch.empty(work_numel, dtype=torch.int64, device=device))
        if self.counters is None or self.counters.device != device or self.counters.numel() < rows:
            self.counters = torch.zeros(rows, dtype=torch.int32, device=device)
        if self.work is None or self.work.device != device or self.work.numel() < work_numel:
            self.work = torch.empty(work_numel, dtype=torch.int64, device=device)
        return self.counters, self.work


def row_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int, rows: torch.Tensor | None = None,
                 block: int | None = None, workspace: LogprobsWorkspace | None = None,
                 ) -> RowLogprobs:
    """Same contract as sampling/sampler.token_logprobs: `logits` [B, V] (float16/bfloat16/float32,
    contiguous last dim; not modified), `token_ids` [B] int64, `rows` [R] int64 rows of both to
    score (None: all B) -> RowLogprobs (chosen [R] float32 logprob of each scored row's token,
    ranks [R] int64 its rank in the row, top_ids [R, k] int64 by descending logprob, top_logprobs
    [R, k] float32).
    `block`: columns per program (a power of two; None: `chunk_columns(k)`; tests shrink it).
    `workspace`: scratch reused by calls on one stream (None: allocated for this call)."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {k!r}")
    if block is None:
        block = chunk_columns(k)
    check_pow2("block", block)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be 2-D [rows, vocab] with a contiguous last dim, got "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    check_float_dtype("logits", logits)
    batch, vocab = logits.shape
    if not 0 <= k <= min(vocab, block):
        raise ValueError(f"k must be in [0, {min(vocab, block)}], got {k}")
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype != torch.int64 or tuple(token_ids.shape) != (batch,):
        raise TypeError(f"token_ids must be an int64 tensor of shape ({batch},), got "
                        f"{getattr(token_ids, 'dtype', type(token_ids))} {tuple(getattr(token_ids, 'shape', ()))}")
    dev = logits.device
    if rows is not None and (not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or rows.dim() != 1):
        raise TypeError(f"rows must be a 1-D int64 tensor, got {getattr(rows, 'dtype', type(rows))}")
    for name, t in (("token_ids", token_ids), ("rows", rows)):
        if t is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device}, logits on {dev}")
    num_chunks = triton.cdiv(vocab, block)
    if num_chunks > MAX_GRID_YZ:
        raise ValueError(f"vocab {vocab} needs {num_chunks} chunks, more than the grid allows ({MAX_GRID_YZ})")
    r = batch if rows is None else rows.shape[0]
    chosen = torch.empty(r, dtype=torch.float32, device=dev)  # [R]
    ranks = torch.empty(r, dtype=torch.int64, device=dev)  # [R]
    top_ids = torch.empty((r, k), dtype=torch.int64, device=dev)  # [R, k]
    top_lps = torch.empty((r, k), dtype=torch.float32, device=dev)  # [R, k]
    if r == 0:
        return RowLogprobs(chosen, ranks, top_ids, top_lps)
    # [R, C, k] keys and [R, C, 4] 32-bit stats; the [R] counters start at 0
    if workspace is None:
        workspace = LogprobsWorkspace()  # this call's own, zeroed counters
    counters, work = workspace.take(r, r * num_chunks * (k + 2), dev)
    _logprobs_kernel[(r, num_chunks)](
        logits, token_ids if rows is None else rows, token_ids, counters, work, chosen, ranks, top_ids, top_lps,
        vocab,
        logits.stride(0), HAS_ROWS=rows is not None, K=k, K_PAD=next_pow2(max(1, k)), BLOCK=block,
        S=min(GROUP, block), C_PAD=next_pow2(num_chunks), KEYS_PAD=next_pow2(max(1, num_chunks * k)),
        num_warps=NUM_WARPS,
    )
    return RowLogprobs(chosen, ranks, top_ids, top_lps)
