"""GPU tests of the Triton attention kernels at Qwen3 shapes (run with `pytest -m gpu`).

float64 PyTorch references on the GPU, computed per sequence (and per head chunk for
long contexts), independent of the kernels.
"""

import numpy as np
import pytest
import torch

from nanovllm.kernels.checks import cuda_sm_count
from nanovllm.kernels.decode_attention import flash_attn_with_kvcache
from nanovllm.kernels.decode_plan import can_fold_merge, choose_num_splits
from nanovllm.kernels.prefill_attention import flash_attn_varlen_func
from nanovllm.kernels.prefill_plan import build_query_tiles, query_tile_rows, takes_long_tiles, tile_programs

pytestmark = pytest.mark.gpu
DEV = "cuda"
TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3}  # bf16 output rounding alone is ~2-3e-3
HEADS = [(16, 8), (32, 8)]
D = 128


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out.double() - ref).norm() / ref.norm()).item()


def randn(shape, gen, dtype):
    return torch.randn(shape, generator=gen, device=DEV, dtype=torch.float32).to(dtype)


def ref_attention(q, k, v, causal, scale, head_chunk=4):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> float64 [Lq, Hq, D], bottom-right causal."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    rep = hq // hkv
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for h0 in range(0, hq, head_chunk):
        hs = slice(h0, min(hq, h0 + head_chunk))
        kh = torch.arange(hs.start, hs.stop, device=q.device) // rep
        qq = q[:, hs].double()
        kk, vv = k[:, kh].double(), v[:, kh].double()
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        if causal:
            j = torch.arange(lq, device=q.device)[:, None]
            t = torch.arange(lk, device=q.device)[None, :]
            s.masked_fill_(t > j + (lk - lq), float("-inf"))
        out[:, hs] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
    return out


