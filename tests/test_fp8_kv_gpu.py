"""FP8 KV cache on a CUDA device (run with `pytest -m gpu`).

Kernels at Qwen3 shapes (head_dim 128, GQA 2 and 4, blocks 16 and 256), compiled: the fused
RoPE kernel's quantizing write byte for byte against the definition e4m3(clamp(x / scale,
-448, 448)) (saturating, no NaN), and decode / paged prefill attention over FP8 caches against
float64 references on the dequantized caches (fp8 * scale), split, unsplit, tiled, and replayed
from CUDA graphs after the scales changed in place. Engines in bf16 with kv_cache_dtype="fp8":
close to transformers, identical with CUDA graphs on and off, twice the blocks of a bf16 cache.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from checkpoints import GPU_SHAPE, checkpoint_fixture, gpu_generate, gpu_reference_fixture, make_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.kernels.decode_attention import flash_attn_with_kvcache
from nanovllm.kernels.fused_rope import qk_norm_rope, rope
from nanovllm.kernels.prefill_attention import flash_attn_varlen_func
from nanovllm.kernels.prefill_plan import build_query_tiles, query_tile_rows
from nanovllm.layers.rotary_embedding import RotaryEmbedding

pytestmark = pytest.mark.gpu
DEV = "cuda"
D = 128
HEADS = [(16, 8), (32, 8)]
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# bf16 output rounding alone is ~2-3e-3 (the FP8 values convert to bf16 exactly).
TOL = 8e-3
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def quantize(x, scale):
    """The stored value's definition: e4m3(clamp(x / scale, -448, 448)), a float32 division."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def rel_err(out, ref):
    assert torch.isfinite(out).all(), "NaN / inf in output"
    return ((out.double() - ref).norm() / ref.norm()).item()


