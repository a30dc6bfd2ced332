"""The Triton MoE routing kernel (moe/routing.py) against the PyTorch route of
moe/layer.py and a float64 softmax: under the CPU interpreter, and compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from nanovllm.moe.routing import moe_route
from nanovllm.moe.layer import route

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("experts, top_k", [(8, 2), (16, 8), (60, 4), (128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_softmax_top_k(device, experts, top_k, renormalize, dtype):
    tokens = 7 if device == "cpu" else 300
    g = torch.Generator().manual_seed(experts + top_k)
    logits = (2 * torch.randn(tokens, experts, generator=g)).to(dtype)
    weights, ids = moe_route(logits.to(device), top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (tokens, top_k)
    probs = torch.softmax(logits.double(), dim=-1)
    want = probs.topk(top_k, dim=-1).values
    if renormalize:
        want = want / want.sum(dim=-1, keepdim=True)
    weights, ids = weights.cpu().double(), ids.cpu().long()
    assert torch.allclose(weights, want, atol=1e-6)
    picked = probs.gather(1, ids)  # the ids carry the weights they are listed with
    if renormalize:
        picked = picked / picked.sum(dim=-1, keepdim=True)
    assert torch.allclose(picked, weights, atol=1e-6)
    assert all(len(set(row)) == top_k for row in ids.tolist())
    torch_w, torch_ids = route(logits.to(device), top_k, renormalize)
    assert torch.allclose(torch_w.cpu().double(), weights, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_pick_the_lower_expert_and_empty_batches(device):
    logits = torch.zeros(2, 16, device=device)
    logits[1, 5] = logits[1, 9] = 3.0
    weights, ids = moe_route(logits, 2, True)
    assert ids.cpu().tolist() == [[0, 1], [5, 9]]
    assert torch.allclose(weights.cpu(), torch.full((2, 2), 0.5))
    w, i = moe_route(logits[:0], 2, False)
    assert w.shape == i.shape == (0, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_rows_still_name_distinct_valid_experts(device):
    """A padded CUDA-graph row can hold garbage (NaN / inf): its ids must stay in range (the
    decode GEMV reads the weights of the ids it is given), distinct, and real rows unaffected."""
    logits = torch.randn(3, 12)
    logits[0, 3] = float("nan")
    logits[1] = float("nan")
    logits[2, 7] = float("inf")
    weights, ids = moe_route(logits.to(device), 4, True)
    ids = ids.cpu()
    assert ((ids >= 0) & (ids < 12)).all()
    assert all(len(set(row)) == 4 for row in ids.tolist())
    clean = torch.randn(2, 12)
    w_mixed, i_mixed = moe_route(torch.cat([clean, logits]).to(device), 4, True)
    w_clean, i_clean = moe_route(clean.to(device), 4, True)
    assert torch.equal(i_mixed[:2].cpu(), i_clean.cpu()) and torch.equal(w_mixed[:2].cpu(), w_clean.cpu())


def test_bad_arguments_name_the_problem():
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, 9, True)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, 0, True)
    with pytest.raises(TypeError, match="logits dtype"):
        moe_route(logits.double(), 2, True)
    with pytest.raises(ValueError, match="experts"):
        moe_route(torch.randn(2, 600), 2, True)
    with pytest.raises(ValueError, match="contiguous last dim"):
        moe_route(logits.t(), 2, True)
