"""Triton top-k / top-p thresholds: per row, the probability below which a token is filtered,
found by radix select on the float bits (no sort). Same contract as
sampling/sampler.top_k_top_p_threshold, which stays the CPU path and the reference.

    kth = the k-th largest probability, ties counted         (k >= V: off, 0.0)
    pth = the largest value t of the row with  sum(x : x >= t, x >= kth) >= top_p * total,
          total = sum(x : x >= kth)                          (top_p >= 1: off)
    threshold = pth where top-p is on, else kth

Probabilities are >= 0, so their float32 bit patterns (sign cleared) order like the values. A
select finds the largest pattern t with weight(x >= t) >= target (weight: count for top-k, mass
for top-p), RADIX_BITS bits a pass from the top; such a t is always a value of the row:

    bits    31..28 27..24 23..20 ... 3..0      pass i histograms digit i of the elements whose
    pass      0      1      2    ...  7        higher digits equal the prefix chosen so far

Each pass is one launch over a (row, chunk) grid, and launches talk only through memory (no
program waits for another): program (r, c) first redoes the last pass's choice for row r from
that pass's per-chunk histograms (every program of the row the same way, in the same order), then
histograms its chunk's matching elements for this pass into part[parity][r, c]. The (r, 0)
program keeps the row's state (prefix, weight above it, target weight) for the pass after:

    launch i:  read part[(i-1) % 2], state[i % 2]  ->  write part[i % 2], state[(i-1) % 2]

A program whose chunk weighed nothing in the bin just chosen has no element under the new prefix
and reads nothing: after the first passes, most chunks. A last one-program-a-row launch makes the
final choice. Per-chunk histograms are summed in a
fixed order, so a row's threshold does not depend on timing. Top-p sums float32 masses in another
order than torch's cumsum: where a limit lies within rounding of a partial sum, the threshold may
keep one value (with its ties) more or less than the torch path. Top-k is exact.

Measured end to end (H200, 2026-12-03, e5994d5, BENCHMARKS.md "tenth"): `bench.py --top-k 2048
--top-p 0.95` on Qwen3-0.6B gave 20,089 / 19,962 tok/s with the select against 17,577 / 17,583 with
torch's sort (`--kernel-routes radix_min_rows=1000000`), runs alternating sort, select, sort,
select: +14%. Kept. It serves batches of 32+ rows whose top-p rows are not all bounded by a
top-k <= 1024 (top-k > 1024, or top-p rows mixed with top-k rows) and that the Triton top-k kernel
(sampling/topk_sample.py: every sampled row with a top-k <= 128) does not take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.checks import MAX_GRID_YZ, check_row_vector
from nanovllm.utils.ints import next_pow2

# Bits chosen per pass: a digit's 16 bins cost 16 compares an element; 8 passes cover 32 bits.
RADIX_BITS = tl.constexpr(4)
BINS = 1 << RADIX_BITS.value
PASSES = 32 // RADIX_BITS.value
# Clears the sign bit: -0.0 reads as 0.0, so the patterns of values >= 0 order as int32 like the values.
ABS_MASK = tl.constexpr(0x7FFFFFFF)
# Columns per program: 38 programs a row at a 151,936-token vocabulary.
CHUNK = 4096
# Columns per step: [BINS, TILE] float32 accumulators, 32 a thread at NUM_WARPS = 4.
TILE = 256
NUM_WARPS = 4
# Counts are float32 histograms: exact up to 2**24 elements a row.
MAX_VOCAB = 2**24


@triton.jit
def _choose(hist, above, limit, BINS: tl.constexpr):
    """(digit, weight above the new prefix): the largest digit whose bins at or above it, with the
    weight above the prefix, reach `limit`; float rounding leaving none: the lowest bin holding
    weight (all-zero bins: digit 0)."""
    bins = tl.arange(0, BINS)
    suffix = tl.sum(tl.where(bins[None, :] >= bins[:, None], hist[None, :], 0.0), axis=1)  # [BINS]
    present = hist > 0
    best = tl.max(tl.where(present & (suffix >= limit - above), bins, -1), axis=0)
    lowest = tl.min(tl.where(present, bins, BINS), axis=0)
    digit = tl.where(best >= 0, best, tl.where(lowest < BINS, lowest, 0))
    return digit, above + tl.sum(tl.where(bins > digit, hist, 0.0), axis=0)


@triton.jit
def _redo_choice(row, target, part_ptr, prefix_ptr, state_ptr, num_chunks, prev_shift,
                 FIRST: tl.constexpr, WEIGHTED: tl.constexpr, BINS: tl.constexpr, C_PAD: tl.constexpr):
    """The row's (prefix, above, limit) after the previous pass, and the digit it chose: that
    pass's choice redone from its per-chunk histograms at part_ptr and the state before it
    (FIRST: the start)."""
    c = tl.arange(0, C_PAD)
    bins = tl.arange(0, BINS)
    offs = (row * num_chunks + c[:, None]) * BINS + bins[None, :]
    hist = tl.sum(tl.load(part_ptr + offs, mask=c[:, None] < num_chunks, other=0.0), axis=0)  # [BINS]
    if FIRST:
        prefix = tl.zeros([], tl.int32)
        above = tl.zeros([], tl.float32)
        limit = target * tl.sum(hist, axis=0) if WEIGHTED else target  # pass 0 saw every candidate
    else:
        prefix = tl.load(prefix_ptr + row)
        above = tl.load(state_ptr + 2 * row)
        limit = tl.load(state_ptr + 2 * row + 1)
    digit, above = _choose(hist, above, limit, BINS)
    return prefix | (digit << prev_shift), above, limit, digit


# The digit position and its mask change every pass: specialized, they would compile per pass.
@triton.jit(do_not_specialize=["shift", "decided"])
def _histogram_kernel(probs_ptr, target_ptr, floor_ptr, part_in_ptr, part_out_ptr, prefix_in_ptr, state_in_ptr,
                      prefix_out_ptr, state_out_ptr, vocab, stride_p, num_chunks, shift, decided,
                      PASS0: tl.constexpr, FIRST: tl.constexpr, WEIGHTED: tl.constexpr, BINS: tl.constexpr,
                      CHUNK: tl.constexpr, TILE: tl.constexpr, C_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    bins = tl.arange(0, BINS)
    target = tl.load(target_ptr + row)
    acc = tl.zeros([BINS, TILE], tl.float32)  # [BINS, TILE] per-lane weights of each digit
    live = target > 0  # rows with this filter off read nothing (their histograms stay 0)
    prefix = tl.zeros([], tl.int32)
    if not PASS0:
        if live:
            # the previous pass's digit sits just above this one's
            prefix, above, limit, digit = _redo_choice(row, target, part_in_ptr, prefix_in_ptr, state_in_ptr,
                                                       num_chunks, shift + RADIX_BITS, FIRST, WEIGHTED, BINS, C_PAD)
            if chunk == 0:
                tl.store(prefix_out_ptr + row, prefix)
                tl.store(state_out_ptr + 2 * row, above)
                tl.store(state_out_ptr + 2 * row + 1, limit)
            # this chunk's weight in the chosen bin is the weight of its elements under the new
            # prefix: none (0) and it has nothing to read (zero-valued matches weigh nothing either)
            live = tl.load(part_in_ptr + (row * num_chunks + chunk) * BINS + digit) > 0
    if live:
        floor = tl.load(floor_ptr + row)
        row_ptr = probs_ptr + row * stride_p
        for s in tl.static_range(CHUNK // TILE):
            cols = chunk * CHUNK + s * TILE + tl.arange(0, TILE)  # [TILE]
            inside = cols < vocab
            x = tl.load(row_ptr + cols, mask=inside, other=0.0)  # [TILE] float32
            bits = x.to(tl.int32, bitcast=True) & ABS_MASK
            matched = inside & ((bits & decided) == prefix) & (bits >= floor)  # decided: the bits above the digit
            nibble = tl.where(matched, (bits >> shift) & (BINS - 1), BINS)  # [TILE] this pass's digit; BINS: none
            hit = nibble[None, :] == bins[:, None]  # [BINS, TILE]
            if WEIGHTED:
                acc += tl.where(hit, x[None, :], 0.0)
            else:
                acc += hit.to(tl.float32)
    tl.store(part_out_ptr + (row * num_chunks + chunk) * BINS + bins, tl.sum(acc, axis=1))


@triton.jit
def _final_kernel(target_ptr, floor_ptr, part_ptr, prefix_ptr, state_ptr, out_ptr, num_chunks,
                  WEIGHTED: tl.constexpr, BINS: tl.constexpr, C_PAD: tl.constexpr):
    """out[row] = the select's bits (the last pass's choice), or floor[row] where it is off."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    result = tl.load(floor_ptr + row)
    if target > 0:
        result, _, _, _ = _redo_choice(row, target, part_ptr, prefix_ptr, state_ptr, num_chunks, 0, False, WEIGHTED,
                                       BINS, C_PAD)
    tl.store(out_ptr + row, result)