def ref_attention(q, k, v, scale, head_chunk=4):
    """float64 q [Lq, Hq, D], k/v [Lk, Hkv, D] (already dequantized) -> [Lq, Hq, D], causal bottom-right."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    out = torch.empty(q.shape, dtype=torch.float64, device=DEV)
    for h0 in range(0, hq, head_chunk):
        hs = slice(h0, min(hq, h0 + head_chunk))
        kh = torch.arange(hs.start, hs.stop, device=DEV) // (hq // hkv)
        s = torch.einsum("qhd,khd->hqk", q[:, hs].double(), k[:, kh]) * scale
        s.masked_fill_(torch.arange(lk, device=DEV)[None, :] > torch.arange(lq, device=DEV)[:, None] + (lk - lq),
                       float("-inf"))
        out[:, hs] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[:, kh])
    return out


def fp8_paged(lens, block_size, hkv, gen, k_scale, v_scale, extra_width=2, d=D):
    """FP8 caches of random values over most of e4m3's range and a shuffled block table."""
    nblk = [-(-n // block_size) for n in lens]
    num_blocks = sum(nblk) + 4
    perm = torch.randperm(num_blocks, device=DEV, generator=gen).int()
    table = torch.zeros((len(lens), max(nblk) + extra_width), dtype=torch.int32, device=DEV)
    for i, start in enumerate(np.cumsum([0] + nblk[:-1]).tolist()):
        table[i, : nblk[i]] = perm[start : start + nblk[i]]
    caches = [quantize(torch.randn((num_blocks, block_size, hkv, d), generator=gen, device=DEV) * 150 * s, s)
              for s in (k_scale, v_scale)]
    return caches[0], caches[1], table


def gather(cache, scale, row, n):
    """The first n tokens of one sequence, dequantized to float64: [n, Hkv, D]."""
    t = torch.arange(n, device=DEV)
    return cache[row.long()[t // cache.shape[1]], t % cache.shape[1]].double() * scale.double()


def cu(lens):
    return torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32, device=DEV)


def scales(k, v):
    return torch.tensor([k], device=DEV), torch.tensor([v], device=DEV)


# ---------------------------------------------------------------- the quantizing write
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("block_size", [16, 256])
def test_rope_kv_write_fp8(with_norm, block_size):
    """quantize(k_out) and quantize(v) at every slot >= 0, byte for byte (div_rn and the hardware's
    round-to-nearest-even conversion are torch's), +-448 past the range (inf too), no NaN."""
    gen = torch.Generator(DEV).manual_seed(block_size)
    n, hq, hkv = 3000, 16, 8
    k_scale, v_scale = scales(0.01 if with_norm else 0.3, 0.05)
    qkv = torch.randn((n, (hq + 2 * hkv) * D), generator=gen, device=DEV) * 40
    q, k, v = (t.reshape(n, -1, D) for t in qkv.bfloat16().split([hq * D, hkv * D, hkv * D], dim=-1))
    v[0, 0, :3] = torch.tensor([float("inf"), -float("inf"), 1e30])
    weights = [(torch.rand(D, generator=gen, device=DEV) + 0.5).bfloat16() for _ in range(2)]
    cos_sin = RotaryEmbedding(D, 4096, 1e6).cos_sin_cache.to(DEV)
    pos = torch.randint(0, 4096, (n,), generator=gen, device=DEV)
    num_blocks = 2 * n // block_size + 1
    slots = torch.randperm(num_blocks * block_size, device=DEV, generator=gen)[:n]
    slots[1:][torch.rand(n - 1, device=DEV, generator=gen) < 0.1] = -1
    k_cache = torch.full((num_blocks, block_size, hkv, D), 0.5, device=DEV).to(FP8)
    v_cache = k_cache.clone()
    kv_write = (v, k_cache, v_cache, slots)
    if with_norm:
        _, k_out = qk_norm_rope(q, k, *weights, pos, cos_sin, 1e-6, kv_write=kv_write, k_scale=k_scale, v_scale=v_scale)
    else:
        _, k_out = rope(q, k, pos, cos_sin, kv_write=kv_write, k_scale=k_scale, v_scale=v_scale)
    keep = slots >= 0
    for cache, x, scale in ((k_cache, k_out, k_scale), (v_cache, v, v_scale)):
        flat = cache.view(-1, hkv, D)
        assert torch.equal(flat[slots[keep]].view(torch.uint8), quantize(x[keep], scale).view(torch.uint8))
        over = (x[keep].float() / scale).abs() > FP8_MAX
        assert over.any() and (flat[slots[keep]].float().abs()[over] == FP8_MAX).all()
        assert not flat.float().isnan().any()
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEV)
        untouched[slots[keep]] = False
        assert (flat[untouched].float() == 0.5).all()


# ---------------------------------------------------------------- attention over FP8 caches
# Qwen3's heads, and head_dim 64 (Qwen2.5-0.5B's 14 / 2, Llama-3.2-1B's 32 / 8), whose kv heads a program
# reads two at a time (decode_plan.heads_per_program)
@pytest.mark.parametrize("hq,hkv,d", [(hq, hkv, D) for hq, hkv in HEADS] + [(14, 2, 64), (32, 8, 64)])
@pytest.mark.parametrize("block_size", [16, 256])
# split (few rows, folded merge), unsplit 128-key tiles (few programs per SM), unsplit 64-key tiles
@pytest.mark.parametrize("lens", [[1, 15, 17, 1000, 4097, 8192], [5000] * 40, [1 + 13 * i for i in range(160)]])
def test_decode_fp8(hq, hkv, d, block_size, lens):
    gen = torch.Generator(DEV).manual_seed(3)
    k_scale, v_scale = scales(0.02, 3.0)
    kc, vc, table = fp8_paged(lens, block_size, hkv, gen, k_scale, v_scale, d=d)
    q = torch.randn((len(lens), 1, hq, d), generator=gen, device=DEV).bfloat16()
    out = flash_attn_with_kvcache(q, kc, vc, torch.tensor(lens, dtype=torch.int32, device=DEV), table,
                                  k_scale=k_scale, v_scale=v_scale)
    ref = torch.stack([ref_attention(q[i], gather(kc, k_scale, table[i], n), gather(vc, v_scale, table[i], n),
                                     d ** -0.5) for i, n in enumerate(lens)])
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("num_seqs", [False, True])
def test_decode_fp8_cuda_graph_reads_scales_at_replay(num_seqs):
    """A decode call captured once (plain, or at a row capacity with num_seqs and an `out` view, as
    mixed steps run it), replayed after new lengths, tables, queries and scales were written in
    place: each replay uses the scales it finds."""
    gen = torch.Generator(DEV).manual_seed(4)
    hq, hkv, bs, batch, width = 16, 8, 256, 8, 16
    k_scale, v_scale = scales(1.0, 1.0)
    kc, vc, _ = fp8_paged([bs * width] * batch, bs, hkv, gen, k_scale, v_scale)
    q = torch.randn((batch, 1, hq, D), generator=gen, device=DEV).bfloat16()
    seqlens = torch.ones(batch, dtype=torch.int32, device=DEV)
    table = torch.zeros((batch, width), dtype=torch.int32, device=DEV)
    rows = torch.full((1,), batch, dtype=torch.int32, device=DEV)
    out = torch.full((batch, 1, hq + 4, D), float("nan"), dtype=torch.bfloat16, device=DEV)[:, :, :hq]
    extra = {"num_seqs": rows, "out": out} if num_seqs else {}

    def attend():
        return flash_attn_with_kvcache(q, kc, vc, seqlens, table, k_scale=k_scale, v_scale=v_scale, **extra)

    attend()  # compiles (and allocates the arrival counters) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = attend()
    for trial, (ks, vs) in enumerate(((0.03, 2.0), (0.5, 0.01), (0.004, 9.0))):
        lens = torch.randint(1, bs * width + 1, (batch,), generator=gen, device=DEV)
        seqlens.copy_(lens.int())
        table.copy_(torch.randperm(kc.shape[0], device=DEV, generator=gen)[: batch * width].view(batch, width).int())
        q.copy_(torch.randn((batch, 1, hq, D), generator=gen, device=DEV))
        k_scale.fill_(ks)
        v_scale.fill_(vs)
        result.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.stack([ref_attention(q[i], gather(kc, k_scale, table[i], n), gather(vc, v_scale, table[i], n),
                                         D ** -0.5) for i, n in enumerate(lens.tolist())])
        assert rel_err(result, ref) < TOL, f"replay {trial}"


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("tiled", [False, True])
def test_prefill_fp8(hq, hkv, block_size, tiled):
    """Chunks after cached prefixes, a fresh prompt and decode-like rows over FP8 caches, by the
    grid launch or the query-tile table."""
    gen = torch.Generator(DEV).manual_seed(2)
    k_scale, v_scale = scales(0.7, 0.004)
    q_lens, k_lens = [1, 200, 513, 300, 17], [1000, 200, 8192, 300, 4000]
    kc, vc, table = fp8_paged(k_lens, block_size, hkv, gen, k_scale, v_scale)
    q = torch.randn((sum(q_lens), hq, D), generator=gen, device=DEV).bfloat16()
    tiles = {}
    if tiled:
        seq, blk = build_query_tiles(np.array(q_lens), query_tile_rows(D, torch.bfloat16), np.array(k_lens))
        tiles = {"tile_seq": torch.from_numpy(seq).int().to(DEV), "tile_block": torch.from_numpy(blk).int().to(DEV),
                 "num_tiles": torch.tensor([len(seq)], dtype=torch.int32, device=DEV)}
    out = flash_attn_varlen_func(q, kc, vc, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), causal=True,
                                 block_table=table, k_scale=k_scale, v_scale=v_scale, **tiles)
    starts = [0] + np.cumsum(q_lens).tolist()
    ref = torch.cat([ref_attention(q[a : a + lq], gather(kc, k_scale, table[i], lk), gather(vc, v_scale, table[i], lk),
                                   D ** -0.5) for i, (a, lq, lk) in enumerate(zip(starts, q_lens, k_lens))])
    assert rel_err(out, ref) < TOL


def test_prefill_fp8_cuda_graph_reads_scales_at_replay():
    """A tile-table prefill call captured once, replayed after the scales changed in place."""
    gen = torch.Generator(DEV).manual_seed(5)
    hq, hkv, bs = 16, 8, 256
    k_scale, v_scale = scales(1.0, 1.0)
    q_lens, k_lens = [1, 1, 700, 300], [900, 40, 1212, 300]
    kc, vc, table = fp8_paged(k_lens, bs, hkv, gen, k_scale, v_scale)
    q = torch.randn((sum(q_lens), hq, D), generator=gen, device=DEV).bfloat16()
    seq, blk = build_query_tiles(np.array(q_lens), query_tile_rows(D, torch.bfloat16), np.array(k_lens))
    tiles = {"tile_seq": torch.from_numpy(seq).int().to(DEV), "tile_block": torch.from_numpy(blk).int().to(DEV),
             "num_tiles": torch.tensor([len(seq)], dtype=torch.int32, device=DEV)}
    cq, ck = cu(q_lens), cu(k_lens)

    def attend():
        return flash_attn_varlen_func(q, kc, vc, cq, ck, max(q_lens), max(k_lens), causal=True, block_table=table,
                                      k_scale=k_scale, v_scale=v_scale, **tiles)

    attend()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()
    starts = [0] + np.cumsum(q_lens).tolist()
    for ks, vs in ((0.05, 3.0), (2.0, 0.001)):
        k_scale.fill_(ks)
        v_scale.fill_(vs)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.cat([ref_attention(q[a : a + lq], gather(kc, k_scale, table[i], lk),
                                       gather(vc, v_scale, table[i], lk), D ** -0.5)
                         for i, (a, lq, lk) in enumerate(zip(starts, q_lens, k_lens))])
        assert rel_err(out, ref) < TOL


# ---------------------------------------------------------------- engines
ckpt = checkpoint_fixture("fp8gpu", GPU_SHAPE)
reference = gpu_reference_fixture()


@torch.no_grad()
def agreement(reference, prompts, outs) -> tuple[float, float]:
    """Teacher-forced on the engine's own tokens: (the fraction of steps where transformers' argmax
    is the engine's token, the largest gap of the engine's token below the argmax as a fraction of
    the row's logit range)."""
    agree, steps, gap = 0, 0, 0.0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out], device=DEV)
        logits = reference(ids).logits[0, len(prompt) - 1 : -1].float()  # [len(out), vocab]
        tokens = torch.tensor(out, device=DEV)
        chosen = logits.gather(1, tokens[:, None])[:, 0]
        agree += int((logits.argmax(-1) == tokens).sum())
        steps += len(out)
        gap = max(gap, ((logits.amax(-1) - chosen) / (logits.amax(-1) - logits.amin(-1))).max().item())
    return agree / steps, gap


