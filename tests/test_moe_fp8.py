"""FP8 experts in the fused MoE kernels (moe/fp8_experts.py, grouped_gemm.py, decode.py) and the
layer / loader that hold them (quantization/config.expert_quant, moe/layer.MoeExperts).

Kernels: FP8 weights with per-channel and 128 x 128 block scales (block scales per K step and,
with 256-column steps, per element) against the float64 reference of tests/test_fused_moe.py on
the dequantized weights (dequantized here in plain torch). Under the interpreter on small shapes
(H=200: a partial block), compiled at Qwen3-30B-A3B's shape on CUDA. Layer: a checkpoint in each
published layout (tests/fp8_checkpoints.py writes them independently of nanovllm) loads as FP8
where the layer runs the kernels (`kernels=True`: the CUDA layout, interpreted on CPU), sliced
per rank, and runs; update_weights quantizes full-precision experts with the engine's scheme.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fp8_checkpoints import LAYOUTS, SCALE_NAMES, quantized
from test_fused_moe import QWEN3_30B, assert_close, make_case, random_ids, reference_moe
from nanovllm.layers.kernel_path import KernelRoutes, kernel_routes
from nanovllm.moe.decode import GemvTiles, moe_gemv, moe_gemv_routed
from nanovllm.moe.grouped_gemm import fused_moe
from nanovllm.moe.tiles import PREFILL_WIDE, MoeTiles, Tiling
from nanovllm.moe.checkpoint_names import map_expert_name
from nanovllm.moe.layer import MoeExperts
from nanovllm.moe.routing import moe_route
from nanovllm.quantization.checkpoint_config import resolve_quantization
from nanovllm.quantization.config import expert_quant, quantization
from nanovllm.utils.loader import load_model, update_weights
from nanovllm.utils.distributed import TensorParallel, tensor_parallel

FP8 = torch.float8_e4m3fn
BLOCK = 128
MODES = ("channel", "block")
# Steps of 256 columns: block scales per element (BLOCK_K does not divide 128).
WIDE_K = MoeTiles(16, Tiling(64, 256, 4, 3), Tiling(64, 256, 4, 3))
W8A16_ONLY = KernelRoutes(moe_fp8_mma_min_tokens=None)  # held FP8 experts, activations never quantized


def quantize_experts(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (fp8 [E, N, K], float32 scales [E, N] per row or [E, ceil(N/128), ceil(K/128)])."""
    e, n, k = w.shape
    w = w.float()
    if mode == "channel":
        s = (w.abs().amax(dim=2) / 448).clamp(min=1e-12)  # [E, N]
        return (w / s[:, :, None]).clamp(-448, 448).to(FP8), s
    gn, gk = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(e, gn * BLOCK, gk * BLOCK, device=w.device)
    padded[:, :n, :k] = w
    s = (padded.view(e, gn, BLOCK, gk, BLOCK).abs().amax(dim=(2, 4)) / 448).clamp(min=1e-12)  # [E, gn, gk]
    return (w / spread_blocks(s, n, k)).clamp(-448, 448).to(FP8), s


def spread_blocks(s: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[E, gn, gk] -> [E, n, k]: each block's scale over its elements."""
    return s.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :n, :k]


