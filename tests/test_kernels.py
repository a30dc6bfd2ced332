"""CPU tests of the Triton attention kernels (TRITON_INTERPRET=1, set by conftest.py).

References are plain float64 PyTorch, independent of the kernels: K/V are gathered per
sequence through the block table, softmax is explicit with a bottom-right causal mask.
Shapes are tiny because the interpreter is slow.
"""


import numpy as np
import pytest
import torch

from nanovllm.kernels.decode_attention import flash_attn_with_kvcache
from nanovllm.kernels.decode_plan import FOLD_MAX_ELEMS, NUM_COUNTERS, can_fold_merge
from nanovllm.kernels.prefill_attention import flash_attn_varlen_func
from nanovllm.kernels.prefill_plan import (LONG_HEAD_DIM, LONG_TILE, build_query_tiles, prefill_tile,
                                           query_tile_rows, tile_programs)

# Triton kernels on CPU tensors: these run where the interpreter is on (no CUDA; see conftest.py).
pytestmark = pytest.mark.interpreter

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16's own output rounding (8-bit significand) alone gives ~2-3e-3 relative error, so
# its bound is looser than fp16's; fp32 (ieee dots) is far tighter.
TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}


# ---------------------------------------------------------------- helpers / references
def rel_err(out, ref):
    assert not torch.isnan(out).any(), "output has NaN (unwritten or broken elements)"
    return ((out.double() - ref).norm() / ref.norm()).item()


def randn(shape, gen, dtype):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(DEV, dtype)


def ref_attention(q, k, v, causal, scale):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> float64 [Lq, Hq, D], bottom-right causal."""
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    rep = hq // hkv
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        j = torch.arange(lq)[:, None]
        t = torch.arange(lk)[None, :]
        s = s.masked_fill(t > j + (lk - lq), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


def make_paged(lens, block_size, hkv, d, dtype, gen, extra_blocks=3):
    """Random caches and a shuffled block table holding len tokens per sequence."""
    nblk = [-(-n // block_size) for n in lens]
    num_blocks = sum(nblk) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(max(nblk), 1) + 1
    table = torch.zeros((len(lens), width), dtype=torch.int32)
    pos = 0
    for i, nb in enumerate(nblk):
        table[i, :nb] = perm[pos:pos + nb].int()
        pos += nb
    k_cache = randn((num_blocks, block_size, hkv, d), gen, dtype)
    v_cache = randn((num_blocks, block_size, hkv, d), gen, dtype)
    return k_cache, v_cache, table.to(DEV)


def gather(cache, table_row, n):
    bs = cache.shape[1]
    t = torch.arange(n, device=cache.device)
    return cache[table_row.long()[t // bs], t % bs]  # [n, Hkv, D]


def cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)


# ---------------------------------------------------------------- prefill
@pytest.mark.parametrize("d,hq,hkv,dtype,causal", [
    (64, 4, 2, torch.float16, True), (128, 2, 1, torch.bfloat16, True),
    (64, 2, 2, torch.float16, False), (64, 2, 1, torch.float32, True), (64, 14, 2, torch.bfloat16, True)])
@pytest.mark.parametrize("lens", [[1, 37, 70, 16], [180]])
def test_prefill_packed(d, hq, hkv, dtype, causal, lens):
    gen = torch.Generator().manual_seed(2)
    total = sum(lens)
    q, k, v = randn((total, hq, d), gen, dtype), randn((total, hkv, d), gen, dtype), randn((total, hkv, d), gen, dtype)
    c = cu(lens)
    out = flash_attn_varlen_func(q, k, v, c, c, max(lens), max(lens), causal=causal)
    assert out.shape == q.shape and out.dtype == dtype
    ref = torch.cat([ref_attention(q[a:b], k[a:b], v[a:b], causal, d ** -0.5)
                     for a, b in zip(c[:-1].tolist(), c[1:].tolist())])
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("rise", [0.02, 0.1, 0.6])
def test_prefill_rising_scores(rise):
    """Scores that climb along the keys (a ramp on one feature), so a row's running max moves tile after
    tile: a score climbs 2 * rise / 8 a key, 16 * rise a 64-key tile (rise 0.02: 0.46 log2 units; 0.6: 13.8,
    71 over the 330 keys). A step that drops the accumulator's or the sum's rescale, or lets 16-bit p
    overflow, fails against the float64 reference."""
    gen = torch.Generator().manual_seed(4)
    lq, lk, hq, hkv, d = 70, 330, 4, 2, 64
    k_cache, v_cache, table = make_paged([lk], 64, hkv, d, torch.float16, gen)
    q = randn((lq, hq, d), gen, torch.float16)
    q[..., 0] = 2.0
    # key position t's feature 0 set to rise * t: a score climbs by 2 * rise * scale a key
    k_cache[..., 0] = 0.0
    t = torch.arange(lk, device=DEV)
    k_cache[table[0, t // 64].long(), t % 64, :, 0] = (rise * t).to(torch.float16)[:, None]
    cq, ck = cu([lq]), cu([lk])
    scale = d ** -0.5
    out = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, lq, lk, softmax_scale=scale, causal=True,
                                 block_table=table)
    ref = ref_attention(q, gather(k_cache, table[0], lk), gather(v_cache, table[0], lk), True, scale)
    assert rel_err(out, ref) < TOL[torch.float16]


@pytest.mark.parametrize("block_size,d,dtype,q_lens,k_lens", [
    (16, 64, torch.float16, [5, 1, 40, 33], [21, 1, 95, 33]),
    (48, 128, torch.bfloat16, [5, 1, 40, 33], [21, 1, 95, 33]),
    (256, 64, torch.float16, [5, 1, 40, 33], [21, 1, 95, 33]),
    # several query tiles and unmasked key tiles before the diagonal
    (32, 64, torch.float16, [150, 7], [150, 200])])
def test_prefill_paged_prefix(block_size, d, dtype, q_lens, k_lens):
    """Paged K/V with Lk >= Lq (prefix-cache hit / later prefill chunk), causal, GQA."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv = 4, 2
    k_cache, v_cache, table = make_paged(k_lens, block_size, hkv, d, dtype, gen)
    q = randn((sum(q_lens), hq, d), gen, dtype)
    cq, ck = cu(q_lens), cu(k_lens)
    scale = 0.11
    out = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(q_lens), max(k_lens),
                                 softmax_scale=scale, causal=True, block_table=table)
    refs = []
    for i, (lq, lk) in enumerate(zip(q_lens, k_lens)):
        a = cq[i].item()
        refs.append(ref_attention(q[a:a + lq], gather(k_cache, table[i], lk), gather(v_cache, table[i], lk),
                                  True, scale))
    assert rel_err(out, torch.cat(refs)) < TOL[dtype]


