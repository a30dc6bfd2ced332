"""FP8 (e4m3) KV cache on CPU: `LLM(kv_cache_dtype="fp8")`.

Kernels (Triton's interpreter, marked `interpreter`): decode and paged prefill attention over FP8
caches against float64 references on the dequantized caches (fp8 * scale), the decode kernel's
word-wise read of every e4m3 byte against torch's conversion, and the quantizing
cache writes (the fused RoPE kernel's, torch_attention's) against the definition
e4m3(clamp(x / scale, -448, 448)), saturating without NaN. Engines (the plain-PyTorch CPU path, the
same numerics): one FP8 engine gives the same tokens under every scheduling regime (with the
checkpoint's scales, so every regime stores the same values), the scales computed from the data
follow the documented rule and stay fixed, the tokens stay close to transformers', and the cache
holds twice (bf16) or four times (float32) the blocks in the same memory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from safetensors.torch import load_file, save_file

from checkpoints import (
    checkpoint_fixture, complete_tokens, cpu_llm, generate_tokens, load_reference, make_prompts,
)
from nanovllm import SamplingParams
from nanovllm.config import Config
from nanovllm.config import KV_CACHE_DTYPES
from nanovllm.engine.kv_cache import blocks_in_budget, kv_block_bytes
from nanovllm.kernels import torch_attention
from nanovllm.kernels.decode_attention import flash_attn_with_kvcache
from nanovllm.kernels.decode_plan import heads_per_program
from nanovllm.kernels.fp8_kv import e4m3_planes
from nanovllm.kernels.fused_rope import qk_norm_rope, rope
from nanovllm.kernels.prefill_attention import flash_attn_varlen_func
from nanovllm.kernels.prefill_plan import build_query_tiles, query_tile_rows
from nanovllm.layers.attention import KV_SCALE_HEADROOM
from nanovllm.layers.attention_backend import select_attention_backend
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.quantization.checkpoint_config import resolve_quantization

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# vs float64 on the dequantized caches: fp32 is tight; fp16/bf16 are bounded by their own rounding
# (the FP8 values convert to them exactly).
TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
interpreter = pytest.mark.interpreter


# ---------------------------------------------------------------- references
def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The stored value's definition: e4m3(clamp(x / scale, -448, 448)), a float32 division."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return cache.double() * scale.double()


def ref_attention(q, k, v, scale):
    """float64 q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D], causal bottom-right aligned."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    q, k, v = q.double(), k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def rel_err(out, ref):
    assert torch.isfinite(out).all(), "output has NaN / inf (unwritten or broken elements)"
    return ((out.double() - ref).norm() / ref.norm()).item()


def fp8_paged(lens, block_size, hkv, d, gen, k_scale, v_scale):
    """FP8 caches holding random values over most of e4m3's range (some saturated) and a
    shuffled block table for sequences of `lens` tokens."""
    nblk = [-(-n // block_size) for n in lens]
    num_blocks = sum(nblk) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros((len(lens), max(nblk) + 1), dtype=torch.int32)
    for i, start in enumerate(np.cumsum([0] + nblk[:-1])):
        table[i, : nblk[i]] = perm[start : start + nblk[i]].int()
    caches = [quantize(torch.randn((num_blocks, block_size, hkv, d), generator=gen) * 150 * s, s)
              for s in (k_scale, v_scale)]
    return caches[0], caches[1], table


def gather(cache, row, n):
    t = torch.arange(n)
    return cache[row.long()[t // cache.shape[1]], t % cache.shape[1]]  # [n, Hkv, D]


def cu(lens):
    return torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)


# ---------------------------------------------------------------- attention kernels
@interpreter
@pytest.mark.parametrize("block_size,d,hq,hkv,dtype,num_splits", [
    (16, 64, 8, 2, torch.bfloat16, 0), (32, 64, 4, 1, torch.float16, 3), (16, 128, 4, 4, torch.float32, 1),
    (32, 64, 4, 2, torch.float32, 3), (16, 64, 14, 2, torch.bfloat16, 0), (32, 64, 14, 2, torch.float32, 3)])
def test_decode_fp8_cache(block_size, d, hq, hkv, dtype, num_splits):
    """One query per sequence over FP8 caches (unsplit, and split three ways then merged): the
    float64 attention of the dequantized caches; a zero-length row gives 0."""
    gen = torch.Generator().manual_seed(block_size + d + hq)
    k_scale, v_scale = torch.tensor([0.021]), torch.tensor([3.5])
    lens = [1, 37, 100, 0]
    k_cache, v_cache, table = fp8_paged([max(n, 1) for n in lens], block_size, hkv, d, gen, k_scale, v_scale)
    q = torch.randn((len(lens), 1, hq, d), generator=gen).to(dtype)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), table,
                                  softmax_scale=0.17, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype
    kd, vd = dequantize(k_cache, k_scale), dequantize(v_cache, v_scale)
    ref = torch.stack([ref_attention(q[i], gather(kd, table[i], n), gather(vd, table[i], n), 0.17)
                       for i, n in enumerate(lens[:3])])
    assert rel_err(out[:3], ref) < TOL[dtype]
    assert (out[3] == 0).all()


@interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_fp8_packed_heads_of_a_strided_cache(num_splits):
    """Narrow FP8 heads read side by side (decode_plan.heads_per_program: two kv heads of 64 a program,
    two programs a row) from caches whose heads are not adjacent (every other head of a wider cache),
    unsplit and split: the float64 attention of the dequantized caches."""
    assert heads_per_program(True, 64, 4) == 2
    gen = torch.Generator().manual_seed(11 + num_splits)
    k_scale, v_scale = torch.tensor([0.03]), torch.tensor([0.7])
    lens = [45, 1, 90]
    k_wide, v_wide, table = fp8_paged(lens, 16, 8, 64, gen, k_scale, v_scale)
    k_cache, v_cache = k_wide[:, :, 1::2], v_wide[:, :, 1::2]  # [blocks, 16, 4, 64], head stride 128
    q = torch.randn((len(lens), 1, 12, 64), generator=gen).to(torch.bfloat16)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), table,
                                  num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
    kd, vd = dequantize(k_cache, k_scale), dequantize(v_cache, v_scale)
    ref = torch.stack([ref_attention(q[i], gather(kd, table[i], n), gather(vd, table[i], n), 64 ** -0.5)
                       for i, n in enumerate(lens)])
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@interpreter
def test_decode_fp8_rows_on_device_into_out_view():
    """The mixed step's decode launch (num_seqs on the device, a strided `out` view): rows in use
    are right, the rest of the buffer is untouched."""
    gen = torch.Generator().manual_seed(3)
    k_scale, v_scale = torch.tensor([0.5]), torch.tensor([0.02])
    lens = [20, 70, 5]
    k_cache, v_cache, table = fp8_paged(lens, 16, 2, 64, gen, k_scale, v_scale)
    q = torch.randn((3, 1, 4, 64), generator=gen).to(torch.bfloat16)
    buf = torch.full((3, 1, 6, 64), -7.0, dtype=torch.bfloat16)
    out = buf[:, :, :4]
    flash_attn_with_kvcache(q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), table,
                            num_seqs=torch.tensor([2], dtype=torch.int32), out=out, k_scale=k_scale, v_scale=v_scale)
    kd, vd = dequantize(k_cache, k_scale), dequantize(v_cache, v_scale)
    ref = torch.stack([ref_attention(q[i], gather(kd, table[i], n), gather(vd, table[i], n), 64 ** -0.5)
                       for i, n in enumerate(lens[:2])])
    assert rel_err(out[:2], ref) < TOL[torch.bfloat16]
    assert (out[2] == -7).all() and (buf[:, :, 4:] == -7).all()


