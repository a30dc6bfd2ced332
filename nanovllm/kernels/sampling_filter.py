"""Triton top-k / top-p thresholds: per row, the probability below which a token is filtered,
found by radix select on the float bits (no sort). Same contract as
layers/sampler._top_k_top_p_threshold, which stays the CPU path and the reference.

    kth = the k-th largest probability, ties counted         (k clamped to [1, V]; k = V: off)
    pth = the largest value t of the row with  sum(x : x >= t, x >= kth) >= top_p * total,
          total = sum(x : x >= kth)                          (top_p >= 1: off)
    threshold = pth where top-p is on, else kth; 0.0 where neither is on (nothing filtered)

pth restates the sort: the first sorted position whose inclusive cumsum reaches top_p * total
holds the largest value whose mass at or above it reaches that limit.

Probabilities are >= 0, so their float32 bits (sign cleared) order like the values. One program
per row finds each threshold's bit pattern MSB first, 4 bits a pass, 8 passes for 31 bits:

    bits   30..27 26..23 22..19  ...  6..3  3..0     pass i: a 16-bin histogram of digit d_i over
    pass     0      1      2     ...   6     7        the elements whose higher bits equal the prefix
           |exponent    | mantissa ...          |     so far (counts for top-k, float32 masses for
    prefix = d0 d1 d2 ...                             top-p); d_i = the largest digit whose bins >= d_i
    plus the weight above the prefix's range reach the target (k, or top_p * total). The last digit
    overlaps bit 3, decided by pass 6: only the digits that agree with it hold elements.

After 8 passes the prefix is the largest pattern t with weight(x >= t) >= target: exactly the k-th
value for top-k. A top-p pass picks only a bin holding mass, so its t is a value of the row even
where float rounding upsets the sums; those are float32 sums in another order than torch's cumsum,
so a row whose limit lies within rounding of a partial sum may keep one value (with its ties) more
or less than the torch path. Top-p's total comes from its first pass (its bins hold every survivor).
Top-k counts are 4-bit counters, 16 packed in an int64 per lane (a lane adds at most one a tile,
MAX_TILES_PER_CHUNK <= 15 tiles before they are unpacked): a shift and an add an element instead
of 16 compares; top-p's masses take the 16 compares.

A pass reads only the chunks (BLOCK columns) holding an element of the prefix it extends: it lists
the chunks it read that matched, each with a bit per digit its matched elements had (per row, int32,
in place), and the next pass reads a listed chunk only if it has the digit just chosen. Before
top-p, a row with top-k lists the chunks holding its survivors (x >= kth) in one cheap read.

    chunks read (softmax of randn * 3 / 0.8, 75 chunks, top-k 50):  75 75 24 7 7 7 7 7
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Bits decided per pass: 16 bins (compares for the masses) against 8 reads of a chunk per select.
RADIX_BITS = tl.constexpr(4)
RADIX = tl.constexpr(1 << RADIX_BITS.value)
DIGIT_MASK = tl.constexpr(RADIX.value - 1)
# Passes for the 31 value bits (the sign bit is cleared): digits at bits 30..27, ..., 6..3, 3..0.
PASSES = tl.constexpr(8)
TOP_SHIFT = tl.constexpr(31 - RADIX_BITS.value)
# Clears the sign bit: -0.0 reads as 0.0, so the bits of values >= 0 order as int32 like the values.
ABS_MASK = tl.constexpr(0x7FFFFFFF)
# Digit of an element outside the prefix (or below the floor): equals no bin.
NO_DIGIT = tl.constexpr(RADIX.value)
# A chunk-list entry is chunk * CHUNK_UNIT + a bit per digit (RADIX bits); ALL_DIGITS: any digit
# may match (the first pass). Chunks a row may have: an entry stays a non-negative int32.
CHUNK_UNIT = tl.constexpr(1 << RADIX.value)
ALL_DIGITS = tl.constexpr(CHUNK_UNIT.value - 1)
MAX_CHUNKS = 2 ** (31 - RADIX.value) - 1
# Bits of one packed top-k counter: RADIX of them fill an int64; a counter holds up to 15.
COUNT_BITS = tl.constexpr(4)

# Columns per tile: one element a thread at NUM_WARPS = 8, so a tile and the [16, TILE] per-lane
# histogram share one layout (no shuffle between the load and the bins; 16 accumulators a thread).
TILE = 256
NUM_WARPS = 8
# Columns per chunk, the skip unit: 8 tiles (8 loads in flight a thread; a packed counter adds <= 8),
# 75 chunks a row at a 151,936-token vocabulary.
BLOCK = 2048
# Tiles a chunk may hold (block <= TILE * 8): a packed 4-bit counter takes at most one a tile
# before it is unpacked and must stay <= 15; 8 is the largest power of two that does.
MAX_TILES_PER_CHUNK = 8


@triton.jit
def _list_chunks_reaching(row_ptr, chunks_ptr, vocab, num_chunks, floor_bits,
                          BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Lists at chunks_ptr the chunks holding an element >= floor (bits), as entries for any
    digit; returns how many."""
    lanes = tl.arange(0, TILE)  # [TILE]
    kept = tl.zeros([], tl.int32)
    for c in range(num_chunks):
        seen = tl.zeros([TILE], tl.int1)  # [TILE]
        for s in tl.static_range(BLOCK // TILE):
            cols = c * BLOCK + s * TILE + lanes  # [TILE] int32
            inside = cols < vocab
            x = tl.load(row_ptr + cols, mask=inside, other=0.0)  # [TILE] float32
            seen = seen | (inside & ((x.to(tl.int32, bitcast=True) & ABS_MASK) >= floor_bits))
        any_seen = tl.max(seen.to(tl.int32), axis=0)
        tl.store(chunks_ptr + kept, c * CHUNK_UNIT + ALL_DIGITS, mask=any_seen > 0)
        kept += any_seen
    return kept


@triton.jit
def _select(row_ptr, chunks_ptr, vocab, live, listed, target, floor_bits,
            WEIGHTED: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Bits of the largest value t of the row (among elements >= floor) whose weight at or above
    it reaches the target: count >= target (WEIGHTED False, target = k), or mass >= target * the
    mass of all elements >= floor (WEIGHTED True, target = top_p). The first pass reads chunks
    0..live-1, or (`listed`) the `live` entries at chunks_ptr, which must hold every element >= floor.

    An entry is chunk * CHUNK_UNIT + the digits its matched elements had in the pass that listed it:
    the next pass reads the chunk only if that holds the digit the pass chose (then it has an
    element of the longer prefix)."""
    bins = tl.arange(0, RADIX)  # [RADIX]
    lanes = tl.arange(0, TILE)  # [TILE]
    prefix = tl.zeros([], tl.int32)  # bits decided so far
    decided = tl.zeros([], tl.int32)  # mask of those bits
    digit = tl.zeros([], tl.int32)  # the digit the last pass chose (first pass: entries hold all)
    if WEIGHTED:
        above = tl.zeros([], tl.float32)  # mass of the elements above the prefix's range
        limit = tl.zeros([], tl.float32)  # target * total, known after the first pass
    else:
        above = tl.zeros([], tl.int32)  # count of the elements above the prefix's range
        limit = target.to(tl.int32)
    for i in range(PASSES):
        shift = tl.maximum(TOP_SHIFT - RADIX_BITS * i, 0)
        if WEIGHTED:
            acc = tl.zeros([RADIX, TILE], tl.float32)  # [RADIX, TILE] per-lane bin masses
        else:
            acc = tl.zeros([RADIX, TILE], tl.int32)  # [RADIX, TILE] per-lane bin counts
        kept = tl.zeros([], tl.int32)  # entries relisted for the next pass (in place: slot kept <= j, read)
        for j in range(live):
            from_list = listed | (i > 0)
            entry = tl.where(from_list, tl.load(chunks_ptr + j, mask=from_list, other=0), j * CHUNK_UNIT + ALL_DIGITS)
            if (entry >> digit) & 1 != 0:
                c = entry // CHUNK_UNIT
                seen = tl.zeros([TILE], tl.int32)  # [TILE] digits of the matched elements a lane, as bits
                packed = tl.zeros([TILE], tl.int64)  # [TILE] RADIX 4-bit counts a lane (top-k)
                for s in tl.static_range(BLOCK // TILE):
                    cols = c * BLOCK + s * TILE + lanes  # [TILE] int32: vocab < 2**31 - BLOCK
                    inside = cols < vocab
                    x = tl.load(row_ptr + cols, mask=inside, other=0.0)  # [TILE] float32
                    bits = x.to(tl.int32, bitcast=True) & ABS_MASK
                    matched = inside & ((bits & decided) == prefix) & (bits >= floor_bits)
                    nibble = (bits >> shift) & DIGIT_MASK  # [TILE] the digit of this pass
                    if WEIGHTED:
                        hit = tl.where(matched, nibble, NO_DIGIT)[None, :] == bins[:, None]  # [RADIX, TILE]
                        acc += tl.where(hit, x[None, :], 0.0)
                    else:
                        one = tl.full([TILE], 1, tl.int64)
                        packed += tl.where(matched, one << (nibble * COUNT_BITS).to(tl.int64), 0)
                    seen = seen | tl.where(matched, 1 << nibble, 0)
                if not WEIGHTED:
                    counts = (packed[None, :] >> (bins[:, None] * COUNT_BITS).to(tl.int64)) & DIGIT_MASK
                    acc += counts.to(tl.int32)  # [RADIX, TILE]
                digits = tl.reduce_or(seen, 0)  # [RADIX bits] the digits seen in the chunk
                tl.store(chunks_ptr + kept, c * CHUNK_UNIT + digits, mask=digits != 0)
                kept += (digits != 0).to(tl.int32)
        live = kept
        hist = tl.sum(acc, axis=1)  # [RADIX]: weight of each digit among the matched
        if WEIGHTED:
            limit = tl.where(i == 0, target * tl.sum(hist, axis=0), limit)  # pass 0 matches every survivor
        # suffix[d] = weight of the digits >= d
        suffix = tl.sum(tl.where(bins[None, :] >= bins[:, None], hist[None, :], 0), axis=1)  # [RADIX]
        need = limit - above
        present = hist > 0  # a bin holding positive weight holds an element
        best = tl.max(tl.where(present & (suffix >= need), bins, -1), axis=0)
        # rounding left no bin reaching `need`: the lowest present one (all matched are 0.0: digit 0)
        lowest = tl.min(tl.where(present, bins, RADIX), axis=0)
        digit = tl.where(best >= 0, best, tl.where(lowest < RADIX, lowest, 0))
        above += tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        prefix = prefix | (digit << shift)
        decided = decided | (DIGIT_MASK << shift)
    return prefix


@triton.jit
def _threshold_kernel(probs_ptr, top_k_ptr, top_p_ptr, chunks_ptr, out_ptr, vocab, stride_p, num_chunks,
                      HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = probs_ptr + row * stride_p
    row_chunks = chunks_ptr + row * num_chunks
    kth_bits = tl.zeros([], tl.int32)  # 0.0: top-k keeps everything
    top_k_on = False
    if HAS_TOP_K:
        k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), vocab)
        top_k_on = k < vocab
        if top_k_on:
            kth_bits = _select(row_ptr, row_chunks, vocab, num_chunks, False, k, 0, False, BLOCK, TILE)
    threshold_bits = kth_bits
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            # pth >= kth (a survivor's value). The top-k survivors lie in few chunks: one cheap
            # read lists them, and top-p's first (16-bin) pass reads only those.
            live = num_chunks
            if top_k_on:
                live = _list_chunks_reaching(row_ptr, row_chunks, vocab, num_chunks, kth_bits, BLOCK, TILE)
            threshold_bits = _select(row_ptr, row_chunks, vocab, live, top_k_on, top_p, kth_bits, True,
                                     BLOCK, TILE)
    tl.store(out_ptr + row, threshold_bits.to(tl.float32, bitcast=True))


def _check_vector(name: str, t, batch: int, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        raise TypeError(f"{name} must be a {dtype} tensor, got {getattr(t, 'dtype', type(t))}")
    if tuple(t.shape) != (batch,) or (batch > 1 and t.stride(0) != 1):
        raise ValueError(f"{name} must be contiguous of shape ({batch},), got {tuple(t.shape)} strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, probs on {device}")


def top_k_top_p_threshold(probs: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None,
                          block: int = BLOCK) -> torch.Tensor:
    """``[B, 1]`` float32 thresholds of `probs` ``[B, V]`` float32 (values >= 0, contiguous last
    dim; not modified): tokens below it are filtered by top-k (`top_ks` ``[B]`` int64, rows with
    top-k off hold V) and top-p (`top_ps` ``[B]`` float32, rows off hold 1.0); None: no row uses it.
    A row with neither gets 0.0 (the torch path's sort branch gives its smallest value: the same
    tokens kept). `block`: columns per chunk (a power of two; tests shrink it)."""
    if (isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1)
            or block > TILE * MAX_TILES_PER_CHUNK):
        raise ValueError(f"block must be a power of two <= {TILE * MAX_TILES_PER_CHUNK}, got {block!r}")
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
        raise ValueError(f"probs must be a 2-D tensor [rows, vocab], got {getattr(probs, 'shape', type(probs))}")
    if probs.dtype != torch.float32:
        raise TypeError(f"probs must be float32, got {probs.dtype}")
    batch, vocab = probs.shape
    if vocab < 1 or vocab >= 2**31 - block:
        raise ValueError(f"vocab must be in [1, 2**31 - block), got {vocab}")
    if probs.stride(1) != 1 and vocab > 1:
        raise ValueError(f"probs must have a contiguous last dim, got strides {probs.stride()}")
    if top_ks is not None:
        _check_vector("top_ks", top_ks, batch, torch.int64, probs.device)
    if top_ps is not None:
        _check_vector("top_ps", top_ps, batch, torch.float32, probs.device)
    if batch == 0 or (top_ks is None and top_ps is None):
        return torch.zeros(batch, 1, dtype=torch.float32, device=probs.device)  # [B, 1]
    num_chunks = triton.cdiv(vocab, block)
    if num_chunks > MAX_CHUNKS:
        raise ValueError(f"vocab {vocab} needs {num_chunks} chunks of {block}, more than {MAX_CHUNKS}")
    out = torch.empty(batch, 1, dtype=torch.float32, device=probs.device)  # [B, 1]: every row written
    chunks = torch.empty(batch, num_chunks, dtype=torch.int32, device=probs.device)  # [B, chunks] lists
    _threshold_kernel[(batch,)](
        probs, probs if top_ks is None else top_ks, probs if top_ps is None else top_ps, chunks, out,
        vocab, probs.stride(0), num_chunks, HAS_TOP_K=top_ks is not None, HAS_TOP_P=top_ps is not None,
        BLOCK=block, TILE=min(block, TILE), num_warps=NUM_WARPS,
    )
    return out
