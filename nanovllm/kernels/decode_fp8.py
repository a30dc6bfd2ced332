"""Decode attention's inner loop over an FP8 (e4m3) cache, read as int32 words and computed in
four fp16 planes (kernels/fp8_kv.py, `e4m3_planes`): plane j holds head dims 4c + j.

    q . k = sum_j q_j . k_j        (q_j, k_j: [D / 4] slices of dims j, j + 4, j + 8, ...)
    o_j   = sum_n p_n v_j[n]       (the output's dims 4c + j; joined back into [G, D] at the end)

Why planes: converting a tile to q's dtype and transposing it for the MMA took the compiled loop to
907 instructions per thread per 64 keys against 432 on a bf16 cache (byte-wise shared-memory reads
into the transposed layout, scalar fp16 -> bf16 converts), and the kernel ran at the bf16 kernel's
time on half the bytes. Words load 4 bytes at a time and convert two values per instruction straight
to an MMA type (fp16 holds every e4m3 value exactly): 401 instructions per 64 keys (sm_90, Triton 3.6).

The words stream through shared memory as a 16-bit cache's tiles do (Triton's pipeliner, stages - 1
tiles in flight; decode_plan.FP8_BLOCK_N keys a tile). Measured (H200, bench_kernels --fp8-tiles,
BENCHMARKS.md, seventeenth session): 89.4 us at 256 x <= 1,024 keys (80% of copy bandwidth on its
bytes) against 154.3 before and 148.6 on a bf16 cache; 0.53-0.65x the old time over engine-like
batches (a register prefetch at one stage instead: 0.8x). End to end, bench.py: Qwen3-0.6B with an FP8
cache 1.336x the bf16 cache's tok/s (was 1.018x), Qwen3-30B-A3B FP8 + FP8 KV 1.396x bf16 (was 1.321x).

Planes are head_dim / 4 columns: at head_dim 64, 16, tl.dot's least, and the kernel ran at 30% of
copy bandwidth on its bytes (Qwen2.5-0.5B's heads), slower than over a bf16 cache. There a program
reads two adjacent kv heads (decode_plan.heads_per_program, kernels/decode_attend.py): planes of 32
columns, one softmax for both heads' query rows: 23.1 against 42.6 us at 256 x <= 1,024 keys (1.84x), 2.36x at
128 rows (Llama-3.2-1B's 32 / 8 heads: 1.73-1.83x); end to end with an FP8 cache, bench.py's Llama-3.2-1B
1.25x the one-head kernel's tok/s, Qwen2.5-0.5B 1.06-1.10x and its rollout preset 1.24x (H100, BENCHMARKS.md,
fifty-fifth and fifty-sixth sessions).

q is cast to fp16 (clamped to +-FP16_MAX; it comes from a bf16 or fp16 activation, and its product
with a key is accumulated in fp32). Under the interpreter or for a float32 q, the planes are fp32.
"""

import triton
import triton.language as tl

from .fp8_kv import INTERPRET, PER_WORD, e4m3_planes
from .online_softmax import M_START, online_softmax
from .paging import head_columns, own_columns, tile_blocks, tile_rows

# Largest finite fp16: q is clamped to it before the cast (a bf16 q may hold larger values).
FP16_MAX = tl.constexpr(65504.0)


@triton.constexpr_function
def _plane_dtype(q_dtype):
    """The planes' dtype: fp16 (the hardware conversion's) for a 16-bit q on the GPU; fp32 for a
    float32 q, and under the interpreter."""
    return tl.float32 if INTERPRET or q_dtype == tl.float32 else tl.float16


@triton.jit
def q_to_fp16(q):
    """A query tile in fp16 for fp16 MMAs over e4m3 keys: clamped to +-FP16_MAX first (a bf16 q may
    hold larger values), exact otherwise above 2^-14 (bf16's 8 significant bits fit fp16's 11)."""
    return tl.clamp(q.to(tl.float32), -FP16_MAX, FP16_MAX).to(tl.float16)


