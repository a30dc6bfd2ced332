"""GPU tests of the Triton attention kernels at Qwen3 shapes (run with `pytest -m gpu`).

float64 PyTorch references on the GPU, computed per sequence (and per head chunk for
long contexts), independent of the kernels.
"""

import pytest
import torch

from nanovllm.kernels import flash_attn_varlen_func, flash_attn_with_kvcache, store_kvcache

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


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_kvcache(block_size, dtype):
    gen = torch.Generator(DEV).manual_seed(0)
    n, hkv = 3000, 8
    num_blocks = 2 * n // block_size + 1
    key, value = randn((n, hkv, D), gen, dtype), randn((n, hkv, D), gen, dtype)
    kc = torch.full((num_blocks, block_size, hkv, D), float("nan"), dtype=dtype, device=DEV)
    vc = kc.clone()
    slots = torch.randperm(num_blocks * block_size, device=DEV, generator=gen)[:n]
    pad = torch.rand(n, device=DEV, generator=gen) < 0.1
    slots[pad] = -1
    store_kvcache(key, value, kc, vc, slots.int())
    keep = slots >= 0
    kf, vf = kc.view(-1, hkv, D), vc.view(-1, hkv, D)
    assert torch.equal(kf[slots[keep]], key[keep]) and torch.equal(vf[slots[keep]], value[keep])
    untouched = torch.ones(kf.shape[0], dtype=torch.bool, device=DEV)
    untouched[slots[keep]] = False
    assert torch.isnan(kf[untouched]).all() and torch.isnan(vf[untouched]).all()


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


def decode_ref(q, kc, vc, table, lens):
    return torch.stack([ref_attention(q[i], gather(kc, table[i], n), gather(vc, table[i], n), True, D ** -0.5)
                        for i, n in enumerate(lens)])


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1, 15, 16, 17, 1000, 4097, 8192], [8192] * 2, [5000] * 40])
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


def capture_decode(q, kc, vc, seqlens, table):
    """(graph, out): one decode call captured in a CUDA graph; it first runs once outside the
    capture (compiles, and allocates the arrival counters)."""
    flash_attn_with_kvcache(q, kc, vc, seqlens, table)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc, seqlens, table)
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
def test_decode_folded_merge_over_many_replays(monkeypatch, hq, hkv, batch):
    """Small batches merge splits in the last split's program (arrival counters, no merge
    kernel). Replayed 20 times with new queries and lengths, every output must match the
    reference: a counter left non-zero or a stale partial read would show up here."""
    import nanovllm.kernels.decode_attention as dec
    monkeypatch.setattr(dec, "_decode_merge_kernel", None)  # fails if the merge kernel is launched
    gen = torch.Generator(DEV).manual_seed(11)
    bs, width, dtype = 256, 16, torch.bfloat16
    num_blocks = batch * width
    kc, vc = randn((num_blocks, bs, hkv, D), gen, dtype), randn((num_blocks, bs, hkv, D), gen, dtype)
    q = randn((batch, 1, hq, D), gen, dtype)
    seqlens = torch.full((batch,), bs * width, dtype=torch.int32, device=DEV)
    table = torch.randperm(num_blocks, device=DEV, generator=gen).view(batch, width).int()
    graph, out = capture_decode(q, kc, vc, seqlens, table)
    for trial in range(20):
        lens = torch.randint(1, bs * width + 1, (batch,), generator=gen, device=DEV)
        seqlens.copy_(lens.int())
        q.copy_(randn((batch, 1, hq, D), gen, dtype))
        assert replay_error(graph, out, q, kc, vc, table, lens) < TOL[dtype], f"replay {trial}"
    assert not dec._counter_cache[q.device].any()
