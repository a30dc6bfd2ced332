"""Decode attention that applies the step's q/k norm + RoPE and writes its K/V itself
(flash_attn_with_kvcache(..., rope=StepRope)): against a float64 reference (torch norm and
rotation, then attention over the reference cache), and bit-equal to the two-kernel path it
replaces (qk_norm_rope / rope with kv_write, then plain decode attention), under the CPU
interpreter and compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from nanovllm.kernels import flash_attn_with_kvcache
from nanovllm.kernels.fused_rope import StepRope, qk_norm_rope, rope
from nanovllm.layers.rotary_embedding import RotaryEmbedding

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
EPS = 1e-6
MAX_POS = 512
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _case(device, dtype, d, hq, hkv, block_size, lens, gen):
    """Caches, block table, raw q / k / v views of one qkv output, norm weights, positions and
    slots of each row's newest token (the token the step adds; lens include it)."""
    n = len(lens)
    nblk = [-(-max(x, 1) // block_size) for x in lens]
    perm = torch.randperm(sum(nblk) + 2, generator=gen)
    table = torch.zeros((n, max(nblk) + 1), dtype=torch.int32)
    at = 0
    for i, nb in enumerate(nblk):
        table[i, :nb] = perm[at:at + nb].int()
        at += nb
    caches = [torch.randn((len(perm), block_size, hkv, d), generator=gen).to(dtype) for _ in range(2)]
    qkv = torch.randn((n, (hq + 2 * hkv) * d), generator=gen).to(dtype)
    q, k, v = (t.reshape(n, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    weights = [(1 + 0.5 * torch.randn(d, generator=gen)).to(dtype) for _ in range(2)]
    pos = torch.tensor([max(x, 1) - 1 for x in lens])
    slots = torch.tensor([int(table[i, p // block_size]) * block_size + p % block_size if x > 0 else -1
                          for i, (x, p) in enumerate(zip(lens, pos.tolist()))])
    to = lambda t: t.to(device)  # noqa: E731
    return (to(caches[0]), to(caches[1]), to(table), to(q), to(k), to(v), [to(w) for w in weights],
            to(pos), to(slots), to(torch.tensor(lens, dtype=torch.int32)))


def _ref_rotated(x, w, pos, cos_sin, dtype):
    """torch's sequence in float32 (norm rounded to dtype, rotation rounded to dtype)."""
    x = x.float()
    if w is not None:
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(dtype).float()
    cos, sin = cos_sin[pos].unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("d,hq,hkv,num_splits", [(64, 8, 2, 1), (64, 8, 2, 3), (128, 4, 4, 0)])
def test_decode_rope_matches_reference_and_two_kernel_path(device, dtype, with_norm, d, hq, hkv, num_splits):
    block_size = 16
    gen = torch.Generator().manual_seed(d + hq + num_splits)
    lens = [1, 37, 70, 0]  # a one-token sequence, splits holding the new token, a padding row (slot -1)
    k_cache, v_cache, table, q, k, v, (qw, kw), pos, slots, seqlens = _case(
        device, dtype, d, hq, hkv, block_size, lens, gen)
    cos_sin = RotaryEmbedding(d, MAX_POS, 1e6).cos_sin_cache.to(device)
    norm = (qw, kw) if with_norm else (None, None)
    before = (k_cache.clone(), v_cache.clone())
    step = StepRope(k, v, pos, slots, cos_sin, *norm, EPS)
    out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, seqlens, table, softmax_scale=0.3,
                                  num_splits=num_splits, rope=step).squeeze(1)

    # the two-kernel path on the untouched caches: bit-equal caches, same output up to summation
    k2, v2 = (c.clone() for c in before)
    kv_write = (v, k2, v2, slots)
    q_rot, _ = (qk_norm_rope(q, k, qw, kw, pos, cos_sin, EPS, kv_write=kv_write) if with_norm
                else rope(q, k, pos, cos_sin, kv_write=kv_write))
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
    assert not torch.equal(k_cache, before[0])  # the new tokens were written
    two = flash_attn_with_kvcache(q_rot.unsqueeze(1), k2, v2, seqlens, table, softmax_scale=0.3,
                                  num_splits=num_splits).squeeze(1)
    torch.testing.assert_close(out[:3], two[:3], rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-5)

    # float64 attention over the reference cache (the rows' newest k / v placed by hand)
    cpu = lambda t: t.cpu()  # noqa: E731
    ref_q = _ref_rotated(cpu(q), cpu(norm[0]) if with_norm else None, cpu(pos), cpu(cos_sin), dtype)
    ref_k = _ref_rotated(cpu(k), cpu(norm[1]) if with_norm else None, cpu(pos), cpu(cos_sin), dtype)
    kc, vc = (cpu(c).clone() for c in before)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            kc[s // block_size, s % block_size], vc[s // block_size, s % block_size] = ref_k[i], cpu(v)[i]
    for i, n in enumerate(lens[:3]):
        t = torch.arange(n)
        rows = cpu(table)[i].long()[t // block_size], t % block_size
        keys = kc[rows].double().repeat_interleave(hq // hkv, 1)  # [n, Hq, D]
        vals = vc[rows].double().repeat_interleave(hq // hkv, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", ref_q[i].double(), keys) * 0.3, dim=-1)
        ref = torch.einsum("hn,nhd->hd", p, vals)
        err = ((cpu(out[i]).double() - ref).norm() / ref.norm()).item()
        assert err < TOL[dtype], (i, err)


def test_decode_rope_bad_inputs():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, table, q, k, v, (qw, kw), pos, slots, seqlens = _case(
        "cpu", torch.float32, 64, 4, 2, 16, [5, 9], gen)
    cos_sin = RotaryEmbedding(64, MAX_POS, 1e6).cos_sin_cache

    def call(step, **kw):
        return flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, seqlens, table, rope=step, **kw)

    with pytest.raises(TypeError, match="StepRope"):
        call((k, v, pos, slots))
    with pytest.raises(ValueError, match="both"):
        call(StepRope(k, v, pos, slots, cos_sin, qw, None, EPS))
    with pytest.raises(ValueError, match="num_seqs"):
        call(StepRope(k, v, pos, slots, cos_sin, None, None, EPS), num_seqs=torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="positions shape"):
        call(StepRope(k, v, pos[:1], slots, cos_sin, None, None, EPS))
    with pytest.raises(ValueError, match="share strides"):
        call(StepRope(k, v.contiguous(), pos, slots, cos_sin, None, None, EPS))