def _select(probs: torch.Tensor, target: torch.Tensor, floor: torch.Tensor, weighted: bool, chunk: int) -> torch.Tensor:
    """[B] int32 bits of each row's select (target > 0: k as a count, or top_p), elements below
    `floor` (bits) left out; rows with target 0 get their floor."""
    batch, vocab = probs.shape
    num_chunks = triton.cdiv(vocab, chunk)
    dev = probs.device
    # by pass parity, each its own allocation: a slice of one would start unaligned at some batch
    # sizes, and Triton compiles a kernel per pointer alignment (mid-run, for a new batch size)
    part = [torch.empty((batch, num_chunks, BINS), dtype=torch.float32, device=dev) for _ in range(2)]
    prefix = [torch.empty(batch, dtype=torch.int32, device=dev) for _ in range(2)]
    state = [torch.empty((batch, 2), dtype=torch.float32, device=dev) for _ in range(2)]  # (above, limit)
    common = dict(WEIGHTED=weighted, BINS=BINS, C_PAD=next_pow2(num_chunks))
    for i in range(PASSES):
        shift = 32 - RADIX_BITS.value * (i + 1)  # this pass's digit: bits shift .. shift + RADIX_BITS - 1
        decided = -(1 << (shift + RADIX_BITS.value)) & 0xFFFFFFFF  # the bits above it, as a uint32 mask
        decided -= (decided >> 31) << 32  # ... passed as the int32 of the same bits
        cur, prev = i % 2, (i + 1) % 2
        _histogram_kernel[(batch, num_chunks)](
            probs, target, floor, part[prev], part[cur], prefix[cur], state[cur], prefix[prev], state[prev],
            vocab, probs.stride(0), num_chunks, shift, decided, PASS0=i == 0, FIRST=i == 1, CHUNK=chunk,
            TILE=min(TILE, chunk), num_warps=NUM_WARPS, **common,
        )
    out = torch.empty(batch, dtype=torch.int32, device=dev)
    last, before = (PASSES - 1) % 2, PASSES % 2
    _final_kernel[(batch,)](target, floor, part[last], prefix[before], state[before], out, num_chunks, **common)
    return out