def test_prefill_bad_inputs():
    q = torch.randn(8, 3, 64, device=DEV, dtype=torch.float16)
    k = torch.randn(8, 2, 64, device=DEV, dtype=torch.float16)
    c = cu([8])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        flash_attn_varlen_func(q, k, k, c, c, 8, 8)
    q = torch.randn(8, 4, 64, device=DEV, dtype=torch.float16)
    with pytest.raises(TypeError, match="dtype"):
        flash_attn_varlen_func(q, k.bfloat16(), k.bfloat16(), c, c, 8, 8)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        flash_attn_varlen_func(q, k, k, c.long(), c, 8, 8)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attn_varlen_func(q[..., :48], k[..., :48], k[..., :48], c, c, 8, 8)
    with pytest.raises(ValueError, match="cu_seqlens_k shape"):
        flash_attn_varlen_func(q, k, k, c, cu([4, 4]), 8, 8)
    cache = torch.zeros(2, 32, 2, 64, device=DEV, dtype=torch.float16)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_varlen_func(q, cache, cache.clone(), c, c, 8, 8,
                               block_table=torch.zeros(2, 1, dtype=torch.int32, device=DEV))


# ---------------------------------------------------------------- prefill over a query-tile table
# Entries past num_tiles hold these: a program that read one would index far out of bounds.
GARBAGE_SEQ, GARBAGE_BLOCK = 1 << 28, -7


def tile_table(q_lens, k_lens, block_m, cap):
    """(tile_seq, tile_block, num_tiles): views of ONE int32 buffer [1 + 2 * cap] laid out as
    [num_tiles | tile_seq (cap) | tile_block (cap)], built by build_query_tiles; garbage past
    the real tiles."""
    seq, blk = build_query_tiles(np.array(q_lens), block_m, np.array(k_lens))
    n = len(seq)
    if n > cap:
        raise ValueError(f"{n} tiles > cap {cap}")
    buf = torch.empty(1 + 2 * cap, dtype=torch.int32)
    buf[0] = n
    buf[1:1 + cap] = GARBAGE_SEQ
    buf[1 + cap:] = GARBAGE_BLOCK
    buf[1:1 + n] = torch.from_numpy(seq)
    buf[1 + cap:1 + cap + n] = torch.from_numpy(blk)
    buf = buf.to(DEV)
    return buf[1:1 + cap], buf[1 + cap:], buf[:1]


def paged_ref(q, k_cache, v_cache, table, q_lens, k_lens, scale):
    cq = [0] + np.cumsum(q_lens).tolist()
    return torch.cat([ref_attention(q[cq[i]:cq[i] + lq], gather(k_cache, table[i], lk),
                                    gather(v_cache, table[i], lk), True, scale)
                      for i, (lq, lk) in enumerate(zip(q_lens, k_lens))])


# Decode-like rows (q_len 1, cached context), a chunk longer than BLOCK_M (64) after a cached
# prefix, a fresh prompt, and an empty padding sequence.
MIXED_Q = [1, 1, 1, 70, 23, 0]
MIXED_K = [37, 5, 80, 100, 23, 0]


# fp32 runs BLOCK_N = 32 and fp16 BLOCK_N = 64 (_config): block 16 and 48 take the per-key
# gather, 64 the one-block-id-per-key-tile path.
@pytest.mark.parametrize("block_size,dtype", [(16, torch.float32), (64, torch.float32), (48, torch.float16),
                                              (64, torch.float16)])
def test_prefill_tiles_mixed_batch(block_size, dtype):
    gen = torch.Generator().manual_seed(9)
    hq, hkv, d = 4, 2, 32
    k_cache, v_cache, table = make_paged(MIXED_K, block_size, hkv, d, dtype, gen)
    q = randn((sum(MIXED_Q), hq, d), gen, dtype)
    cq, ck = cu(MIXED_Q), cu(MIXED_K)
    block_m = query_tile_rows(d, dtype)
    tile_seq, tile_block, num_tiles = tile_table(MIXED_Q, MIXED_K, block_m, cap=12)
    assert num_tiles.item() == 6  # 3 decode rows + 2 + 1 tiles; the empty sequence has none
    poisoned = torch.full_like(q, float("nan"))  # rows no program writes keep their NaN
    out = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(MIXED_Q), max(MIXED_K), softmax_scale=0.15,
                                 causal=True, block_table=table,
                                 tile_seq=tile_seq, tile_block=tile_block, num_tiles=num_tiles, out=poisoned.clone())
    ref = paged_ref(q, k_cache, v_cache, table, MIXED_Q, MIXED_K, 0.15)
    assert rel_err(out, ref) < TOL[dtype]  # every row written (no NaN left) and right
    # No real tiles: every program returns before storing anything.
    num_tiles.zero_()
    out = flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(MIXED_Q), max(MIXED_K), causal=True,
                                 block_table=table, tile_seq=tile_seq, tile_block=tile_block, num_tiles=num_tiles,
                                 out=poisoned.clone())
    assert torch.isnan(out).all()