@triton.jit
def _q_plane(q_rows, mask, j: tl.constexpr, PACK: tl.constexpr, CW: tl.constexpr, DTYPE: tl.constexpr):
    """Plane j of the query tile over PACK heads of CW words each ([BLOCK_G, 1] row pointers; mask:
    each row's own head's columns): column c holds dim 4 (c % CW) + j, as DTYPE: [BLOCK_G, PACK * CW]."""
    offs = (tl.arange(0, PACK * CW) % CW) * PER_WORD + j
    q = tl.load(q_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if DTYPE == tl.float16:  # constexpr: q's type may change
        q = q_to_fp16(q)
    return q.to(DTYPE)


@triton.jit
def _tile_words(k_ptr, v_ptr, blocks, start_n, hi, cols, stride_kb, stride_kt,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The K and V words [BLOCK_N, len(cols)] of keys start_n + arange(BLOCK_N) (0 at or past hi)."""
    valid = (start_n + tl.arange(0, BLOCK_N)) < hi
    off = tile_rows(blocks, start_n, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N)[:, None] + cols[None, :]
    return (tl.load(k_ptr + off, mask=valid[:, None], other=0),
            tl.load(v_ptr + off, mask=valid[:, None], other=0))


@triton.jit
def attend_fp8_planes(q_rows, g_valid, row_head, k_ptr, v_ptr, bt_row, lo, hi, qk_scale, stride_kb, stride_kt,
                      stride_kh, PACK: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PREC: tl.constexpr):
    """Keys [lo, hi) of PACK adjacent kv heads for their query rows (decode_attend.attend's arguments
    and result; k_ptr / v_ptr int32 words, strides in words). The e4m3 values are unscaled (k_scale is
    in qk_scale, v_scale is the caller's)."""
    DTYPE: tl.constexpr = _plane_dtype(q_rows.dtype.element_ty)
    CW: tl.constexpr = HEAD_DIM // PER_WORD  # words a head
    own = own_columns(row_head, g_valid, PACK, CW)
    q0 = _q_plane(q_rows, own, 0, PACK, CW, DTYPE)  # [BLOCK_G, PACK * CW] each
    q1 = _q_plane(q_rows, own, 1, PACK, CW, DTYPE)
    q2 = _q_plane(q_rows, own, 2, PACK, CW, DTYPE)
    q3 = _q_plane(q_rows, own, 3, PACK, CW, DTYPE)
    cols = head_columns(PACK, CW, stride_kh)
    m_i = tl.full([BLOCK_G], M_START, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_G, PACK * CW], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_G, PACK * CW], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_G, PACK * CW], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_G, PACK * CW], dtype=tl.float32)
    blocks = tile_blocks(bt_row, lo, hi, BLOCK_SIZE, BLOCK_N)  # fetched a tile ahead: kernels/paging.py
    for start_n in range(lo, hi, BLOCK_N):
        k_words, v_words = _tile_words(k_ptr, v_ptr, blocks, start_n, hi, cols, stride_kb, stride_kt,
                                       BLOCK_SIZE, BLOCK_N)  # [BLOCK_N, PACK * CW] int32 each
        blocks = tile_blocks(bt_row, start_n + BLOCK_N, hi, BLOCK_SIZE, BLOCK_N)
        k0, k1, k2, k3 = e4m3_planes(k_words, DTYPE)  # [BLOCK_N, PACK * CW] each
        qk = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC)
        qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PREC)
        qk = tl.dot(q2, tl.trans(k2), qk, input_precision=DOT_PREC)
        qk = tl.dot(q3, tl.trans(k3), qk, input_precision=DOT_PREC)  # [BLOCK_G, BLOCK_N], unscaled
        qk = tl.where((start_n + tl.arange(0, BLOCK_N) < hi)[None, :], qk, float("-inf"))
        p, alpha, m_i, l_i = online_softmax(qk, qk_scale, m_i, l_i)
        p = p.to(DTYPE)
        v0, v1, v2, v3 = e4m3_planes(v_words, DTYPE)
        acc0 = tl.dot(p, v0, acc0 * alpha[:, None], input_precision=DOT_PREC)
        acc1 = tl.dot(p, v1, acc1 * alpha[:, None], input_precision=DOT_PREC)
        acc2 = tl.dot(p, v2, acc2 * alpha[:, None], input_precision=DOT_PREC)
        acc3 = tl.dot(p, v3, acc3 * alpha[:, None], input_precision=DOT_PREC)
    # [BLOCK_G, PACK * CW, 2 (plane bit 1), 2 (plane bit 0)] -> [BLOCK_G, PACK * D]: column 4c + 2 * b1 + b0,
    # which is dim 4 (c % CW) + 2 * b1 + b0 of head c // CW, as decode_attend.attend lays acc out
    acc = tl.join(tl.join(acc0, acc2), tl.join(acc1, acc3)).reshape(BLOCK_G, PACK * HEAD_DIM)
    return m_i, l_i, acc