@interpreter
@pytest.mark.parametrize("block_size,dtype,tiled", [
    (16, torch.float32, False), (32, torch.bfloat16, True), (16, torch.float16, True), (32, torch.float32, True)])
def test_prefill_fp8_cache(block_size, dtype, tiled):
    """Prefill chunks after cached prefixes (Lk > Lq), a fresh prompt, GQA, over FP8 caches, by the
    grid launch or the query-tile table: the float64 attention of the dequantized caches."""
    gen = torch.Generator().manual_seed(block_size + tiled)
    hq, hkv, d = 4, 2, 64
    k_scale, v_scale = torch.tensor([2.0]), torch.tensor([0.013])
    q_lens, k_lens = [5, 1, 70, 33], [21, 9, 95, 33]
    k_cache, v_cache, table = fp8_paged(k_lens, block_size, hkv, d, gen, k_scale, v_scale)
    q = torch.randn((sum(q_lens), hq, d), generator=gen).to(dtype)
    tiles = {}
    if tiled:
        seq, blk = build_query_tiles(np.array(q_lens), query_tile_rows(d, dtype), np.array(k_lens))
        tiles = {"tile_seq": torch.from_numpy(seq).int(), "tile_block": torch.from_numpy(blk).int(),
                 "num_tiles": torch.tensor([len(seq)], dtype=torch.int32)}
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens),
                                 softmax_scale=0.2, causal=True, block_table=table, k_scale=k_scale,
                                 v_scale=v_scale, **tiles)
    kd, vd = dequantize(k_cache, k_scale), dequantize(v_cache, v_scale)
    starts = cu(q_lens).tolist()
    ref = torch.cat([ref_attention(q[a : a + lq], gather(kd, table[i], lk), gather(vd, table[i], lk), 0.2)
                     for i, (a, lq, lk) in enumerate(zip(starts, q_lens, k_lens))])
    assert rel_err(out, ref) < TOL[dtype]


@triton.jit
def _planes_kernel(words_ptr, out_ptr, N: tl.constexpr):
    """out[j, c] = plane j of word c (e4m3_planes, float32)."""
    offs = tl.arange(0, N)
    p0, p1, p2, p3 = e4m3_planes(tl.load(words_ptr + offs), tl.float32)
    tl.store(out_ptr + offs, p0)
    tl.store(out_ptr + N + offs, p1)
    tl.store(out_ptr + 2 * N + offs, p2)
    tl.store(out_ptr + 3 * N + offs, p3)