@pytest.mark.parametrize("paged", [True, False])
def test_prefill_tiles_match_grid_mode(paged):
    """The same tiles computed either way: bit-identical outputs."""
    gen = torch.Generator().manual_seed(10)
    hq, hkv, d, dtype = 4, 2, 32, torch.float16
    q_lens, k_lens = ([1, 70, 9, 1], [30, 90, 9, 64]) if paged else ([1, 70, 9], [1, 70, 9])
    q = randn((sum(q_lens), hq, d), gen, dtype)
    cq, ck = cu(q_lens), cu(k_lens)
    if paged:
        k, v, table = make_paged(k_lens, 32, hkv, d, dtype, gen)
    else:
        k, v, table = randn((sum(k_lens), hkv, d), gen, dtype), randn((sum(k_lens), hkv, d), gen, dtype), None
    tiles = dict(zip(("tile_seq", "tile_block", "num_tiles"),
                     tile_table(q_lens, k_lens, query_tile_rows(d, dtype), cap=8)))
    args = (q, k, v, cq, ck, max(q_lens), max(k_lens))
    grid_out = flash_attn_varlen_func(*args, causal=True, block_table=table)
    tile_out = flash_attn_varlen_func(*args, causal=True, block_table=table, **tiles)
    assert torch.equal(tile_out, grid_out)


def out_view(rows, hq, d, dtype):
    """(buf, out): out [rows, hq, d] is rows [1, 1 + rows) x columns [8, 8 + hq * d) of a larger
    NaN-filled buffer (row stride hq * d + 8, not hq * d); buf is that whole buffer."""
    buf = torch.full((rows + 3, hq * d + 8), float("nan"), dtype=dtype, device=DEV)
    return buf, buf[1:1 + rows, 8:].view(rows, hq, d)


def outside(buf, rows):
    """The elements of buf (from out_view) that out does not cover."""
    mask = torch.ones(buf.shape, dtype=torch.bool, device=buf.device)
    mask[1:1 + rows, 8:] = False
    return buf[mask]


def tile_rows(tile_seq, tile_block, n, q_lens, block_m):
    """Bool [sum(q_lens)]: the query rows that table entries 0 .. n-1 compute."""
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    covered = torch.zeros(int(starts[-1]), dtype=torch.bool)
    for s, b in zip(tile_seq[:n].tolist(), tile_block[:n].tolist()):
        lo = b * block_m
        covered[starts[s] + lo:starts[s] + min(q_lens[s], lo + block_m)] = True
    return covered


# CPU_SM_COUNT 2 x TILE_PROGRAMS_PER_SM 4 = 8 programs over all heads: P = 2 at 4 heads, 1 at 8,
# so the 6 tiles of the mixed batch take 3 and 6 loop trips per program.
@pytest.mark.parametrize("hq,hkv,block_size,dtype", [(4, 2, 64, torch.float16), (8, 2, 16, torch.float32)])
def test_prefill_tiles_persistent_loop_into_out_view(hq, hkv, block_size, dtype):
    """Fewer programs per head than tiles (each loops over every P-th entry), writing into `out`,
    a strided view of a larger poisoned buffer: every row a tile covers is right, every other
    element (bucket padding rows, entries past num_tiles, the rest of the buffer) keeps its NaN."""
    gen = torch.Generator().manual_seed(14)
    d, cap, pad = 32, 40, 5
    k_cache, v_cache, table = make_paged(MIXED_K, block_size, hkv, d, dtype, gen)
    real = sum(MIXED_Q)
    q = randn((real + pad, hq, d), gen, dtype)  # rows past cu_seqlens_q[-1]: bucket padding
    cq, ck = cu(MIXED_Q), cu(MIXED_K)
    block_m = query_tile_rows(d, dtype)
    tile_seq, tile_block, num_tiles = tile_table(MIXED_Q, MIXED_K, block_m, cap)
    n = num_tiles.item()
    programs = tile_programs(hq, cap, q.device)
    assert programs == 8 // hq and programs < n < cap
    ref = paged_ref(q, k_cache, v_cache, table, MIXED_Q, MIXED_K, 0.15)

    def attend(out, tiled=True):
        tiles = dict(tile_seq=tile_seq, tile_block=tile_block, num_tiles=num_tiles) if tiled else {}
        return flash_attn_varlen_func(q, k_cache, v_cache, cq, ck, max(MIXED_Q), max(MIXED_K), softmax_scale=0.15,
                                      causal=True, block_table=table, out=out, **tiles)

    buf, out = out_view(real + pad, hq, d, dtype)
    assert out.stride(0) != hq * d
    assert attend(out) is out
    assert rel_err(out[:real], ref) < TOL[dtype]
    assert torch.isnan(out[real:]).all() and torch.isnan(outside(buf, real + pad)).all()
    # Grid mode into a view too: the same tiles, bit-identical.
    grid_buf, grid_out = out_view(real + pad, hq, d, dtype)
    assert attend(grid_out, tiled=False) is grid_out
    assert torch.equal(grid_out[:real], out[:real])
    assert torch.isnan(grid_out[real:]).all() and torch.isnan(outside(grid_buf, real + pad)).all()
    # Only the first 3 entries (still > P): the loop stops at num_tiles, the rest stay poisoned.
    num_tiles.fill_(3)
    buf.fill_(float("nan"))
    attend(out)
    covered = tile_rows(tile_seq.cpu(), tile_block.cpu(), 3, MIXED_Q, block_m)
    assert 0 < covered.sum() < real
    assert rel_err(out[:real][covered.to(DEV)], ref[covered]) < TOL[dtype]
    assert torch.isnan(out[:real][~covered.to(DEV)]).all() and torch.isnan(out[real:]).all()
    assert torch.isnan(outside(buf, real + pad)).all()


