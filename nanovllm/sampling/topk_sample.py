"""Top-k sampling (with or without top-p / min-p) in two Triton launches, for top_k <= MAX_K.

The sampler's threshold path (sampling/sampler.py) keeps the tokens whose probability reaches a
per-row threshold (min-p against the row's max first; top-k's k-th largest value, ties kept; top-p's
over the mass of the min-p and top-k survivors) and takes argmax(log p + g), g the row's Gumbel
noise. With a small k every kept token lies among the row's largest values, so neither the softmax
nor a pass over the filtered row is needed: x = logit / T orders like p, the top-p test is a ratio
of masses e^(x - m) (the row normaliser cancels), and the Gumbel-max draw over the kept tokens needs
the noise of at most K columns.

    launch 1, grid (rows, chunks of CHUNK columns): the chunk's K largest x, as packed keys
      (sampling/sort_keys.py: a key orders by value, then lowest column first). Cheaply: the K-th largest of NG
      (2K or 4K: ListShape) group maxima bounds the chunk's K-th value from below; the elements at or above it
      (about 1.15 K of them at 4K groups) are compacted into the chunk's slot and their top K taken (tl.topk); a
      chunk with more than CAP of them (ties, a partial last chunk) takes tl.topk of all its keys. Also the count
      of the chunk's elements equal to its K-th value (ties that may lie past its list).
    launch 2, one program per row: the top K of the row's chunk lists (its exact K largest), then kth = v[k-1],
      the ties of kth past the list (from the pool and the chunks' counts), min-p's floor, top-p's threshold
      from the cumulative masses over the survivors of both (as the torch path's _threshold_from_top on
      probabilities min-p zeroed), and argmax(x + g) over the kept list entries. Only when kept ties of kth lie
      past the list (rare: more than K - k ties) does the row's program scan its whole row with the threshold.

The tokens are the threshold path's with the same noise (gumbel_torch.py's layout) up to float32
near-ties: the filters compare x = logit / T where the torch path compares probabilities, and the
score is x + g where it is log(p) + g. Greedy rows (T = 0) take the row's argmax (lowest column on
ties). No device value reaches the host: the launch shapes follow the host's max_top_k.

Measured end to end (H200, 2026-12-03, 6dcadc1, BENCHMARKS.md "tenth"): `bench.py --top-k 20
--top-p 0.95` on Qwen3-0.6B 26,004 tok/s = 0.990 of the plain run's 26,256 in the same call
(torch.topk's threshold path: 22,300 = 0.85, ninth session).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.kernels.checks import check_row_vector
from nanovllm.utils.ints import next_pow2
from nanovllm.utils.validation import check_pow2

from .candidate_walk import load_scaled
from .gumbel_max import gumbel_noise, keep_best, tile_uniforms
from .gumbel_torch import SUB, TILE, check_gumbel_args
from .sort_keys import NO_KEY, key_column, key_value, pack_key

# Largest top_k served: the row's pool (chunks x K packed int64 keys, up to 64 x 128) is sorted by
# one program in registers; 128 covers the common defaults (20, 40, 50, 64, 100).
MAX_K = 128
# Columns per program of launch 1: 38 programs a row at Qwen3's 151,936-token vocabulary.
CHUNK = 4096
# Chunks a row may have (the pool's sort holds next_pow2(chunks) x K keys): vocabularies up to 262,144.
MAX_CHUNKS = 64
MAX_VOCAB = CHUNK * MAX_CHUNKS


@dataclass(frozen=True)
class ListShape:
    """Launch 1's shape for one list length: `k` list entries, the K-th largest of `groups` group maxima
    bounds the chunk's k-th value (groups >= k), and a slot of `cap` candidates (more: the chunk's whole
    top-k). Each shape is one compiled variant of each kernel."""

    k: int
    groups: int
    cap: int


# The list lengths, each the shortest holding a batch's max_top_k. At 256 rows of a 151,936 vocabulary
# (H100, 2026-12-05, BENCHMARKS.md "forty-second"), both launches: max_top_k 20 in the 32-list 304-311 us
# (4K groups / 4K slot: 311); 50 in a 128-list 737 us, in a 64-list 364 us with 2K groups and an 8K slot
# (4K / 4K: 541; 1K / 8K: 377). A top_k equal to its list's length leaves no room for ties of the k-th value, so
# bf16 logits send rows to the whole-row scan more often: `bench.py --top-k 64 --top-p 0.95` read 0.947x of plain
# against 0.980x for top-k 50 (random weights); the 128-list would cost more than those scans.
LIST_SHAPES = (ListShape(32, 4 * 32, 4 * 32), ListShape(64, 2 * 64, 8 * 64), ListShape(MAX_K, 4 * MAX_K, 4 * MAX_K))
NUM_WARPS = 8
# The noise layout's widths (gumbel_torch.py), as the kernels read them.
_SUB = tl.constexpr(SUB)
_TILE = tl.constexpr(TILE)


def list_shape(max_top_k: int) -> ListShape:
    """The list of a batch whose largest top_k is `max_top_k` (1 .. MAX_K): the shortest that holds it."""
    return next(shape for shape in LIST_SHAPES if max_top_k <= shape.k)


def top_k_per_list(max_k: int) -> tuple[int, ...]:
    """For each list that a top_k of at most `max_k` takes, the largest such top_k (ascending): a batch
    sampled with each compiles every variant the kernel runs up to `max_k` (the engine's warm-up)."""
    largest = {list_shape(k).k: k for k in range(1, min(max_k, MAX_K) + 1)}
    return tuple(largest.values())


@triton.jit
def _chunk_top_kernel(x_ptr, temperature_ptr, slot_ptr, eq_ptr, vocab, stride_x, num_chunks,
                      K: tl.constexpr, NG: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    temp = tl.load(temperature_ptr + row)
    t = tl.where(temp == 0.0, 1.0, temp)  # greedy rows: the logits' own order
    GS: tl.constexpr = CHUNK // NG
    cols = chunk * CHUNK + tl.arange(0, NG)[:, None] * GS + tl.arange(0, GS)[None, :]  # [NG, GS]
    inside = cols < vocab
    x = load_scaled(x_row, cols, vocab, t)  # -inf past the vocab
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 == 0.0: one key for both
    keys = tl.where(inside, pack_key(x, cols), NO_KEY)
    # at least K elements (one a group) reach the K-th largest group max: the chunk's K-th value is above it
    low = tl.min(tl.topk(tl.max(x, axis=1), K), axis=0)
    cand = inside & (x >= low)
    count = tl.sum(cand.to(tl.int32))
    slot = slot_ptr + (row * num_chunks + chunk).to(tl.int64) * CAP
    if count <= CAP:
        flat = tl.reshape(cand.to(tl.int32), [CHUNK])
        pos = tl.cumsum(flat, 0) - 1
        tl.store(slot + pos, tl.reshape(keys, [CHUNK]), mask=flat != 0)
        tl.debug_barrier()  # the slot's candidates, written by every thread, are read by others
        i = tl.arange(0, CAP)
        top = tl.topk(tl.load(slot + i, mask=i < count, other=NO_KEY), K)
    else:
        top = tl.topk(tl.reshape(keys, [CHUNK]), K)
    tl.debug_barrier()  # every thread has read the candidates before the slot's head is rewritten
    tl.store(slot + tl.arange(0, K), top)
    last = tl.min(top, axis=0)
    last_x = key_value(last)
    ties = tl.sum((inside & (x == last_x)).to(tl.int32))
    tl.store(eq_ptr + row * num_chunks + chunk, tl.where(last == NO_KEY, 0, ties))


@triton.jit
def _column_noise(key, cols):
    """Gumbel noise of `cols` (any shape) in the layout of gumbel_torch.py."""
    u0, u1, u2, u3 = tile_uniforms(key, cols // _TILE * _TILE, cols % _SUB)
    word = cols % _TILE // _SUB
    u = tl.where(word == 0, u0, tl.where(word == 1, u1, tl.where(word == 2, u2, u3)))
    return gumbel_noise(u, 1.0)


@triton.jit
def _scan_sub(x_row, c, u, t, thr, m, min_p, vocab, best, best_col):
    x = load_scaled(x_row, c, vocab, t)
    kept = (x >= thr) & (tl.exp(x - m) >= min_p)
    return keep_best(best, best_col, tl.where(kept, x + gumbel_noise(u, 1.0), float("-inf")), c)


@triton.jit
def _scan_sample(x_row, key, t, thr, m, min_p, vocab, SUB: tl.constexpr):
    """argmax(x + g) over the whole row's tokens with x >= thr and e^(x - m) >= min_p (lowest column)."""
    j = tl.arange(0, SUB)
    best = tl.full([SUB], float("-inf"), tl.float32)
    best_col = tl.zeros([SUB], tl.int32)
    for s0 in range(0, vocab, 4 * SUB):
        u0, u1, u2, u3 = tile_uniforms(key, s0, j)
        c = s0 + j
        best, best_col = _scan_sub(x_row, c, u0, t, thr, m, min_p, vocab, best, best_col)
        best, best_col = _scan_sub(x_row, c + SUB, u1, t, thr, m, min_p, vocab, best, best_col)
        best, best_col = _scan_sub(x_row, c + 2 * SUB, u2, t, thr, m, min_p, vocab, best, best_col)
        best, best_col = _scan_sub(x_row, c + 3 * SUB, u3, t, thr, m, min_p, vocab, best, best_col)
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, best_col, vocab), axis=0)


@triton.jit
def _row_sample_kernel(x_ptr, temperature_ptr, key_ptr, top_k_ptr, top_p_ptr, min_p_ptr, slot_ptr, eq_ptr,
                       out_ptr, vocab, stride_x, num_chunks, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
                       K: tl.constexpr, CAP: tl.constexpr, C_PAD: tl.constexpr, SUB: tl.constexpr):
    row = tl.program_id(0)
    temp = tl.load(temperature_ptr + row)
    greedy = temp == 0.0
    c = tl.arange(0, C_PAD)
    idx = tl.arange(0, K)
    in_row = c < num_chunks
    pool = tl.load(slot_ptr + (row * num_chunks + c[:, None]).to(tl.int64) * CAP + idx[None, :],
                   mask=in_row[:, None], other=NO_KEY)  # [C_PAD, K] each chunk's list, descending
    top = tl.topk(tl.reshape(pool, [C_PAD * K]), K)  # [K] the row's K largest, descending
    v, col = key_value(top), key_column(top)
    valid = top != NO_KEY
    m = tl.max(tl.where(valid, v, float("-inf")), axis=0)
    first = tl.sum(tl.where(idx == 0, col, 0), axis=0)  # the argmax (lowest column of the max)
    k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), K).to(tl.int32)
    kth = tl.max(tl.where(idx == k - 1, v, float("-inf")), axis=0)
    # ties of kth past the K list: in the pool but not the list, and past a chunk's list
    pool_x = key_value(pool)
    pool_eq = (pool != NO_KEY) & (pool_x == kth)  # [C_PAD, K]
    last = tl.min(pool, axis=1)  # [C_PAD] each list's K-th key
    last_x = key_value(last)
    chunk_ties = tl.load(eq_ptr + row * num_chunks + c, mask=in_row, other=0)
    in_list = tl.sum(pool_eq.to(tl.int32), axis=1)
    spill = tl.sum(tl.where((last != NO_KEY) & (last_x == kth), chunk_ties - in_list, 0), axis=0)
    past = tl.sum(in_list, axis=0) - tl.sum((valid & (v == kth)).to(tl.int32), axis=0) + spill
    min_p = 0.0
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row)
    floor_kept = tl.exp(v - m) >= min_p  # [K] min-p's survivors (a suffix of the list fails it)
    thr = kth
    if HAS_TOP_P:
        # top-p weighs the survivors of min-p and top-k (vLLM's order: min-p first)
        top_p = tl.load(top_p_ptr + row)
        mass = tl.where(valid & (v >= kth) & floor_kept, tl.exp(v - m), 0.0)
        inclusive = tl.cumsum(mass, 0)  # [K], non-decreasing
        ties_mass = tl.where(tl.exp(kth - m) >= min_p, past.to(tl.float32) * tl.exp(kth - m), 0.0)
        limit = top_p * (tl.max(inclusive, axis=0) + ties_mass)
        num_kept = 1 + tl.sum(((idx < K - 1) & (inclusive < limit)).to(tl.int32), axis=0)
        pth = tl.max(tl.where(idx == num_kept - 1, v, float("-inf")), axis=0)
        thr = tl.where(top_p < 1.0, tl.maximum(kth, pth), kth)
    key = tl.load(key_ptr + row)
    kept = valid & (v >= thr) & floor_kept
    score = tl.where(kept, v + _column_noise(key, col), float("-inf"))
    best = tl.max(score, axis=0)
    token = tl.min(tl.where(kept & (score == best), col, vocab), axis=0)
    token = tl.where(token == vocab, first, token)  # nothing kept (a row of -inf): its argmax
    if (temp != 0.0) & (past > 0) & (thr <= kth) & (tl.exp(kth - m) >= min_p):
        # kept ties of kth lie past the list: their noise is drawn over the whole row
        token = _scan_sample(x_ptr + row.to(tl.int64) * stride_x, key, temp, thr, m, min_p, vocab, SUB)
    tl.store(out_ptr + row, tl.where(greedy, first, token).to(tl.int64))


