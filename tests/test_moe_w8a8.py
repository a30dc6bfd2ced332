"""W8A8 grouped GEMMs on FP8 experts (moe/grouped_gemm.py, act_fp8 / ACT_FP8) and the layer's
route to them (KernelRoutes.moe_fp8_mma_min_tokens, moe/layer.MoeExperts.runs_fp8_mma).

The reference is the W8A8 arithmetic in float64, written here in plain torch: hidden rounded to
e4m3 with its scale (per token, or per token per 128 columns for block-scaled weights: amax / 448,
floored at 1e-12, x / scale clamped to +-448), times the dequantized weights; g and u rounded to
the compute dtype, silu(g) * u rounded too, then quantized by the same rule and multiplied by the
dequantized w2. Triton's CPU interpreter runs tl.dot on e4m3 operands (exactly, as products of
e4m3 values are exact in float32), so the kernels' own FP8 path runs here on small shapes (H=200:
a partial 128-column group and K step); the GPU tests run Qwen3-30B-A3B's expert shape.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from test_fused_moe import QWEN3_30B, assert_close, reference_moe
from test_moe_fp8 import MODES, WIDE_K, fp8_case, quantize_experts
from nanovllm.layers.kernel_path import KernelRoutes, kernel_routes
from nanovllm.kernels.fp8_quant import quantize
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.moe.grouped_gemm import act_row_quant, fused_moe
from nanovllm.kernels.checks import ScaleMode
from nanovllm.moe.layer import MoeExperts
from nanovllm.moe.tiles import DECODE_GATE_UP, PREFILL_WIDE, WIDE_MIN_PAIRS, moe_tiles, plan_tiles
from nanovllm.quantization.checkpoint_config import resolve_quantization
from nanovllm.quantization.config import quantization

FP8 = torch.float8_e4m3fn
GROUP = 128


def fp8_round_trip(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x [M, K] -> float64 e4m3(x / s) * s, s = max(amax / 448, 1e-12) in float32 per row (group
    None) or per row per `group` columns (the last group partial)."""
    x = x.float()
    m, k = x.shape
    width = k if group is None else group
    groups = -(-k // width)
    padded = torch.zeros(m, groups * width, device=x.device)
    padded[:, :k] = x
    s = (padded.view(m, groups, width).abs().amax(dim=2) / 448).clamp(min=1e-12)  # [M, groups] float32
    spread = s.repeat_interleave(width, dim=1)[:, :k]  # [M, K]
    q = (x / spread).clamp(-448, 448).to(FP8)
    return q.double() * spread.double()


def w8a8_reference(hidden, w13, w2, topk_weights, topk_ids, mode: str) -> torch.Tensor:
    """float64 [T, H]: the W8A8 arithmetic (module docstring) on dequantized w13 / w2 (float64)."""
    group = GROUP if mode == "block" else None
    dtype, inter = hidden.dtype, w13.shape[1] // 2
    x = fp8_round_trip(hidden, group)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = (x[tokens] @ w13[e].T).to(dtype).double()  # [n, 2I], rounded as the kernel rounds g, u
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(dtype)
        out.index_add_(0, tokens, (fp8_round_trip(act, group) @ w2[e].T) * topk_weights[tokens, slots, None].double())
    return out


def check_w8a8(args, deq, mode, dtype, distinct: bool = False) -> None:
    """fused_moe(act_fp8=True) against the W8A8 reference. `distinct`: the W8A16 reference
    (activations not quantized) must lie outside the tolerance, so the check tells the two apart."""
    hidden, q13, q2, weights, ids, s13, s2 = args
    out = fused_moe(hidden, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, act_fp8=True)
    assert_close(out, w8a8_reference(hidden, *deq, weights, ids, mode), dtype)
    if distinct:
        with pytest.raises(AssertionError):
            assert_close(out, reference_moe(hidden, *deq, weights, ids), dtype)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu(g), g << 0: exp(-g) = inf, as on a GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_w8a8_grouped_gemm_matches_reference(mode, dtype):
    """Random rows; then a zero row, which quantizes with the floor scale (no 0 / 0) and gives
    exact zeros, and a row 10^4 times larger (past e4m3's range), which takes a 10^4 times larger
    scale: the same e4m3 values, no inf or NaN (each row against its own magnitude)."""
    args, deq = fp8_case(5, 4, 2, 200, 136, dtype, "cpu", mode)
    check_w8a8(args, deq, mode, dtype, distinct=True)
    hidden, q13, q2, weights, ids, s13, s2 = args
    hidden = hidden.clone()
    hidden[0] = 0
    hidden[1] *= 1e4
    out = fused_moe(hidden, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, act_fp8=True)
    ref = w8a8_reference(hidden, *deq, weights, ids, mode)
    assert torch.isfinite(out).all() and torch.equal(out[0], torch.zeros_like(out[0]))
    for row in range(1, hidden.shape[0]):
        assert_close(out[row:row + 1], ref[row:row + 1], dtype)


def test_w8a8_decode_steps_read_whole_groups_or_256_bytes():
    """Decode batches: W8A8 gate_up with per-channel scales steps 256 columns (256 bytes of an e4m3 row);
    with block scales a step stays inside one 128-column activation group; bf16 / W8A16 keep theirs."""
    for t in (1, 64, 256):
        _, channel, _ = plan_tiles(t, 8, 128, 2048, 768, 132, w8a8=ScaleMode.CHANNEL)
        _, block, _ = plan_tiles(t, 8, 128, 2048, 768, 132, w8a8=ScaleMode.BLOCK)
        _, plain, _ = plan_tiles(t, 8, 128, 2048, 768, 132)
        assert channel.block_k == 256 and GROUP % block.block_k == 0 and plain.block_k == DECODE_GATE_UP.block_k


def test_many_pairs_an_expert_take_the_wide_prefill_tiling():
    """From WIDE_MIN_PAIRS mean pairs an expert every call takes its mode's PREFILL_WIDE, launched N-major;
    one pair fewer an expert keeps the blocks-fastest launch of the blocks block_m_for picks (at most 64 rows)."""
    e = 128
    for mode in (None, ScaleMode.CHANNEL, ScaleMode.BLOCK):
        assert moe_tiles(WIDE_MIN_PAIRS * e, e, mode) == PREFILL_WIDE[mode] and PREFILL_WIDE[mode].n_major
        fewer = moe_tiles((WIDE_MIN_PAIRS - 1) * e, e, mode)
        assert fewer.block_m == 64 and fewer.n_major  # the 64-row prefill tiles, N-major too
        assert not moe_tiles(4 * e, e, mode).n_major  # decode: a weight tile's blocks together


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("n_major", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_w8a8_wide_prefill_tiling_matches_reference(mode, n_major):
    """The wide prefill tiling (its block height past a small case's pairs: one block an expert, mostly
    padding rows), launched in either order, gives the W8A8 reference's output."""
    args, deq = fp8_case(40, 4, 2, 256, 136, torch.bfloat16, "cpu", mode)
    hidden, q13, q2, weights, ids, s13, s2 = args
    out = fused_moe(hidden, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, act_fp8=True,
                    tiles=replace(PREFILL_WIDE[ScaleMode[mode.upper()]], n_major=n_major))
    assert_close(out, w8a8_reference(hidden, *deq, weights, ids, mode), torch.bfloat16)


def test_bad_w8a8_arguments_are_named():
    (hidden, q13, q2, weights, ids, s13, s2), _ = fp8_case(2, 4, 2, 256, 128, torch.float32, "cpu", "block")
    with pytest.raises(ValueError, match="act_fp8 .W8A8. takes FP8 experts"):
        fused_moe(hidden, q13.float(), q2.float(), weights, ids, act_fp8=True)
    with pytest.raises(TypeError, match="act_fp8 must be a bool, got 1"):
        fused_moe(hidden, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, act_fp8=1)
    with pytest.raises(ValueError, match="gate_up block_k=256"):
        fused_moe(hidden, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, act_fp8=True, tiles=WIDE_K)
    with pytest.raises(ValueError, match="moe_fp8_mma_min_tokens"):
        KernelRoutes(moe_fp8_mma_min_tokens=0)  # from no tokens on would be always: None is never


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", MODES)
def test_hidden_quantized_before_the_call_gives_the_same_output(mode):
    """x_fp8 (hidden quantized as act_row_quant says, as a W8A8 MoE block's norm writes it) gives
    fused_moe's own quantization's output bit for bit; one not so quantized is refused naming it."""
    args, _ = fp8_case(5, 4, 2, 200, 136, torch.bfloat16, "cpu", mode)
    hidden, q13, q2, weights, ids, s13, s2 = args
    scales = dict(w13_scale=s13, w2_scale=s2)
    how = act_row_quant(ScaleMode.BLOCK if mode == "block" else ScaleMode.CHANNEL)
    want = fused_moe(hidden, q13, q2, weights, ids, act_fp8=True, **scales)
    assert torch.equal(fused_moe(hidden, q13, q2, weights, ids, act_fp8=True, x_fp8=quantize(hidden, how), **scales),
                       want)
    other = act_row_quant(ScaleMode.CHANNEL if mode == "block" else ScaleMode.BLOCK)
    with pytest.raises(ValueError, match=f"x_fp8 must be hidden's rows quantized as act_row_quant.{mode.upper()}"):
        fused_moe(hidden, q13, q2, weights, ids, act_fp8=True, x_fp8=quantize(hidden, other), **scales)
    with pytest.raises(ValueError, match="x_fp8 must be hidden's rows"):
        fused_moe(hidden, q13, q2, weights, ids, act_fp8=True, x_fp8=quantize(hidden[:4], how), **scales)
    with pytest.raises(ValueError, match="x_fp8 .hidden already quantized. takes act_fp8=True"):
        fused_moe(hidden, q13, q2, weights, ids, x_fp8=quantize(hidden, how), **scales)
    with pytest.raises(TypeError, match="x_fp8 must be a QuantizedRows, got Tensor"):
        fused_moe(hidden, q13, q2, weights, ids, act_fp8=True, x_fp8=hidden, **scales)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t", [256, 2048])
def test_hidden_quantized_before_the_call_on_the_gpu(mode, t):
    """The same at Qwen3-30B-A3B's expert shape (decode and prefill tilings), hidden quantized by the
    RMSNorm kernel as the MoE block does (fused_norm.rms_norm_both), bit for bit."""
    from nanovllm.kernels.fused_norm import rms_norm_both

    e, k, h, i = QWEN3_30B["E"], QWEN3_30B["K"], QWEN3_30B["H"], QWEN3_30B["I"]
    (x, q13, q2, weights, ids, s13, s2), _ = fp8_case(t, e, k, h, i, torch.bfloat16, "cuda", mode, seed=t)
    norm_weight = torch.rand(h, device="cuda").to(torch.bfloat16) + 0.5
    how = act_row_quant(ScaleMode.BLOCK if mode == "block" else ScaleMode.CHANNEL)
    hidden, hidden_fp8, _ = rms_norm_both(x, None, norm_weight, 1e-6, how)
    scales = dict(w13_scale=s13, w2_scale=s2)
    want = fused_moe(hidden, q13, q2, weights, ids, act_fp8=True, **scales)
    assert torch.equal(fused_moe(hidden, q13, q2, weights, ids, act_fp8=True, x_fp8=hidden_fp8, **scales), want)


ONLINE = resolve_quantization("fp8", None, "test")


def fp8_layer(routes: KernelRoutes, kernels: bool, e: int = 4, h: int = 200, i: int = 136) -> MoeExperts:
    """Online-FP8 experts (held per channel where they run the kernels) built under `routes`,
    filled with quantize_experts' values when held."""
    with quantization(ONLINE), kernel_routes(routes):
        experts = MoeExperts(e, h, i, "mlp.experts", kernels=kernels)
    if experts.scales is not None:
        g = torch.Generator().manual_seed(4)
        for w, s, shape in ((experts.w13, experts.scales[0], (e, 2 * i, h)), (experts.w2, experts.scales[1], (e, h, i))):
            q, scale = quantize_experts(torch.randn(shape, generator=g, device="cpu") / shape[2] ** 0.5, "channel")
            w.data.copy_(q.to(w.device))
            s.data.copy_(scale.to(s.device))
    return experts


@pytest.mark.interpreter
def test_layer_routes_steps_by_size_class():
    """Steps whose size class reaches moe_fp8_mma_min_tokens run W8A8 (16 tokens: class 16; 17:
    class 32), the others W8A16; None turns it off, as does running off the kernels (CPU: dequantized
    experts) or full-precision experts."""
    experts = fp8_layer(KernelRoutes(moe_fp8_mma_min_tokens=32), kernels=True)
    assert experts.w13.dtype == FP8 and experts.fp8_mma_tokens == 32
    g = torch.Generator().manual_seed(5)
    scales = dict(w13_scale=experts.scales[0], w2_scale=experts.scales[1])
    for t, w8a8 in ((16, False), (17, True)):
        hidden = torch.randn(t, 200, generator=g)
        ids = torch.randn(t, 4, generator=g).topk(2, dim=1).indices
        weights = torch.softmax(torch.randn(t, 2, generator=g), dim=1)
        assert experts.runs_fp8_mma(hidden) == w8a8
        out = experts(hidden, weights, ids)
        want = fused_moe(hidden, experts.w13, experts.w2, weights, ids, act_fp8=w8a8, **scales)
        other = fused_moe(hidden, experts.w13, experts.w2, weights, ids, act_fp8=not w8a8, **scales)
        assert torch.equal(out, want) and not torch.equal(out, other)
        # A W8A8 step asks its input quantized (per token: channel scales), as the block's norm writes it
        how = experts.step_input_quant(hidden)
        assert (how == act_row_quant(ScaleMode.CHANNEL)) if w8a8 else how is None
        if w8a8:
            normed, hidden_fp8, summed = RMSNorm(200).add_norm_and_quantize(hidden, hidden, how)
            assert torch.equal(summed, hidden + hidden)
            assert torch.equal(experts(normed, weights, ids, hidden_fp8), experts(normed, weights, ids))
    assert fp8_layer(KernelRoutes(moe_fp8_mma_min_tokens=None), kernels=True).fp8_mma_tokens is None
    assert fp8_layer(KernelRoutes(moe_fp8_mma_min_tokens=None), kernels=True).step_input_quant(hidden) is None
    assert fp8_layer(KernelRoutes(moe_fp8_mma_min_tokens=1), kernels=False).fp8_mma_tokens is None
    with kernel_routes(KernelRoutes(moe_fp8_mma_min_tokens=1)):
        assert MoeExperts(4, 200, 136, kernels=True).fp8_mma_tokens is None  # full precision


# On the GPU the float32 sums of g and u come in another order than float64's (Hopper's FP8 MMAs
# also accumulate with fewer bits), which moves a few roundings of g, u and act to bf16, and a moved
# act value (or a row's act scale) can land on the neighbouring e4m3 value: up to 2^-3 of it. H200,
# 30B-A3B shapes: each row's largest error against the W8A8 reference 1.0-1.1% of the largest output
# (median), 2.4% at most over 512 rows and 3.1% over 8,192; against the W8A16 reference 2.7-3.3%
# (median). So the GPU check bounds the largest error (a dropped or misplaced scale is off by O(1))
# and asks the median row to sit nearer W8A8 than W8A16 by GPU_W8A8_SEPARATION.
GPU_W8A8_TOLERANCE = 5e-2
GPU_W8A8_SEPARATION = 2.0


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[T] each row's largest |out - ref|, over ref's largest magnitude."""
    return (out.double() - ref).abs().amax(dim=1) / ref.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t", [16, 256, 512, 2048, 8192, 16384])
def test_w8a8_qwen3_30b_shape(mode, t):
    """Decode (16, 256: 16- and 32-row blocks) and prefill (64-row blocks, PREFILL_W8A8; from WIDE_MIN_PAIRS
    an expert, PREFILL_WIDE) tilings."""
    e, k, h, i = QWEN3_30B["E"], QWEN3_30B["K"], QWEN3_30B["H"], QWEN3_30B["I"]
    (hidden, q13, q2, weights, ids, s13, s2), deq = fp8_case(t, e, k, h, i, torch.bfloat16, "cuda", mode, seed=t)
    out = fused_moe(hidden, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, act_fp8=True)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    w8a8 = row_errors(out, w8a8_reference(hidden, *deq, weights, ids, mode))
    w8a16 = row_errors(out, reference_moe(hidden, *deq, weights, ids))
    assert w8a8.max() <= GPU_W8A8_TOLERANCE, w8a8.max().item()
    assert w8a16.median() >= GPU_W8A8_SEPARATION * w8a8.median(), (w8a16.median().item(), w8a8.median().item())


@pytest.mark.gpu
def test_w8a8_layer_route_default_on_cuda():
    """Built on CUDA with the default routes, every grouped-GEMM step runs W8A8 (class 16 up)."""
    with torch.device("cuda"):
        experts = fp8_layer(KernelRoutes(), kernels=None)
    assert experts.fp8_mma_tokens == KernelRoutes().moe_fp8_mma_min_tokens == 16
    for t in (1, 16, 17, 512):
        assert experts.runs_fp8_mma(torch.empty(t, 200, device="cuda"))