@pytest.mark.parametrize("v_layout", ["fused_qkv", "padded_heads", "contiguous"])
def test_prefill_packed_qkv_views_and_kv_strides(v_layout):
    """q and k views of a fused [N, (Hq + 2 Hkv) * D] projection (strided rows); v its third
    slice (the engine's layout, k's strides) or a tensor with other row (and head) strides."""
    gen = torch.Generator().manual_seed(11)
    lens, hq, hkv, d, dtype = [9, 40], 4, 2, 32, torch.float16
    n = sum(lens)
    qkv = randn((n, (hq + 2 * hkv) * d), gen, dtype)
    q, k, v = (t.reshape(n, h, d) for t, h in zip(qkv.split([hq * d, hkv * d, hkv * d], -1), (hq, hkv, hkv)))
    if v_layout == "padded_heads":
        v = randn((n, hkv, 2 * d), gen, dtype)[..., :d]  # strides (2 Hkv D, 2 D, 1)
    elif v_layout == "contiguous":
        v = randn((n, hkv, d), gen, dtype)
    assert not q.is_contiguous() and not k.is_contiguous()
    assert (k.stride() == v.stride()) == (v_layout == "fused_qkv")
    c = cu(lens)
    out = flash_attn_varlen_func(q, k, v, c, c, max(lens), max(lens), causal=True)
    ref = torch.cat([ref_attention(q[a:b], k[a:b], v[a:b], True, d ** -0.5)
                     for a, b in zip(c[:-1].tolist(), c[1:].tolist())])
    assert rel_err(out, ref) < TOL[dtype]


def test_prefill_packed_kv_needs_contiguous_last_dim():
    k = torch.zeros(8, 2, 64, device=DEV, dtype=torch.float16)
    q = torch.zeros(8, 4, 64, device=DEV, dtype=torch.float16)
    v = torch.zeros(8, 2, 128, device=DEV, dtype=torch.float16)[..., ::2]
    with pytest.raises(ValueError, match="v must have a contiguous last dim"):
        flash_attn_varlen_func(q, k, v, cu([8]), cu([8]), 8, 8)


