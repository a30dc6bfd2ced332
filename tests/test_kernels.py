"""CPU tests of the Triton attention kernels (TRITON_INTERPRET=1, set by conftest.py).

References are plain float64 PyTorch, independent of the kernels: K/V are gathered per
sequence through the block table, softmax is explicit with a bottom-right causal mask.
Shapes are tiny because the interpreter is slow.
"""

import pytest
import torch

from nanovllm.kernels import flash_attn_varlen_func, flash_attn_with_kvcache, store_kvcache

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


# ---------------------------------------------------------------- store_kvcache
@pytest.mark.parametrize("block_size,d,dtype,slot_dtype", [
    (16, 64, torch.float16, torch.int32), (48, 128, torch.bfloat16, torch.int64),
    (32, 64, torch.float32, torch.int64)])
def test_store_kvcache(block_size, d, dtype, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    n, hkv, num_blocks = 13, 2, 5
    # Non-contiguous key/value, as sliced from a fused qkv projection.
    qkv = randn((n, 3 * hkv, d), gen, dtype)
    key, value = qkv[:, hkv:2 * hkv], qkv[:, 2 * hkv:]
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=DEV)
    v_cache = k_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[[2, 7]] = -1  # padding rows
    slot_mapping = slots.to(DEV, slot_dtype)
    store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    written = torch.zeros(kf.shape[0], dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kf[s], key[i]) and torch.equal(vf[s], value[i])
            written[s] = True
    # Everything else (including what padding rows would have hit) is untouched.
    assert torch.isnan(kf[~written]).all() and torch.isnan(vf[~written]).all()


def test_store_kvcache_bad_inputs():
    k = torch.randn(4, 2, 64, device=DEV, dtype=torch.float16)
    cache = torch.zeros(2, 16, 2, 64, device=DEV, dtype=torch.float16)
    slots = torch.arange(4, device=DEV, dtype=torch.int32)
    with pytest.raises(TypeError, match="slot_mapping"):
        store_kvcache(k, k, cache, cache.clone(), slots.float())
    with pytest.raises(TypeError, match="dtype"):
        store_kvcache(k.int(), k.int(), cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="block_size"):
        c = torch.zeros(2, 24, 2, 64, device=DEV, dtype=torch.float16)
        store_kvcache(k, k, c, c.clone(), slots)
    with pytest.raises(ValueError, match="num_kv_heads"):
        c = torch.zeros(2, 16, 4, 64, device=DEV, dtype=torch.float16)
        store_kvcache(k, k, c, c.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping shape"):
        store_kvcache(k, k, cache, cache.clone(), slots[:3])


# ---------------------------------------------------------------- prefill
@pytest.mark.parametrize("d,hq,hkv,dtype,causal", [
    (64, 4, 2, torch.float16, True), (128, 2, 1, torch.bfloat16, True),
    (64, 2, 2, torch.float16, False), (64, 2, 1, torch.float32, True)])
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


def test_prefill_packed_views_of_fused_qkv():
    """q, k, v as column slices of one fused projection output (different row strides)."""
    gen = torch.Generator().manual_seed(5)
    lens, hq, hkv, d = [9, 30], 4, 2, 64
    qkv = randn((sum(lens), (hq + 2 * hkv) * d), gen, torch.float16)
    q, k, v = (t.reshape(-1, h, d) for t, h in zip(qkv.split([hq * d, hkv * d, hkv * d], -1), (hq, hkv, hkv)))
    c = cu(lens)
    out = flash_attn_varlen_func(q, k, v, c, c, max(lens), max(lens), causal=True)
    ref = torch.cat([ref_attention(q[a:b], k[a:b], v[a:b], True, d ** -0.5)
                     for a, b in zip(c[:-1].tolist(), c[1:].tolist())])
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


# ---------------------------------------------------------------- decode
@pytest.mark.parametrize("block_size,d,hq,hkv,dtype", [
    (16, 64, 8, 2, torch.float16), (32, 128, 4, 1, torch.bfloat16),
    (256, 64, 2, 2, torch.float16), (16, 64, 4, 2, torch.float32)])
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


@pytest.mark.parametrize("block_size,dtype", [(16, torch.float16), (48, torch.bfloat16)])
@pytest.mark.parametrize("fold", [True, False])
def test_decode_split_k(monkeypatch, block_size, dtype, fold):
    """Force several splits (some empty for short rows) so the merge is exercised: in the last
    split's program (fold, arrival counters) or as the merge kernel (tile too large to fold)."""
    import nanovllm.kernels.decode_attention as dec
    if fold:  # the merge kernel must not be launched
        monkeypatch.setattr(dec, "_decode_merge_kernel", None)
    else:
        monkeypatch.setattr(dec, "FOLD_MAX_ELEMS", 0)
    monkeypatch.setattr(dec, "MIN_TOKENS_PER_SPLIT", 16)
    monkeypatch.setattr(dec, "CPU_SM_COUNT", 64)
    assert dec.choose_num_splits(3, 2, 160, 64) > 4
    gen = torch.Generator().manual_seed(6)
    lens = [1, 150, 70]
    k_cache, v_cache, table = make_paged(lens, block_size, 2, 64, dtype, gen)
    q = randn((3, 1, 8, 64), gen, dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, softmax_scale=0.2)
    ref = torch.stack([ref_attention(q[i], gather(k_cache, table[i], n), gather(v_cache, table[i], n),
                                     True, 0.2) for i, n in enumerate(lens)])
    assert rel_err(out, ref) < TOL[dtype]
    if fold:
        assert not dec._counter_cache[q.device].any()  # every merging program reset its counter
    again = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, softmax_scale=0.2)
    assert torch.equal(again, out)  # a second call finds the counters at zero


def test_decode_fold_falls_back_without_counters(monkeypatch):
    """More (sequence, kv head) pairs than counters: the merge kernel runs instead, same result."""
    import nanovllm.kernels.decode_attention as dec
    gen = torch.Generator().manual_seed(8)
    lens = [40, 90]
    k_cache, v_cache, table = make_paged(lens, 16, 2, 64, torch.float32, gen)
    q = randn((2, 1, 4, 64), gen, torch.float32)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    folded = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, num_splits=3)
    monkeypatch.setattr(dec, "_counter_cache", {q.device: torch.zeros(3, dtype=torch.int32)})  # < 2 x 2
    unfolded = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, num_splits=3)
    assert dec._arrival_counters(q.device, 4) is None
    torch.testing.assert_close(unfolded, folded, rtol=1e-6, atol=1e-6)


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


def test_import_exports():
    import nanovllm.kernels as kmod
    assert sorted(kmod.__all__) == ["flash_attn_varlen_func", "flash_attn_with_kvcache", "gumbel_sample",
                                    "store_kvcache"]
    assert all(callable(getattr(kmod, name)) for name in kmod.__all__)