def top_k_top_p_threshold(probs: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None,
                          block: int = CHUNK) -> torch.Tensor:
    """``[B, 1]`` float32 thresholds of `probs` ``[B, V]`` float32 (values >= 0, contiguous last
    dim; not modified): tokens below it are filtered by top-k (`top_ks` ``[B]`` int64, rows with
    top-k off hold V) and top-p (`top_ps` ``[B]`` float32, rows off hold 1.0); None: no row uses it.
    A row with neither gets 0.0 (the torch path's sort branch gives its smallest value: the same
    tokens kept). `block`: columns per program (a power of two; tests shrink it)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block!r}")
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        raise ValueError(f"probs must be a 2-D tensor [rows, vocab], got {getattr(probs, 'shape', type(probs))}")
    if probs.dtype != torch.float32:
        raise TypeError(f"probs must be float32, got {probs.dtype}")
    batch, vocab = probs.shape
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"vocab must be in [1, {MAX_VOCAB}], got {vocab}")
    if triton.cdiv(vocab, block) > MAX_GRID_YZ:
        raise ValueError(f"vocab {vocab} needs more than {MAX_GRID_YZ} chunks of {block}")
    if probs.stride(1) != 1 and vocab > 1:
        raise ValueError(f"probs must have a contiguous last dim, got strides {probs.stride()}")
    if top_ks is not None:
        check_row_vector("top_ks", top_ks, batch, torch.int64, probs.device)
    if top_ps is not None:
        check_row_vector("top_ps", top_ps, batch, torch.float32, probs.device)
    bits = torch.zeros(batch, dtype=torch.int32, device=probs.device)  # [B] kth's bits; 0: top-k off
    if batch and top_ks is not None:
        target = torch.where(top_ks < vocab, top_ks.clamp(min=1), 0).to(torch.float32)  # counts, exact below 2**24
        bits = _select(probs, target, bits, False, block)
    if batch and top_ps is not None:
        bits = _select(probs, torch.where(top_ps < 1.0, top_ps, 0.0), bits, True, block)
    return bits.view(torch.float32).unsqueeze(1)  # [B, 1]