def test_prefill_tiles_bad_inputs():
    q = torch.zeros(8, 4, 64, device=DEV, dtype=torch.float16)
    k = torch.zeros(8, 2, 64, device=DEV, dtype=torch.float16)
    c = cu([8])
    seq = torch.zeros(4, dtype=torch.int32, device=DEV)
    n = torch.ones(1, dtype=torch.int32, device=DEV)

    def call(tile_seq=seq, tile_block=seq, num_tiles=n):
        flash_attn_varlen_func(q, k, k, c, c, 8, 8, tile_seq=tile_seq, tile_block=tile_block, num_tiles=num_tiles)

    with pytest.raises(ValueError, match="together"):
        flash_attn_varlen_func(q, k, k, c, c, 8, 8, tile_seq=seq, tile_block=seq)
    with pytest.raises(TypeError, match="tile_seq"):
        call(tile_seq=seq.long())
    with pytest.raises(TypeError, match="tile_block"):
        call(tile_block=seq.float())
    with pytest.raises(TypeError, match="num_tiles"):
        call(num_tiles=n.long())
    with pytest.raises(ValueError, match="tile_seq must be 1-D"):
        call(tile_seq=seq.view(2, 2))
    with pytest.raises(ValueError, match="tile_block length 3"):
        call(tile_block=seq[:3])
    with pytest.raises(ValueError, match="num_tiles shape"):
        call(num_tiles=seq[:2])
    with pytest.raises(ValueError, match="tile_block must have a contiguous"):
        call(tile_block=torch.zeros(8, dtype=torch.int32, device=DEV)[::2])
    with pytest.raises(ValueError, match="tile_seq is on meta"):
        call(tile_seq=torch.zeros(4, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="tile_seq length"):
        big = torch.zeros(1 << 16, dtype=torch.int32, device=DEV)
        call(tile_seq=big, tile_block=big)


# The long-context tile (128 query rows) over a small mixed batch: decode-like rows, a chunk of three
# long tiles after a cached prefix (its last tile partial), a fresh prompt shorter than one tile.
LONG_Q = [1, 300, 90, 1]
LONG_K = [45, 420, 90, 260]


@pytest.mark.parametrize("block_size,dtype", [(64, torch.float16), (48, torch.bfloat16)])
def test_prefill_long_tiles(block_size, dtype):
    """long_tiles=True: a table of query_tile_rows(..., long=True) rows a tile covers every row, right
    against float64; grid mode on the long tile computes the same tiles, bit for bit."""
    gen = torch.Generator().manual_seed(16)
    hq, hkv, d = 2, 1, LONG_HEAD_DIM
    rows = query_tile_rows(d, dtype, long=True)
    assert rows == LONG_TILE.block_m == 2 * query_tile_rows(d, dtype)
    k_cache, v_cache, table = make_paged(LONG_K, block_size, hkv, d, dtype, gen)
    q = randn((sum(LONG_Q), hq, d), gen, dtype)
    args = (q, k_cache, v_cache, cu(LONG_Q), cu(LONG_K), max(LONG_Q), max(LONG_K))
    tile_seq, tile_block, num_tiles = tile_table(LONG_Q, LONG_K, rows, cap=10)
    assert num_tiles.item() == 6  # 2 decode rows + 3 + 1 tiles
    out = flash_attn_varlen_func(*args, softmax_scale=0.15, causal=True, block_table=table, tile_seq=tile_seq,
                                 tile_block=tile_block, num_tiles=num_tiles, out=torch.full_like(q, float("nan")),
                                 long_tiles=True)
    assert rel_err(out, paged_ref(q, k_cache, v_cache, table, LONG_Q, LONG_K, 0.15)) < TOL[dtype]
    grid = flash_attn_varlen_func(*args, softmax_scale=0.15, causal=True, block_table=table, long_tiles=True)
    assert torch.equal(grid, out)


def test_long_tiles_only_where_measured():
    """The long tile at a 16-bit LONG_HEAD_DIM only: fp32 and head_dim 256 keep their one smaller tile,
    other head sizes the 64-row one."""
    for d, dtype in ((64, torch.float32), (128, torch.float32), (256, torch.float16), (256, torch.bfloat16),
                     (64, torch.float16), (64, torch.bfloat16), (32, torch.bfloat16)):
        assert prefill_tile(d, dtype, long=True) == prefill_tile(d, dtype)
        assert query_tile_rows(d, dtype, long=True) == query_tile_rows(d, dtype)
    for dtype in (torch.float16, torch.bfloat16):
        assert prefill_tile(LONG_HEAD_DIM, dtype, long=True) == LONG_TILE != prefill_tile(LONG_HEAD_DIM, dtype)


def test_prefill_long_tiles_bad_inputs():
    q = torch.zeros(8, 4, 64, device=DEV, dtype=torch.bfloat16)
    c = cu([8])
    with pytest.raises(TypeError, match="long_tiles must be a bool, got 1"):
        flash_attn_varlen_func(q, q[:, :2], q[:, :2], c, c, 8, 8, long_tiles=1)
    cache = torch.zeros(2, 16, 2, 64, device=DEV, dtype=torch.float8_e4m3fn)
    scale = torch.ones(1, device=DEV)
    with pytest.raises(ValueError, match="long_tiles=True over FP8 caches"):
        flash_attn_varlen_func(q, cache, cache.clone(), c, c, 8, 8, block_table=torch.zeros(1, 1, dtype=torch.int32,
                               device=DEV), k_scale=scale, v_scale=scale.clone(), long_tiles=True)


def test_prefill_out_bad_inputs():
    q = torch.zeros(8, 4, 64, device=DEV, dtype=torch.float16)
    k = torch.zeros(8, 2, 64, device=DEV, dtype=torch.float16)
    c = cu([8])

    def call(out):
        flash_attn_varlen_func(q, k, k, c, c, 8, 8, out=out)

    with pytest.raises(TypeError, match="out must be a tensor"):
        call([[0.0]])
    with pytest.raises(ValueError, match=r"out shape \(7, 4, 64\)"):
        call(torch.zeros(7, 4, 64, device=DEV, dtype=torch.float16))
    with pytest.raises(TypeError, match="out dtype torch.float32"):
        call(torch.zeros(8, 4, 64, device=DEV, dtype=torch.float32))
    with pytest.raises(ValueError, match="out is on meta"):
        call(torch.zeros(8, 4, 64, device="meta", dtype=torch.float16))
    with pytest.raises(ValueError, match="out must have a contiguous last dim"):
        call(torch.zeros(8, 4, 128, device=DEV, dtype=torch.float16)[..., ::2])


def test_build_query_tiles():
    q_lens = np.array([1, 130, 0, 64, 1, 65])
    k_lens = np.array([500, 130, 0, 100, 3, 65])
    seq, blk = build_query_tiles(q_lens, 64, k_lens)
    assert seq.dtype == np.int32 and blk.dtype == np.int32
    # Every (sequence, block) of a non-empty sequence exactly once.
    expect = {(i, b) for i, n in enumerate(q_lens) for b in range(-(-n // 64))}
    assert sorted(zip(seq.tolist(), blk.tolist())) == sorted(expect) and len(seq) == len(expect)
    keys = (k_lens - q_lens)[seq] + np.minimum(q_lens[seq], (blk.astype(np.int64) + 1) * 64)
    assert (np.diff(keys) <= 0).all()  # heaviest first
    assert (seq[0], blk[0]) == (0, 0)  # the decode row with 500 keys beats every prefill tile
    # Without k_lens no prefix is assumed: the last block of the longest prompt leads.
    seq, blk = build_query_tiles([1, 130, 0], 64)
    assert list(zip(seq.tolist(), blk.tolist())) == [(1, 2), (1, 1), (1, 0), (0, 0)]
    seq, blk = build_query_tiles(np.zeros(3, dtype=np.int64), 64)
    assert seq.shape == blk.shape == (0,)
    for bad in (dict(q_lens=[[1]], block_m=64), dict(q_lens=[1.5], block_m=64), dict(q_lens=[-1], block_m=64),
                dict(q_lens=[1], block_m=0), dict(q_lens=[4], block_m=64, k_lens=[3]),
                dict(q_lens=[4], block_m=64, k_lens=[4, 4])):
        with pytest.raises(ValueError):
            build_query_tiles(**bad)


def test_query_tile_rows():
    """query_tile_rows is the kernel's tile height for every config (head_dim, dtype): a table of
    the one entry (sequence 0, block 1) computes exactly query rows [rows, 2 * rows)."""
    gen = torch.Generator().manual_seed(15)

    def one(value):
        return torch.tensor([value], dtype=torch.int32, device=DEV)

    for d, dtype in ((64, torch.float16), (128, torch.bfloat16), (64, torch.float32), (256, torch.float16)):
        rows = query_tile_rows(d, dtype)
        n = 3 * rows
        q, k, v = (randn((n, 1, d), gen, dtype) for _ in range(3))
        out = flash_attn_varlen_func(q, k, v, cu([n]), cu([n]), n, n, causal=True, tile_seq=one(0),
                                     tile_block=one(1), num_tiles=one(1), out=torch.full_like(q, float("nan")))
        written = ~torch.isnan(out).any(dim=2).any(dim=1)
        assert written.nonzero().flatten().tolist() == list(range(rows, 2 * rows)), (d, dtype)
        ref = ref_attention(q, k, v, True, d ** -0.5)
        assert rel_err(out[rows:2 * rows], ref[rows:2 * rows]) < TOL[dtype]
    with pytest.raises(ValueError, match="head_dim"):
        query_tile_rows(48, torch.float16)
    with pytest.raises(TypeError, match="dtype"):
        query_tile_rows(64, torch.int32)


# ---------------------------------------------------------------- decode
@pytest.mark.parametrize("block_size,d,hq,hkv,dtype", [
    (16, 64, 8, 2, torch.float16), (32, 128, 4, 1, torch.bfloat16),
    (256, 64, 2, 2, torch.float16), (16, 64, 4, 2, torch.float32),
    (16, 64, 14, 2, torch.bfloat16),  # Qwen2.5-0.5B's group of 7 (padded to the tile's 16 rows)
    (32, 128, 10, 2, torch.float16)])  # Qwen3-14B's group of 5
def test_decode(block_size, d, hq, hkv, dtype):
    gen = torch.Generator().manual_seed(4)
    lens = [1, 17, 99, 64]
    k_cache, v_cache, table = make_paged(lens, block_size, hkv, d, dtype, gen)
    q = randn((len(lens), 1, hq, d), gen, dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, causal=True)
    assert out.shape == q.shape and out.dtype == dtype
    ref = torch.stack([ref_attention(q[i], gather(k_cache, table[i], n), gather(v_cache, table[i], n),
                                     True, d ** -0.5) for i, n in enumerate(lens)])
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("pack,hq,hkv,d,num_splits", [(2, 14, 2, 64, 1), (2, 8, 4, 128, 3), (4, 16, 4, 64, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_kv_heads_per_program_override(pack, hq, hkv, d, num_splits, dtype):
    """A 16-bit cache read `pack` kv heads a program (the override benchmarks time against the plan's one
    head; the plan packs only an FP8 cache's narrow heads: tests/test_fp8_kv.py), unsplit and split: the
    float64 reference. Values that are not a power of two dividing Hkv are refused."""
    gen = torch.Generator().manual_seed(pack + hq + d)
    lens = [1, 40, 99]
    k_cache, v_cache, table = make_paged(lens, 16, hkv, d, dtype, gen)
    q = randn((len(lens), 1, hq, d), gen, dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, num_splits=num_splits,
                                  kv_heads_per_program=pack)
    ref = torch.stack([ref_attention(q[i], gather(k_cache, table[i], n), gather(v_cache, table[i], n),
                                     True, d ** -0.5) for i, n in enumerate(lens)])
    assert rel_err(out, ref) < TOL[dtype]
    for bad, err in ((3, "power of two"), (2 * hkv, "must divide"), (True, "kv_heads_per_program")):
        with pytest.raises((ValueError, TypeError), match=err):
            flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, kv_heads_per_program=bad)


@pytest.mark.parametrize("block_size,dtype", [(16, torch.float16), (48, torch.bfloat16)])
@pytest.mark.parametrize("fold", [True, False])
def test_decode_split_k(block_size, dtype, fold):
    """Eight splits (some empty for short rows), merged in the last split's program (fold, arrival
    counters: fold=True refuses to run otherwise) or by the merge kernel (fold=False). A second
    call into a poisoned output repeats the first: the counters were left at zero."""
    gen = torch.Generator().manual_seed(6)
    lens = [1, 150, 70]
    k_cache, v_cache, table = make_paged(lens, block_size, 2, 64, dtype, gen)
    q = randn((3, 1, 8, 64), gen, dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)

    def attend():
        return flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, softmax_scale=0.2, num_splits=8,
                                       out=torch.full_like(q, float("nan")), fold=fold)

    out = attend()
    ref = torch.stack([ref_attention(q[i], gather(k_cache, table[i], n), gather(v_cache, table[i], n),
                                     True, 0.2) for i, n in enumerate(lens)])
    assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(attend(), out)


def test_decode_fold_needs_a_small_tile_and_enough_counters():
    """can_fold_merge: several splits, a [group, splits, head_dim] tile within FOLD_MAX_ELEMS and an
    arrival counter per (sequence, kv head); where it says no, fold=None takes the merge kernel
    (the same result as fold=False) and fold=True is refused."""
    assert can_fold_merge(3, 2, 64, NUM_COUNTERS)
    assert not can_fold_merge(1, 2, 64, 4)  # one split: nothing to merge
    assert not can_fold_merge(3, 2, 64, NUM_COUNTERS + 1)
    fit = FOLD_MAX_ELEMS // (8 * 64)  # splits whose [8, splits, 64] tile just fits (a power of two)
    assert can_fold_merge(fit, 8, 64, 4) and not can_fold_merge(fit + 1, 8, 64, 4)
    gen = torch.Generator().manual_seed(8)
    lens = [40, 90]
    k_cache, v_cache, table = make_paged(lens, 16, 2, 64, torch.float32, gen)
    q = randn((2, 1, 16, 64), gen, torch.float32)  # group 8
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    splits = fit + 1  # too large a tile to fold
    auto = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, num_splits=splits)
    unfolded = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, num_splits=splits, fold=False)
    assert torch.equal(auto, unfolded)
    with pytest.raises(ValueError, match="fold=True"):
        flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, num_splits=splits, fold=True)
    with pytest.raises(ValueError, match="fold=True"):
        flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, num_splits=1, fold=True)
    with pytest.raises(TypeError, match="fold"):
        flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, fold=1)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_explicit_num_splits(num_splits):
    """flash-attn's num_splits: 1 writes the output directly (no merge pass), 3 merges three."""
    gen = torch.Generator().manual_seed(7)
    lens = [5, 130, 64, 0]
    k_cache, v_cache, table = make_paged([5, 130, 64, 1], 16, 2, 64, torch.float16, gen)
    q = randn((4, 1, 4, 64), gen, torch.float16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, num_splits=num_splits)
    ref = torch.stack([ref_attention(q[i], gather(k_cache, table[i], n), gather(v_cache, table[i], n),
                                     True, 64 ** -0.5) for i, n in enumerate(lens[:3])])
    assert rel_err(out[:3], ref) < TOL[torch.float16]
    assert (out[3] == 0).all()


