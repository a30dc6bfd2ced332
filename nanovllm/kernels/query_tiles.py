"""The query-tile table of the prefill kernel's persistent launch (kernels/prefill_attention.py):
which BLOCK_M rows of which sequence each table entry computes, built on the host (numpy) and
checked at the call that receives it.

    sequence i with q_lens[i] queries -> tiles (i, 0), (i, 1), ... (i, cdiv(q_lens[i], block_m) - 1)
    table order: by the keys a tile attends to, most first (the longest programs start first)
"""

import numpy as np
import torch

from .checks import check_int_tensor, check_on_device

# CUDA limit on grid dims y and z (sequences, query tiles or table entries are launched there).
MAX_GRID_YZ = 65535


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
