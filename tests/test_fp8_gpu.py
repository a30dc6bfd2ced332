"""GPU tests of FP8 weights (`pytest -m gpu`): the GEMV's FP8 variant at Qwen3 layer shapes
against float64 on the dequantized weights; the activation quantization bit for bit; the
scaled-mm path (per-token x rowwise, per-group x blockwise, static) against float64 on its
dequantized operands; FP8 engines in bf16 against transformers in float32 on the dequantized
weights, graphs on and off identical, update_weights equal to a fresh engine (block scales, and a
static-activation engine keeping its input scales)."""

from __future__ import annotations

import re

import pytest
import torch

from checkpoints import (
    MoeShape, TinyShape, build_checkpoint, build_moe_checkpoint, checkpoint_fixture, gpu_generate, make_prompts,
)
from fp8_checkpoints import (LAYOUTS, checkpoint_state, quantize_activations, quantize_channels, quantize_state, write_fp8,
                             write_state)
from nanovllm import SamplingParams
from nanovllm.kernels.fp8_quant import quantize, quantize_rows
from nanovllm.kernels.fused_activation import silu_and_mul, silu_and_mul_fp8
from nanovllm.kernels.fused_norm import add_rms_norm, rms_norm_both, rms_norm_fp8
from nanovllm.kernels.gemv import gemv, rms_norm_gemv, silu_mul_gemv
from nanovllm.layers.kernel_path import KernelRoutes
from nanovllm.quantization.fp8 import Fp8Weights, fp8_linear

pytestmark = pytest.mark.gpu
DEV = "cuda"
FP8 = torch.float8_e4m3fn
# (N, K) of qkv, o, gate_up, down for Qwen3-0.6B and Qwen3-8B
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
          (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
# bf16 output rounding (2^-8 relative per element) bounds the error vs float64.
REF_TOL = 8e-3
# Block geometry of the 128 x 128 scales.
B = 128
# An FP8 engine's token passes if the reference's logit for it is within this fraction of the
# row's logit range of the maximum: activations quantized to e4m3 (3 mantissa bits) move
# near-ties further than bf16 rounding does (checkpoints.BF16_TOLERANCE, 0.02). Measured on the
# H200: 0.060 (online FP8, per-channel weights, per-token activations); twice that here.
FP8_TOLERANCE = 0.12
# No FP8-engine token may be further than this fraction of the logit range from the float32
# maximum: a wrong scale or layout gives gaps near 1; e4m3 activations gave 0.14-0.21 on the
# H200 (2026-12-02, 192 tokens) on this random-weight model's near-ties.
FAR_GAP = 0.35
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Qwen3-0.6B's attention geometry at a small width, with widths the FP8 kernels take (output parts
# in whole 128-blocks, widths multiples of 512: quantization/config.BLOCKWISE_ALIGN), so the
# layers hold FP8.
SHAPE = TinyShape(hidden_size=512, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=1024, max_position_embeddings=4096, tie_word_embeddings=False)
MOE = MoeShape(hidden_size=512, head_dim=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
               moe_intermediate_size=256, mlp_only_layers=(0,))


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out.double() - ref).norm() / ref.norm()).item()


def spread_blocks(s, n, k):
    return s.repeat_interleave(B, 0).repeat_interleave(B, 1)[:n, :k]