def test_decode_zero_length_row():
    gen = torch.Generator().manual_seed(5)
    lens = [0, 40]
    k_cache, v_cache, table = make_paged([1, 40], 16, 2, 64, torch.float16, gen)
    q = randn((2, 1, 4, 64), gen, torch.float16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()
    ref = ref_attention(q[1], gather(k_cache, table[1], 40), gather(v_cache, table[1], 40), False, 64 ** -0.5)
    assert rel_err(out[1], ref) < TOL[torch.float16]


def test_decode_bad_inputs():
    q = torch.randn(2, 1, 4, 64, device=DEV, dtype=torch.float16)
    cache = torch.zeros(3, 16, 2, 64, device=DEV, dtype=torch.float16)
    lens = torch.tensor([3, 5], dtype=torch.int32, device=DEV)
    table = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="batch, 1"):
        flash_attn_with_kvcache(q.expand(2, 2, 4, 64), cache, cache.clone(), lens, table)
    with pytest.raises(TypeError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, cache, cache.clone(), lens.long(), table)
    with pytest.raises(TypeError, match="k_cache dtype"):
        flash_attn_with_kvcache(q, cache.float(), cache.float(), lens, table)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        flash_attn_with_kvcache(q[:, :, :3], cache, cache.clone(), lens, table)
    with pytest.raises(ValueError, match="block_table has"):
        flash_attn_with_kvcache(q, cache, cache.clone(), lens, table[:1])
    with pytest.raises(ValueError, match="v_cache"):
        flash_attn_with_kvcache(q, cache, cache[:2].clone(), lens, table)
    with pytest.raises(ValueError, match="num_splits"):
        flash_attn_with_kvcache(q, cache, cache.clone(), lens, table, num_splits=-1)