def make_paged(lens, block_size, hkv, dtype, gen, width_extra=2):
    nblk = [-(-n // block_size) for n in lens]
    num_blocks = sum(nblk) + 4
    perm = torch.randperm(num_blocks, device=DEV, generator=gen).int()
    table = torch.zeros((len(lens), max(nblk) + width_extra), dtype=torch.int32, device=DEV)
    pos = 0
    for i, nb in enumerate(nblk):
        table[i, :nb] = perm[pos:pos + nb]
        pos += nb
    kc = randn((num_blocks, block_size, hkv, D), gen, dtype)
    vc = randn((num_blocks, block_size, hkv, D), gen, dtype)
    return kc, vc, table


def gather(cache, row, n):
    t = torch.arange(n, device=DEV)
    bs = cache.shape[1]
    return cache[row.long()[t // bs], t % bs]


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_packed(hq, hkv, dtype):
    gen = torch.Generator(DEV).manual_seed(1)
    lens = [1, 300, 1024, 77, 2048, 129]
    total = sum(lens)
    q, k, v = randn((total, hq, D), gen, dtype), randn((total, hkv, D), gen, dtype), randn((total, hkv, D), gen, dtype)
    c = cu(lens)
    out = flash_attn_varlen_func(q, k, v, c, c, max(lens), max(lens), causal=True)
    ref = torch.cat([ref_attention(q[a:b], k[a:b], v[a:b], True, D ** -0.5)
                     for a, b in zip(c[:-1].tolist(), c[1:].tolist())])
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_paged(hq, hkv, block_size, dtype):
    gen = torch.Generator(DEV).manual_seed(2)
    q_lens, k_lens = [1, 200, 513, 300, 17], [1000, 200, 8192, 300, 4000]
    kc, vc, table = make_paged(k_lens, block_size, hkv, dtype, gen)
    q = randn((sum(q_lens), hq, D), gen, dtype)
    cq, ck = cu(q_lens), cu(k_lens)
    out = flash_attn_varlen_func(q, kc, vc, cq, ck, max(q_lens), max(k_lens), causal=True, block_table=table)
    refs = [ref_attention(q[cq[i]:cq[i + 1]], gather(kc, table[i], lk), gather(vc, table[i], lk), True, D ** -0.5)
            for i, lk in enumerate(k_lens)]
    assert rel_err(out, torch.cat(refs)) < TOL[dtype]


# ---------------------------------------------------------------- prefill over a query-tile table
# The brief's bound for bf16 mixed batches (bf16 output rounding alone is ~2-3e-3).
TILE_TOL = 1e-2
# Entries past num_tiles hold these: a program that read one would fault.
GARBAGE_SEQ, GARBAGE_BLOCK = 1 << 28, -7


class TileBatch:
    """Static tensors of one captured mixed step (the model runner's view): q [rows, Hq, D],
    cu_seqlens [num_seqs + 1], block table, and one int32 buffer [num_tiles | tile_seq | tile_block]
    of fixed cap, whose views are the kernel's tile arguments."""

    def __init__(self, rows, num_seqs, width, cap, hq):
        self.q = torch.zeros((rows, hq, D), dtype=torch.bfloat16, device=DEV)
        self.cq = torch.zeros(num_seqs + 1, dtype=torch.int32, device=DEV)
        self.ck = torch.zeros(num_seqs + 1, dtype=torch.int32, device=DEV)
        self.table = torch.zeros((num_seqs, width), dtype=torch.int32, device=DEV)
        self.cap = cap
        self.tiles = torch.zeros(1 + 2 * cap, dtype=torch.int32, device=DEV)

    def load(self, q, q_lens, k_lens, table):
        """Copy one batch's inputs and metadata in (num_seqs fixed: shorter batches pad with empty rows)."""
        pad = self.cq.shape[0] - 1 - len(q_lens)
        q_lens, k_lens = np.array(q_lens + [0] * pad), np.array(k_lens + [0] * pad)
        self.q[:q.shape[0]].copy_(q)
        self.cq.copy_(torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)])).int())
        self.ck.copy_(torch.from_numpy(np.concatenate([[0], np.cumsum(k_lens)])).int())
        self.table[:table.shape[0]].copy_(table)
        seq, blk = build_query_tiles(q_lens, query_tile_rows(D, torch.bfloat16), k_lens)
        n, cap = len(seq), self.cap
        assert n <= cap
        host = np.concatenate([[n], seq, np.full(cap - n, GARBAGE_SEQ), blk, np.full(cap - n, GARBAGE_BLOCK)])
        self.tiles.copy_(torch.from_numpy(host.astype(np.int32)))

    def attend(self, kc, vc, out=None):
        cap = self.cap
        return flash_attn_varlen_func(
            self.q, kc, vc, self.cq, self.ck, self.q.shape[0], self.table.shape[1] * kc.shape[1], causal=True,
            block_table=self.table, tile_seq=self.tiles[1:1 + cap], tile_block=self.tiles[1 + cap:],
            num_tiles=self.tiles[:1], out=out)


def mixed_batch(gen, n_decode, chunks, prefixes, max_context, num_blocks, width, hq):
    """(q, q_lens, k_lens, table): n_decode q_len-1 rows with contexts in [1, max_context], then
    prefill chunks with cached prefixes; table entries drawn at random from the cache's blocks."""
    ctx = torch.randint(1, max_context + 1, (n_decode,), generator=gen, device=DEV).tolist()
    q_lens = [1] * n_decode + list(chunks)
    k_lens = ctx + [c + p for c, p in zip(chunks, prefixes)]
    table = torch.randint(0, num_blocks, (len(q_lens), width), generator=gen, device=DEV, dtype=torch.int32)
    q = randn((sum(q_lens), hq, D), gen, torch.bfloat16)
    return q, q_lens, k_lens, table


def mixed_ref(q, kc, vc, table, q_lens, k_lens):
    starts = [0] + np.cumsum(q_lens).tolist()
    return torch.cat([ref_attention(q[starts[i]:starts[i] + lq], gather(kc, table[i], lk), gather(vc, table[i], lk),
                                    True, D ** -0.5) for i, (lq, lk) in enumerate(zip(q_lens, k_lens)) if lq])


# Qwen3-0.6B attention: 16 query heads, 8 kv heads, D=128; engine block size 256.
TILE_HQ, TILE_HKV, TILE_BS = 16, 8, 256
TILE_WIDTH, TILE_BLOCKS = 13, 256  # 13 x 256 >= the longest context below (3000)


def tile_cache(gen):
    shape = (TILE_BLOCKS, TILE_BS, TILE_HKV, D)
    return randn(shape, gen, torch.bfloat16), randn(shape, gen, torch.bfloat16)