@interpreter
def test_e4m3_planes_decode_every_byte_in_place():
    """The decode kernel's word-wise read: every finite e4m3 byte (subnormals, +-0, +-448), at each of
    a word's four positions, gives torch's float8_e4m3fn value, in plane j = byte j."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F / 0xFF: NaN
    n = codes.numel()  # 254: each code once per byte position, rotated through the four positions
    grid = torch.stack([codes.roll(-j) for j in range(4)], dim=1)  # [n, 4]: byte j of word c
    words = grid.contiguous().view(torch.int32).reshape(n)
    pad = triton.next_power_of_2(n)
    words = torch.cat([words, torch.zeros(pad - n, dtype=torch.int32)])
    out = torch.empty(4, pad, dtype=torch.float32)
    _planes_kernel[(1,)](words, out, N=pad)
    ref = grid.view(FP8).float().T  # [4, n]
    assert torch.equal(out[:, :n], ref)
    assert torch.equal(out[:, :n].signbit(), ref.signbit())  # -0 kept


@interpreter
def test_fp8_attention_bad_inputs():
    q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16)
    fp8 = torch.zeros(3, 16, 2, 64, dtype=FP8)
    lens, table = torch.tensor([3, 5], dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32)
    scale = torch.ones(1)
    with pytest.raises(TypeError, match="k_cache dtype torch.float8_e4m3fn.*k_scale and v_scale"):
        flash_attn_with_kvcache(q, fp8, fp8.clone(), lens, table)
    with pytest.raises(TypeError, match="k_cache dtype torch.bfloat16"):
        flash_attn_with_kvcache(q, fp8.bfloat16(), fp8.bfloat16(), lens, table, k_scale=scale, v_scale=scale)
    with pytest.raises(TypeError, match="v_scale"):
        flash_attn_with_kvcache(q, fp8, fp8.clone(), lens, table, k_scale=scale)
    with pytest.raises(TypeError, match="k_scale must be a float32"):
        flash_attn_with_kvcache(q, fp8, fp8.clone(), lens, table, k_scale=scale.double(), v_scale=scale)
    with pytest.raises(ValueError, match=r"v_scale must have shape \(1,\)"):
        flash_attn_with_kvcache(q, fp8, fp8.clone(), lens, table, k_scale=scale, v_scale=torch.ones(2))
    qp, c = q[:, 0], cu([2])
    with pytest.raises(ValueError, match="need block_table"):
        flash_attn_varlen_func(qp, qp[:, :2], qp[:, :2], c, c, 2, 2, k_scale=scale, v_scale=scale)
    with pytest.raises(TypeError, match="k dtype torch.float8_e4m3fn != q dtype"):
        flash_attn_varlen_func(qp, fp8, fp8.clone(), c, c, 2, 2, block_table=table[:1])
    # read as int32 words in four planes of head_dim / 4: a head_dim under 64, or a cache not word-aligned
    small = torch.zeros(3, 16, 2, 32, dtype=FP8)
    with pytest.raises(ValueError, match="FP8 KV cache needs head_dim >= 64.*got 32"):
        flash_attn_with_kvcache(q[..., :32].contiguous(), small, small.clone(), lens, table, k_scale=scale, v_scale=scale)
    shifted = torch.zeros(3 * 16 * 2 * 64 + 1, dtype=FP8)[1:].view(3, 16, 2, 64)
    with pytest.raises(ValueError, match=r"FP8 k_cache is read 4 values to a word.*offset 1"):
        flash_attn_with_kvcache(q, shifted, fp8.clone(), lens, table, k_scale=scale, v_scale=scale)


# ---------------------------------------------------------------- quantizing cache writes
def kv_with_outliers(n, hkv, d, gen, dtype, k_scale, v_scale):
    """k, v [n, Hkv, D] (strided views, as sliced from a fused qkv projection) with entries past
    448 * scale, and +-inf in v, which must saturate (all in token 0: give it a slot)."""
    qkv = torch.randn((n, (4 + 2 * hkv) * d), generator=gen) * 40
    q, k, v = (t.reshape(n, -1, d) for t in qkv.split([4 * d, hkv * d, hkv * d], dim=-1))
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 3.0 * FP8_MAX, 1.01 * FP8_MAX]) * k_scale
    v[0, 1, :4] = torch.tensor([float("inf"), -float("inf"), 1e30, -2.0 * FP8_MAX * v_scale.item()])
    return q.to(dtype), k.to(dtype), v.to(dtype)


def assert_stored(cache, values, slots, scale, untouched):
    """cache holds quantize(values[i]) at slots[i] >= 0, the saturated ones at +-448, no NaN
    anywhere; every other slot still holds `untouched`."""
    flat = cache.view(-1, *cache.shape[2:])
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s].view(torch.uint8), quantize(values[i], scale).view(torch.uint8))
            written[s] = True
    over = (values[slots >= 0].float() / scale).abs() > FP8_MAX
    assert over.any()  # the test reaches saturation
    assert (flat[slots[slots >= 0]].float().abs()[over] == FP8_MAX).all()
    assert not flat.float().isnan().any()
    assert torch.equal(flat[~written].view(torch.uint8), untouched.view(-1, *cache.shape[2:])[~written].view(torch.uint8))


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("with_norm", [True, False])
def test_rope_kv_write_fp8(dtype, block_size, with_norm):
    """The fused RoPE kernel's write into FP8 caches stores quantize(k_out) and quantize(v) byte for
    byte (the same bytes torch_attention.store_kvcache writes), saturating, skipping slot -1."""
    gen = torch.Generator().manual_seed(block_size + with_norm)
    n, hkv, d = 6, 2, 64
    # normalized k is O(1): a small scale makes its largest entries saturate too
    k_scale, v_scale = torch.tensor([0.008 if with_norm else 0.37]), torch.tensor([1.7])
    q, k, v = kv_with_outliers(n, hkv, d, gen, dtype, k_scale, v_scale)
    weights = [(torch.rand(d, generator=gen) + 0.5).to(dtype) for _ in range(2)]
    cos_sin = RotaryEmbedding(d, 64, 1e6).cos_sin_cache
    pos = torch.randint(0, 64, (n,), generator=gen)

    def call(**kw):
        if with_norm:
            return qk_norm_rope(q, k, *weights, pos, cos_sin, 1e-6, **kw)
        return rope(q, k, pos, cos_sin, **kw)

    slots = torch.tensor([3, -1, 2 * block_size + 5, block_size, 4 * block_size - 1, 7])
    empty = torch.full((4, block_size, hkv, d), 0.5).to(FP8)
    k_cache, v_cache = empty.clone(), empty.clone()
    q_out, k_out = call(kv_write=(v, k_cache, v_cache, slots), k_scale=k_scale, v_scale=v_scale)
    ref_q, ref_k = call()
    assert torch.equal(q_out, ref_q) and torch.equal(k_out, ref_k)
    assert_stored(k_cache, k_out, slots, k_scale, empty)
    assert_stored(v_cache, v, slots, v_scale, empty)
    torch_k, torch_v = empty.clone(), empty.clone()
    torch_attention.store_kvcache(k_out, v, torch_k, torch_v, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(torch_k.view(torch.uint8), k_cache.view(torch.uint8))
    assert torch.equal(torch_v.view(torch.uint8), v_cache.view(torch.uint8))
    with pytest.raises(ValueError, match="need kv_write"):
        call(k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(TypeError, match="k_cache dtype torch.float8_e4m3fn"):
        call(kv_write=(v, k_cache, v_cache, slots))


def test_torch_store_fp8_saturates():
    """The CPU path's cache write (no Triton): quantize(x) at each slot, +-448 past the range, no NaN."""
    gen = torch.Generator().manual_seed(0)
    k_scale, v_scale = torch.tensor([0.05]), torch.tensor([8.0])
    _, k, v = kv_with_outliers(5, 2, 32, gen, torch.float32, k_scale, v_scale)
    slots = torch.tensor([0, 17, -1, 31, 9])
    empty = torch.zeros((2, 16, 2, 32), dtype=FP8)
    k_cache, v_cache = empty.clone(), empty.clone()
    torch_attention.store_kvcache(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    assert_stored(k_cache, k, slots, k_scale, empty)
    assert_stored(v_cache, v, slots, v_scale, empty)


# ---------------------------------------------------------------- engines
checkpoint = checkpoint_fixture("fp8kv")


def with_kv_scales(src: str, dst: str, tensors: dict[str, torch.Tensor], scheme: dict | str | None) -> str:
    """A copy of checkpoint `src` at `dst` with `tensors` added and, when given, a compressed-tensors
    quantization_config whose kv_cache_scheme is `scheme`."""
    shutil.copytree(src, dst)
    weights = load_file(os.path.join(dst, "model.safetensors"))
    save_file({**weights, **tensors}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if scheme is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return dst


FP8_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def scale_tensors(scales, spelling="{kv}_scale"):
    return {f"model.layers.{i}.self_attn.{spelling.format(kv=kv)}": torch.tensor(s[j])
            for i, s in enumerate(scales) for j, kv in enumerate("kv")}


def engine_scales(llm) -> list[tuple[float, float]]:
    return [(k.item(), v.item()) for k, v in llm.model_runner.kv_scales]


def test_fp8_engine_same_tokens_under_every_scheduling_regime(checkpoint, tmp_path):
    """With the checkpoint's scales (compressed-tensors) the scales do not depend on the schedule, so
    the prefix cache (which must hit), 16-token prefill chunks and preemption give the tokens of the
    plain run on this model; the scales are the checkpoint's, unchanged. (Not a law: a schedule's
    float32 rounding can flip a value's e4m3 rounding, and a model with very sharp attention can then
    change a token, as a 12 / 2-head model of head_dim 128 did once in 112 under 16-token chunks.)"""
    scales = [(0.017, 0.029), (0.019, 0.032)]  # about what calibration picks for this model and prompts
    path = with_kv_scales(checkpoint, str(tmp_path / "scaled"), scale_tensors(scales), FP8_SCHEME)
    shared = list(range(100, 132))  # two full 16-token blocks for the prefix cache
    prompts = [shared + p for p in make_prompts(1, 5, 1, 40)] + make_prompts(2, 4, 20, 90)
    baseline, _ = generate_tokens(path, prompts, GREEDY, kv_cache_dtype="fp8", enable_prefix_caching=False)
    cached, llm = generate_tokens(path, prompts, GREEDY, kv_cache_dtype="fp8_e4m3")
    assert llm.block_manager.num_prefix_hit_blocks > 0
    chunked, _ = generate_tokens(path, prompts, GREEDY, kv_cache_dtype="fp8", max_num_batched_tokens=16)
    preempted, llm = generate_tokens(path, prompts, GREEDY, kv_cache_dtype="fp8", num_kvcache_blocks=12)
    assert llm.scheduler.num_preemptions > 0
    assert cached == baseline and chunked == baseline and preempted == baseline
    llm = cpu_llm(path, kv_cache_dtype="fp8", kvcache_block_size=16, max_model_len=512)
    assert llm.model_runner.kv_cache.dtype == FP8
    np.testing.assert_allclose(engine_scales(llm), scales, rtol=1e-6)
    assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == baseline
    np.testing.assert_allclose(engine_scales(llm), scales, rtol=1e-6)  # no calibration over the checkpoint's
    llm.exit()


def test_fp8_scales_from_the_first_prefill_step(checkpoint):
    """Without checkpoint scales they are 1.0 until the first prefill step, which sets them before
    writing: its largest |K| (|V|) of each layer is stored as FP8_MAX / KV_SCALE_HEADROOM. Later
    steps and requests leave them as they are."""
    prompt = make_prompts(3, 1, 32, 33)[0]  # two 16-token blocks: the whole 2-block cache is written
    llm = cpu_llm(checkpoint, kv_cache_dtype="fp8", kvcache_block_size=16, num_kvcache_blocks=2)
    assert engine_scales(llm) == [(1.0, 1.0)] * 2
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # one prefill step
    scales = engine_scales(llm)
    assert all(1e-4 < s < 1.0 for layer in scales for s in layer)
    stored_max = llm.model_runner.kv_cache.float().abs().amax(dim=(2, 3, 4, 5))  # [K / V, layer]
    assert (stored_max == FP8_MAX / KV_SCALE_HEADROOM).all()
    llm.generate(make_prompts(4, 2, 5, 16), SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert engine_scales(llm) == scales
    llm.exit()



def test_calculate_kv_scales_as_vllm_takes_it(checkpoint, tmp_path):
    """LLM(calculate_kv_scales=...): None (nanovllm's default) the checkpoint's scales, else the
    first prefill's; True (vLLM's) the first prefill's over the checkpoint's; False (vLLM's default)
    the checkpoint's, else 1.0 and never calibrated. A non-bool is a TypeError."""
    prompt = make_prompts(3, 1, 32, 33)[0]
    params = SamplingParams(temperature=0, max_tokens=2)
    scales = [(0.017, 0.029), (0.019, 0.032)]
    scaled = with_kv_scales(checkpoint, str(tmp_path / "scaled"), scale_tensors(scales), FP8_SCHEME)
    seen = {}
    for name, path, calculate in [("data", checkpoint, None), ("data", checkpoint, True), ("ones", checkpoint, False),
                                  ("ckpt", scaled, None), ("ckpt", scaled, False), ("recomputed", scaled, True)]:
        llm = cpu_llm(path, kv_cache_dtype="fp8", kvcache_block_size=16, calculate_kv_scales=calculate)
        try:
            llm.generate([prompt], params, use_tqdm=False)
            seen.setdefault(name, []).append(engine_scales(llm))
        finally:
            llm.exit()
    assert seen["ones"] == [[(1.0, 1.0)] * 2]
    np.testing.assert_allclose(seen["ckpt"], [scales, scales], rtol=1e-6)
    assert seen["data"][0] == seen["data"][1] == seen["recomputed"][0] != [(1.0, 1.0)] * 2
    with pytest.raises(TypeError, match="calculate_kv_scales must be None or a bool"):
        cpu_llm(checkpoint, kv_cache_dtype="fp8", calculate_kv_scales=1)


def test_update_weights_sets_the_scales_again(checkpoint, tmp_path):
    """Scales computed from the data belong to the weights they were computed under: after
    update_weights the next prefill step sets them again, so an engine started on dummy weights
    (verl's pattern: a warm-up request, then the real weights) serves as one started on the real
    ones. A checkpoint's scales stay as they are."""
    prompt = make_prompts(3, 1, 32, 33)[0]
    params = SamplingParams(temperature=0, max_tokens=6)
    weights = list(load_reference(checkpoint).state_dict().items())
    fresh = cpu_llm(checkpoint, kv_cache_dtype="fp8", kvcache_block_size=16)
    want = fresh.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    want_scales = engine_scales(fresh)
    fresh.exit()
    llm = cpu_llm(checkpoint, kv_cache_dtype="fp8", kvcache_block_size=16, load_format="dummy")
    llm.generate([prompt], params, use_tqdm=False)  # calibrates on the dummy weights
    assert engine_scales(llm) != want_scales
    llm.update_weights(weights)
    assert llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == want
    assert engine_scales(llm) == want_scales
    llm.exit()
    scales = [(0.017, 0.029), (0.019, 0.032)]
    path = with_kv_scales(checkpoint, str(tmp_path / "scaled"), scale_tensors(scales), FP8_SCHEME)
    llm = cpu_llm(path, kv_cache_dtype="fp8", kvcache_block_size=16)
    llm.update_weights(weights)
    llm.generate([prompt], params, use_tqdm=False)
    np.testing.assert_allclose(engine_scales(llm), scales, rtol=1e-6)
    llm.exit()


@pytest.mark.parametrize("empty", [list, lambda: (pair for pair in ())], ids=["list", "generator"])
def test_an_empty_update_leaves_no_cached_kv_of_other_scales(checkpoint, empty):
    """update_weights([]) still sets the scales computed from the data anew at the next prefill step
    (as every update_weights does); the prefix cache, whose KV the old scales quantized, is emptied
    with them. It was kept (no tensor was copied): a prompt cached before was then read with the new
    scales and its tokens changed. An empty generator (a sync that yields nothing) is the same update:
    it left the old scales (and the cache) as they were, unlike the empty list."""
    prompt = make_prompts(4, 1, 48, 49)[0]
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = cpu_llm(checkpoint, kv_cache_dtype="fp8", kvcache_block_size=16)
    try:
        llm.generate([prompt], params, use_tqdm=False)  # calibrates, and caches the prompt's blocks
        scales = engine_scales(llm)
        llm.update_weights(empty())
        llm.generate([[t * 3 % 384 for t in make_prompts(9, 1, 20, 21)[0]]], params, use_tqdm=False)
        assert engine_scales(llm) != scales  # set again from another prompt's data
        hits = llm.block_manager.num_prefix_hit_blocks
        fresh = cpu_llm(checkpoint, kv_cache_dtype="fp8", kvcache_block_size=16, calculate_kv_scales=False)
        for layer, (k_scale, v_scale) in zip(fresh.model_runner.kv_scales, engine_scales(llm)):
            layer[0].fill_(k_scale)
            layer[1].fill_(v_scale)
        want = fresh.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
        fresh.exit()
        assert llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == want
        assert llm.block_manager.num_prefix_hit_blocks == hits  # nothing of the old scales' KV was read
    finally:
        llm.exit()


def test_a_first_prefill_step_that_raises_calibrates_nothing(checkpoint):
    """A first prefill step that fails part way (an out-of-memory error, an interrupt: here a forward
    pre-hook on decoder layer 1 raising, after layer 0 set its scales) leaves the calibration to the next prefill step, which sets every
    layer's scales as a fresh engine's first step does."""
    prompt = make_prompts(3, 1, 32, 33)[0]
    params = SamplingParams(temperature=0, max_tokens=4)
    clean = cpu_llm(checkpoint, kv_cache_dtype="fp8", kvcache_block_size=16)
    want = clean.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    want_scales = engine_scales(clean)
    clean.exit()

    def fail(module, args):
        raise RuntimeError("injected failure in layer 1")

    llm = cpu_llm(checkpoint, kv_cache_dtype="fp8", kvcache_block_size=16)
    hook = llm.model_runner.model.model.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([prompt], params, use_tqdm=False)
    hook.remove()
    assert llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == want
    assert engine_scales(llm) == want_scales
    llm.exit()

@torch.no_grad()
def test_fp8_engine_close_to_transformers(checkpoint):
    """Teacher-forced on the FP8 engine's own greedy tokens, transformers (float32) picks the same
    token at most steps, and where it does not the FP8 token is a near-tie. Measured: 241 of 256
    steps (94%) agree, the largest gap is 2.9% of the row's logit range (a float32 engine: 100%, 0)."""
    prompts = make_prompts(5, 8, 20, 120)
    outs, _ = generate_tokens(checkpoint, prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                              kv_cache_dtype="fp8")
    reference = load_reference(checkpoint)
    agree, gaps = 0, []
    for prompt, out in zip(prompts, outs):
        logits = reference(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]  # [32, vocab]
        chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        agree += int((logits.argmax(-1) == torch.tensor(out)).sum())
        gaps.append(((logits.amax(-1) - chosen) / (logits.amax(-1) - logits.amin(-1))).max().item())
    assert agree >= 0.85 * sum(map(len, outs))
    assert max(gaps) < 0.08


@torch.no_grad()
def off_argmax_rate(reference, prompts, outs) -> float:
    """The fraction of the engine's tokens (teacher-forced on its own contexts) that are not the
    argmax of `reference`'s logits."""
    off = sum(int((reference(torch.tensor([p + o])).logits[0, len(p) - 1 : -1].argmax(-1) != torch.tensor(o)).sum())
              for p, o in zip(prompts, outs))
    return off / sum(map(len, outs))


def test_fp8_cache_accuracy_rule(checkpoint):
    """Issue 32's rule, against transformers in float32: a bf16 engine on an FP8 cache is off the
    float32 argmax at most twice as often as the larger of (a) the same engine on a bf16 cache and
    (b) a float32 engine on an FP8 cache, the e4m3 rounding of K and V and nothing else. On this
    random-weight model's flat logits (b) alone is 2.6x (a), so no FP8 cache meets "2x (a)" here;
    measured: (a) 2.3%, (b) 5.9%, the bf16 FP8 engine 7.8% of 256 steps (the models of seeds 1 and
    2: 2.3 / 9.8 / 8.2% and 2.0 / 11.7 / 9.4%). A wrong scale or layout puts it near 100%."""
    prompts = make_prompts(5, 8, 20, 120)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    reference = load_reference(checkpoint)
    rate = {(dtype, kv): off_argmax_rate(reference, prompts,
                                         generate_tokens(checkpoint, prompts, greedy, dtype=dtype, kv_cache_dtype=kv)[0])
            for dtype, kv in (("bfloat16", "auto"), ("float32", "fp8"), ("bfloat16", "fp8"))}
    assert rate["bfloat16", "fp8"] <= 2 * max(rate["bfloat16", "auto"], rate["float32", "fp8"]), rate


def test_fp8_cache_holds_more_blocks_in_the_same_memory(checkpoint):
    """The sizing the engine uses for num_kvcache_blocks=None, at a given memory: an FP8 cache has
    twice the blocks of a bfloat16 one and four times those of a float32 one."""
    budget = 3 * 2**30
    blocks = {(dtype, kv): blocks_in_budget(budget, kv_block_bytes(Config(checkpoint, dtype=dtype, kv_cache_dtype=kv)))
              for dtype in ("bfloat16", "float32") for kv in ("auto", "fp8")}
    assert blocks[("bfloat16", "fp8")] == 2 * blocks[("bfloat16", "auto")]
    assert blocks[("float32", "fp8")] == 4 * blocks[("float32", "auto")] == blocks[("bfloat16", "fp8")]
    cfg = Config(checkpoint, kv_cache_dtype="fp8", kvcache_block_size=16)
    shape = cfg.model_config
    assert kv_block_bytes(cfg) == 2 * shape.num_hidden_layers * 16 * shape.num_key_value_heads * shape.head_dim
    assert kv_block_bytes(cfg, world_size=2) == kv_block_bytes(cfg) // 2
    assert cfg.kv_cache_torch_dtype == FP8 and Config(checkpoint).kv_cache_torch_dtype == torch.float32


def test_kv_cache_memory_bytes_sizes_the_cache(checkpoint):
    """vLLM's kv_cache_memory_bytes: the cache holds the blocks that fit those bytes on one rank (an FP8
    cache, 1 byte an element, four times a float32 one's), whatever gpu_memory_utilization."""
    block = kv_block_bytes(Config(checkpoint, kvcache_block_size=16))  # float32 on the CPU
    for kv, per_block in (("auto", block), ("fp8", block // 4)):
        llm = cpu_llm(checkpoint, kv_cache_dtype=kv, kvcache_block_size=16, kv_cache_memory_bytes=37 * block + 5,
                      gpu_memory_utilization=0.01)
        try:
            assert llm.num_kvcache_blocks == (37 * block + 5) // per_block
            tokens = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            assert len(tokens[0].outputs[0].token_ids) == 4
        finally:
            llm.exit()
    with pytest.raises(ValueError, match=f"kv_cache_memory_bytes=100 holds no KV cache block: one takes {block} bytes"):
        cpu_llm(checkpoint, kvcache_block_size=16, kv_cache_memory_bytes=100)
    with pytest.raises(ValueError, match="pass num_kvcache_blocks or kv_cache_memory_bytes, not both"):
        Config(checkpoint, num_kvcache_blocks=4, kv_cache_memory_bytes=2**30)
    with pytest.raises(TypeError, match="kv_cache_memory_bytes"):
        Config(checkpoint, kv_cache_memory_bytes=1.5e9)


def test_start_up_line_names_blocks_and_dtype(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="nanovllm.engine.model_runner"):
        cpu_llm(checkpoint, kv_cache_dtype="fp8", kvcache_block_size=16, num_kvcache_blocks=40).exit()
        cpu_llm(checkpoint, kvcache_block_size=16, num_kvcache_blocks=20).exit()
    fp8_line, auto_line = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    assert "40 blocks of 16 tokens" in fp8_line and "float8_e4m3fn" in fp8_line
    assert "20 blocks of 16 tokens" in auto_line and "float32" in auto_line


@pytest.mark.parametrize("bad", ["fp16", "FP8", "fp8_e5m2", "float8_e4m3fn", None, 8])
def test_bad_kv_cache_dtype_is_refused(checkpoint, bad):
    with pytest.raises(ValueError, match=rf"kv_cache_dtype must be one of .*'fp8_e4m3'.*got {bad!r}"):
        cpu_llm(checkpoint, kv_cache_dtype=bad)
    assert KV_CACHE_DTYPES == ("auto", "bfloat16", "fp8", "fp8_e4m3")


def test_bfloat16_cache_is_the_model_dtype_by_vllms_name(checkpoint):
    """kv_cache_dtype="bfloat16" (vLLM's name of a bf16 cache): the "auto" cache of a bfloat16 engine,
    refused naming both dtypes where the model computes in another (the kernels read the compute dtype)."""
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bfloat16' needs the model to compute in bfloat16, but it "
                                         r"computes in torch.float32"):
        cpu_llm(checkpoint, kv_cache_dtype="bfloat16")
    outs = []
    for kv in ("auto", "bfloat16"):
        llm = cpu_llm(checkpoint, dtype="bfloat16", kv_cache_dtype=kv, kvcache_block_size=16, num_kvcache_blocks=20)
        try:
            assert llm.model_runner.kv_cache.dtype == torch.bfloat16
            outs.append([o["token_ids"] for o in llm.generate(make_prompts(4, 2, 5, 20), GREEDY, use_tqdm=False)])
        finally:
            llm.exit()
    assert outs[0] == outs[1]


def test_flash_attn_cannot_read_an_fp8_cache():
    """flash-attn 2 has no FP8 KV: asked for explicitly it is refused; "auto" takes our kernels."""
    with pytest.raises(ValueError, match="flash_attn.*FP8 KV cache"):
        select_attention_backend("flash_attn", "cuda", 256, fp8_kv=True, head_dim=128)
    assert select_attention_backend("auto", "cuda", 256, fp8_kv=True, head_dim=128).name == "triton"


def test_fp8_cache_head_dim_floor_on_the_triton_kernels():
    """The Triton decode kernel reads an FP8 cache in planes of head_dim / 4 (>= 16 for an MMA): a
    smaller head_dim is refused when the backend is chosen, naming it; the CPU's torch path reads any."""
    with pytest.raises(ValueError, match="FP8 KV cache needs head_dim >= 64.*got 32"):
        select_attention_backend("triton", "cuda", 256, fp8_kv=True, head_dim=32)
    assert select_attention_backend("triton", "cuda", 256, fp8_kv=True, head_dim=64).name == "triton"
    assert select_attention_backend("auto", "cpu", 16, fp8_kv=True, head_dim=32).name == "torch"


def test_checkpoint_scales_spellings_and_errors(checkpoint, tmp_path):
    """k_proj / v_proj.output_scale are read as k / v scales; an "auto" cache ignores scales; partial
    scales, a scheme that is not 8-bit float or not symmetric, a declared scheme without scales and a
    non-scalar scale are refused naming the problem."""
    scales = [(0.02, 0.03), (0.04, 0.05)]
    path = with_kv_scales(checkpoint, str(tmp_path / "output"), scale_tensors(scales, "{kv}_proj.output_scale"), None)
    llm = cpu_llm(path, kv_cache_dtype="fp8")
    np.testing.assert_allclose(engine_scales(llm), scales, rtol=1e-6)
    llm.exit()
    cpu_llm(path).exit()  # the weight loader skips the scale tensors
    partial = {k: v for k, v in scale_tensors(scales).items() if "layers.1.self_attn.v" not in k}
    cases = [
        (partial, FP8_SCHEME, r"some KV-cache scales but not all .*: missing model\.layers\.1\.self_attn\.v_scale"),
        (scale_tensors(scales), {**FP8_SCHEME, "num_bits": 4, "type": "int"}, "not an FP8"),
        # asymmetric (a zero point besides each scale): vLLM refuses it too, the scales alone would misread
        (scale_tensors(scales), {**FP8_SCHEME, "symmetric": False}, r"kv_cache_scheme symmetric=False .*symmetric"),
        ({}, FP8_SCHEME, "holds no"),
        ({**scale_tensors(scales), "model.layers.0.self_attn.k_scale": torch.ones(2)}, FP8_SCHEME,
         r"k_scale must be one positive finite number, got shape \(2,\)"),
        ({**scale_tensors(scales), "model.layers.1.self_attn.k_scale": torch.tensor(0.0)}, None, "positive"),
    ]
    for i, (tensors, scheme, message) in enumerate(cases):
        bad = with_kv_scales(checkpoint, str(tmp_path / f"bad{i}"), tensors, scheme)
        with pytest.raises(ValueError, match=message):
            cpu_llm(bad, kv_cache_dtype="fp8")


def test_kv_cache_scheme_named_as_a_string(checkpoint, tmp_path):
    """quant_method "fp8" checkpoints (AMD's *-FP8-KV, AutoFP8's) write kv_cache_scheme "static" with
    k_proj / v_proj.output_scale tensors; "dynamic" holds none (it raised AttributeError on the str)."""
    scales = [(0.02, 0.03), (0.04, 0.05)]
    tensors = scale_tensors(scales, "{kv}_proj.output_scale")
    llm = cpu_llm(with_kv_scales(checkpoint, str(tmp_path / "static"), tensors, "static"), kv_cache_dtype="fp8")
    np.testing.assert_allclose(engine_scales(llm), scales, rtol=1e-6)
    llm.exit()
    cpu_llm(with_kv_scales(checkpoint, str(tmp_path / "dynamic"), {}, "dynamic"), kv_cache_dtype="fp8").exit()
    with pytest.raises(ValueError, match="declares kv_cache_scheme 'static' but holds no"):
        cpu_llm(with_kv_scales(checkpoint, str(tmp_path / "none"), {}, "static"), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"kv_cache_scheme 'fp8' is not a compressed-tensors scheme .*'static'"):
        cpu_llm(with_kv_scales(checkpoint, str(tmp_path / "odd"), tensors, "fp8"), kv_cache_dtype="fp8")


def test_one_kv_scale_per_layer_serves_keys_and_values(checkpoint, tmp_path):
    """The first FP8-KV checkpoints (AutoFP8, vLLM's docs) hold one model.layers.N.self_attn.kv_scale:
    vLLM reads it as both scales. Such a checkpoint was refused whatever the cache (an unknown weight)."""
    scales = [(0.02, 0.02), (0.04, 0.04)]
    tensors = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(k) for i, (k, _) in enumerate(scales)}
    path = with_kv_scales(checkpoint, str(tmp_path / "kv"), tensors, "static")
    llm = cpu_llm(path, kv_cache_dtype="fp8")
    np.testing.assert_allclose(engine_scales(llm), scales, rtol=1e-6)
    llm.exit()
    cpu_llm(path).exit()  # the weight loader skips them


def test_per_head_kv_scales_are_refused_naming_the_strategy(checkpoint, tmp_path):
    """compressed-tensors' per-head KV scheme (strategy "attn_head": one k_scale / v_scale per KV
    head) is named as such under an FP8 cache, which takes one scale a layer (it was refused as a
    scale of the wrong shape, naming neither the scheme nor its strategy); an "auto" cache ignores
    the scales, as any other."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        heads = json.load(f)["num_key_value_heads"]
    tensors = {f"model.layers.{i}.self_attn.{kv}_scale": torch.full((heads, 1, 1), 0.02)
               for i in range(2) for kv in "kv"}
    path = with_kv_scales(checkpoint, str(tmp_path / "heads"), tensors, {**FP8_SCHEME, "strategy": "attn_head"})
    with pytest.raises(ValueError, match="kv_cache_scheme strategy 'attn_head' is not supported .*'tensor'"):
        cpu_llm(path, kv_cache_dtype="fp8")
    cpu_llm(path).exit()


def test_kv_cache_scheme_alone_as_llm_compressor_writes_it(checkpoint, tmp_path):
    """A calibrated FP8 KV cache alone, as compressed-tensors serializes it: config_groups {} (no weight
    scheme), format "dense", every Linear in ignore, empty sparsity / transform configs. Full-precision
    weights (as vLLM reads it; it was refused for its format, then for its empty config_groups) and
    the checkpoint's KV scales, the tokens of the same scales under the bare kv_cache_scheme."""
    scales = [(0.02, 0.03), (0.04, 0.05)]
    bare = with_kv_scales(checkpoint, str(tmp_path / "bare"), scale_tensors(scales), FP8_SCHEME)
    path = with_kv_scales(checkpoint, str(tmp_path / "ct"), scale_tensors(scales), None)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    linears = [f"model.layers.{i}.{m}" for i in range(cfg["num_hidden_layers"])
               for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]
    cfg["quantization_config"] = {"config_groups": {}, "format": "dense", "global_compression_ratio": None,
                                  "ignore": linears, "kv_cache_scheme": FP8_SCHEME,
                                  "quant_method": "compressed-tensors", "quantization_status": "compressed",
                                  "sparsity_config": {}, "transform_config": {}, "version": "0.12.2"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    prompts = make_prompts(3, 3, 10, 40)
    llm = cpu_llm(path, kv_cache_dtype="fp8", kvcache_block_size=16, max_model_len=512)
    try:
        assert llm.config.quant_config is None
        np.testing.assert_allclose(engine_scales(llm), scales, rtol=1e-6)
        tokens = complete_tokens(llm, prompts, GREEDY)
    finally:
        llm.exit()
    assert tokens == generate_tokens(bare, prompts, GREEDY, kv_cache_dtype="fp8")[0]
    # whatever format it names: no config group quantizes any weight
    quant = {**cfg["quantization_config"], "format": "float-quantized"}
    assert resolve_quantization(None, quant, "c") is None
    assert resolve_quantization("fp8", quant, "c") == resolve_quantization("fp8", None, "c")  # online FP8 weights


@pytest.mark.parametrize("spelling", ["{kv}_proj.{kv}_scale", "qkv_proj.{kv}_scale", "attn.{kv}_scale"])
def test_kv_scales_under_every_name_vllm_loads(checkpoint, tmp_path, spelling):
    """vLLM's maybe_remap_kv_scale_name maps ModelOpt's self_attn.k_proj.k_scale / v_proj.v_scale and
    self_attn.qkv_proj.k_scale / v_scale onto the layer's scales; its own parameter names,
    self_attn.attn.k_scale / v_scale, it loads past (unread, with a warning). Each is read as the
    layer's scales under an FP8 cache and skipped under an "auto" one (each was refused whatever the
    cache, an unknown weight)."""
    scales = [(0.02, 0.03), (0.04, 0.05)]
    path = with_kv_scales(checkpoint, str(tmp_path / "named"), scale_tensors(scales, spelling), FP8_SCHEME)
    llm = cpu_llm(path, kv_cache_dtype="fp8")
    np.testing.assert_allclose(engine_scales(llm), scales, rtol=1e-6)
    llm.exit()
    cpu_llm(path).exit()


def test_query_and_softmax_scales_are_skipped(checkpoint, tmp_path):
    """Checkpoints calibrated for FP8 attention also hold the query's and the softmax output's scales
    (self_attn.q_scale / prob_scale; quant_method "fp8" ones q_proj.output_scale / prob_output_scale),
    which vLLM loads for its FP8 attention backends only. Attention here runs in the compute dtype: they
    are skipped, whatever the cache, and the K / V scales stay the checkpoint's (they were refused
    as unknown weights)."""
    scales = [(0.02, 0.03), (0.04, 0.05)]
    others = {f"model.layers.{i}.self_attn.{name}": torch.tensor(0.5) for i in range(len(scales))
              for name in ("q_scale", "prob_scale", "q_proj.output_scale", "prob_output_scale")}
    path = with_kv_scales(checkpoint, str(tmp_path / "attn"), {**scale_tensors(scales), **others}, FP8_SCHEME)
    prompts = make_prompts(3, 2, 10, 30)
    llm = cpu_llm(path, kv_cache_dtype="fp8")
    np.testing.assert_allclose(engine_scales(llm), scales, rtol=1e-6)
    llm.exit()
    llm = cpu_llm(path)
    try:
        tokens = complete_tokens(llm, prompts, GREEDY)
    finally:
        llm.exit()
    assert tokens == generate_tokens(checkpoint, prompts, GREEDY)[0]
