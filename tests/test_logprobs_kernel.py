"""The Triton logprobs kernel (kernels/logprobs.py) against a float64 log_softmax: under the CPU
interpreter on small shapes, compiled on CUDA at serving size."""

from __future__ import annotations

import pytest
import torch

from nanovllm.kernels.logprobs import row_logprobs

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
# float32 normaliser and logits against float64: a few ulps of values of order ten.
ATOL = 1e-4


def reference(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    lp = torch.log_softmax(logits.double(), dim=-1)
    return lp.gather(1, tokens[:, None]).squeeze(1), lp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_matches_float64_log_softmax(device, dtype, k):
    rows, vocab, block = (5, 3 * 256 - 17, 256) if device == "cpu" else (256, 151_936, None)
    # drawn, and the float64 reference computed, on the device under test (39M values on CUDA)
    g = torch.Generator(device=device).manual_seed(k)
    logits = (4 * torch.randn(rows, vocab, generator=g, device=device)).to(dtype)
    logits[1, 100:110] = logits[1].max()  # ties at the top: the lower ids rank first within a chunk
    tokens = torch.randint(0, vocab, (rows,), generator=g, device=device)
    tokens[0] = logits[0].argmax()
    kw = {"block": block} if block else {}
    chosen, top_ids, top_lps = row_logprobs(logits, tokens, k, **kw)
    want, lp = reference(logits, tokens, k)
    assert chosen.dtype == top_lps.dtype == torch.float32 and top_ids.dtype == torch.int64
    assert top_ids.shape == top_lps.shape == (rows, k)
    assert torch.allclose(chosen.double(), want, atol=ATOL)
    if k:
        top_lps = top_lps.double()
        # each listed token's logprob is its own, in descending order, and no better token is left out
        assert torch.allclose(top_lps, lp.gather(1, top_ids), atol=ATOL)
        assert (top_lps[:, :-1] >= top_lps[:, 1:] - ATOL).all()
        kth = lp.topk(k, dim=1).values[:, -1:]
        assert torch.allclose(top_lps[:, -1:], kth, atol=ATOL)
        assert all(len(set(r)) == k for r in top_ids.tolist())  # distinct ids


@pytest.mark.parametrize("device", DEVICES)
def test_row_strides_and_empty_batches(device):
    vocab, block = (300, 128) if device == "cpu" else (151_936, None)
    kw = {"block": block} if block else {}
    wide = torch.randn(3, vocab + 64).to(device)
    logits = wide[:, :vocab]  # rows of a wider buffer (the LM head's padded vocabulary)
    tokens = torch.tensor([0, 5, vocab - 1], device=device)
    chosen, top_ids, _ = row_logprobs(logits, tokens, 3, **kw)
    want, lp = reference(logits.cpu(), tokens.cpu(), 3)
    assert torch.allclose(chosen.cpu().double(), want, atol=ATOL)
    assert (top_ids.cpu() < vocab).all()
    none = row_logprobs(logits[:0], tokens[:0], 2, **kw)
    assert [tuple(t.shape) for t in none] == [(0,), (0, 2), (0, 2)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_subset_of_rows_is_scored_in_place(device):
    """`rows` picks the scored rows of logits and tokens (the sampler's asking rows), in their order."""
    from nanovllm.layers.sampler import token_logprobs

    vocab, block = (300, 128) if device == "cpu" else (151_936, None)
    kw = {"block": block} if block else {}
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=g).to(device)
    tokens = torch.randint(0, vocab, (6,), generator=g).to(device)
    rows = torch.tensor([4, 1, 5], device=device)
    chosen, top_ids, top_lps = row_logprobs(logits, tokens, 4, rows, **kw)
    want, lp = reference(logits.cpu()[rows.cpu()], tokens.cpu()[rows.cpu()], 4)
    assert torch.allclose(chosen.cpu().double(), want, atol=ATOL)
    assert torch.allclose(top_lps.cpu().double(), lp.topk(4, dim=1).values, atol=ATOL)
    twin = token_logprobs(logits.cpu(), tokens.cpu(), 4, rows.cpu())  # the CPU path's same contract
    assert torch.equal(twin[1], top_ids.cpu()) and torch.allclose(twin[0], chosen.cpu(), atol=ATOL)


def test_bad_arguments_name_the_problem():
    logits = torch.randn(2, 50)
    tokens = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="k must be an int"):
        row_logprobs(logits, tokens, 1.0)
    with pytest.raises(ValueError, match="k must be in"):
        row_logprobs(logits, tokens, 51)
    with pytest.raises(TypeError, match="token_ids"):
        row_logprobs(logits, tokens.int(), 1)
    with pytest.raises(TypeError, match="logits dtype"):
        row_logprobs(logits.double(), tokens, 1)
    with pytest.raises(ValueError, match="contiguous last dim"):
        row_logprobs(logits.t(), tokens, 1)
    with pytest.raises(TypeError, match="rows must be"):
        row_logprobs(logits, tokens, 1, torch.tensor([0.0]))
