"""Split-K (flash-decoding) attention for one new query token per sequence over the paged cache.

Stage 1 (grid Hkv / PACK x batch x num_splits): one program reads ONE kv head (PACK adjacent
ones for an FP8 cache's narrow heads: decode_plan.heads_per_program, kernels/decode_attend.py) once
for the whole GQA group of query heads (a [BLOCK_G >= 16, PACK * D] query tile, so QK^T and PV are
tl.dot MMAs) over its slice of the sequence, and writes a partial
(log-sum-exp, normalised accumulator) pair. The merge of the splits either runs in the
last stage-1 program to finish for its (sequence, kv heads), which it learns from an
arrival counter (small [group, splits, D] tiles), or as stage 2 (grid batch x Hq).
With a single split, stage 1 writes the final output and nothing is merged.

Paging and split arithmetic for a sequence of length L (BLOCK_N = 64 here)::

    tokens:  | split 0          | split 1          | ... | split S-1       |
             |<- per_split ---->|                                          per_split =
             [tile][tile][tile]  [tile][tile]...                           ceil(L/S) rounded up to BLOCK_N
    token t -> block_table[b, t // block_size], row t % block_size of that cache block

The split count S is chosen on the host from shapes only (batch, Hkv, max context =
block_table.shape[1] * block_size; kernels/decode_plan.py, with the key tile and where the splits
merge), so the launch is CUDA-graph capturable; per_split
is computed in the kernel from the device length, balancing splits for every L.
Splits past the end (and sequences of length 0) write lse = -inf and give 0 output.

With `groups` (kernels/decode_groups.py), an unsplit call gives a group of rows sharing a prompt
prefix one program per kv head, reading the prefix once for all of them.

With `num_seqs` (an int32 [1] device tensor: rows in use of a CUDA graph captured at a
fixed capacity `batch`), the kernel runs unsplit over a grid as wide as the capacity
(Hkv x batch): the programs of rows below num_seqs[0] write their final output, the others
exit at once, reading and writing nothing. (A persistent loop of fewer programs, each taking
rows p, p + P, ..., balanced uneven rows worse: ~82% of copy bandwidth in mixed steps.) The
output may be a caller's buffer (`out`, any row stride).

An FP8 cache (float8_e4m3fn, given with its `k_scale` / `v_scale`, float32 [1] device tensors
read by the kernel, so a CUDA graph replays with the values they hold then) is read in a
constexpr branch (the scale pointers are None for a cache of q's dtype, leaving that code as
it was): the cache is read as int32 words and computed in four fp16 planes of head_dim / 4
(kernels/decode_fp8.py; head_dim >= 64), k_scale is folded into the softmax scale and v_scale
into the output (o = v_scale * sum_j p_j v8_j / sum_j p_j).

Measured end to end (H200, bench.py default workload): longest-first order with kv heads on grid
axis 0 took the decode step from 4.91 to 4.65 ms (24,983 -> 26,305 tok/s, 50a5716); decode rows of
mixed steps on this kernel took the long workload from 68.7% to 73.3% of the roofline (edd37c6;
BENCHMARKS.md, "Throughput and latency history" and "Decode attention in mid-size and mixed steps").
"""

import torch
import triton
import triton.language as tl

from nanovllm.utils.context import RowGroups
from nanovllm.utils.ints import next_pow2
from nanovllm.utils.validation import check_pow2

from .checks import (INTERPRET, LOG2E, check_cache, check_fp8_words, check_gqa, check_int_tensor,
                     check_kv_scales, check_on_device, check_out, check_query, kv_cache_dtype, sm_count,
                     softmax_scale_of)
from .counters import arrival_counters
from .decode_attend import attend, store_own
from .decode_group_plan import query_tile_height
from .decode_groups import decode_group
from .decode_plan import (MAX_SPLITS, NUM_COUNTERS, DecodeTile, can_fold_merge, choose_num_splits, decode_tile,
                          heads_per_program)
from .pdl import pdl_launch_options, wait_for_prior

