"""Qwen3-MoE on a CUDA device in bf16: the engine (fused MoE kernel) against transformers, CUDA
graphs against eager, and the MoE layer's CUDA path against its PyTorch path on the same weights,
eagerly and replayed from a CUDA graph with new routing."""

from __future__ import annotations

import pytest
import torch

from checkpoints import (
    MoeShape, assert_bf16_greedy_matches, check_gpu_regimes, checkpoint_fixture, gpu_generate, gpu_reference_fixture,
    make_prompts,
)
from nanovllm import SamplingParams
from nanovllm.moe.layer import SparseMoeBlock, experts_native, route

pytestmark = pytest.mark.gpu

# Qwen3-30B-A3B's attention geometry (32 q heads, 4 kv heads, head_dim 128) and routing (top 8)
# at a small width, 32 experts; layer 3 dense, so both MLP kinds run in the graphs.
SHAPE = MoeShape(hidden_size=256, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 intermediate_size=512, moe_intermediate_size=128, num_experts=32, num_experts_per_tok=8,
                 mlp_only_layers=(3,), max_position_embeddings=4096)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# Greedy tokens are checked with checkpoints.BF16_TOLERANCE (the engine in bf16 on CPU stayed
# within 1% of the logit range on this shape); engines are checkpoints.gpu_generate's.
# Layer shapes (experts, top k, hidden, expert width): the test model's; Qwen3-30B-A3B's; its
# tensor-parallel rank at tp=2 (half the expert width).
LAYER_SHAPES = [(32, 8, 256, 128), (128, 8, 2048, 768), (128, 8, 2048, 384)]
# Token counts: decode batches (1, 2: the graphs' smallest; 8), a mixed step, a prefill chunk.
LAYER_TOKENS = [1, 2, 8, 100, 1024]
# Expert weight std for the layer tests: outputs of order one at these widths.
LAYER_WEIGHT_STD = 0.05
# Router weight std: logits of order one, so the top k stand out without being one-hot.
ROUTER_WEIGHT_STD = 0.05
# bf16 against float32: relative error of a few bf16 roundings (inputs, the SwiGLU product, output).
LAYER_RTOL = 3e-2


ckpt = checkpoint_fixture("moe-gpu", SHAPE)
reference = gpu_reference_fixture()


def generate(ckpt, ps, **kw):
    outs, facts = gpu_generate(ckpt, [ps], GREEDY, **kw)
    return outs[0], facts


def test_bf16_greedy_matches_transformers(ckpt, reference):
    ps = make_prompts(0, 8, 1, 300)
    outs, facts = generate(ckpt, ps)
    assert facts["graphs"]
    for p, o in zip(ps, outs):
        assert_bf16_greedy_matches(reference, p, o)


