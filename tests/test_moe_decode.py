"""The decode-step MoE GEMV (kernels/moe_decode.py) against the float64 reference of
tests/test_fused_moe.py: under the CPU interpreter on small shapes, compiled on CUDA at the
Qwen3-30B-A3B shape, and against fused_moe (the grouped path) on the same inputs."""

from __future__ import annotations

import pytest
import torch

from nanovllm.kernels.moe_decode import moe_gemv
from test_fused_moe import DEVICES, QWEN3_30B, TOLERANCE, assert_close, make_case, reference_moe


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2])
def test_matches_float64_reference(device, dtype, tokens):
    e, k, h, i = (8, 2, 96, 40) if device == "cpu" else (QWEN3_30B["E"], QWEN3_30B["K"], QWEN3_30B["H"], QWEN3_30B["I"])
    hidden, w13, w2, weights, ids = make_case(tokens, e, k, h, i, dtype, device, seed=tokens, row_pad=3)
    out = moe_gemv(hidden, w13, w2, weights, ids)
    assert_close(out.cpu(), reference_moe(hidden.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu()), dtype)


@pytest.mark.gpu
def test_agrees_with_the_grouped_kernel_on_cuda():
    from nanovllm.kernels import fused_moe

    args = make_case(2, QWEN3_30B["E"], QWEN3_30B["K"], QWEN3_30B["H"], QWEN3_30B["I"], torch.bfloat16, "cuda", seed=5)
    a, b = moe_gemv(*args).double(), fused_moe(*args).double()
    assert (a - b).abs().max().item() <= TOLERANCE[torch.bfloat16] * b.abs().max().item()


def test_bad_arguments_name_the_problem():
    hidden, w13, w2, weights, ids = make_case(2, 4, 2, 32, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="1..2 tokens"):
        moe_gemv(hidden.repeat(2, 1), w13, w2, weights.repeat(2, 1), ids.repeat(2, 1))
    with pytest.raises(ValueError, match="do not fit"):
        moe_gemv(hidden, w13[:, :, :16], w2, weights, ids)
    with pytest.raises(TypeError, match="topk_ids"):
        moe_gemv(hidden, w13, w2, weights, ids.float())
    with pytest.raises(TypeError, match="topk_weights"):
        moe_gemv(hidden, w13, w2, weights.double(), ids)
    with pytest.raises(ValueError, match="w2 must be"):
        moe_gemv(hidden, w13, w2.half(), weights, ids)


def test_the_step_kind_reaches_layers_through_the_forward_context():
    """The MoE layer runs this path only inside a decode step (see layers/fused_moe.MoeExperts)."""
    from nanovllm.utils.context import AttentionMetadata, attention_context, in_decode_step

    slots = torch.zeros(1, dtype=torch.int64)
    assert not in_decode_step()  # no forward running
    with attention_context(AttentionMetadata(is_prefill=False, slot_mapping=slots)):
        assert in_decode_step()
    with attention_context(AttentionMetadata(is_prefill=True, slot_mapping=slots)):
        assert not in_decode_step()
    assert not in_decode_step()