@pytest.mark.parametrize("bad", [0.0, -0.125, float("nan"), float("inf")])
def test_softmax_scale_must_be_positive_and_finite(bad):
    """The kernels take each row's max before scaling it (kernels/online_softmax.py): a softmax_scale that is not
    a positive finite number is refused by every attention entry point, Triton's and the plain-PyTorch path's."""
    from nanovllm.kernels import torch_attention

    q = torch.randn(2, 1, 4, 64, device=DEV, dtype=torch.float16)
    cache = torch.zeros(3, 16, 2, 64, device=DEV, dtype=torch.float16)
    lens = torch.tensor([3, 5], dtype=torch.int32, device=DEV)
    table = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    c = cu([2])
    for decode in (flash_attn_with_kvcache, torch_attention.flash_attn_with_kvcache):
        with pytest.raises(ValueError, match="softmax_scale must be a positive finite number"):
            decode(q, cache, cache.clone(), lens, table, softmax_scale=bad)
    for prefill in (flash_attn_varlen_func, torch_attention.flash_attn_varlen_func):
        with pytest.raises(ValueError, match="softmax_scale must be a positive finite number"):
            prefill(q[:, 0], q[:, 0, :2], q[:, 0, :2], c, c, 2, 2, softmax_scale=bad, causal=True)
    with pytest.raises(TypeError, match="softmax_scale must be a number, got '0.1'"):
        flash_attn_with_kvcache(q, cache, cache.clone(), lens, table, softmax_scale="0.1")
    with pytest.raises(TypeError, match="softmax_scale must be a number, got True"):
        flash_attn_with_kvcache(q, cache, cache.clone(), lens, table, softmax_scale=True)
    out = flash_attn_with_kvcache(q, cache, cache.clone(), lens, table, softmax_scale=np.float32(0.125))
    assert torch.equal(out, flash_attn_with_kvcache(q, cache, cache.clone(), lens, table, softmax_scale=0.125))