def test_prefill_tiles_mixed_batch():
    gen = torch.Generator(DEV).manual_seed(12)
    kc, vc = tile_cache(gen)
    q, q_lens, k_lens, table = mixed_batch(gen, 64, [700, 1500], [512, 1000], 2000, TILE_BLOCKS, TILE_WIDTH, TILE_HQ)
    batch = TileBatch(q.shape[0], len(q_lens), TILE_WIDTH, 128, TILE_HQ)
    batch.load(q, q_lens, k_lens, table)
    out = batch.attend(kc, vc)
    assert rel_err(out, mixed_ref(q, kc, vc, table, q_lens, k_lens)) < TILE_TOL
    grid_out = flash_attn_varlen_func(batch.q, kc, vc, batch.cq, batch.ck, max(q_lens), max(k_lens), causal=True,
                                      block_table=batch.table)
    # Same tiles, same arithmetic; separately compiled variants, so allow a rounding flip.
    assert rel_err(out, grid_out.double()) < 1e-3


def test_prefill_tiles_cuda_graph():
    """Capture one tile-table call writing into `out`, a strided view of a larger buffer, then
    replay it on other batches' metadata (same cap): other sequence counts (padded with empty
    ones), lengths, tiles and block tables, from one tile to many more tiles than the P programs
    per head. Before each replay the whole buffer is poisoned: rows no tile covers and the rest
    of the buffer must keep the poison."""
    gen = torch.Generator(DEV).manual_seed(13)
    kc, vc = tile_cache(gen)
    rows, cap = 2560, 160
    batch = TileBatch(rows, 66, TILE_WIDTH, cap, TILE_HQ)
    # out: rows [2, 2 + rows) x columns [64, 64 + Hq * D) of a buffer with row stride Hq * D + 128.
    buf = torch.full((rows + 4, TILE_HQ * D + 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = buf[2:2 + rows, 64:64 + TILE_HQ * D].view(rows, TILE_HQ, D)
    outside = torch.ones(buf.shape, dtype=torch.bool, device=DEV)
    outside[2:2 + rows, 64:64 + TILE_HQ * D] = False
    programs = tile_programs(TILE_HQ, cap, torch.device(DEV))
    first = mixed_batch(gen, 64, [700, 1500], [512, 1000], 2000, TILE_BLOCKS, TILE_WIDTH, TILE_HQ)
    batch.load(*first)
    batch.attend(kc, vc, out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = batch.attend(kc, vc, out)
    assert result is out
    one = mixed_batch(gen, 0, [40], [300], 1, TILE_BLOCKS, TILE_WIDTH, TILE_HQ)  # a single tile
    many = mixed_batch(gen, 0, [1600, 900], [0, 1000], 1, TILE_BLOCKS, TILE_WIDTH, TILE_HQ)  # 25 + 15 tiles
    second = mixed_batch(gen, 30, [1200, 300, 900], [256, 0, 1700], 3000, TILE_BLOCKS, TILE_WIDTH, TILE_HQ)
    for name, (q, q_lens, k_lens, table) in (("mixed", first), ("one", one), ("many", many), ("mixed2", second)):
        batch.load(q, q_lens, k_lens, table)
        n_tiles = batch.tiles[0].item()
        assert (n_tiles == 1) if name == "one" else (n_tiles > programs), (name, n_tiles, programs)
        buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = q.shape[0]
        assert rel_err(out[:n], mixed_ref(q, kc, vc, table, q_lens, k_lens)) < TILE_TOL, name
        assert torch.isnan(out[n:]).all() and torch.isnan(buf[outside]).all(), name


@pytest.mark.parametrize("hq,hkv", HEADS)
def test_prefill_long_tiles_over_long_contexts(hq, hkv):
    """The long-context tile on a step that takes it (prefill_plan.takes_long_tiles): a decode-like row, a
    2,048-row chunk after 6,144 cached keys and a fresh 3,000-token prompt, over a paged bf16 cache
    (256-token blocks) through a tile table at the long tile's height, against float64; grid mode on
    the long tile, and the 64-row tile's table, alike."""
    gen = torch.Generator(DEV).manual_seed(21)
    q_lens, k_lens = [1, 2048, 3000], [7000, 8192, 3000]
    assert takes_long_tiles(sum(q_lens[1:]), max(k_lens[1:]))
    kc, vc, table = make_paged(k_lens, 256, hkv, torch.bfloat16, gen)
    q = randn((sum(q_lens), hq, D), gen, torch.bfloat16)
    args = (q, kc, vc, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens))

    def tiled(long):
        seq, blk = build_query_tiles(np.array(q_lens), query_tile_rows(D, torch.bfloat16, long), np.array(k_lens))
        n = torch.tensor([len(seq)], dtype=torch.int32, device=DEV)
        return flash_attn_varlen_func(*args, causal=True, block_table=table, tile_seq=torch.from_numpy(seq).to(DEV),
                                      tile_block=torch.from_numpy(blk).to(DEV), num_tiles=n, long_tiles=long)

    out = tiled(True)
    assert rel_err(out, mixed_ref(q, kc, vc, table, q_lens, k_lens)) < TILE_TOL
    grid = flash_attn_varlen_func(*args, causal=True, block_table=table, long_tiles=True)
    assert rel_err(out, grid.double()) < 1e-3  # same tiles; separately compiled variants
    assert rel_err(out, tiled(False).double()) < 1e-2  # other tiles: another summation order


def decode_ref(q, kc, vc, table, lens):
    return torch.stack([ref_attention(q[i], gather(kc, table[i], n), gather(vc, table[i], n), True, D ** -0.5)
                        for i, n in enumerate(lens)])


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
# split (few rows), unsplit with 128-key tiles (64 rows: few programs per SM), unsplit 64-key tiles
@pytest.mark.parametrize("lens", [[1, 15, 16, 17, 1000, 4097, 8192], [8192] * 2, [5000] * 40,
                                  [1 + 37 * i for i in range(64)], [1 + 13 * i for i in range(160)]])
def test_decode(hq, hkv, block_size, dtype, lens):
    gen = torch.Generator(DEV).manual_seed(3)
    kc, vc, table = make_paged(lens, block_size, hkv, dtype, gen)
    q = randn((len(lens), 1, hq, D), gen, dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = flash_attn_with_kvcache(q, kc, vc, seqlens, table, causal=True)
    assert rel_err(out, decode_ref(q, kc, vc, table, lens)) < TOL[dtype]


@pytest.mark.parametrize("num_splits", [1, 7])
def test_decode_explicit_num_splits(num_splits):
    lens = [1, 300, 4097, 64]
    gen = torch.Generator(DEV).manual_seed(8)
    kc, vc, table = make_paged(lens, 256, 8, torch.bfloat16, gen)
    q = randn((len(lens), 1, 16, D), gen, torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = flash_attn_with_kvcache(q, kc, vc, seqlens, table, num_splits=num_splits)
    assert rel_err(out, decode_ref(q, kc, vc, table, lens)) < TOL[torch.bfloat16]


def capture_decode(q, kc, vc, seqlens, table, **options):
    """(graph, out): one decode call (flash_attn_with_kvcache's keyword `options`) captured in a
    CUDA graph; it first runs once outside the capture (compiles, and allocates the arrival counters)."""
    flash_attn_with_kvcache(q, kc, vc, seqlens, table, **options)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc, seqlens, table, **options)
    return graph, out


def replay_error(graph, out, q, kc, vc, table, lens):
    """Replay with `out` poisoned (NaN) first; its relative error against the reference."""
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return rel_err(out, decode_ref(q, kc, vc, table, lens.tolist()))


def test_decode_cuda_graph():
    gen = torch.Generator(DEV).manual_seed(4)
    hq, hkv, bs, batch, width = 16, 8, 256, 8, 16
    dtype = torch.bfloat16
    num_blocks = batch * width + 4
    kc, vc = randn((num_blocks, bs, hkv, D), gen, dtype), randn((num_blocks, bs, hkv, D), gen, dtype)
    q = randn((batch, 1, hq, D), gen, dtype)
    seqlens = torch.ones(batch, dtype=torch.int32, device=DEV)
    table = torch.zeros((batch, width), dtype=torch.int32, device=DEV)
    graph, out = capture_decode(q, kc, vc, seqlens, table)
    for trial in range(3):
        lens = torch.randint(1, bs * width + 1, (batch,), generator=gen, device=DEV)
        lens[0] = 1 + trial
        seqlens.copy_(lens.int())
        table.copy_(torch.randperm(num_blocks, device=DEV, generator=gen)[:batch * width].view(batch, width).int())
        q.copy_(randn((batch, 1, hq, D), gen, dtype))
        assert replay_error(graph, out, q, kc, vc, table, lens) < TOL[dtype]


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_folded_merge_over_many_replays(hq, hkv, batch):
    """Small batches merge splits in the last split's program (arrival counters, no merge
    kernel): the default split count folds here, and fold=True (refused where it cannot fold)
    is captured. Replayed 20 times with new queries and lengths into a poisoned output, every
    output must match the reference: a counter left non-zero (nothing merged: NaN) or a stale
    partial read would show up here."""
    gen = torch.Generator(DEV).manual_seed(11)
    bs, width, dtype = 256, 16, torch.bfloat16
    splits = choose_num_splits(batch, hkv, bs * width, cuda_sm_count(torch.device(DEV)))
    assert splits > 1 and can_fold_merge(splits, hq // hkv, D, batch * hkv)
    num_blocks = batch * width
    kc, vc = randn((num_blocks, bs, hkv, D), gen, dtype), randn((num_blocks, bs, hkv, D), gen, dtype)
    q = randn((batch, 1, hq, D), gen, dtype)
    seqlens = torch.full((batch,), bs * width, dtype=torch.int32, device=DEV)
    table = torch.randperm(num_blocks, device=DEV, generator=gen).view(batch, width).int()
    graph, out = capture_decode(q, kc, vc, seqlens, table, fold=True)
    for trial in range(20):
        lens = torch.randint(1, bs * width + 1, (batch,), generator=gen, device=DEV)
        seqlens.copy_(lens.int())
        q.copy_(randn((batch, 1, hq, D), gen, dtype))
        assert replay_error(graph, out, q, kc, vc, table, lens) < TOL[dtype], f"replay {trial}"


# The brief's bound for the captured num_seqs decode (bf16 output rounding alone is ~2-3e-3).
NUM_SEQS_TOL = 1e-2


def test_decode_num_seqs_cuda_graph():
    """One decode call captured at a capacity of 512 rows with num_seqs (rows in use) and a
    preallocated out (a view of a larger buffer), replayed for 0, 3, 200 and 512 rows in use.
    Rows past num_seqs hold garbage lengths and block ids (reading one would fault); they and
    the rest of the buffer must keep their NaN poison."""
    gen = torch.Generator(DEV).manual_seed(15)
    hq, hkv, bs, cap, width, num_blocks = 16, 8, 256, 512, 8, 256
    dtype = torch.bfloat16
    kc, vc = randn((num_blocks, bs, hkv, D), gen, dtype), randn((num_blocks, bs, hkv, D), gen, dtype)
    q = randn((cap, 1, hq, D), gen, dtype)
    seqlens = torch.ones(cap, dtype=torch.int32, device=DEV)
    table = torch.zeros((cap, width), dtype=torch.int32, device=DEV)
    num_seqs = torch.full((1,), cap, dtype=torch.int32, device=DEV)
    buf = torch.full((cap + 8, hq, D), float("nan"), dtype=dtype, device=DEV)
    out = buf[:cap].unsqueeze(1)

    def attend():
        return flash_attn_with_kvcache(q, kc, vc, seqlens, table, num_seqs=num_seqs, out=out)

    assert attend() is out  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend()
    for n in (0, 3, 200, 512):
        lens = torch.randint(1, bs * width + 1, (n,), generator=gen, device=DEV)
        seqlens.fill_(GARBAGE_SEQ)
        seqlens[:n] = lens.int()
        table.fill_(GARBAGE_BLOCK)
        table[:n] = torch.randint(0, num_blocks, (n, width), generator=gen, device=DEV, dtype=torch.int32)
        q.copy_(randn((cap, 1, hq, D), gen, dtype))
        num_seqs.fill_(n)
        buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if n:
            assert rel_err(out[:n], decode_ref(q, kc, vc, table, lens.tolist())) < NUM_SEQS_TOL, f"num_seqs={n}"
        assert torch.isnan(buf[n:]).all(), f"num_seqs={n}: a row past it was written"
