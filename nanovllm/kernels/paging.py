"""Where a key tile lives in the paged KV cache, for the attention kernels' inner loops, and which
columns of a cache row a decode program reads when it takes several kv heads at once.

A tile's cache blocks are fetched one tile ahead, carried into the next iteration:

    keys:     | tile 0 | tile 1 | tile 2 | tile 3 | tile 4 | ...   BLOCK_N keys each
    blocks:   |<----------- cache block b0 ---------->|<-- b1 ...   (BLOCK_SIZE = 4 x BLOCK_N here)
    loop i:   load K/V of tile i at blocks(i) (fetched by loop i-1); fetch blocks(i+1)

Why: when a K/V load's address comes from a block-table load in the same iteration, Triton 3.6's
pipeliner spends a stage on that load and gives the K/V tiles one buffer less, waiting for every
copy at the top of each iteration (sm_90 TTGIR at 3 stages: one [64, 128] buffer and
`async_wait {num = 0}` in decode attention: no tile's loads overlap the previous tile's MMAs).
Carried across iterations the id is an ordinary loop value, and num_stages - 1 tiles are in flight.
Measured (H200, BENCHMARKS.md, sixteenth session): the prefill kernel 0.890x / 0.879x the time at the
0.6B / 8B heads; decode attention unchanged (it was not bound by loads in flight). End to end, against
main in the same call (bench.py, Qwen3-0.6B): steps with prefill 416,150 vs 393,287 tok/s (+5.8%), the
default workload 26,583 vs 26,407 tok/s (+0.7%), prompt scoring 58.3% vs 57.9% of its roofline.
"""

import triton
import triton.language as tl


@triton.jit
def tile_blocks(bt_row, start_n, end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache blocks (int32) holding keys [start_n, start_n + BLOCK_N) of the sequence whose
    block-table row starts at `bt_row`: one scalar when a tile sits in one block (BLOCK_SIZE a
    multiple of BLOCK_N, start_n a multiple of BLOCK_N), else one per key ([BLOCK_N]). Keys at or
    past `end` read nothing and give block 0."""
    if BLOCK_SIZE % BLOCK_N == 0:
        return tl.load(bt_row + start_n // BLOCK_SIZE, mask=start_n < end, other=0)
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        return tl.load(bt_row + offs_n // BLOCK_SIZE, mask=offs_n < end, other=0)


@triton.jit
def tile_rows(blocks, start_n, stride_b, stride_t, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 element offsets [BLOCK_N] of keys start_n + arange(BLOCK_N) in a cache of block
    stride `stride_b` and token stride `stride_t`, from their `tile_blocks`. A tile in one block
    (start_n a multiple of BLOCK_N, as every caller's is) is one scalar base plus the loop-invariant
    row offsets. sm_90 loop bodies (Triton 3.6, scripts/sass_loops.py), instructions a thread: decode
    over a 16-bit cache 431 -> 367 a 64-key tile, over an FP8 one 806 -> 759 a 128-key tile; the paged
    prefill kernel's two key loops (tile-table mode) 797 -> 665 and 477 -> 412 (over an FP8 cache
    691 -> 674 and 486 -> 473); measured with the scale inside the exponent: kernels/online_softmax.py."""
    if BLOCK_SIZE % BLOCK_N == 0:  # the tile lies in one block (start_n a multiple of BLOCK_N): one scalar base
        base = blocks.to(tl.int64) * stride_b + tl.cast(start_n % BLOCK_SIZE, tl.int64) * stride_t
        return base + tl.arange(0, BLOCK_N).to(tl.int64) * stride_t
    else:  # [BLOCK_N] blocks, one per key
        within = ((start_n + tl.arange(0, BLOCK_N)) % BLOCK_SIZE).to(tl.int64)
        return blocks.to(tl.int64) * stride_b + within * stride_t


@triton.jit
def head_columns(PACK: tl.constexpr, PER_HEAD: tl.constexpr, stride_h):
    """Offsets [PACK * PER_HEAD] in a cache row of PACK kv heads read side by side, PER_HEAD elements
    each, head stride `stride_h` (kernels/decode_plan.heads_per_program)::

        column w:  | head 0: 0 .. PER_HEAD-1 | head 1: PER_HEAD .. | ...     -> head w // PER_HEAD, element w % PER_HEAD
    """
    cols = tl.arange(0, PACK * PER_HEAD)
    if PACK == 1:
        return cols
    else:
        return (cols // PER_HEAD) * stride_h + cols % PER_HEAD


@triton.jit
def own_columns(row_head, valid, PACK: tl.constexpr, PER_HEAD: tl.constexpr):
    """[rows, PACK * PER_HEAD] mask of a query tile over PACK heads: row r's valid columns of its own
    head row_head[r] (the rest of its row is zero in q and dropped from the output)."""
    if PACK == 1:
        return valid[:, None]
    else:
        heads = tl.arange(0, PACK * PER_HEAD) // PER_HEAD
        return valid[:, None] & (row_head[:, None] == heads[None, :])