# ---------------------------------------------------------------- decode: rows in use (num_seqs), caller's out
# Capacity 6: a grid of 6 rows x 2 kv heads, the programs of rows past num_seqs[0] idle.
ROWS_LENS = [1, 70, 33, 130, 17, 64]


def decode_rows_ref(q, k_cache, v_cache, table, lens, scale):
    return torch.stack([ref_attention(q[i], gather(k_cache, table[i], n), gather(v_cache, table[i], n), True, scale)
                        for i, n in enumerate(lens)])


@pytest.mark.parametrize("block_size,hq,dtype", [(16, 4, torch.float16), (64, 8, torch.bfloat16),
                                                 (128, 4, torch.float32)])
def test_decode_num_seqs(block_size, hq, dtype):
    """Only rows < num_seqs[0] are computed; the rest of `out` keeps its NaN poison. A count
    past the capacity computes every row."""
    hkv, d, batch = 2, 32, len(ROWS_LENS)
    gen = torch.Generator().manual_seed(20)
    k_cache, v_cache, table = make_paged(ROWS_LENS, block_size, hkv, d, dtype, gen)
    q = randn((batch, 1, hq, d), gen, dtype)
    seqlens = torch.tensor(ROWS_LENS, dtype=torch.int32, device=DEV)
    ref = decode_rows_ref(q, k_cache, v_cache, table, ROWS_LENS, d ** -0.5)
    for n, num_splits in ((0, 0), (4, 0), (batch, 1), (batch + 3, 0)):
        out = torch.full_like(q, float("nan"))
        num_seqs = torch.tensor([n], dtype=torch.int32, device=DEV)
        res = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, num_splits=num_splits,
                                      num_seqs=num_seqs, out=out)
        assert res is out
        m = min(n, batch)
        if m:
            assert rel_err(out[:m], ref[:m]) < TOL[dtype]
        assert torch.isnan(out[m:]).all(), f"num_seqs={n}: a row past it was written"


@pytest.mark.parametrize("launch", ["fold", "merge", "unsplit", "num_seqs"])
def test_decode_out_strided_view(launch):
    """out as rows of a larger NaN-poisoned [N, Hq, D] buffer, its row stride unlike q's (q is a
    view of a fused projection): every launch variant writes its rows there and nothing else."""
    hq, hkv, d, dtype = 4, 2, 32, torch.float16
    lens = [5, 130, 64, 40]
    batch = len(lens)
    gen = torch.Generator().manual_seed(21)
    k_cache, v_cache, table = make_paged(lens, 16, hkv, d, dtype, gen)
    qkv = randn((batch, (hq + 2 * hkv) * d), gen, dtype)
    q = qkv[:, :hq * d].view(batch, 1, hq, d)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    buf = torch.full((batch + 3, hq, d), float("nan"), dtype=dtype, device=DEV)
    out = buf[1:1 + batch].unsqueeze(1)
    assert out.stride(0) != q.stride(0)
    kwargs = {"fold": dict(num_splits=3, fold=True), "merge": dict(num_splits=3, fold=False),
              "unsplit": dict(num_splits=1),
              "num_seqs": dict(num_seqs=torch.tensor([3], dtype=torch.int32, device=DEV))}[launch]
    assert flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, out=out, **kwargs) is out
    m = 3 if launch == "num_seqs" else batch
    assert rel_err(out[:m], decode_rows_ref(q, k_cache, v_cache, table, lens[:m], d ** -0.5)) < TOL[dtype]
    assert torch.isnan(buf[0]).all() and torch.isnan(buf[1 + m:]).all()


def test_decode_num_seqs_out_bad_inputs():
    q = torch.randn(2, 1, 4, 64, device=DEV, dtype=torch.float16)
    cache = torch.zeros(3, 16, 2, 64, device=DEV, dtype=torch.float16)
    lens = torch.tensor([3, 5], dtype=torch.int32, device=DEV)
    table = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    n = torch.ones(1, dtype=torch.int32, device=DEV)

    def call(**kwargs):
        flash_attn_with_kvcache(q, cache, cache.clone(), lens, table, **kwargs)

    with pytest.raises(ValueError, match="num_splits must be 0 or 1 with num_seqs"):
        call(num_seqs=n, num_splits=3)
    with pytest.raises(TypeError, match="num_seqs"):
        call(num_seqs=n.long())
    with pytest.raises(TypeError, match="num_seqs"):
        call(num_seqs=1)
    with pytest.raises(ValueError, match="num_seqs shape"):
        call(num_seqs=torch.ones(2, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="num_seqs is on meta"):
        call(num_seqs=torch.ones(1, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="out shape"):
        call(out=torch.empty(2, 1, 4, 32, device=DEV, dtype=torch.float16))
    with pytest.raises(ValueError, match="out shape"):
        call(out=torch.empty(2, 4, 64, device=DEV, dtype=torch.float16))
    with pytest.raises(TypeError, match="out dtype"):
        call(out=torch.empty(2, 1, 4, 64, device=DEV, dtype=torch.float32))
    with pytest.raises(TypeError, match="out must be a tensor"):
        call(out=[0.0])
    with pytest.raises(ValueError, match="out is on meta"):
        call(out=torch.empty(2, 1, 4, 64, device="meta", dtype=torch.float16))
    with pytest.raises(ValueError, match="out must have a contiguous last dim"):
        call(out=torch.empty(2, 1, 4, 128, device=DEV, dtype=torch.float16)[..., ::2])
    with pytest.raises(ValueError, match="out strides .* overlap"):
        call(out=torch.empty(1, 1, 4, 64, device=DEV, dtype=torch.float16).expand(2, 1, 4, 64))