NUM_WARPS = 4

_counter_cache: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """This kernel's zeroed arrival counters on `device` (kernels/counters.py), or None."""
    return arrival_counters(_counter_cache, device, needed, NUM_COUNTERS)


@triton.jit
def _merge_group(mid_o_ptr, mid_lse_ptr, out_ptr, b, head0, n_heads,
                 stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                 NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, GP: tl.constexpr):
    """out[b, h] = sum_s exp2(lse_s - m) o_s / sum_s exp2(lse_s - m) for heads [head0, head0 + n_heads).
    Partials are read from L2 (.cg): they were written by other programs."""
    offs_g = tl.arange(0, GP)
    heads = head0 + offs_g
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    gs = (offs_g < n_heads)[:, None] & (offs_s < NUM_SPLITS)[None, :]
    lse = tl.load(mid_lse_ptr + b * stride_mlb + heads[:, None] * stride_mlh + offs_s[None, :], mask=gs,
                  other=float("-inf"), cache_modifier=".cg")  # [GP, BLOCK_S]
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights become 0, not NaN
    w = tl.exp2(lse - m[:, None])
    denom = tl.sum(w, 1)
    o = tl.load(mid_o_ptr + b * stride_mob + heads[:, None, None] * stride_moh + offs_s[None, :, None] * stride_mos
                + offs_d[None, None, :], mask=gs[:, :, None], other=0.0, cache_modifier=".cg")  # [GP, BLOCK_S, D]
    out = tl.sum(o * w[:, :, None], 1) / tl.where(denom > 0, denom, 1.0)[:, None]  # [GP, D]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(offs_g < n_heads)[:, None])