def dequantize_experts(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """q x s in `dtype` (s per row [E, N] or per block [E, gn, gk])."""
    e, n, k = q.shape
    s = s.to(dtype)[:, :, None] if s.dim() == 2 else spread_blocks(s.to(dtype), n, k)
    return q.to(dtype) * s


def fp8_case(t, e, k, h, i, dtype, device, mode, seed=0):
    """(hidden, w13, w2, weights, ids, w13_scale, w2_scale) and the dequantized (w13, w2)."""
    hidden, w13, w2, weights, ids = make_case(t, e, k, h, i, torch.float32, device, seed=seed)
    q13, s13 = quantize_experts(w13, mode)
    q2, s2 = quantize_experts(w2, mode)
    return (hidden.to(dtype), q13, q2, weights, ids, s13, s2), (dequantize_experts(q13, s13), dequantize_experts(q2, s2))


def check_fused(args, deq, dtype, **kwargs):
    hidden, q13, q2, weights, ids, s13, s2 = args
    out = fused_moe(hidden, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, **kwargs)
    assert_close(out, reference_moe(hidden, *deq, weights, ids), dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_grouped_gemm_fp8_matches_reference(mode, dtype):
    args, deq = fp8_case(5, 4, 2, 200, 136, dtype, "cpu", mode)
    check_fused(args, deq, dtype)
    check_fused(args, deq, dtype, tiles=PREFILL_WIDE[None])  # W8A16 over many pairs an expert: N-major
    if mode == "block":  # 256-column steps: scales per element
        check_fused(args, deq, dtype, tiles=WIDE_K)


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens", [1, 2])
def test_decode_gemv_fp8_matches_reference(mode, tokens):
    """moe_gemv with the default tiles (gate_up rows halved to 8 under block scales: I=136) and
    256-column down steps (block scales per element); moe_gemv_routed routes as moe_route."""
    dtype = torch.bfloat16
    (hidden, q13, q2, weights, ids, s13, s2), deq = fp8_case(tokens, 8, 2, 200, 136, dtype, "cpu", mode, seed=tokens)
    ref = reference_moe(hidden, *deq, weights, ids)
    assert_close(moe_gemv(hidden, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2), ref, dtype)
    tiles = GemvTiles(32, 64, 2, 256, 4)
    assert_close(moe_gemv(hidden, q13, q2, weights, ids, tiles, w13_scale=s13, w2_scale=s2), ref, dtype)
    logits = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(5))
    out, w, i = moe_gemv_routed(hidden, q13, q2, logits, 2, True, w13_scale=s13, w2_scale=s2)
    want_w, want_i = moe_route(logits, 2, True)
    assert torch.equal(i, want_i) and torch.equal(w, want_w)
    assert_close(out, reference_moe(hidden, *deq, w, i.long()), dtype)


@pytest.mark.interpreter
def test_decode_gemv_block_fp8_rows_must_be_words():
    """gate_up reads block-scaled experts as int32 words of four: a hidden size off that grid is refused."""
    (hidden, q13, q2, weights, ids, s13, s2), _ = fp8_case(1, 4, 2, 130, 64, torch.bfloat16, "cpu", "block")
    with pytest.raises(ValueError, match="multiples of 4"):
        moe_gemv(hidden, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t", [1, 16, 256, 2000, 4096])
def test_grouped_gemm_fp8_qwen3_30b_shape(mode, t):
    e, k, h, i = QWEN3_30B["E"], QWEN3_30B["K"], QWEN3_30B["H"], QWEN3_30B["I"]
    args, deq = fp8_case(t, e, k, h, i, torch.bfloat16, "cuda", mode, seed=t)
    check_fused(args, deq, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t", [1, 2])
def test_decode_gemv_fp8_qwen3_30b_shape(mode, t):
    e, k, h, i = QWEN3_30B["E"], QWEN3_30B["K"], QWEN3_30B["H"], QWEN3_30B["I"]
    (hidden, q13, q2, _, _, s13, s2), deq = fp8_case(t, e, k, h, i, torch.bfloat16, "cuda", mode, seed=t)
    logits = torch.randn(t, e, device="cuda")
    out, w, ids = moe_gemv_routed(hidden, q13, q2, logits, k, True, w13_scale=s13, w2_scale=s2)
    assert_close(out, reference_moe(hidden, *deq, w, ids.long()), torch.bfloat16)
    assert_close(moe_gemv(hidden, q13, q2, w, ids, w13_scale=s13, w2_scale=s2),
                 reference_moe(hidden, *deq, w, ids.long()), torch.bfloat16)


def test_bad_fp8_arguments_are_named():
    (hidden, q13, q2, weights, ids, s13, s2), _ = fp8_case(2, 4, 2, 64, 32, torch.float32, "cpu", "channel")
    with pytest.raises(ValueError, match="come together"):
        fused_moe(hidden, q13, q2, weights, ids, w13_scale=s13)
    with pytest.raises(TypeError, match="w13 dtype"):
        moe_gemv(hidden, q13, q2, weights, ids)  # FP8 weights without their scales
    with pytest.raises(TypeError, match="w13_scale must be a float32"):
        fused_moe(hidden, q13, q2, weights, ids, w13_scale=s13.double(), w2_scale=s2)
    with pytest.raises(ValueError, match=r"w2_scale must be contiguous \(4, 64\)"):
        moe_gemv(hidden, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2[:, :10])
    with pytest.raises(TypeError, match="w2 must be torch.float8_e4m3fn"):
        fused_moe(hidden, q13, q2.float(), weights, ids, w13_scale=s13, w2_scale=s2)


# ----- which experts hold FP8, and the loader filling them -----

ONLINE = resolve_quantization("fp8", None, "test")


def config_of(layout: str | None):
    return ONLINE if layout is None else resolve_quantization(None, LAYOUTS[layout], "test")


def test_expert_quant_holds_where_the_kernels_run_and_blocks_fit():
    names = ("m.experts.0.gate_proj",)
    with quantization(config_of("qwen-block")):
        assert expert_quant(names, 256, kernels=True, hidden=2048).held
        assert not expert_quant(names, 64, kernels=True, hidden=2048).held  # a rank's rows split a block
        assert not expert_quant(names, 256, kernels=True, hidden=130).held  # rows off the int32 words
        assert not expert_quant(names, 256, kernels=False, hidden=2048).held  # CPU: dequantized at load
        assert expert_quant(None, 256, kernels=True, hidden=2048) is None  # no checkpoint names: full precision
    for layout in ("ct-channel", "ct-tensor", "qwen-tensor", None):
        with quantization(config_of(layout)):
            quant = expert_quant(names, 40, kernels=True, hidden=2048)
            assert quant.held and quant.weight_only and quant.fmt.requant_scales == "channel"
    assert expert_quant(names, 256, kernels=True, hidden=2048) is None  # no config


class ExpertsModel(nn.Module):
    """One experts layer under the checkpoint prefix `mlp.experts`, as a model the loader fills."""

    def __init__(self, config, e: int, h: int, i: int, rank: int = 0, world_size: int = 1):
        super().__init__()
        self.mlp = nn.Module()
        with quantization(config), tensor_parallel(TensorParallel(rank, world_size)):
            self.mlp.experts = MoeExperts(e, h, i, "mlp.experts", kernels=True)

    def map_checkpoint_name(self, name: str):
        return map_expert_name(name) or (name, None)

    def ignored_checkpoint_name(self, name: str) -> bool:
        return False


def write_experts(path, layout: str, e: int, h: int, i: int) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint of e experts in `layout` (with static input scales for ct-tensor); returns
    the dequantized float32 weights by name."""
    g = torch.Generator().manual_seed(1)
    tensors, deq = {}, {}
    for x in range(e):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            name = f"mlp.experts.{x}.{proj}"
            w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) / h ** 0.5
            q, s, d = quantized(w, layout)
            tensors[f"{name}.weight"], tensors[f"{name}.{SCALE_NAMES[layout]}"], deq[name] = q, s, d
            if layout == "ct-tensor":
                tensors[f"{name}.input_scale"] = torch.tensor([0.5])
    save_file(tensors, str(path / "model.safetensors"))
    return deq


def stacked(deq: dict[str, torch.Tensor], e: int, rank: int, local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's dequantized w13 [E, 2 local, H] and w2 [E, H, local], float64."""
    part = slice(rank * local, (rank + 1) * local)
    w13 = torch.stack([torch.cat([deq[f"mlp.experts.{x}.gate_proj"][part], deq[f"mlp.experts.{x}.up_proj"][part]])
                       for x in range(e)])
    w2 = torch.stack([deq[f"mlp.experts.{x}.down_proj"][:, part] for x in range(e)])
    return w13.double(), w2.double()


def held_weights(experts: MoeExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 fp8 x scale, as tests/fp8_checkpoints.py dequantizes."""
    w13_scale, w2_scale = experts.scales
    return (dequantize_experts(experts.w13, w13_scale, torch.float32).double(),
            dequantize_experts(experts.w2, w2_scale, torch.float32).double())


@pytest.mark.interpreter
@pytest.mark.parametrize("layout,i,world_size", [("qwen-block", 256, 2), ("ct-channel", 48, 2), ("ct-tensor", 48, 1),
                                                 ("qwen-tensor", 48, 1)])
def test_checkpoint_loads_fp8_experts_per_rank_and_runs(tmp_path, layout, i, world_size):
    e, h, k = 3, 200, 2
    deq = write_experts(tmp_path, layout, e, h, i)
    for rank in range(world_size):
        with kernel_routes(W8A16_ONLY):  # fp32 activations, exact against the dequantized weights
            model = ExpertsModel(config_of(layout), e, h, i, rank, world_size)
        experts = model.mlp.experts
        load_model(model, str(tmp_path))
        assert experts.w13.dtype == FP8 and experts.w2.dtype == FP8
        names = {n for n, _ in model.named_parameters()}
        assert names == {f"mlp.experts.{p}" for p in ("w13", "w2", f"w13_{SCALE_NAMES[layout]}",
                                                      f"w2_{SCALE_NAMES[layout]}")}
        w13, w2 = stacked(deq, e, rank, i // world_size)
        got13, got2 = held_weights(experts)
        assert torch.equal(got13, w13) and torch.equal(got2, w2)
        g = torch.Generator().manual_seed(rank)
        hidden, ids = torch.randn(5, h, generator=g), random_ids(5, e, k, g)
        weights = torch.softmax(torch.randn(5, k, generator=g), dim=1)
        assert_close(experts(hidden, weights, ids), reference_moe(hidden, w13, w2, weights, ids), torch.float32)


@pytest.mark.interpreter
def test_block_scales_splitting_a_block_over_ranks_dequantize_at_load(tmp_path):
    e, h, i = 2, 200, 128  # 64 rows a rank: half a block
    deq = write_experts(tmp_path, "qwen-block", e, h, i)
    model = ExpertsModel(config_of("qwen-block"), e, h, i, rank=1, world_size=2)
    load_model(model, str(tmp_path))
    experts = model.mlp.experts
    assert experts.scales is None and experts.w13.dtype == torch.float32
    w13, w2 = stacked(deq, e, 1, 64)
    assert torch.equal(experts.w13.double(), w13) and torch.equal(experts.w2.double(), w2)


@pytest.mark.interpreter
@pytest.mark.parametrize("layout", [None, "qwen-block"])
def test_update_weights_quantizes_full_precision_experts_with_the_engines_scheme(layout):
    """transformers 5's fused tensors (full precision) into held FP8 experts: quantized per channel
    (online) or per block (a block checkpoint's engine), as tests/fp8_checkpoints.py quantizes."""
    e, h, i = 2, 200, 128
    model = ExpertsModel(config_of(layout), e, h, i)
    g = torch.Generator().manual_seed(3)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) / 10, torch.randn(e, h, i, generator=g) / 10
    update_weights(model, [("mlp.experts.gate_up_proj", gate_up), ("mlp.experts.down_proj", down)])
    experts = model.mlp.experts
    want = "qwen-block" if layout else "ct-channel"
    for x in range(e):
        for got, got_s, w in ((experts.w13[x], experts.scales[0][x], gate_up[x]),
                              (experts.w2[x], experts.scales[1][x], down[x])):
            parts = (w[:i], w[i:]) if w is gate_up[x] else (w,)
            q, s = zip(*(quantized(p, want)[:2] for p in parts))
            assert torch.equal(got.float(), torch.cat(q).float())
            assert torch.equal(got_s.reshape(-1), torch.cat([t.reshape(-1) for t in s]))


@pytest.mark.interpreter
def test_bench_moe_fp8_smoke_counts_the_bytes_each_format_reads(tmp_path):
    """bench_moe_fp8.py block --shape tiny on CPU: both kernels run on bf16 and FP8 experts (the
    grouped GEMM W8A16 and W8A8) and pass the bench's own fp32 check; the bytes it counts are the stored widths by hand (FP8: one
    byte a weight plus float32 block scales, 2 x 2 for w13 [256, 256] and 2 x 1 for w2 [256, 128])."""
    import json

    from benchmarks.harness.moe_cases import SHAPES
    from benchmarks.kernels import bench_moe_fp8

    out = tmp_path / "rows.json"
    bench_moe_fp8.main(["block", "--shape", "tiny", "--tokens", "3", "--json", str(out)])
    head, *rows = json.loads(out.read_text())
    assert head["shape"] == "tiny" and head["scales"] == "block" and head["copy_gbps"] is None
    e, _, h, i = SHAPES["tiny"]
    assert [(r["kernel"], r["tokens"], r["weights"]) for r in rows] == [
        ("fused_moe", 3, w) for w in ("bf16", "fp8-block", "fp8-block-w8a8")] + [
        ("gemv", t, w) for t in (1, 2) for w in ("bf16", "fp8-block")]
    for r in rows:
        per_expert = 3 * h * i * 2 if r["weights"] == "bf16" else 3 * h * i + (2 * 2 + 2 * 1) * 4
        assert 1 <= r["distinct_experts"] <= e and r["bytes_read"] == r["distinct_experts"] * per_expert
        assert r["us"] > 0 and r["fraction_of_copy"] is None
    with pytest.raises(SystemExit):
        bench_moe_fp8.parse_args(["--shape", "tiny"])  # the weight scales are required
    assert bench_moe_fp8.parse_args(["channel"]).tokens == list(bench_moe_fp8.FP8_TOKENS)