def random_fp8(n, k, gen, scales):
    """(fp8 weight, its scale as the kernels take it, the dequantized float64 weight)."""
    q = torch.randn(n, k, generator=gen, device=DEV).clamp(-448, 448).to(FP8)
    if scales == "block":
        s = torch.rand(-(-n // B), -(-k // B), generator=gen, device=DEV) * k ** -0.5 + 1e-3
        return q, s, q.double() * spread_blocks(s, n, k).double()
    s = torch.rand(n, generator=gen, device=DEV) * k ** -0.5 + 1e-3
    return q, s, q.double() * s.double()[:, None]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("scales", ["block", "row"])
def test_fp8_gemv_shapes(n, k, m, scales):
    gen = torch.Generator(DEV).manual_seed(n + k + m)
    q, s, wd = random_fp8(n, k, gen, scales)
    x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
    assert rel_err(gemv(x, q, weight_scale=s), x.double() @ wd.T) < REF_TOL


@pytest.mark.parametrize("scales", ["block", "row"])
@pytest.mark.parametrize("m", [1, 2])
def test_fp8_gemv_prologues(scales, m):
    """8B down (SiLU-and-mul in front) and 8B qkv (add + RMSNorm in front)."""
    gen = torch.Generator(DEV).manual_seed(m)
    q, s, wd = random_fp8(4096, 12288, gen, scales)
    x = (2 * torch.randn(m, 2 * 12288, generator=gen, device=DEV)).to(torch.bfloat16)
    gate, up = x.double().chunk(2, dim=-1)
    assert rel_err(silu_mul_gemv(x, q, weight_scale=s), (gate * torch.sigmoid(gate) * up) @ wd.T) < REF_TOL
    q, s, wd = random_fp8(6144, 4096, gen, scales)
    h, res = (torch.randn(m, 4096, generator=gen, device=DEV).to(torch.bfloat16) for _ in range(2))
    g = (1 + 0.3 * torch.randn(4096, generator=gen, device=DEV)).to(torch.bfloat16)
    out, summed = rms_norm_gemv(h, res, g, 1e-6, q, weight_scale=s)
    sd = summed.double()
    normed = (sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).double() * g.double()
    assert rel_err(out, normed @ wd.T) < REF_TOL


def ref_quantize(x, group):
    """Per-token (group None) or per-128-group e4m3 quantization written out in torch."""
    m, k = x.shape
    size = k if group is None else group
    xf = torch.nn.functional.pad(x.float(), (0, -k % size)).view(m, -1, size)
    s = (xf.abs().amax(dim=2).double() / 448).float().clamp(min=1e-12)  # [M, G], divided exactly
    q = (xf / s[:, :, None]).clamp(-448, 448).view(m, -1)[:, :k].to(FP8)
    return q, s


@pytest.mark.parametrize("m,k", [(1, 4096), (7, 12288), (300, 1000)])
@pytest.mark.parametrize("group", [None, 128])
def test_activation_quantization_bit_for_bit(m, k, group):
    gen = torch.Generator(DEV).manual_seed(m + k)
    x = (30 * torch.randn(m, k, generator=gen, device=DEV)).to(torch.bfloat16)
    q, s = quantize_rows(x, group=group)
    ref_q, ref_s = ref_quantize(x, group)
    assert torch.equal(q.float(), ref_q.float()) and torch.equal(s, ref_s)


@pytest.mark.parametrize("n,k", [(6144, 4096), (1024, 3072), (4096, 12288)])
@pytest.mark.parametrize("m", [3, 5, 16, 100, 2048])
@pytest.mark.parametrize("kind", ["block", "row", "static"])
def test_fp8_linear_against_dequantized_operands(n, k, m, kind):
    """torch._scaled_mm on x quantized here (per 1 x 128 group, per token, or with a static
    scale): the float64 product of the dequantized x and weight, within bf16 output rounding
    (per token and static: plus the MMAs' fast accumulation)."""
    gen = torch.Generator(DEV).manual_seed(n + m)
    q, s, wd = random_fp8(n, k, gen, "block" if kind == "block" else "row")
    x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=DEV).to(torch.bfloat16)
    static = torch.tensor([0.01, 0.02], device=DEV) if kind == "static" else None
    out = fp8_linear(x, Fp8Weights(q, s, static), bias)
    if kind == "static":  # the larger of the two parts' scales
        xd = (x.float() / 0.02).clamp(-448, 448).to(FP8).double() * 0.02
    elif kind == "block":
        xq, xs = ref_quantize(x, B)
        xd = xq.double() * xs.double().repeat_interleave(B, 1)[:, :k]
    else:
        xq, xs = ref_quantize(x, None)
        xd = xq.double() * xs.double()
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    err = rel_err(out, xd @ wd.T + bias.double())
    print(f"{kind} {m} x {n} x {k}: relative error {err:.2e}")
    assert err < REF_TOL


@pytest.mark.parametrize("m,k", [(1, 4096), (7, 12288), (300, 1000)])
def test_bounded_activation_quantization_bit_for_bit(m, k):
    """Per token with an amax bound (fbgemm_fp8's activation_scale_ub): the float64 reference with
    min(amax, bound) in amax's place; rows past the bound saturate at +-448."""
    gen = torch.Generator(DEV).manual_seed(m + k)
    x = (30 * torch.randn(m, k, generator=gen, device=DEV)).to(torch.bfloat16)
    bound = 60.0  # below the rows' amax (~30 x 4 sigma and more): every row is bounded
    q, s = quantize_rows(x, amax_ub=bound)
    ref_s = (x.double().abs().amax(1, keepdim=True).clamp(max=bound) / 448).float().clamp(min=1e-12)
    ref_q = (x.float() / ref_s).clamp(-448, 448).to(FP8)
    assert torch.equal(q.float(), ref_q.float()) and torch.equal(s, ref_s) and (s == bound / 448).all()


@pytest.mark.parametrize("m", [3, 256, 1000])
@pytest.mark.parametrize("kind", ["block", "row", "static", "bounded"])
def test_norm_and_activation_quantize_their_outputs(m, kind):
    """The FP8 layers' inputs quantized inside the RMSNorm and SiLU-and-mul kernels (8B widths:
    hidden 4096, intermediate 12288) are bit for bit the standalone quantization of those kernels'
    16-bit outputs, so fp8_linear gives the same output either way."""
    gen = torch.Generator(DEV).manual_seed(m)
    x, res = (torch.randn(m, 4096, generator=gen, device=DEV).to(torch.bfloat16) for _ in range(2))
    w_norm = torch.rand(4096, generator=gen, device=DEV).to(torch.bfloat16)
    gate_up = (4 * torch.randn(m, 2 * 12288, generator=gen, device=DEV)).to(torch.bfloat16)
    static = torch.tensor([0.01, 0.02], device=DEV) if kind == "static" else None
    q, s, _ = random_fp8(4096, 4096, gen, "block" if kind == "block" else "row")
    w = Fp8Weights(q, s, static, 2.0 if kind == "bounded" else None)  # bounded: below most rows' amax
    how = w.row_quant()
    got, summed = rms_norm_fp8(x, res, w_norm, 1e-6, how)
    normed, ref_sum = add_rms_norm(x, res, w_norm, 1e-6)
    ref = quantize(normed, how)
    assert torch.equal(summed, ref_sum) and torch.equal(got.q.float(), ref.q.float())
    assert torch.equal(got.scales, ref.scales) and got.scales.stride() == ref.scales.stride()
    kept, both, both_summed = rms_norm_both(x, res, w_norm, 1e-6, how)  # the 16-bit rows written too
    assert torch.equal(kept, normed) and torch.equal(both_summed, ref_sum)
    assert torch.equal(both.q.float(), ref.q.float()) and torch.equal(both.scales, ref.scales)
    assert torch.equal(fp8_linear(got, w, None), fp8_linear(normed, w, None))
    got = silu_and_mul_fp8(gate_up, how)
    ref = quantize(silu_and_mul(gate_up), how)
    assert torch.equal(got.q.float(), ref.q.float()) and torch.equal(got.scales, ref.scales)
    assert got.m == m and got.q.shape[0] == how.rows(m)


# ---- engines ----

dense = checkpoint_fixture("fp8dense", SHAPE)


def fp8_reference(path, dtype=torch.float32):
    """transformers' model of the dequantized checkpoint at `path`, on the GPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").cuda().eval()


@torch.no_grad()
def output_logits(model, prompts, outs) -> list[torch.Tensor]:
    """`model`'s float32 logits at each generated token's position, teacher-forced on the
    engine's own contexts: one [len(o), vocab] tensor per prompt."""
    return [model(torch.tensor([p + o], device=DEV)).logits[0, len(p) - 1:-1].float() for p, o in zip(prompts, outs)]


def largest_gap(reference_logits, outs) -> float:
    """The largest (max logit - the token's logit) / logit range of the reference's logits
    (output_logits) over every generated token."""
    worst = 0.0
    for logits, o in zip(reference_logits, outs):
        chosen = logits.gather(1, torch.tensor(o, device=DEV)[:, None])[:, 0]
        gap = (logits.max(1).values - chosen) / (logits.max(1).values - logits.min(1).values)
        worst = max(worst, gap.max().item())
    return worst


def off_argmax_rate(reference_logits, tokens) -> float:
    """The fraction of `tokens` (per prompt: a list or tensor) that are not the reference logits'
    argmax (output_logits)."""
    off = sum((logits.argmax(1) != torch.as_tensor(t, device=DEV)).sum().item()
              for logits, t in zip(reference_logits, tokens))
    return off / sum(len(t) for t in tokens)


@pytest.mark.parametrize("layout", ["qwen-block", "ct-channel", "ct-tensor", "ct-block", "fbgemm", "modelopt",
                                    "modelopt-channel", "modelopt-block"])
def test_fp8_engine_matches_transformers_on_dequantized_weights(dense, tmp_path, layout):
    """FP8 weights with FP8 activations against transformers in float32 on the dequantized weights.

    Issue 32's rule (the engine off the float32 argmax at most twice as often as transformers-bf16)
    is out of reach for any engine that quantizes activations to e4m3 (3 mantissa bits), as these
    checkpoint formats prescribe: transformers itself in float32 with its inputs to each projection
    rounded to e4m3 as the layout says (fp8_checkpoints.quantize_activations: the FP8 engine's
    arithmetic without its bf16 roundings) falls off the float32 argmax on 22-26% of this model's
    tokens, against 2.7-5.2% for transformers-bf16 (CPU, 2026-12-03, BENCHMARKS.md). So the rule
    here is the same x2 against that exact W8A8 computation: the engine's tokens fall off the
    float32 argmax at most twice as often (plus one token) as its own; a wrong scale or layout
    gives rates near 1. Both rates and transformers-bf16's are printed, and no token may be far
    from the maximum (FAR_GAP of the logit range)."""
    write_fp8(dense, str(tmp_path / "fp8"), str(tmp_path / "ref"), layout)
    ps = make_prompts(0, 8, 1, 300)
    (outs,), facts = gpu_generate(str(tmp_path / "fp8"), [ps], GREEDY)
    model = fp8_reference(str(tmp_path / "ref"))
    reference = output_logits(model, ps, outs)
    gap = largest_gap(reference, outs)
    engine_off = off_argmax_rate(reference, outs)
    hooks = quantize_activations(model, str(tmp_path / "fp8"), layout)
    w8a8_off = off_argmax_rate(reference, [a.argmax(1) for a in output_logits(model, ps, outs)])
    for hook in hooks:
        hook.remove()
    bf16 = output_logits(fp8_reference(str(tmp_path / "ref"), torch.bfloat16), ps, outs)
    bf16_off = off_argmax_rate(reference, [b.argmax(1) for b in bf16])
    steps = sum(len(o) for o in outs)
    print(f"{layout}: largest gap {gap:.4f}, off the fp32 argmax: FP8 engine {engine_off:.4f}, exact W8A8 "
          f"{w8a8_off:.4f}, transformers-bf16 {bf16_off:.4f} ({steps} tokens)")
    assert engine_off <= 2 * w8a8_off + 1 / steps
    assert gap < FAR_GAP


def test_online_fp8_and_fp8_moe_match_transformers(dense, tmp_path):
    """LLM(quantization="fp8") on a bf16 checkpoint (per-channel scales at load; reference:
    quantized by hand), and a Qwen3-MoE block-FP8 checkpoint (experts held in FP8: the fused MoE
    kernels' block-scaled path, prefill and decode GEMVs)."""
    state = checkpoint_state(dense)
    by_hand = {n: (lambda q, s: q.float() * s)(*quantize_channels(t)) if n.endswith("_proj.weight") else t
               for n, t in state.items()}
    write_state(dense, str(tmp_path / "ref"), by_hand)
    ps = make_prompts(1, 6, 1, 200)
    (outs,), _ = gpu_generate(dense, [ps], GREEDY, quantization="fp8")
    gap = largest_gap(output_logits(fp8_reference(str(tmp_path / "ref")), ps, outs), outs)
    print(f"online: largest gap {gap:.4f}")
    assert gap < FP8_TOLERANCE
    moe = build_moe_checkpoint(str(tmp_path / "moe"), MOE)
    write_fp8(moe, str(tmp_path / "moe_fp8"), str(tmp_path / "moe_ref"), "qwen-block", ("mlp.gate",))
    (outs,), _ = gpu_generate(str(tmp_path / "moe_fp8"), [ps], GREEDY)
    gap = largest_gap(output_logits(fp8_reference(str(tmp_path / "moe_ref")), ps, outs), outs)
    print(f"moe: largest gap {gap:.4f}")
    assert gap < FP8_TOLERANCE


def test_fp8_layers_hold_fp8(dense, tmp_path):
    from nanovllm import LLM

    write_fp8(dense, str(tmp_path / "fp8"), str(tmp_path / "ref"), "qwen-block", ("model.layers.3.mlp.down_proj",))
    llm = LLM(str(tmp_path / "fp8"), dtype="bfloat16", num_kvcache_blocks=64, kvcache_block_size=16, max_num_seqs=4,
              enforce_eager=True)
    try:
        layers = llm.model_runner.model.model.layers
        assert layers[0].self_attn.qkv_proj.weight.dtype == FP8
        assert layers[0].mlp.down_proj.weight_scale_inv.shape == (SHAPE.hidden_size // B, SHAPE.intermediate_size // B)
        assert layers[3].mlp.down_proj.weight.dtype == torch.bfloat16  # kept in full precision
        assert llm.model_runner.model.lm_head.weight.dtype == torch.bfloat16
        # decode batches past the GEMV's rows take the W8A16 skinny GEMM (its first version zeroed
        # this path at construction, and an end-to-end A/B ran _scaled_mm on both sides unseen)
        assert layers[0].self_attn.qkv_proj.path.skinny_rows == KernelRoutes().fp8_skinny_max_rows
    finally:
        llm.exit()
    # fbgemm_fp8: per-channel scales [out, 1] held per row, and the activations' amax bound on every held layer
    write_fp8(dense, str(tmp_path / "fbgemm"), str(tmp_path / "fbgemm_ref"), "fbgemm", ("lm_head",))
    llm = LLM(str(tmp_path / "fbgemm"), dtype="bfloat16", num_kvcache_blocks=64, kvcache_block_size=16,
              max_num_seqs=4, enforce_eager=True)
    try:
        mlp = llm.model_runner.model.model.layers[0].mlp
        assert mlp.down_proj.weight.dtype == FP8 and mlp.down_proj.weight_scale.shape == (SHAPE.hidden_size,)
        assert mlp.gate_up_proj.fp8.row_quant().amax_ub == LAYOUTS["fbgemm"]["activation_scale_ub"]
    finally:
        llm.exit()
    moe = build_moe_checkpoint(str(tmp_path / "moe"), MOE)
    write_fp8(moe, str(tmp_path / "moe_fp8"), str(tmp_path / "moe_ref"), "qwen-block", ("mlp.gate",))
    llm = LLM(str(tmp_path / "moe_fp8"), dtype="bfloat16", num_kvcache_blocks=64, kvcache_block_size=16,
              max_num_seqs=4, enforce_eager=True)
    try:
        experts = llm.model_runner.model.model.layers[1].mlp.experts  # layer 0 is dense (mlp_only_layers)
        assert experts.w13.dtype == FP8 and experts.w2.dtype == FP8
        i, h = MOE.moe_intermediate_size, MOE.hidden_size
        assert experts.w13_weight_scale_inv.shape == (experts.num_experts, 2 * i // B, h // B)
        assert experts.w2_weight_scale_inv.shape == (experts.num_experts, h // B, i // B)
    finally:
        llm.exit()


def test_fp8_cuda_graph_and_eager_identical(dense, tmp_path):
    write_fp8(dense, str(tmp_path / "fp8"), str(tmp_path / "ref"), "qwen-block")
    batches = [make_prompts(3, batch, 20, 200) for batch in (1, 2, 8, 16, 48)]
    graph, facts = gpu_generate(str(tmp_path / "fp8"), batches, GREEDY)
    assert facts["graphs"]
    eager, facts = gpu_generate(str(tmp_path / "fp8"), batches, GREEDY, enforce_eager=True)
    assert not facts["graphs"]
    assert graph == eager


def test_fp8_update_weights_equals_a_fresh_engine(dense, tmp_path):
    """Full-precision weights into a block-FP8 engine (held FP8: quantized into the weight and
    its block scales in place; graphs stay valid) equal an engine loaded from them quantized by hand."""
    from nanovllm import LLM

    write_fp8(dense, str(tmp_path / "a"), str(tmp_path / "ref"), "qwen-block")
    other = build_checkpoint(str(tmp_path / "other"), SHAPE, seed=1)
    fp8_b, _ = quantize_state(checkpoint_state(other), "qwen-block")
    write_state(other, str(tmp_path / "b"), fp8_b, LAYOUTS["qwen-block"])
    ps = make_prompts(4, 8, 20, 120)
    (expected,), _ = gpu_generate(str(tmp_path / "b"), [ps], GREEDY)
    llm = LLM(str(tmp_path / "a"), dtype="bfloat16", num_kvcache_blocks=512, kvcache_block_size=16, max_num_seqs=16,
              max_num_batched_tokens=1024, max_model_len=2048)
    try:
        before = [o["token_ids"] for o in llm.generate(ps, GREEDY, use_tqdm=False)]
        llm.update_weights(checkpoint_state(other).items())
        after = [o["token_ids"] for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    finally:
        llm.exit()
    assert before != expected
    assert after == expected


def test_fp8_update_weights_into_a_static_scale_engine_equals_a_fresh_engine(dense, tmp_path):
    """Full-precision weights into a static-activation FP8 engine (ct-tensor: held FP8 with the
    checkpoint's input_scale): each weight quantized per output channel, the input scales kept, so
    it equals an engine loaded from those weights quantized per channel by hand beside the same
    input scales. Input scales given to update_weights are refused naming the layer and that the
    checkpoint's stay (they were refused as "their scales are computed here"); nothing changes."""
    from nanovllm import LLM

    write_fp8(dense, str(tmp_path / "a"), str(tmp_path / "ref"), "ct-tensor")
    other = checkpoint_state(build_checkpoint(str(tmp_path / "other"), SHAPE, seed=1))
    scales = {n: t for n, t in checkpoint_state(str(tmp_path / "a")).items() if n.endswith(".input_scale")}
    fp8_b = dict(scales)
    for name, t in other.items():
        if name.endswith("_proj.weight"):
            fp8_b[name], fp8_b[name.removesuffix("weight") + "weight_scale"] = quantize_channels(t)
        else:
            fp8_b[name] = t
    group = LAYOUTS["ct-tensor"]["config_groups"]["group_0"]
    channel_weights = {**LAYOUTS["ct-tensor"], "ignore": [], "config_groups": {"group_0": {
        **group, "weights": {**group["weights"], "strategy": "channel"}}}}
    write_state(str(tmp_path / "other"), str(tmp_path / "b"), fp8_b, channel_weights)
    ps = make_prompts(6, 8, 20, 120)
    # Every generate alike, so each step takes the same path: whether a step quantizes its
    # activations (W8A8 from 33 rows, W8A16 below) depends on its size, and this model's near-ties
    # turn on that quantization's noise. Hence one set of engine settings (gpu_generate's other
    # ones gave other tokens, H100), and no prefix cache: the refused call leaves it filled, so the
    # third generate's few uncached rows would take W8A16 (its tokens differed, H200; this reading of
    # it is not yet re-run there).
    kw = {"dtype": "bfloat16", "num_kvcache_blocks": 512, "kvcache_block_size": 16, "max_num_seqs": 16,
          "max_num_batched_tokens": 1024, "max_model_len": 2048, "enable_prefix_caching": False}
    fresh = LLM(str(tmp_path / "b"), **kw)
    try:
        expected = [o["token_ids"] for o in fresh.generate(ps, GREEDY, use_tqdm=False)]
    finally:
        fresh.exit()
    llm = LLM(str(tmp_path / "a"), **kw)
    try:
        held = dict(llm.model_runner.model.named_parameters())
        assert held["model.layers.0.self_attn.qkv_proj.input_scale"].gt(0).all()  # held FP8, static scales
        before = [o["token_ids"] for o in llm.generate(ps, GREEDY, use_tqdm=False)]
        llm.update_weights(other.items())
        after = [o["token_ids"] for o in llm.generate(ps, GREEDY, use_tqdm=False)]
        name = "model.layers.0.self_attn.k_proj.input_scale"
        with pytest.raises(ValueError, match=re.escape(
                f"{name!r}: layer 'model.layers.0.self_attn.k_proj' quantizes its inputs with the checkpoint's "
                "static input_scale (calibration), which update_weights keeps as loaded")):
            llm.update_weights([(name, scales[name] * 4)])
        again = [o["token_ids"] for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    finally:
        llm.exit()
    assert before != expected
    assert after == again == expected


def test_level2_sleep_keeps_static_input_scales(dense, tmp_path):
    """sleep(level=2) discards the weights, which update_weights refills from full-precision
    tensors; a checkpoint's static activation scales (ct-tensor's input_scale) are calibration no
    weight gives back, so they wait on the host and return as they were (zeros before: every
    static-scale layer then quantized its activations with a zero scale)."""
    from nanovllm import LLM

    write_fp8(dense, str(tmp_path / "fp8"), str(tmp_path / "ref"), "ct-tensor")
    llm = LLM(str(tmp_path / "fp8"), dtype="bfloat16", num_kvcache_blocks=512, kvcache_block_size=16,
              max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=2048)
    try:
        scales = lambda: {n: p.detach().clone() for n, p in llm.model_runner.model.named_parameters()
                          if n.endswith("input_scale")}
        before = scales()
        llm.sleep(level=2)
        llm.wake_up()
        llm.update_weights(checkpoint_state(str(tmp_path / "ref")).items())
        after = scales()
    finally:
        llm.exit()
    assert before and all(s.gt(0).all() for s in before.values())
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
