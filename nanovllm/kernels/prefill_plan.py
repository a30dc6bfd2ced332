"""How a prefill-attention call (kernels/prefill_attention.py) is planned on the host, from shapes
only (so a CUDA graph can capture the launch): its tile (query rows and keys per program, warps,
stages), and the query-tile table of its persistent launch with the programs that walk it: which
BLOCK_M rows of which sequence each table entry computes, built on the host (numpy) and checked at
the call that receives it. The tuned numbers were measured on an H200: BENCHMARKS.md, "Tuning notes
moved from kernel docstrings" and the sixteenth session.

    sequence i with q_lens[i] queries -> tiles (i, 0), (i, 1), ... (i, cdiv(q_lens[i], block_m) - 1)
    table order: by the keys a tile attends to, most first (the longest programs start first)
"""

from dataclasses import dataclass

import numpy as np
import torch

from .checks import MAX_GRID_YZ, SUPPORTED_DTYPES, check_head_dim, check_int_tensor, check_on_device, sm_count

# Query rows per program: 64 gives 2x more programs (better SM balance for causal tiles).
BLOCK_M = 64
# Keys per inner step: 64 keeps the fp32 [BLOCK_M, BLOCK_N] score tile in registers.
BLOCK_N = 64
# One warpgroup per program; 3 stages: three K/V tiles buffered in shared memory, the next ones
# loading while one is used (4 stages overflow shared memory at one program per SM: 1.8x slower).
NUM_WARPS = 4
NUM_STAGES = 3
# Tile mode launches up to this many programs per SM over all heads (P per head = this x SMs // Hq):
# ~2 programs fit per SM (the pipelined K/V tiles' shared memory), so 4 is two resident waves,
# enough slack for the block scheduler to even out tiles of unequal key counts, while a small
# step no longer launches cap programs per head that mostly exit at once.
TILE_PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class PrefillTile:
    """A prefill program's shape: query rows, keys per inner step, warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Long contexts: 128 query rows a program (8 warps, 4 K/V stages) read each key tile for twice the
# rows. Against the 64-row tile (H100, tile-table launches, BENCHMARKS.md sixtieth session): 2,048
# keys -3 to -4%, 4,096 a tie, 6,144 +3-5%, 8-16k +8-12%, a 16k chunk over 24-32k keys +12-22%. End to end:
# prefill_attention.py's docstring (first token at 16-32k tokens 3-9% sooner; the sixty-first session).
LONG_TILE = PrefillTile(128, 64, 8, 4)
# The head size it was measured at (Qwen3-0.6B / 8B heads); other head sizes keep the 64-row tile
LONG_HEAD_DIM = 128
# A step takes it when its longest chunk attends to at least this many keys (the shortest span measured to gain)
LONG_KEYS = 6144
# ... and its chunks hold at least this many query rows: 16 long tiles a head, so the step's Hq x 16
# programs (one an SM) still fill the SMs.
LONG_MIN_QUERIES = 2048


def prefill_tile(head_dim: int, dtype: torch.dtype, long: bool = False) -> PrefillTile:
    """The kernel's tile for this head_dim and dtype: smaller where 16-bit D <= 128 tiles would
    overflow the 228 KB of shared memory per SM (fp32 or head_dim 256); LONG_TILE when `long` (a step
    over long contexts: `takes_long_tiles`) at a 16-bit LONG_HEAD_DIM. Elsewhere `long` changes nothing."""
    if dtype == torch.float32 or head_dim > 128:
        return PrefillTile(64, 32, 4, 2)
    if long and head_dim == LONG_HEAD_DIM:
        return LONG_TILE
    return PrefillTile(BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES)


def takes_long_tiles(query_rows: int, max_keys: int) -> bool:
    """Whether a step whose prefill chunks hold `query_rows` query rows in all, the longest attending
    to `max_keys` keys, takes the long tile (LONG_KEYS, LONG_MIN_QUERIES)."""
    return query_rows >= LONG_MIN_QUERIES and max_keys >= LONG_KEYS


def tile_programs(num_heads: int, cap: int, device: torch.device) -> int:
    """P, the programs per head of a tile-table launch: min(cap, max(1, TILE_PROGRAMS_PER_SM x SMs // Hq)).
    Shapes and device only (no tensor values), so a captured launch keeps it on every replay."""
    target = TILE_PROGRAMS_PER_SM * sm_count(device)
    return min(cap, max(1, target // num_heads))


def query_tile_rows(head_dim: int, dtype: torch.dtype, long: bool = False) -> int:
    """Query rows per program (BLOCK_M) of the kernel for this head_dim and dtype (and `long`, as
    the call's `long_tiles`): the `block_m` that `build_query_tiles` must be given for a tile-table call."""
    check_head_dim(head_dim)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of float16/bfloat16/float32, got {dtype}")
    return prefill_tile(head_dim, dtype, long).block_m


def build_query_tiles(q_lens, block_m: int, k_lens=None) -> tuple[np.ndarray, np.ndarray]:
    """Host-built query-tile table: (tile_seq, tile_block), int32 [num_tiles] each.

    Every sequence i with q_lens[i] > 0 contributes cdiv(q_lens[i], block_m) tiles
    (i, 0 .. cdiv - 1); sequences with no queries contribute none. Tiles are ordered by the
    number of keys they attend to under bottom-right causal masking, most first (ties keep
    sequence, then block order), so the longest programs start first and the tail is short::

        keys(i, b) = (k_lens[i] - q_lens[i]) + min(q_lens[i], (b + 1) * block_m)

    k_lens (optional, >= q_lens) are the key counts incl. any cached prefix; without them
    no prefix is assumed. Vectorised numpy, no per-tile Python work.
    """
    if isinstance(block_m, bool) or not isinstance(block_m, (int, np.integer)) or block_m <= 0:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    q = np.asarray(q_lens)
    if q.ndim != 1 or (q.size and not np.issubdtype(q.dtype, np.integer)):
        raise ValueError(f"q_lens must be a 1-D integer array, got shape {q.shape} dtype {q.dtype}")
    q = q.astype(np.int64)
    if q.size and q.min() < 0:
        raise ValueError("q_lens must be non-negative")
    if k_lens is None:
        prefix = np.zeros_like(q)
    else:
        k = np.asarray(k_lens)
        if k.shape != q.shape or (k.size and not np.issubdtype(k.dtype, np.integer)):
            raise ValueError(f"k_lens must be an integer array of shape {q.shape}, got shape {k.shape} "
                             f"dtype {k.dtype}")
        prefix = k.astype(np.int64) - q
        if prefix.size and prefix.min() < 0:
            raise ValueError("k_lens must be >= q_lens element-wise")
    per_seq = (q + block_m - 1) // block_m  # [num_seqs] tiles of each sequence
    total = int(per_seq.sum())
    seq = np.repeat(np.arange(q.size, dtype=np.int64), per_seq)  # [total]
    first = np.cumsum(per_seq) - per_seq  # index of each sequence's first tile
    block = np.arange(total, dtype=np.int64) - np.repeat(first, per_seq)
    keys = prefix[seq] + np.minimum(q[seq], (block + 1) * block_m)
    order = np.argsort(-keys, kind="stable")
    return seq[order].astype(np.int32), block[order].astype(np.int32)


def check_tiles(tile_seq, tile_block, num_tiles, device: torch.device) -> int:
    """Validate a query-tile table (all three tensors or none); return its cap (0: none given)."""
    given = [t is not None for t in (tile_seq, tile_block, num_tiles)]
    if not any(given):
        return 0
    if not all(given):
        raise ValueError("tile_seq, tile_block and num_tiles must be given together (or none of them)")
    check_int_tensor("tile_seq", tile_seq, dims=1)
    check_int_tensor("tile_block", tile_block, dims=1)
    check_int_tensor("num_tiles", num_tiles, shape=(1,))
    cap = tile_seq.shape[0]
    if tile_block.shape[0] != cap:
        raise ValueError(f"tile_block length {tile_block.shape[0]} != tile_seq length {cap}")
    if cap > MAX_GRID_YZ:
        raise ValueError(f"tile_seq length {cap} exceeds the grid limit {MAX_GRID_YZ}")
    check_on_device(device, (("tile_seq", tile_seq), ("tile_block", tile_block), ("num_tiles", num_tiles)))
    return cap
