"""Decode attention's inner loop: a query tile over keys [lo, hi) of one sequence's paged cache, as an
online softmax (m, l, acc) in log2 units, unnormalised. A 16-bit cache is read here; an FP8 cache goes to
kernels/decode_fp8.py. The caller picks the query rows (one sequence's GQA group, or several sequences'
groups sharing a prefix: kernels/decode_groups.py) and merges.

A program may read PACK adjacent kv heads at once (kernels/decode_plan.heads_per_program): each key's
PACK * head_dim values form one row, and each query row is zero outside its own head's columns, so one
score tile holds every head's scores and one softmax serves them all::

    q tile [rows, PACK * D]:   row of head 0: | q  | 0  |        K tile [keys, PACK * D]: | k head 0 | k head 1 |
                               row of head 1: | 0  | q  |
    acc [rows, PACK * D] = p @ V: a row keeps its own head's columns (`store_own`)

The engine packs only an FP8 cache's heads of 64 (Qwen2.5-0.5B, Llama-3.2-1B), where it buys, end to end
on bench.py, 1.25x on Llama-3.2-1B and 1.06-1.10x on Qwen2.5-0.5B (1.24x on its rollout preset) (H100;
BENCHMARKS.md, fifty-fifth and fifty-sixth sessions; the rule and its kernel figures:
decode_plan.FP8_PACKED_ROW_VALUES).
"""

import triton
import triton.language as tl

from .decode_fp8 import attend_fp8_planes
from .online_softmax import M_START, online_softmax
from .paging import head_columns, own_columns, tile_blocks, tile_rows


@triton.jit
def _attend_16bit(q_rows, g_valid, row_head, k_ptr, v_ptr, bt_row, lo, hi, qk_scale, stride_kb, stride_kt, stride_kh,
                  PACK: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Keys [lo, hi) over a cache of q's dtype (the arguments and the result as `attend`'s)."""
    offs_d = tl.arange(0, PACK * HEAD_DIM) % HEAD_DIM
    q = tl.load(q_rows + offs_d[None, :], mask=own_columns(row_head, g_valid, PACK, HEAD_DIM),
                other=0.0)  # [BLOCK_G, PACK * HEAD_DIM]
    if UPCAST:
        q = q.to(tl.float32)
    cols = head_columns(PACK, HEAD_DIM, stride_kh)
    m_i = tl.full([BLOCK_G], M_START, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, PACK * HEAD_DIM], dtype=tl.float32)
    blocks = tile_blocks(bt_row, lo, hi, BLOCK_SIZE, BLOCK_N)  # fetched a tile ahead: kernels/paging.py
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        rows = tile_rows(blocks, start_n, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N)
        blocks = tile_blocks(bt_row, start_n + BLOCK_N, hi, BLOCK_SIZE, BLOCK_N)
        ptr_off = rows[:, None] + cols[None, :]  # [BLOCK_N, PACK * HEAD_DIM]
        k = tl.load(k_ptr + ptr_off, mask=n_valid[:, None], other=0.0)
        v = tl.load(v_ptr + ptr_off, mask=n_valid[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BLOCK_G, BLOCK_N], unscaled
        qk = tl.where(n_valid[None, :], qk, float("-inf"))
        p, alpha, m_i, l_i = online_softmax(qk, qk_scale, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_i, l_i, acc


@triton.jit
def attend(q_rows, g_valid, row_head, k_ptr, v_ptr, bt_row, lo, hi, qk_scale, stride_kb, stride_kt, stride_kh,
           FP8: tl.constexpr, PACK: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Keys [lo, hi) of the sequence whose block-table row starts at bt_row, for the query rows
    q_rows [BLOCK_G, 1] (pointers to each row's query head; rows where g_valid is False load zeros and
    their results are the caller's to drop), row_head [BLOCK_G] each row's kv head among the PACK
    read (0 .. PACK - 1). k_ptr / v_ptr: the first of those kv heads in the cache (FP8: its int32 words,
    strides in words), stride_kh the head stride.
    -> (m [BLOCK_G], l [BLOCK_G], acc [BLOCK_G, PACK * HEAD_DIM]: column w is dim w % HEAD_DIM of
    head w // HEAD_DIM, meaningful in the row's own head's columns)."""
    if FP8:
        return attend_fp8_planes(q_rows, g_valid, row_head, k_ptr, v_ptr, bt_row, lo, hi, qk_scale, stride_kb,
                                 stride_kt, stride_kh, PACK, BLOCK_G, HEAD_DIM, BLOCK_N, BLOCK_SIZE, DOT_PREC)
    else:
        return _attend_16bit(q_rows, g_valid, row_head, k_ptr, v_ptr, bt_row, lo, hi, qk_scale, stride_kb, stride_kt,
                             stride_kh, PACK, BLOCK_G, HEAD_DIM, BLOCK_N, BLOCK_SIZE, DOT_PREC, UPCAST)


@triton.jit
def store_own(out_rows, o, valid, row_head, PACK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Store each valid row of o [BLOCK_G, PACK * HEAD_DIM] (`attend`'s acc, normalised) at
    out_rows [BLOCK_G, 1] (pointers to the row's head_dim outputs): its own head's columns."""
    offs_d = tl.arange(0, PACK * HEAD_DIM) % HEAD_DIM
    tl.store(out_rows + offs_d[None, :], o.to(out_rows.dtype.element_ty),
             mask=own_columns(row_head, valid, PACK, HEAD_DIM))