# Calibrated on the H200 (torch 2.11, Triton 3.6; bf16 engine, FP8 cache, the test's prompts), per
# regime: 86.5-89.1% of steps agree, the largest gap is 6.9% of the row's logit range (a bf16 cache:
# 96.4-97.4%, 1.0%). e4m3 keeps 3 mantissa bits, so near-ties flip more often than with bf16's 7.
MIN_AGREEMENT = 0.8
MAX_GAP = 0.12


def test_fp8_engine_close_to_transformers(ckpt, reference):
    """A bf16 engine with an FP8 cache (scales from the first prefill step), through every
    scheduling regime: transformers' bf16 argmax agrees with its greedy token at most steps, and
    where not the token is a near-tie. (A bf16 cache passes assert_bf16_greedy_matches at every
    step: checkpoints.BF16_TOLERANCE = 0.02.)"""
    shared = list(range(100, 372))
    ps = [shared + p for p in make_prompts(1, 6, 1, 80)] + make_prompts(2, 6, 50, 400)
    regimes = {"plain": {"enable_prefix_caching": False}, "prefix-cache": {},
               "chunked": {"max_num_batched_tokens": 64}, "preempt": {"num_kvcache_blocks": -(-(400 + 32) // 16) + 1}}
    for name, kw in regimes.items():
        (outs,), facts = gpu_generate(ckpt, [ps], GREEDY, kv_cache_dtype="fp8", **kw)
        assert facts["backend"] == "triton"  # flash-attn cannot read FP8 K/V
        if name == "preempt":
            assert facts["preemptions"] > 0
        if name == "prefix-cache":
            assert facts["prefix_hits"] > 0
        share, gap = agreement(reference, ps, outs)
        assert share >= MIN_AGREEMENT and gap < MAX_GAP, (name, share, gap)


def test_fp8_cache_accuracy_rule(ckpt):
    """Issue 32's rule on the GPU kernels (tests/test_fp8_kv.py holds its CPU twin and the reasoning),
    against transformers in float32: a bf16 engine on an FP8 cache is off the float32 argmax at
    most twice as often as the larger of the bf16 cache's rate and the FP8 format's own (a float32
    engine on an FP8 cache: fp32 planes in the decode kernel)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa")
    reference = reference.cuda().eval()
    ps = make_prompts(7, 16, 50, 400)
    rate = {}
    for dtype, kv in (("bfloat16", "auto"), ("float32", "fp8"), ("bfloat16", "fp8")):
        (outs,), _ = gpu_generate(ckpt, [ps], GREEDY, dtype=dtype, kv_cache_dtype=kv)
        rate[dtype, kv] = 1 - agreement(reference, ps, outs)[0]
    print("off the float32 argmax:", rate)
    assert rate["bfloat16", "fp8"] <= 2 * max(rate["bfloat16", "auto"], rate["float32", "fp8"]), rate


def test_fp8_cuda_graphs_and_eager_identical(ckpt):
    """Decode graphs and prefill / mixed-step graphs read the same FP8 cache and scales as eager
    steps: batches of 1, 2, 8 and 48 requests, one after another on one engine of each kind, give
    identical tokens (the scales come from the same first prefill step, which runs eagerly)."""
    batches = [make_prompts(3, batch, 20, 200) for batch in (1, 2, 8, 48)]
    graph, facts = gpu_generate(ckpt, batches, GREEDY, kv_cache_dtype="fp8")
    assert facts["graphs"] and facts["prefill_graphs"]
    eager, facts = gpu_generate(ckpt, batches, GREEDY, kv_cache_dtype="fp8", enforce_eager=True)
    assert not facts["graphs"]
    assert graph == eager


# Qwen2.5-0.5B's attention (14 query heads over 2 kv heads of 64), whose FP8 cache a decode program
# reads two kv heads at a time (decode_plan.heads_per_program)
narrow_ckpt = checkpoint_fixture("fp8gpu64", replace(GPU_SHAPE, num_attention_heads=14, num_key_value_heads=2,
                                                     head_dim=64))


def test_fp8_narrow_heads_engine(narrow_ckpt):
    """Decode graphs over an FP8 cache of narrow heads give the tokens of eager steps (prefill and
    mixed steps eager on both sides; batches of 16 and 48, prompts sharing a prefix among them), and
    with prefill graphs on too, the engine's greedy tokens agree with transformers' bf16 argmax as
    test_fp8_engine_close_to_transformers asks. Prefill graphs are off for the identity: a prefill
    graph's padded token bucket runs the projections at the bucket's rows, where cuBLAS may round
    otherwise than eager (measured: with prefill graphs on, 1-4 of 12-16 sequences parted from eager,
    each at a top-2 logprob margin of 0-0.125, and as often with packing off; with decode graphs
    only, none, at 12 rows too: BENCHMARKS.md, fifty-sixth session). Both batches are captured sizes,
    as the other identity tests' are (test_moe_gpu.test_cuda_graph_and_eager_decode_identical)."""
    from transformers import AutoModelForCausalLM

    shared = list(range(100, 372))
    ps = [shared + p for p in make_prompts(1, 8, 1, 80)] + make_prompts(2, 8, 50, 400)
    batches = [ps, make_prompts(3, 48, 20, 200)]
    graph, facts = gpu_generate(narrow_ckpt, batches, GREEDY, kv_cache_dtype="fp8", prefill_graphs=False)
    assert facts["graphs"] and not facts["prefill_graphs"]
    eager, facts = gpu_generate(narrow_ckpt, batches, GREEDY, kv_cache_dtype="fp8", enforce_eager=True)
    assert not facts["graphs"] and graph == eager
    both, facts = gpu_generate(narrow_ckpt, batches[:1], GREEDY, kv_cache_dtype="fp8")
    assert facts["prefill_graphs"]
    reference = AutoModelForCausalLM.from_pretrained(narrow_ckpt, dtype=torch.bfloat16, attn_implementation="sdpa")
    reference = reference.cuda().eval()
    for outs in (graph[0], both[0]):
        share, gap = agreement(reference, ps, outs)
        assert share >= MIN_AGREEMENT and gap < MAX_GAP, (share, gap)


def test_fp8_cache_has_twice_the_blocks(ckpt):
    """Sized from memory (num_kvcache_blocks=None) at the same gpu_memory_utilization, an FP8 cache
    has about twice the blocks of a bf16 one, in the same bytes."""

    def cache_facts(kv_cache_dtype):  # (blocks, bytes, dtype); the engine and its cache are gone after
        # 0.3: the first engine's cache, freed but still reserved by PyTorch's allocator, leaves room
        llm = LLM(ckpt, kvcache_block_size=256, max_model_len=2048, gpu_memory_utilization=0.3, max_num_seqs=8,
                  dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, enforce_eager=True)
        try:
            return llm.num_kvcache_blocks, llm.model_runner.kv_cache.nbytes, llm.model_runner.kv_cache.dtype
        finally:
            llm.exit()

    (auto_blocks, auto_bytes, auto_dtype), (fp8_blocks, fp8_bytes, fp8_dtype) = map(cache_facts, ("auto", "fp8"))
    assert auto_dtype == torch.bfloat16 and fp8_dtype == FP8
    assert 1.95 < fp8_blocks / auto_blocks < 2.05
    assert 0.95 < fp8_bytes / auto_bytes < 1.05


def test_flash_attn_backend_refused_with_fp8(ckpt):
    with pytest.raises(ValueError, match="FP8 KV cache"):
        LLM(ckpt, kv_cache_dtype="fp8", attention_backend="flash_attn", kvcache_block_size=256)
