"""Flash-attention-2 style varlen prefill kernel (Triton): packed or paged K/V, GQA, causal.

One program computes a BLOCK_M tile of queries of one sequence and one query head,
streaming key tiles with an online softmax (fp32 running max/sum/accumulator).

Causal is bottom-right aligned: with Lq queries and Lk keys, query j sees keys
0 .. j + (Lk - Lq). For the query tile [m0, m0 + BLOCK_M)::

    keys:  0 ........ full_end ........ end ........ Lk
           |  no mask  |  masked tiles   | skipped  |
    full_end = min(Lk, m0 + Lk - Lq + 1) rounded down to BLOCK_N (every row sees these)
    end      = min(Lk, m0 + BLOCK_M + Lk - Lq)          (no row sees beyond this)

Paged K/V: key n of sequence s lives at
``cache[block_table[s, n // block_size], n % block_size]``. When BLOCK_N divides
block_size a key tile lies in one cache block and one block id is loaded per tile;
otherwise the block id is gathered per key. Block ids are fetched a tile ahead
(kernels/paging.py), so the next tile's K/V copies are in flight while this one's MMAs run:
the kernel went from 458.8 to 408.4 us (0.6B heads) and 1,044 to 918 us (8B) on 48 prompts of
256-1,024 tokens; bench.py's steps with prefill (Qwen3-0.6B) 393,287 -> 416,150 tok/s, scoring 57.9% ->
58.3% of its roofline (BENCHMARKS.md, sixteenth session).

Two launch modes, one per-tile body (`_prefill_tile`):

- grid (Hq, num_seqs, cdiv(max_seqlen_q, BLOCK_M)): shaped by the batch; one tile per
  program, programs past a sequence's end skip it.
- query-tile table (``tile_seq``/``tile_block``/``num_tiles``, built on the host with
  kernels/prefill_plan.build_query_tiles, heaviest tile first): a persistent grid (Hq, P) with
  P = min(cap, max(1, TILE_PROGRAMS_PER_SM * SMs // Hq)), cap the table length. P depends
  on shapes and the device only, so the launch can sit in a CUDA graph and replay with any
  table of that cap. Program (h, p) walks entries t = p, p + P, p + 2P, ... < num_tiles
  (round robin over a heaviest-first table keeps the programs' work even); entries past
  num_tiles are never read, so a small step costs P programs per head, not cap::

      t:            0    1   ...  P-1 |  P    P+1  ...  | ... num_tiles-1 | num_tiles ... cap-1
      program p:    0    1   ...  P-1 |  0    1    ...  | ...             | (not read)
      tile_seq:     s_0  s_1 ...      |                 |                 |
      tile_block:   b_0  b_1 ...      |                 |                 |
      entry t -> query rows [b_t * BLOCK_M, (b_t + 1) * BLOCK_M) of sequence s_t, head h

Output rows no tile covers (e.g. bucket padding past cu_seqlens_q[-1]) are never written,
so a caller's preallocated ``out`` keeps whatever those rows held.

Paged FP8 caches (float8_e4m3fn, given with their `k_scale` / `v_scale`, float32 [1] device
tensors the kernel reads, so a captured launch uses the values they hold at replay) are read in
a constexpr branch (the scale pointers are None otherwise, leaving that code as it was): a
bf16 q is taken to fp16 (decode_fp8.q_to_fp16), each K/V tile is converted to q's dtype in
registers (exact), k_scale is folded into the softmax scale and v_scale into the output. fp16
MMAs, because e4m3 -> fp16 is one instruction a pair and e4m3 -> bf16 is not: the kernel over an
FP8 cache took 1.42x the bf16 cache's time with bf16 MMAs, 1.22x with fp16 (H200, 48 prompts of
256-1,024 tokens: 586 -> 502 us at 0.6B's heads; scoring with an FP8 cache 341,565 -> 347,652
prompt tok/s; BENCHMARKS.md, twenty-first session).

Steps over long contexts (kernels/prefill_plan.takes_long_tiles) take a 128-row tile (`long_tiles`), which
reads each key tile for twice the query rows: time to first token at 16,384 / 32,768 tokens 113.60 -> 107.35 /
398.66 -> 361.54 ms on Qwen3-0.6B (-5.5 / -9.3%) and 590.12 -> 570.93 / 1,612.61 -> 1,525.88 ms on Qwen3-8B
(-3.3 / -5.4%) (H100, bench.py --ttft; BENCHMARKS.md, sixty-first session).

Measured end to end (H200, bench.py): with the query-tile table and the prefill / mixed-step CUDA
graphs it serves, time to first token at 128 / 1,000 tokens went from 32.10 / 31.40 ms to 1.85 /
3.91 ms and the long workload from 49.7% to 69.0% of the roofline (2167754, 36e8716; BENCHMARKS.md,
"Prefill and mixed steps (#14)"). Kernel alone: 1.30-1.43x torch's FA2 varlen_attn ("Kernels").
"""

