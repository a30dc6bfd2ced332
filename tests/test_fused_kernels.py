"""CPU tests of the fused elementwise Triton kernels (TRITON_INTERPRET=1, set by conftest.py).

Each kernel is compared to an independent float64 PyTorch reference and to the existing
torch layer path (`forward_native`), for fp32/fp16/bf16, strided inputs (views into a
fused qkv / wider tensor) and several N including 1. Shapes are small: the interpreter is slow.
"""

import pytest
import torch

from nanovllm.kernels.fused_activation import silu_and_mul
from nanovllm.kernels.fused_norm import add_rms_norm, rms_norm
from nanovllm.kernels.fused_rope import qk_norm_rope, rope
from nanovllm.kernels.torch_attention import store_kvcache
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding

# Triton kernels on CPU tensors: these run where the interpreter is on (no CUDA; see conftest.py).
pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6
MAX_POS = 64
# vs float64: fp32 is tight; fp16/bf16 are bounded by their own output rounding.
REF_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "output has NaN (unwritten or broken elements)"
    return ((out.double() - ref).norm() / ref.norm()).item()


def assert_close_to_torch(out, ref):
    """Elementwise: within 2 ulp of the torch path (almost always bit-equal for fp16/bf16;
    a 1-ulp difference in an intermediate rounding, e.g. silu before the multiply, can
    surface as 2 ulp in the product)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol = 1e-5 if out.dtype == torch.float32 else 2 * torch.finfo(out.dtype).eps
    # atol covers fp32 cancellation in rope (x1*cos - x2*sin ~ 0) on O(1) values.
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=1e-6)


def randn(shape, gen, dtype, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float32)).to(dtype)


def strided_rows(n, h, gen, dtype, pad):
    """[n, h] with row stride h + pad (a column slice of a wider tensor) when pad > 0."""
    return randn((n, h + pad), gen, dtype)[:, :h] if pad else randn((n, h), gen, dtype)


# ---------------------------------------------------------------- float64 references
def ref_norm(x, w):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def ref_rope(x, pos, cache):
    x = x.double()
    half = x.shape[-1] // 2
    cos, sin = cache[pos].double().unsqueeze(1).split(half, dim=-1)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def norm_layer(h, gen, dtype):
    layer = RMSNorm(h, EPS)
    layer.weight.data = randn((h,), gen, torch.float32, 0.5).add_(1.0).to(dtype)
    return layer


# ---------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [64, 96, 1024])
@pytest.mark.parametrize("n,pad", [(1, 0), (5, 8), (37, 0)])
def test_rms_norm(dtype, h, n, pad):
    gen = torch.Generator().manual_seed(h * 100 + n)
    layer = norm_layer(h, gen, dtype)
    x = strided_rows(n, h, gen, dtype, pad)
    out = rms_norm(x, layer.weight, EPS)
    assert out.is_contiguous() and out.dtype == dtype
    assert rel_err(out, ref_norm(x, layer.weight)) < REF_TOL[dtype]
    assert_close_to_torch(out, layer.forward_native(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [64, 96, 1024])
@pytest.mark.parametrize("n,pad", [(1, 0), (5, 8), (37, 16)])
def test_add_rms_norm(dtype, h, n, pad):
    gen = torch.Generator().manual_seed(h * 100 + n + 1)
    layer = norm_layer(h, gen, dtype)
    x = strided_rows(n, h, gen, dtype, pad)
    residual = strided_rows(n, h, gen, dtype, pad // 2)
    out, summed = add_rms_norm(x, residual, layer.weight, EPS)
    ref_out, ref_summed = layer.forward_native(x, residual)
    assert summed.is_contiguous() and out.is_contiguous()
    assert torch.equal(summed, ref_summed), "x + residual must be rounded exactly like the torch path"
    assert rel_err(out, ref_norm(summed, layer.weight)) < REF_TOL[dtype]
    assert rel_err(summed, x.double() + residual.double()) < REF_TOL[dtype]
    assert_close_to_torch(out, ref_out)


def test_rms_norm_layer_dispatch_paths_agree():
    """RMSNorm.forward_triton (the CUDA path) equals forward_native, incl. 3-D inputs."""
    gen = torch.Generator().manual_seed(7)
    layer = norm_layer(64, gen, torch.bfloat16)
    x = randn((3, 4, 64), gen, torch.bfloat16)
    res = randn((3, 4, 64), gen, torch.bfloat16)
    assert torch.equal(layer.forward_triton(x), layer.forward_native(x))
    for a, b in zip(layer.forward_triton(x, res), layer.forward_native(x, res)):
        assert a.shape == (3, 4, 64) and torch.equal(a, b)
    xt = randn((64, 5), gen, torch.bfloat16).t()  # non-contiguous last dim
    assert torch.equal(layer.forward_triton(xt), layer.forward_native(xt))
    assert torch.equal(layer(x), layer.forward_native(x))  # a layer built on the CPU keeps the torch path


def test_rms_norm_empty_batch():
    w = torch.ones(64)
    assert rms_norm(torch.empty(0, 64), w, EPS).shape == (0, 64)
    out, summed = add_rms_norm(torch.empty(0, 64), torch.empty(0, 64), w, EPS)
    assert out.shape == summed.shape == (0, 64)


def test_rms_norm_bad_inputs():
    x, w = torch.randn(4, 64), torch.ones(64)
    with pytest.raises(ValueError, match="x must be a 2-D"):
        rms_norm(torch.randn(64), w, EPS)
    with pytest.raises(TypeError, match="x dtype"):
        rms_norm(x.double(), w, EPS)
    with pytest.raises(TypeError, match="x dtype"):
        rms_norm(x.int(), w, EPS)
    with pytest.raises(ValueError, match="weight must be a tensor of shape"):
        rms_norm(x, torch.ones(32), EPS)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        rms_norm(x, torch.ones(64, 2)[:, 0], EPS)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rms_norm(torch.randn(64, 4).t(), w[:4], EPS)
    with pytest.raises(ValueError, match="hidden size"):
        rms_norm(torch.randn(1, 32768), torch.ones(32768), EPS)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="residual shape"):
        add_rms_norm(x, torch.randn(3, 64), w, EPS)
    with pytest.raises(ValueError, match="does not match hidden size"):
        add_rms_norm(x, torch.randn(4, 32), w, EPS)
    with pytest.raises(TypeError, match="residual dtype"):
        add_rms_norm(x, torch.randn(4, 64).double(), w, EPS)


# ---------------------------------------------------------------- SiLU-and-mul
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 96, 1500])
@pytest.mark.parametrize("n,pad", [(1, 0), (6, 10)])
def test_silu_and_mul(dtype, inter, n, pad):
    gen = torch.Generator().manual_seed(inter + n)
    x = strided_rows(n, 2 * inter, gen, dtype, pad).mul_(3)  # reach silu's saturated tails
    out = silu_and_mul(x)
    assert out.shape == (n, inter) and out.is_contiguous() and out.dtype == dtype
    g, u = x.double().chunk(2, dim=-1)
    ref = g * torch.sigmoid(g) * u
    assert rel_err(out, ref) < REF_TOL[dtype]
    assert_close_to_torch(out, SiluAndMul.forward_native(x))


def test_silu_and_mul_layer_path_and_bad_inputs():
    gen = torch.Generator().manual_seed(3)
    x = randn((2, 3, 128), gen, torch.bfloat16)
    assert torch.equal(SiluAndMul.forward_triton(x), SiluAndMul.forward_native(x))
    assert silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="2-D"):
        silu_and_mul(torch.randn(8))
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(TypeError, match="x dtype"):
        silu_and_mul(torch.randn(2, 8).double())
    with pytest.raises(ValueError, match="contiguous last dim"):
        silu_and_mul(torch.randn(8, 2).t())


# ---------------------------------------------------------------- q/k norm + RoPE
def qkv_views(n, hq, hkv, d, gen, dtype):
    """q [n, hq, d], k [n, hkv, d] as strided views of a fused qkv projection output."""
    qkv = randn((n, (hq + 2 * hkv) * d), gen, dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.reshape(n, hq, d), k.reshape(n, hkv, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n,hq,hkv", [(1, 4, 2), (7, 6, 2), (3, 32, 4)])
def test_qk_norm_rope(dtype, d, n, hq, hkv):
    gen = torch.Generator().manual_seed(d + n + hq)
    q, k = qkv_views(n, hq, hkv, d, gen, dtype)
    assert n == 1 or not (q.is_contiguous() or k.is_contiguous())
    q_norm, k_norm = norm_layer(d, gen, dtype), norm_layer(d, gen, dtype)
    rot = RotaryEmbedding(d, MAX_POS, 10000.0)
    pos = torch.randint(0, MAX_POS, (n,), generator=gen)
    q_out, k_out = qk_norm_rope(q, k, q_norm.weight, k_norm.weight, pos, rot.cos_sin_cache, EPS)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.is_contiguous() and k_out.is_contiguous() and q_out.dtype == k_out.dtype == dtype
    for out, x, w in ((q_out, q, q_norm.weight), (k_out, k, k_norm.weight)):
        assert rel_err(out, ref_rope(ref_norm(x, w), pos, rot.cos_sin_cache)) < REF_TOL[dtype]
    ref_q, ref_k = rot(pos, q_norm.forward_native(q), k_norm.forward_native(k))
    assert_close_to_torch(q_out, ref_q)
    assert_close_to_torch(k_out, ref_k)


@pytest.mark.parametrize("dtype,slot_dtype", [(torch.bfloat16, torch.int32), (torch.float32, torch.int64)])
def test_store_kvcache_writes_each_slot(dtype, slot_dtype):
    """torch_attention.store_kvcache (the CPU path's write, and the reference of kv_write below),
    slot by slot: key / value views of a fused qkv row land at their slots, padding rows (slot -1)
    write nothing, every other cache row keeps its NaN."""
    gen = torch.Generator().manual_seed(1)
    n, hkv, d, block_size, num_blocks = 13, 2, 64, 16, 5
    qkv = randn((n, 3 * hkv, d), gen, dtype)
    key, value = qkv[:, hkv:2 * hkv], qkv[:, 2 * hkv:]
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[[2, 7]] = -1
    store_kvcache(key, value, k_cache, v_cache, slots.to(slot_dtype))
    kf, vf = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    written = torch.zeros(kf.shape[0], dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(kf[slot], key[i]) and torch.equal(vf[slot], value[i])
            written[slot] = True
    assert torch.isnan(kf[~written]).all() and torch.isnan(vf[~written]).all()


def test_kv_write_bad_inputs():
    """The cache write's arguments (fused_rope.check_kv_store) are refused by name."""
    gen = torch.Generator().manual_seed(2)
    n, hq, hkv, d = 4, 4, 2, 64
    q, k, v = (randn((n, h, d), gen, torch.float16) for h in (hq, hkv, hkv))
    pos = torch.arange(n)
    cos_sin = RotaryEmbedding(d, MAX_POS, 1e4).cos_sin_cache
    cache = torch.zeros(2, 16, hkv, d, dtype=torch.float16)
    slots = torch.arange(n, dtype=torch.int32)

    def write(v=v, k_cache=cache, v_cache=cache.clone(), slots=slots):
        rope(q, k, pos, cos_sin, kv_write=(v, k_cache, v_cache, slots))

    write()
    for error, match, bad in (
            (TypeError, "slot_mapping", dict(slots=slots.float())),
            (TypeError, "value dtype", dict(v=v.float())),
            (TypeError, "k_cache dtype", dict(k_cache=cache.float(), v_cache=cache.float())),
            (ValueError, "block_size", dict(k_cache=torch.zeros(2, 24, hkv, d, dtype=torch.float16),
                                            v_cache=torch.zeros(2, 24, hkv, d, dtype=torch.float16))),
            (ValueError, "num_kv_heads", dict(k_cache=torch.zeros(2, 16, 4, d, dtype=torch.float16),
                                              v_cache=torch.zeros(2, 16, 4, d, dtype=torch.float16))),
            (ValueError, "slot_mapping shape", dict(slots=slots[:3])),
            (ValueError, "value shape", dict(v=v[:, :1]))):
        with pytest.raises(error, match=match):
            write(**bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("with_norm", [True, False])
def test_rope_kernels_write_kv_cache(dtype, block_size, with_norm):
    """kv_write (qk_norm_rope, and rope: the no-norm variant) stores exactly what
    torch_attention.store_kvcache(k_out, v, ...) stores, skipping slot -1 rows, and leaves every other cache
    row untouched; q/k outputs are those of the call without kv_write."""
    gen = torch.Generator().manual_seed(block_size)
    n, hq, hkv, d = 6, 4, 2, 64
    qkv = randn((n, (hq + 2 * hkv) * d), gen, dtype)
    q, k, v = (t.reshape(n, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    q_norm, k_norm = norm_layer(d, gen, dtype), norm_layer(d, gen, dtype)
    cos_sin = RotaryEmbedding(d, MAX_POS, 1e6).cos_sin_cache
    pos = torch.randint(0, MAX_POS, (n,), generator=gen)

    def call(**kw):
        if with_norm:
            return qk_norm_rope(q, k, q_norm.weight, k_norm.weight, pos, cos_sin, EPS, **kw)
        return rope(q, k, pos, cos_sin, **kw)

    slots = torch.tensor([3, -1, 2 * block_size + 5, block_size, -1, 4 * block_size - 1])
    caches = [randn((4, block_size, hkv, d), gen, dtype) for _ in range(2)]
    k_cache, v_cache = (c.clone() for c in caches)
    q_out, k_out = call(kv_write=(v, k_cache, v_cache, slots))
    ref_q, ref_k = call()
    assert torch.equal(q_out, ref_q) and torch.equal(k_out, ref_k)
    ref_k_cache, ref_v_cache = (c.clone() for c in caches)
    store_kvcache(ref_k, v, ref_k_cache, ref_v_cache, slots)
    assert torch.equal(k_cache, ref_k_cache) and torch.equal(v_cache, ref_v_cache)
    assert not torch.equal(k_cache, caches[0])  # something was written
    with pytest.raises(ValueError, match="kv_write must be a tuple.*got a tuple of 2"):
        call(kv_write=(v, k_cache))
    with pytest.raises(ValueError, match="slot_mapping shape"):
        call(kv_write=(v, k_cache, v_cache, slots[:3]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_other_layouts(dtype):
    """Head-major (transposed) views, int32 positions and a strided positions tensor."""
    gen = torch.Generator().manual_seed(11)
    n, hq, hkv, d = 5, 4, 2, 64
    q = randn((hq, n, d), gen, dtype).transpose(0, 1)  # token stride d, head stride n * d
    k = randn((hkv, n, d), gen, dtype).transpose(0, 1)
    q_norm, k_norm = norm_layer(d, gen, dtype), norm_layer(d, gen, dtype)
    rot = RotaryEmbedding(d, MAX_POS, 1e6)
    pos = torch.randint(0, MAX_POS, (2 * n,), generator=gen)[::2]
    for p in (pos, pos.int()):
        q_out, k_out = qk_norm_rope(q, k, q_norm.weight, k_norm.weight, p, rot.cos_sin_cache, EPS)
        ref_q, ref_k = rot(pos, q_norm.forward_native(q), k_norm.forward_native(k))
        assert_close_to_torch(q_out, ref_q)
        assert_close_to_torch(k_out, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 6])
def test_rope_only(dtype, n):
    gen = torch.Generator().manual_seed(n)
    q, k = qkv_views(n, 4, 2, 128, gen, dtype)
    rot = RotaryEmbedding(128, MAX_POS, 10000.0)
    pos = torch.randint(0, MAX_POS, (n,), generator=gen)
    q_out, k_out = rope(q, k, pos, rot.cos_sin_cache)
    assert rel_err(q_out, ref_rope(q, pos, rot.cos_sin_cache)) < REF_TOL[dtype]
    ref_q, ref_k = rot(pos, q, k)
    assert_close_to_torch(q_out, ref_q)
    assert_close_to_torch(k_out, ref_k)


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_attention_rope_steps_agree(qk_norm, dtype):
    """SelfAttention's Triton RoPE step (the one a CUDA-built layer takes: one kernel does the
    optional q/k norm, RoPE and the K/V cache write; run here on CPU tensors) gives the torch
    step's q, k and cache: with the norm (Qwen3) through qk_norm_rope, without it (Llama,
    Qwen2) through rope, both given the attention layer's kv_write."""
    from nanovllm.layers.attention_backend import select_attention_backend
    from nanovllm.layers.self_attention import SelfAttention
    from nanovllm.utils.context import AttentionMetadata, attention_context

    gen = torch.Generator().manual_seed(21 + qk_norm)
    n, hidden, hq, hkv, d, block = 7, 64, 4, 2, 32, 16
    with torch.device("cpu"):
        layer = SelfAttention(hidden, hq, hkv, d, RotaryEmbedding(d, MAX_POS, 1e4), qk_norm=qk_norm,
                              rms_norm_eps=EPS, qkv_bias=True, o_bias=False)
    assert not layer.use_triton  # built on the CPU: forward takes the torch step
    if qk_norm:
        for norm in (layer.q_norm, layer.k_norm):
            norm.weight.data = randn((d,), gen, torch.float32, 0.5).add_(1.0).to(dtype)
    q, k, v = (t.reshape(n, -1, d) for t in randn((n, (hq + 2 * hkv) * d), gen, dtype).split(
        [hq * d, hkv * d, hkv * d], dim=-1))
    pos = torch.randint(0, MAX_POS, (n,), generator=gen)
    slots = torch.tensor([0, 17, -1, 40, 3, 63, 20])
    meta = AttentionMetadata(is_prefill=True, slot_mapping=slots)
    layer.attn.backend = select_attention_backend("torch", "cpu", block, False, layer.head_dim)
    results = []
    for step in (layer.rope_and_store_triton, layer.rope_and_store_native):
        layer.attn.k_cache, layer.attn.v_cache = torch.zeros(2, 4, block, hkv, d, dtype=dtype)
        with attention_context(meta):
            q_out, k_out = step(pos, q, k, v)
        results.append((q_out, k_out, layer.attn.k_cache, layer.attn.v_cache))
    (tq, tk, tkc, tvc), (nq, nk, nkc, nvc) = results
    assert_close_to_torch(tq, nq)
    assert_close_to_torch(tk, nk)
    assert_close_to_torch(tkc, nkc)
    assert torch.equal(tvc, nvc)
    stored = slots >= 0
    assert torch.equal(tvc.view(-1, hkv, d)[slots[stored]], v[stored])
    assert tkc.view(-1, hkv, d)[slots[stored]].abs().sum() > 0 and not tkc.view(-1, hkv, d)[1].any()


def test_qk_norm_rope_empty_batch():
    q, k = torch.empty(0, 4, 64), torch.empty(0, 2, 64)
    cache = RotaryEmbedding(64, MAX_POS, 10000.0).cos_sin_cache
    q_out, k_out = qk_norm_rope(q, k, torch.ones(64), torch.ones(64), torch.empty(0, dtype=torch.int64), cache, EPS)
    assert q_out.shape == (0, 4, 64) and k_out.shape == (0, 2, 64)


def test_qk_norm_rope_bad_inputs():
    n, d = 3, 64
    q, k, w = torch.randn(n, 4, d), torch.randn(n, 2, d), torch.ones(d)
    pos = torch.zeros(n, dtype=torch.int64)
    cache = RotaryEmbedding(d, MAX_POS, 10000.0).cos_sin_cache

    def call(q=q, k=k, qw=w, kw=w, pos=pos, cache=cache, eps=EPS):
        return qk_norm_rope(q, k, qw, kw, pos, cache, eps)

    with pytest.raises(ValueError, match="q must be a 3-D"):
        call(q=q.flatten(1))
    with pytest.raises(TypeError, match="k dtype"):
        call(k=k.half())
    with pytest.raises(TypeError, match="q dtype"):
        call(q=q.double())
    with pytest.raises(ValueError, match="does not match q shape"):
        call(k=torch.randn(n + 1, 2, d))
    with pytest.raises(ValueError, match="head_dim must be even"):
        call(q=torch.randn(n, 4, 63), k=torch.randn(n, 2, 63))
    with pytest.raises(ValueError, match="contiguous last dim"):
        call(q=torch.randn(n, d, 4).transpose(1, 2))
    with pytest.raises(TypeError, match="positions must be"):
        call(pos=pos.float())
    with pytest.raises(ValueError, match="positions shape"):
        call(pos=torch.zeros(n + 1, dtype=torch.int64))
    with pytest.raises(TypeError, match="cos_sin_cache must be a float32"):
        call(cache=cache.half())
    with pytest.raises(ValueError, match="cos_sin_cache must be"):
        call(cache=cache[:, : d // 2])
    with pytest.raises(ValueError, match="q_weight must be a tensor of shape"):
        call(qw=torch.ones(d + 1))
    with pytest.raises(ValueError, match="k_weight must be contiguous"):
        call(kw=torch.ones(d, 2)[:, 0])
    with pytest.raises(ValueError, match="eps"):
        call(eps=float("nan"))
    with pytest.raises(TypeError, match="positions must be"):
        rope(q, k, pos.float(), cache)