@triton.jit
def _decode_row(
    q_ptr, k_ptr, v_ptr, seqlens_ptr, bt_ptr, mid_o_ptr, mid_lse_ptr, out_ptr, count_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, pack, b, split,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    GROUP: tl.constexpr, PACK: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, FOLD: tl.constexpr, GP: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Split `split` of sequence b (int64) for kv heads [pack * PACK, (pack + 1) * PACK) and their
    query heads: the final output when NUM_SPLITS == 1, else a partial (and, with FOLD, the merge if it
    is the last split to arrive). k_scale_ptr / v_scale_ptr: an FP8 cache's scales, None for a cache of
    q's dtype (an FP8 cache's k_scale is already folded into qk_scale)."""
    seq_len = tl.load(seqlens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    g_valid = offs_g < PACK * GROUP
    row_head = offs_g // GROUP  # each tile row's kv head among the PACK read
    heads = pack * PACK * GROUP + offs_g  # query heads of these kv heads' GQA groups
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh  # [BLOCK_G, 1]
    k_ptr += pack * PACK * stride_kh
    v_ptr += pack * PACK * stride_kh
    bt_row = bt_ptr + b * stride_bt
    # FP8: int32 words of the cache, in fp16 planes (kernels/decode_fp8.py)
    m_i, l_i, acc = attend(q_rows, g_valid, row_head, k_ptr, v_ptr, bt_row, lo, hi, qk_scale, stride_kb, stride_kt,
                           stride_kh, k_scale_ptr is not None, PACK, BLOCK_G, HEAD_DIM, BLOCK_N, BLOCK_SIZE, DOT_PREC,
                           UPCAST)

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if v_scale_ptr is not None:  # FP8: the values' scale, once per output (merging is linear in it)
        o = o * tl.load(v_scale_ptr)
    if NUM_SPLITS == 1:  # the whole sequence in one program: final output, no merge pass
        store_own(out_ptr + b * stride_ob + heads[:, None] * stride_oh, o, g_valid, row_head, PACK, HEAD_DIM)
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # log2 units
        store_own(mid_o_ptr + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos, o, g_valid, row_head,
                  PACK, HEAD_DIM)
        tl.store(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + split, lse, mask=g_valid)
        if FOLD:
            tl.debug_barrier()  # every thread's partial stores precede the release below
            counter = count_ptr + b * tl.num_programs(0) + pack
            if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:  # the last split here
                _merge_group(mid_o_ptr, mid_lse_ptr, out_ptr, b, pack * PACK * GROUP, PACK * GROUP,
                             stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                             NUM_SPLITS, BLOCK_S, HEAD_DIM, GP)
                tl.atomic_xchg(counter, 0)  # ready for the next call


# The block-table width varies with the batch: specializing on it would recompile mid-run.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, seqlens_ptr, bt_ptr, mid_o_ptr, mid_lse_ptr, out_ptr, count_ptr, num_seqs_ptr,
    members_ptr, shared_ptr, k_scale_ptr, v_scale_ptr, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    GROUP: tl.constexpr, PACK: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, FOLD: tl.constexpr, GP: tl.constexpr, BLOCK_S: tl.constexpr,
    ROWS_ON_DEVICE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)  # before any load: num_seqs, lengths, tables, q and the cache are all written upstream
    pack = tl.program_id(0).to(tl.int64)  # kv heads [pack * PACK, (pack + 1) * PACK)
    if k_scale_ptr is not None:  # FP8: k_scale folded into the softmax scale, for every path below
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    if ROWS_ON_DEVICE:
        # NUM_SPLITS == 1, one program per (kv heads, row of the capacity): rows at or past the
        # device row count num_seqs[0] do nothing.
        b = tl.program_id(1).to(tl.int64)
        if b < tl.load(num_seqs_ptr):
            _decode_row(q_ptr, k_ptr, v_ptr, seqlens_ptr, bt_ptr, mid_o_ptr, mid_lse_ptr, out_ptr, count_ptr,
                        k_scale_ptr, v_scale_ptr, qk_scale, pack, b, 0,
                        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                        stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                        GROUP, PACK, BLOCK_G, HEAD_DIM, BLOCK_N, BLOCK_SIZE, NUM_SPLITS, DOT_PREC, UPCAST, FOLD, GP,
                        BLOCK_S)
    elif members_ptr is not None:  # unsplit, rows in groups sharing a prefix (kernels/decode_groups.py)
        decode_group(q_ptr, k_ptr + pack * PACK * stride_kh, v_ptr + pack * PACK * stride_kh, seqlens_ptr, bt_ptr,
                     out_ptr, members_ptr, shared_ptr, v_scale_ptr, qk_scale, pack, tl.program_id(1).to(tl.int64),
                     stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ob, stride_oh,
                     k_scale_ptr is not None, GROUP, PACK, BLOCK_G, HEAD_DIM, BLOCK_N, BLOCK_SIZE, DOT_PREC, UPCAST)
    else:
        _decode_row(q_ptr, k_ptr, v_ptr, seqlens_ptr, bt_ptr, mid_o_ptr, mid_lse_ptr, out_ptr, count_ptr,
                    k_scale_ptr, v_scale_ptr, qk_scale, pack, tl.program_id(1).to(tl.int64), tl.program_id(2),
                    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                    GROUP, PACK, BLOCK_G, HEAD_DIM, BLOCK_N, BLOCK_SIZE, NUM_SPLITS, DOT_PREC, UPCAST, FOLD, GP,
                    BLOCK_S)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    _merge_group(mid_o_ptr, mid_lse_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), 1,
                 stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                 NUM_SPLITS, BLOCK_S, HEAD_DIM, 1)


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table,
                            softmax_scale=None, causal=False, num_splits=0, *, num_seqs=None, out=None,
                            fold=None, k_scale=None, v_scale=None, tile: DecodeTile | None = None,
                            groups: RowGroups | None = None, kv_heads_per_program: int | None = None):
    """Decode attention. q [batch, 1, Hq, D] -> out [batch, 1, Hq, D].

    k_cache/v_cache: [num_blocks, block_size, Hkv, D]; cache_seqlens: int32 [batch], each
    sequence's length including the current token (already stored); block_table: int32
    [batch, max_blocks]. With one query per sequence, causal (bottom-right) changes nothing.
    num_splits (flash-attn's meaning): 0 picks the split count from the shapes, 1 does
    not split (and needs no merge pass), n > 1 splits each sequence n ways (at most MAX_SPLITS).

    num_seqs: optional int32 [1] on q's device, the number of rows in use (for a CUDA graph
    captured at capacity `batch`): only rows b < min(num_seqs[0], batch) are read and written,
    rows past it of the output are left as they were. The launch depends on shapes only (its
    programs of rows past the count exit); it runs unsplit, so num_splits must be 0 or 1.
    out: optional preallocated output [batch, 1, Hq, D] of q's dtype and device (any row
    stride, e.g. a view of a larger buffer; last dim contiguous; must not overlap the inputs),
    written and returned; without it the output is allocated.
    fold: where split partials are merged. None: in the last split's program where
    `can_fold_merge` allows it and the arrival counters exist (not when first needed inside a
    CUDA-graph capture), else by the merge kernel; False: always the merge kernel; True: always
    in the kernel (ValueError where it cannot be).
    k_scale / v_scale: float32 [1] tensors on q's device, both or neither: with them the caches
    are FP8 (float8_e4m3fn) holding K / k_scale and V / v_scale; without, they are of q's dtype.
    tile: a DecodeTile overriding `decode_tile`'s choice (benchmarks).
    kv_heads_per_program: adjacent kv heads a program reads side by side, a power of two dividing Hkv,
    overriding `decode_plan.heads_per_program`'s choice (benchmarks).
    groups: rows sharing a prefix (kernels/decode_groups.py: members / shared, int32 [batch] on q's
    device, as `group_rows` makes them; not with num_seqs): an unsplit call reads each group's prefix once
    for as many of its rows as a program's tile holds (GroupLimits.cap plans groups that size; a larger
    group takes several passes); a split call attends each row by itself (the same output).
    """
    if tile is not None and not isinstance(tile, DecodeTile):
        raise TypeError(f"tile must be a DecodeTile or None, got {type(tile).__name__}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_SPLITS}], got {num_splits!r}")
    if fold is not None and not isinstance(fold, bool):
        raise TypeError(f"fold must be None, True or False, got {fold!r}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"q must be [batch, 1, num_heads, head_dim], got {getattr(q, 'shape', type(q))}")
    check_query(q)
    batch, _, hq, d = q.shape
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, Hkv, D], got "
                         f"{getattr(k_cache, 'shape', type(k_cache))}")
    hkv = k_cache.shape[2]
    fp8 = check_kv_scales(k_scale, v_scale, q.device)
    block_size = check_cache(k_cache, v_cache, hkv, d, kv_cache_dtype(q.dtype, fp8))
    if fp8:
        check_fp8_words(k_cache, v_cache)
    check_gqa(hq, hkv)
    if kv_heads_per_program is not None:
        check_pow2("kv_heads_per_program", kv_heads_per_program, 1)
        if hkv % kv_heads_per_program:
            raise ValueError(f"kv_heads_per_program must divide the {hkv} kv heads, got {kv_heads_per_program}")
    check_int_tensor("cache_seqlens", cache_seqlens, shape=(batch,))
    check_int_tensor("block_table", block_table, dims=2)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, expected batch={batch}")
    if batch > 2**31 - 1:
        raise ValueError(f"batch {batch} too large")
    tensors = [("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens),
               ("block_table", block_table)]
    if num_seqs is not None:
        check_int_tensor("num_seqs", num_seqs, shape=(1,))
        tensors.append(("num_seqs", num_seqs))
        if num_splits > 1:
            raise ValueError(f"num_splits must be 0 or 1 with num_seqs (the rows in use are only known "
                             f"on the device, so there is nothing to size splits from), got {num_splits}")
        num_splits = 1
    if groups is not None:
        if not isinstance(groups, RowGroups):
            raise TypeError(f"groups must be a RowGroups or None, got {type(groups).__name__}")
        if num_seqs is not None:
            raise ValueError("groups cannot be given with num_seqs (a mixed step's decode rows are not grouped)")
        check_int_tensor("groups.members", groups.members, shape=(batch,))
        check_int_tensor("groups.shared", groups.shared, shape=(batch,))
        tensors += [("groups.members", groups.members), ("groups.shared", groups.shared)]
    check_on_device(q.device, tensors)
    if out is None:
        out = torch.empty_like(q)
    else:
        check_out(out, q)
    scale = softmax_scale_of(softmax_scale, d)

    if batch == 0:
        return out
    group = hq // hkv
    pack = heads_per_program(fp8, d, hkv) if kv_heads_per_program is None else kv_heads_per_program
    per_row = hkv // pack  # programs a row (a split)
    max_context = block_table.shape[1] * block_size
    if num_splits == 0:
        num_splits = choose_num_splits(batch, per_row, max_context, sm_count(q.device))
    # Temporaries sized from shapes only (capturable): partial outputs and log-sum-exps.
    n_mid = num_splits if num_splits > 1 else 0  # one split writes `out` directly
    mid_o = torch.empty((batch, hq, n_mid, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, hq, n_mid), dtype=torch.float32, device=q.device)
    dot_prec = "ieee" if q.dtype == torch.float32 else None
    block_s, gp = next_pow2(num_splits), next_pow2(group * pack)
    foldable = can_fold_merge(num_splits, group * pack, d, batch * per_row)
    counters = _arrival_counters(q.device, batch * per_row) if foldable and fold is not False else None
    if fold and counters is None:
        raise ValueError(f"fold=True, but {num_splits} splits of {group * pack} query heads a program, head_dim {d} "
                         f"over {batch * per_row} programs cannot merge in the kernel "
                         f"({'no arrival counters inside this capture' if foldable else 'see can_fold_merge'})")
    if num_splits > 1:
        groups = None  # each split is a slice of one row's keys: rows attend by themselves
    if tile is None:
        tile = decode_tile(q.dtype, d, num_splits == 1 and num_seqs is None, batch * per_row / sm_count(q.device), fp8)
    if fp8:  # [num_blocks, block_size, Hkv, D / 4] int32 words of four e4m3 values (kernels/decode_fp8.py)
        k_cache, v_cache = k_cache.view(torch.int32), v_cache.view(torch.int32)
    # kv heads on grid axis 0 (fastest): programs start in sequence order, all heads of a
    # sequence together, so a batch ordered longest first leaves only short work for the tail.
    grid = (per_row, batch, num_splits)
    dummy = cache_seqlens  # stands in for pointers the variant never reads
    _decode_split_kernel[grid](
        q, k_cache, v_cache, cache_seqlens, block_table, mid_o, mid_lse, out,
        counters if counters is not None else dummy, num_seqs if num_seqs is not None else dummy,
        None if groups is None else groups.members, None if groups is None else groups.shared,  # None: constexpr
        k_scale, v_scale, scale * LOG2E,  # scales None (16-bit cache): constexpr, no code
        q.stride(0), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(2),
        GROUP=group, PACK=pack, BLOCK_G=query_tile_height(group * pack), HEAD_DIM=d, BLOCK_N=tile.block_n,
        BLOCK_SIZE=block_size, NUM_SPLITS=num_splits, DOT_PREC=dot_prec, UPCAST=INTERPRET and q.dtype == torch.bfloat16,
        FOLD=counters is not None, GP=gp, BLOCK_S=block_s, ROWS_ON_DEVICE=num_seqs is not None,
        num_warps=NUM_WARPS, num_stages=tile.stages,
        **pdl_launch_options(q),
    )
    if num_splits == 1 or counters is not None:
        return out
    _decode_merge_kernel[(batch, hq)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(2),
        NUM_SPLITS=num_splits, BLOCK_S=block_s, HEAD_DIM=d,
        num_warps=4, **pdl_launch_options(q),
    )
    return out