import torch
import triton
import triton.language as tl

from .checks import (INTERPRET, LOG2E, MAX_GRID_YZ, check_cache, check_gqa, check_int_tensor, check_kv_scales,
                     check_on_device, check_out, check_query, kv_cache_dtype, softmax_scale_of)
from .decode_fp8 import q_to_fp16
from .online_softmax import M_START, online_softmax
from .paging import tile_blocks, tile_rows
from .prefill_plan import check_tiles, prefill_tile, tile_programs


@triton.jit
def _kv_offsets(start_n, blocks, k_start, stride_kb, stride_kt, stride_vb, stride_vt, PAGED: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 row offsets ([BLOCK_N] for K, [BLOCK_N] for V) of keys start_n + arange(BLOCK_N):
    in the paged cache at `blocks` (kernels/paging.py), or packed from row k_start."""
    if PAGED:
        return (tile_rows(blocks, start_n, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N),
                tile_rows(blocks, start_n, stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N))
    else:
        rows = k_start + (start_n + tl.arange(0, BLOCK_N)).to(tl.int64)
        return rows * stride_kt, rows * stride_vt


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_ptr, v_ptr, offs_m, offs_d, start_n, k_len, causal_off,
                 blocks, k_start, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, k_scale_ptr,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                 UPCAST: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_valid = offs_n < k_len
    k_rows, v_rows = _kv_offsets(start_n, blocks, k_start, stride_kb, stride_kt, stride_vb, stride_vt, PAGED,
                                 BLOCK_SIZE, BLOCK_N)
    k_off = k_rows[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
    v_off = v_rows[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
    if MASKED:
        k = tl.load(k_ptr + k_off, mask=n_valid[:, None], other=0.0)
        v = tl.load(v_ptr + v_off, mask=n_valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + k_off)
        v = tl.load(v_ptr + v_off)
    if k_scale_ptr is not None:  # FP8 -> q's dtype (fp16 for a bf16 q): exact, the scales are applied outside
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N], unscaled
    if MASKED:
        keep = n_valid[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + causal_off)
        qk = tl.where(keep, qk, float("-inf"))
    p, alpha, m_i, l_i = online_softmax(qk, qk_scale, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _prefill_tile(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, bt_ptr, k_scale_ptr, v_scale_ptr, head, seq, m_block, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Query rows [m_block * BLOCK_M, +BLOCK_M) of sequence `seq` (int64), query head `head`
    (int64): attend over the sequence's keys and store the rows that exist; a block past the
    sequence's end does nothing. k_scale_ptr / v_scale_ptr: an FP8 cache's scales, else None."""
    q_start = tl.load(cu_q_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    start_m = m_block * BLOCK_M
    if start_m < q_len:
        k_start = tl.load(cu_k_ptr + seq).to(tl.int64)
        k_len = (tl.load(cu_k_ptr + seq + 1) - k_start).to(tl.int32)
        kv_head = head // GROUP
        if k_scale_ptr is not None:  # FP8: k_scale folded into the softmax scale
            qk_scale = qk_scale * tl.load(k_scale_ptr)

        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        m_valid = offs_m < q_len
        q_off = (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=m_valid[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
        if UPCAST:
            q = q.to(tl.float32)
        elif k_scale_ptr is not None and q.dtype == tl.bfloat16:
            # FP8 cache: fp16 MMAs. e4m3 -> fp16 is one instruction a pair; e4m3 -> bf16 went through
            # fp16 and a scalar convert a value (256 F2F.BF16.F16 in the sm_90 SASS, at 16 an SM a clock).
            q = q_to_fp16(q)

        k_head_ptr = k_ptr + kv_head * stride_kh
        v_head_ptr = v_ptr + kv_head * stride_vh
        causal_off = k_len - q_len
        if CAUSAL:
            end = tl.minimum(k_len, start_m + BLOCK_M + causal_off)
            full_end = tl.minimum(k_len, start_m + causal_off + 1)
        else:
            end = k_len
            full_end = k_len
        end = tl.maximum(end, 0)
        full_end = (tl.maximum(full_end, 0) // BLOCK_N) * BLOCK_N

        bt_row = bt_ptr + seq * stride_bt
        blocks = tile_blocks(bt_row, 0, k_len, BLOCK_SIZE, BLOCK_N) if PAGED else 0
        # Finite start for the running max: fully masked rows then give p = 0, never NaN.
        m_i = tl.full([BLOCK_M], M_START, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for start_n in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, offs_m, offs_d, start_n, k_len,
                                         causal_off, blocks, k_start, stride_kb, stride_kt,
                                         stride_vb, stride_vt, qk_scale, k_scale_ptr,
                                         False, CAUSAL, PAGED, BLOCK_SIZE, BLOCK_N, DOT_PREC, UPCAST)
            if PAGED:  # the next tile's blocks, a tile ahead (kernels/paging.py)
                blocks = tile_blocks(bt_row, start_n + BLOCK_N, k_len, BLOCK_SIZE, BLOCK_N)
        for start_n in range(full_end, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_head_ptr, v_head_ptr, offs_m, offs_d, start_n, k_len,
                                         causal_off, blocks, k_start, stride_kb, stride_kt,
                                         stride_vb, stride_vt, qk_scale, k_scale_ptr,
                                         True, CAUSAL, PAGED, BLOCK_SIZE, BLOCK_N, DOT_PREC, UPCAST)
            if PAGED:  # the next tile's blocks, a tile ahead (kernels/paging.py)
                blocks = tile_blocks(bt_row, start_n + BLOCK_N, k_len, BLOCK_SIZE, BLOCK_N)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        if v_scale_ptr is not None:  # FP8: the values' scale, once per output row
            out = out * tl.load(v_scale_ptr)
        o_off = (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=m_valid[:, None])


# These ints vary with the batch (cap with the token bucket): specializing on their value would recompile mid-run.
@triton.jit(do_not_specialize=["num_m_blocks", "cap", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, bt_ptr, tile_seq_ptr, tile_block_ptr, num_tiles_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale, num_m_blocks, cap,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, PAGED: tl.constexpr, TILED: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    if TILED:
        # Persistent: this program takes entries pid, pid + P, ... of the heaviest-first table.
        # Entries past num_tiles (clamped to cap) are padding of the fixed cap, never read.
        n_tiles = tl.minimum(tl.load(num_tiles_ptr), cap)
        for tile in range(tl.program_id(1), n_tiles, tl.num_programs(1)):
            seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
            m_block = tl.load(tile_block_ptr + tile)
            _prefill_tile(q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, bt_ptr, k_scale_ptr, v_scale_ptr,
                          head, seq, m_block, qk_scale,
                          stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                          stride_ot, stride_oh, stride_bt,
                          GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE, CAUSAL, PAGED, DOT_PREC, UPCAST)
    else:
        seq = tl.program_id(1).to(tl.int64)
        # Heaviest (last) causal query tiles are launched first for a shorter tail.
        m_block = num_m_blocks - 1 - tl.program_id(2)
        _prefill_tile(q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr, bt_ptr, k_scale_ptr, v_scale_ptr,
                      head, seq, m_block, qk_scale,
                      stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                      stride_ot, stride_oh, stride_bt,
                      GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_SIZE, CAUSAL, PAGED, DOT_PREC, UPCAST)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, block_table=None, *,
                           tile_seq=None, tile_block=None, num_tiles=None, out=None, k_scale=None, v_scale=None,
                           long_tiles=False):
    """Varlen attention. q [total_q, Hq, D] -> out [total_q, Hq, D].

    k/v: packed [total_k, Hkv, D] (k and v may have different strides, e.g. views of a fused
    qkv projection), or with ``block_table`` [num_seqs, max_blocks] int32 the paged caches
    [num_blocks, block_size, Hkv, D]. cu_seqlens_*: int32 [num_seqs + 1].
    max_seqlen_q/k: host ints (upper bounds) used for grid sizing only.

    Query-tile table (keyword-only, all three or none): tile_seq, tile_block int32 [cap] and
    num_tiles int32 [1] (1-D contiguous, may be views of one buffer), e.g. from
    `build_query_tiles` with block_m = `query_tile_rows(D, q.dtype)`. Entry t < num_tiles
    computes query rows [tile_block[t] * BLOCK_M, +BLOCK_M) of sequence tile_seq[t] (each
    entry must name a real sequence; blocks past its end are skipped). The grid is (Hq, P),
    P = `tile_programs(Hq, cap, q.device)` <= cap, each program looping over every P-th entry,
    whatever the batch, so the call can be captured in a CUDA graph; rows no tile covers
    (e.g. bucket padding past cu_seqlens_q[-1]) are left unwritten.

    out (keyword-only, optional): a preallocated [total_q, Hq, D] tensor of q's dtype and
    device with a contiguous last dim (row and head strides are free: it may be a view of a
    larger buffer) and overlapping none of q, k, v. The kernel writes the rows its tiles
    cover and leaves every other row untouched; it is returned. Without it a new tensor is
    allocated (uncovered rows then hold uninitialised memory).

    k_scale / v_scale (keyword-only, both or neither; paged caches only): float32 [1] tensors on
    q's device; with them the caches are FP8 (float8_e4m3fn) holding K / k_scale and V / v_scale.

    long_tiles (keyword-only, bool): the long-context tile (`prefill_tile(D, q.dtype, long=True)`; a
    tile table's block_m is then `query_tile_rows(D, q.dtype, long=True)`). 16-bit caches only: over
    FP8 caches it is not measured, and refused.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor [total_q, num_heads, head_dim], got "
                         f"{getattr(q, 'shape', type(q))}")
    check_query(q)
    total_q, hq, d = q.shape
    paged = block_table is not None
    fp8 = check_kv_scales(k_scale, v_scale, q.device)
    if not isinstance(long_tiles, bool):
        raise TypeError(f"long_tiles must be a bool, got {long_tiles!r}")
    if long_tiles and fp8:
        raise ValueError("long_tiles=True over FP8 caches (k_scale / v_scale given) is not supported: the long tile "
                         "is measured on 16-bit caches only")
    if fp8 and not paged:
        raise ValueError("k_scale / v_scale describe FP8 paged caches: they need block_table")
    kv_dtype = kv_cache_dtype(q.dtype, fp8)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t)}")
        if t.dtype != kv_dtype:
            raise TypeError(f"{name} dtype {t.dtype} != {'FP8 (k_scale / v_scale given)' if fp8 else 'q dtype'} "
                            f"{kv_dtype}")
    if paged:
        if k.dim() != 4:
            raise ValueError(f"with block_table, k must be [num_blocks, block_size, Hkv, D], got {tuple(k.shape)}")
        hkv = k.shape[2]
        block_size = check_cache(k, v, hkv, d, kv_dtype)
    else:
        if k.dim() != 3 or k.shape[2] != d:
            raise ValueError(f"k must be [total_k, Hkv, {d}], got {tuple(k.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
        # k and v are walked with their own strides (views of a fused qkv projection need no copy).
        for name, t in (("k", k), ("v", v)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
        hkv = k.shape[1]
        block_size = 16  # unused by the packed path; fixed to avoid recompiles
    check_gqa(hq, hkv)
    check_int_tensor("cu_seqlens_q", cu_seqlens_q, dims=1)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0 or num_seqs > MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_q must describe 0..{MAX_GRID_YZ} sequences, got {num_seqs}")
    check_int_tensor("cu_seqlens_k", cu_seqlens_k, shape=(num_seqs + 1,))
    if paged:
        check_int_tensor("block_table", block_table, dims=2)
        if block_table.shape[0] != num_seqs:
            raise ValueError(f"block_table has {block_table.shape[0]} rows, expected num_seqs={num_seqs}")
        if max_seqlen_k > block_table.shape[1] * block_size:
            raise ValueError(f"max_seqlen_k={max_seqlen_k} exceeds block_table capacity "
                             f"{block_table.shape[1]} x {block_size}")
    for name, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(val, int) or val < 0:
            raise TypeError(f"{name} must be a non-negative Python int, got {val!r}")
    tensors = [("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)]
    if paged:
        tensors.append(("block_table", block_table))
    check_on_device(q.device, tensors)
    cap = check_tiles(tile_seq, tile_block, num_tiles, q.device)
    tiled = tile_seq is not None
    if out is None:
        out = torch.empty_like(q)
    else:
        check_out(out, q)
    scale = softmax_scale_of(softmax_scale, d)

    # Tile mode decides from shapes only (capturable); max_seqlen_q is not consulted.
    if total_q == 0 or num_seqs == 0 or (cap == 0 if tiled else max_seqlen_q == 0):
        return out
    if paged:
        stride_kb, stride_kt, stride_kh = k.stride(0), k.stride(1), k.stride(2)
        stride_vb, stride_vt, stride_vh = v.stride(0), v.stride(1), v.stride(2)
        bt, stride_bt = block_table, block_table.stride(0)
    else:
        stride_kb, stride_kt, stride_kh = 0, k.stride(0), k.stride(1)
        stride_vb, stride_vt, stride_vh = 0, v.stride(0), v.stride(1)
        bt, stride_bt = cu_seqlens_k, 0  # dummy pointer, never read
    tile = prefill_tile(d, q.dtype, long_tiles)
    if tiled:
        num_m_blocks = 0  # unused: the table names each program's query block
        grid = (hq, tile_programs(hq, cap, q.device))
    else:
        num_m_blocks = triton.cdiv(max_seqlen_q, tile.block_m)
        grid = (hq, num_seqs, num_m_blocks)
        tile_seq = tile_block = num_tiles = cu_seqlens_q  # dummy pointers, never read
    _prefill_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, bt, tile_seq, tile_block, num_tiles,
        k_scale, v_scale, scale * LOG2E, num_m_blocks, cap,  # scales None (16-bit cache): constexpr, no code
        q.stride(0), q.stride(1), stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        out.stride(0), out.stride(1), stride_bt,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_SIZE=block_size,
        CAUSAL=bool(causal), PAGED=paged, TILED=tiled, DOT_PREC="ieee" if q.dtype == torch.float32 else None,
        UPCAST=INTERPRET and q.dtype == torch.bfloat16,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out