def topk_sample(logits: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                max_top_k: int, top_ps: torch.Tensor | None, min_ps: torch.Tensor | None, *,
                chunk: int = CHUNK) -> torch.Tensor:
    """One token per row of `logits` [B, V]: the Gumbel-max sample (noise of `keys` [B] int64, as
    gumbel_sample) of softmax(logits / T) restricted to the row's top-k set (`top_ks` [B] int64,
    every non-greedy row's <= `max_top_k` <= MAX_K, the host's bound), within it the top-p set
    (`top_ps` [B] float32, 1.0: off) and the min-p floor (`min_ps` [B] float32, 0.0: off), each
    None when no row uses it. `temperatures` [B] float32 (0: greedy argmax). Returns [B] int64.
    `chunk`: columns a program of launch 1 reads (a power of two >= the list's groups; tests shrink it)."""
    check_gumbel_args(logits, keys, temperatures, is_probs=False)
    rows, vocab = logits.shape
    if isinstance(max_top_k, bool) or not isinstance(max_top_k, int) or not 1 <= max_top_k <= MAX_K:
        raise ValueError(f"max_top_k must be an int in [1, {MAX_K}], got {max_top_k!r}")
    shape = list_shape(max_top_k)
    check_pow2("chunk", chunk, shape.groups)
    if not max_top_k < vocab <= MAX_CHUNKS * chunk:
        raise ValueError(f"vocab must be in ({max_top_k}, {MAX_CHUNKS * chunk}] for top_k {max_top_k}, got {vocab}")
    check_row_vector("top_ks", top_ks, rows, torch.int64, logits.device)
    for name, values in (("top_ps", top_ps), ("min_ps", min_ps)):
        if values is not None:
            check_row_vector(name, values, rows, torch.float32, logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    k, cap = shape.k, shape.cap
    num_chunks = triton.cdiv(vocab, chunk)
    slots = torch.empty(rows, num_chunks, cap, dtype=torch.int64, device=logits.device)
    ties = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_top_kernel[(rows, num_chunks)](logits, temperatures, slots, ties, vocab, logits.stride(0), num_chunks,
                                          K=k, NG=shape.groups, CAP=cap, CHUNK=chunk, num_warps=NUM_WARPS)
    _row_sample_kernel[(rows,)](
        logits, temperatures, keys, top_ks, top_ps if top_ps is not None else temperatures,
        min_ps if min_ps is not None else temperatures, slots, ties, out, vocab, logits.stride(0), num_chunks,
        HAS_TOP_P=top_ps is not None, HAS_MIN_P=min_ps is not None, K=k, CAP=cap, C_PAD=next_pow2(num_chunks),
        SUB=SUB, num_warps=NUM_WARPS)
    return out
