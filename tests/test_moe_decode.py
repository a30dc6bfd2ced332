"""The decode-step MoE GEMV (moe/decode.py) against the float64 reference of
tests/test_fused_moe.py: under the CPU interpreter on small shapes, compiled on CUDA at the
Qwen3-30B-A3B shape, and against fused_moe (the grouped path) on the same inputs; tile overrides
(GemvTiles) and the bench's --sweep-gemv candidate grid."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from nanovllm.moe.decode import DEFAULT_TILES, GemvTiles, moe_gemv, moe_gemv_routed
from nanovllm.moe.routing import moe_route
from test_fused_moe import DEVICES, QWEN3_30B, TOLERANCE, assert_close, make_case, reference_moe


def shape(device, k=None):
    """(E, K, H, I): small under the interpreter, Qwen3-30B-A3B's on CUDA."""
    e, top_k, h, i = (8, 2, 96, 40) if device == "cpu" else (QWEN3_30B["E"], QWEN3_30B["K"], QWEN3_30B["H"], QWEN3_30B["I"])
    return e, k or top_k, h, i


def check_against_reference(args, dtype, **kwargs):
    hidden, w13, w2, weights, ids = args
    out = moe_gemv(hidden, w13, w2, weights, ids, **kwargs)
    assert_close(out, reference_moe(hidden, w13, w2, weights, ids), dtype)  # float64 on the same device
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2])
def test_matches_float64_reference(device, dtype, tokens):
    e, k, h, i = shape(device)
    check_against_reference(make_case(tokens, e, k, h, i, dtype, device, seed=tokens, row_pad=3), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,top_k,renormalize", [(1, 2, True), (2, 3, False), (2, 8, True)])
def test_routing_folded_in_equals_moe_route_then_moe_gemv(device, tokens, top_k, renormalize):
    """moe_gemv_routed: its weights and ids are moe_route's on the same logits (ties among the
    logits included: the lower expert first), and its output is moe_gemv's on them, bit for bit,
    and within tolerance of the float64 reference; a row of NaN logits (a padded graph row) still
    names distinct experts."""
    e, _, h, i = shape(device)
    dtype = torch.bfloat16
    hidden, w13, w2, _, _ = make_case(tokens, e, top_k, h, i, dtype, device, seed=20 + top_k)
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(tokens, e, generator=g).to(dtype)
    logits[0, 1] = logits[0, 4] = logits[0].max()  # a tie at the top
    if tokens == 2:
        logits[1] = float("nan")
    logits = logits.to(device)
    out, weights, ids = moe_gemv_routed(hidden, w13, w2, logits, top_k, renormalize)
    want_weights, want_ids = moe_route(logits, top_k, renormalize)
    assert torch.equal(ids, want_ids) and torch.equal(weights.nan_to_num(-1), want_weights.nan_to_num(-1))
    assert ids[0, :2].tolist() == [1, 4]
    assert all(len(set(row)) == top_k for row in ids.tolist())
    torch.testing.assert_close(out, moe_gemv(hidden, w13, w2, want_weights, want_ids), rtol=0, atol=0, equal_nan=True)
    if tokens == 1:
        assert_close(out, reference_moe(hidden, w13, w2, weights, ids), dtype)


def test_routed_path_refuses_logits_that_do_not_fit():
    e, k, h, i = shape("cpu")
    hidden, w13, w2, _, _ = make_case(1, e, k, h, i, torch.float32, "cpu", seed=1)
    with pytest.raises(ValueError, match="router_logits"):
        moe_gemv_routed(hidden, w13, w2, torch.zeros(1, e + 1), k, True)
    with pytest.raises(ValueError, match="router_logits"):
        moe_gemv_routed(hidden, w13, w2, torch.zeros(2, e), k, True)
    with pytest.raises(ValueError, match="top_k"):
        moe_gemv_routed(hidden, w13, w2, torch.zeros(1, e), e + 1, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_k", [1, 3, 6])
def test_any_top_k_pads_the_expert_axis_to_a_power_of_two(device, top_k):
    """The down kernel's slot axis is next_pow2(K) wide (K = 3, 6: 4, 8); padded slots add nothing."""
    e, k, h, i = shape(device, top_k)
    dtype = torch.bfloat16
    check_against_reference(make_case(2, e, k, h, i, dtype, device, seed=10 + top_k), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_tokens_with_shared_and_distinct_experts(device, dtype):
    """Token 0 and token 1 both pick expert 5 (in different slots); the other picks differ, ids int32."""
    e, k, h, i = shape(device, 4)
    ids = torch.tensor([[5, 0, 7, 2], [1, 5, 3, 6]], dtype=torch.int32)
    args = make_case(2, e, k, h, i, dtype, device, ids=ids, seed=3, row_pad=5)
    out = check_against_reference(args, dtype)
    # each token's row equals that token alone: no slot of one token leaks into the other
    hidden, w13, w2, weights, ids = args
    for t in range(2):
        alone = moe_gemv(hidden[t:t + 1], w13, w2, weights[t:t + 1].contiguous(), ids[t:t + 1].contiguous())
        torch.testing.assert_close(alone, out[t:t + 1], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_tiles_override_matches_the_default(device):
    """Smaller column steps: under the interpreter H = 96 and I = 40 take several steps, the last partial."""
    e, k, h, i = shape(device, 6)
    dtype = torch.bfloat16
    args = make_case(2, e, k, h, i, dtype, device, seed=7)
    other = GemvTiles(gate_up_block_n=8, gate_up_block_k=64, down_block_n=16, down_block_k=16, num_warps=8)
    assert other != DEFAULT_TILES
    default = check_against_reference(args, dtype)
    swapped = check_against_reference(args, dtype, tiles=other)
    ref = default.double().abs().max().item()
    assert (swapped.double() - default.double()).abs().max().item() <= TOLERANCE[dtype] * ref


def test_bad_tiles_are_refused():
    args = make_case(1, 4, 2, 32, 16, torch.float32, "cpu")
    for bad in ((16, 256, 4, 256, 4), {"gate_up_block_n": 16}, "default"):
        with pytest.raises(TypeError, match="tiles must be a GemvTiles"):
            moe_gemv(*args, tiles=bad)
    for field, value, error in (("down_block_n", 6, ValueError), ("num_warps", 0, ValueError),
                                ("gate_up_block_k", 256.0, TypeError), ("down_block_k", True, TypeError)):
        with pytest.raises(error, match=field):
            GemvTiles(**{**DEFAULT_TILES.__dict__, field: value})


def test_the_bench_sweep_grid_parses_and_stays_small():
    """bench_moe.py --sweep-gemv (GPU only) on CPU: its arguments parse and its candidate grid holds
    the defaults, only valid tiles, and at most 60 candidates."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "kernels" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.parse_args(["--sweep-gemv"]).sweep_gemv and not bench.parse_args([]).sweep_gemv
    candidates = bench.gemv_candidates()
    assert candidates[0] == DEFAULT_TILES and len(set(candidates)) == len(candidates) <= 60
    assert all(isinstance(c, GemvTiles) for c in candidates)


@pytest.mark.gpu
def test_agrees_with_the_grouped_kernel_on_cuda():
    from nanovllm.moe.grouped_gemm import fused_moe

    args = make_case(2, QWEN3_30B["E"], QWEN3_30B["K"], QWEN3_30B["H"], QWEN3_30B["I"], torch.bfloat16, "cuda", seed=5)
    a, b = moe_gemv(*args).double(), fused_moe(*args).double()
    assert (a - b).abs().max().item() <= TOLERANCE[torch.bfloat16] * b.abs().max().item()


def test_bad_arguments_name_the_problem():
    hidden, w13, w2, weights, ids = make_case(2, 4, 2, 32, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="1..2 tokens"):
        moe_gemv(hidden.repeat(2, 1), w13, w2, weights.repeat(2, 1), ids.repeat(2, 1))
    with pytest.raises(ValueError, match=r"w13 shape \(4, 32, 16\) must be \[E, 2 \* I, H=32\]"):  # as fused_moe names it
        moe_gemv(hidden, w13[:, :, :16], w2, weights, ids)
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        moe_gemv(hidden, w13, w2, weights, ids + 4)
    with pytest.raises(TypeError, match="topk_ids"):
        moe_gemv(hidden, w13, w2, weights, ids.float())
    with pytest.raises(TypeError, match="topk_weights"):
        moe_gemv(hidden, w13, w2, weights.double(), ids)
    with pytest.raises(TypeError, match="w2 dtype torch.float16 != hidden dtype"):  # as fused_moe names it
        moe_gemv(hidden, w13, w2.half(), weights, ids)
    with pytest.raises(ValueError, match="w2 must be a 3-D tensor"):
        moe_gemv(hidden, w13, w2[0], weights, ids)


def test_the_step_kind_reaches_layers_through_the_forward_context():
    """The MoE layer runs this path only inside a decode step (see moe/layer.MoeExperts)."""
    from nanovllm.utils.context import AttentionMetadata, attention_context, in_decode_step

    slots = torch.zeros(1, dtype=torch.int64)
    assert not in_decode_step()  # no forward running
    with attention_context(AttentionMetadata(is_prefill=False, slot_mapping=slots)):
        assert in_decode_step()
    with attention_context(AttentionMetadata(is_prefill=True, slot_mapping=slots)):
        assert not in_decode_step()
    assert not in_decode_step()


@pytest.mark.interpreter
@pytest.mark.parametrize("tokens", [1, 2])
def test_the_layer_routes_inside_the_gemvs_in_decode_steps(tokens):
    """SparseMoeBlock on its Triton path (forced on CPU: the interpreter) in a decode step of 1-2
    tokens takes moe_gemv_routed and gives the PyTorch path's output on the same weights; outside
    a decode step it does not (it routes, then fused_moe)."""
    from nanovllm.layers.kernel_path import KernelRoutes
    from nanovllm.moe.layer import SparseMoeBlock
    from nanovllm.utils.context import AttentionMetadata, attention_context

    torch.manual_seed(tokens)
    e, k, h, i = shape("cpu")
    block = SparseMoeBlock(h, e, k, i, renormalize=True)
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    hidden = torch.randn(tokens, h)
    want = block(hidden)  # built on CPU: route + experts_native
    # the CUDA path's kernels, under the interpreter
    block.experts.use_triton, block.experts.gemv_tokens = True, KernelRoutes().moe_gemv_max_tokens
    assert not block.experts.runs_gemv(hidden)  # no decode step running
    with attention_context(AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(tokens, dtype=torch.int64))):
        assert block.experts.runs_gemv(hidden)
        got = block(hidden)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