def test_scheduling_regimes_match_transformers(ckpt, reference):
    shared = list(range(100, 372))
    ps = [shared + p for p in make_prompts(1, 6, 1, 80)] + make_prompts(2, 6, 50, 400)
    regimes = {
        "plain": {"enable_prefix_caching": False},
        "prefix-cache": {},
        "chunked": {"max_num_batched_tokens": 64},
        "preempt": {"num_kvcache_blocks": -(-(400 + 32) // 16) + 1},
    }
    check_gpu_regimes(ckpt, reference, ps, GREEDY, regimes)


def test_cuda_graph_and_eager_decode_identical(ckpt, reference):
    """Decode graphs: at a captured batch size the graph runs the same kernels on the same shapes
    as eager, the routing (read on the device) changing from step to step inside the replayed
    graph, so with prefill steps eager on both sides the tokens are identical. Batches of 1, 2, 8
    and 48 requests, one after another on one engine of each kind.

    Prefill graphs replay a padded token bucket, where cuBLAS may pick another kernel for the
    dense projections than at the exact count, and a bf16 router near a tie may then pick
    another expert: with them on, the tokens are checked against transformers within the bf16
    tolerance instead (an H200 run at 72ae2c1 saw graph and eager part at the 11th token of a
    batch-2 sequence)."""
    batches = [make_prompts(3, batch, 20, 200) for batch in (1, 2, 8, 48)]
    graph, facts = gpu_generate(ckpt, batches, GREEDY, prefill_graphs=False)
    assert facts["graphs"] and not facts["prefill_graphs"]
    eager, facts = gpu_generate(ckpt, batches, GREEDY, enforce_eager=True)
    assert not facts["graphs"]
    assert graph == eager
    both, facts = gpu_generate(ckpt, batches, GREEDY)
    assert facts["prefill_graphs"]
    for ps, outs in zip(batches, both):
        for p, o in zip(ps, outs):
            assert_bf16_greedy_matches(reference, p, o)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_matches_transformers(ckpt, reference):
    """Experts split on their width over two GPUs (bf16 partial sums all-reduced, so tokens may
    differ from one GPU's where logits nearly tie): transformers' tokens within tolerance."""
    ps = make_prompts(5, 8, 20, 200)
    outs, _ = generate(ckpt, ps, tensor_parallel_size=2)
    for p, o in zip(ps, outs):
        assert_bf16_greedy_matches(reference, p, o)


def _block(num_experts, top_k, hidden, width, seed=0) -> SparseMoeBlock:
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.device("cuda"):
        block = SparseMoeBlock(hidden, num_experts, top_k, width, renormalize=True).to(torch.bfloat16)
    assert block.experts.use_triton
    for p in block.parameters():
        p.data.normal_(0, ROUTER_WEIGHT_STD if p is block.gate.weight else LAYER_WEIGHT_STD, generator=g)
    return block


def _native(block: SparseMoeBlock, hidden: torch.Tensor, topk_weights, topk_ids) -> torch.Tensor:
    """The PyTorch path in float32 on the same (bf16) weights and routing."""
    e = block.experts
    return experts_native(hidden.float(), e.w13.float(), e.w2.float(), topk_weights, topk_ids)


def _assert_close_to(out: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=LAYER_RTOL, atol=LAYER_RTOL * scale)


@pytest.mark.parametrize("shape", LAYER_SHAPES, ids=lambda s: "E{}-K{}-H{}-I{}".format(*s))
def test_layer_cuda_path_matches_pytorch_path(shape):
    block = _block(*shape)
    with torch.inference_mode():
        for tokens in LAYER_TOKENS:
            hidden = torch.randn(tokens, shape[2], device="cuda", dtype=torch.bfloat16)
            topk_weights, topk_ids = route(block.gate(hidden), block.top_k, block.renormalize)  # [T, K] each
            out = block.experts(hidden, topk_weights, topk_ids)  # [T, H]
            assert out.dtype == torch.bfloat16 and out.shape == hidden.shape
            _assert_close_to(out, _native(block, hidden, topk_weights, topk_ids))


# The captured rows' seed: any but the replays' (0-2).
CAPTURE_SEED = 100


def test_layer_replays_from_a_cuda_graph_with_new_routing():
    """Captured once, replayed on new hidden states: the experts each row picks differ from the
    capture's, and the output is the eager output of the new inputs, bit for bit."""
    block = _block(32, 8, 256, 128)
    with torch.inference_mode():
        # Its own seed, apart from the replays' 0-2: from the default generator, static equalled the seed-0
        # rows whenever an earlier test had left that generator at torch.manual_seed(0).
        static = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16,
                             generator=torch.Generator(device="cuda").manual_seed(CAPTURE_SEED))
        captured_ids = route(block.gate(static), 8, True)[1]
        block(static)  # compile and warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(static)
        for seed in range(3):
            g = torch.Generator(device="cuda").manual_seed(seed)
            fresh = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16, generator=g)
            static.copy_(fresh)
            graph.replay()
            assert not torch.equal(route(block.gate(fresh), 8, True)[1], captured_ids)
            torch.testing.assert_close(out, block(fresh), rtol=0, atol=0)
