"""Token masks of structured outputs in the sampler (sampling/token_mask.py, token_mask_kernel.py).

References: the bitmask layout is xgrammar's (its own `apply_token_bitmask_inplace` masks the same
logits), and a float64 loop over the bits; the masked sampler's tokens lie in the allowed sets and
equal the unmasked sampler's on the masked logits; rows without a mask are untouched. The Triton
kernel runs under Triton's interpreter on CPU (small shapes) and compiled on CUDA (Qwen3's vocabulary).
"""

from __future__ import annotations

import pytest
import torch
import xgrammar

from nanovllm import SamplingParams
from nanovllm.sampling.batch import SamplingBatch, row_key
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling.token_mask import TokenMask, allowed_tokens, apply_token_mask, mask_words

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


def random_mask(rows: list[int], vocab: int, seed: int, density: float = 0.05) -> TokenMask:
    """A mask of `rows` allowing a random `density` of the vocabulary (at least one token a row)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(len(rows), vocab, generator=g) < density
    allowed[torch.arange(len(rows)), torch.randint(0, vocab, (len(rows),), generator=g)] = True
    padded = torch.zeros(len(rows), mask_words(vocab) * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(len(rows), -1, 32) << torch.arange(32)).sum(-1)  # [R, W] in [0, 2**32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return TokenMask(torch.tensor(rows, dtype=torch.int64), bitmask)


def reference_masked(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """float64: -inf where bit t % 32 of word t // 32 of a masked row is clear, one token at a time."""
    out = logits.double().clone()
    words = mask.bitmask.tolist()
    for i, row in enumerate(mask.rows.tolist()):
        for t in range(logits.shape[1]):
            if not (words[i][t // 32] >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [100, 2_048, 3_001])
def test_apply_token_mask_masks_the_listed_rows_only(vocab):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    mask = random_mask([4, 1, 3], vocab, seed=vocab)
    masked = logits.clone()
    apply_token_mask(masked, mask)
    assert torch.equal(masked.double(), reference_masked(logits, mask))
    for row in (0, 2, 5):
        assert torch.equal(masked[row], logits[row])


def test_the_bitmask_layout_is_xgrammars():
    """xgrammar's own CPU apply masks the same tokens as ours, for the same bitmask."""
    vocab = 1_000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    mask = random_mask([0, 1, 2], vocab, seed=2, density=0.3)
    ours, theirs = logits.clone(), logits.clone()
    apply_token_mask(ours, mask)
    xgrammar.apply_token_bitmask_inplace(theirs, mask.bitmask)
    assert torch.equal(ours, theirs)
    assert torch.equal(allowed_tokens(mask.bitmask, vocab), torch.isfinite(theirs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_masks_as_the_torch_path(device, dtype):
    from nanovllm.sampling.token_mask_kernel import triton_apply_token_mask

    vocab = 151_936 if device == "cuda" else 2_100
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(3)).to(dtype)
    mask = random_mask([8, 0, 5, 2], vocab, seed=4)
    want = logits.clone()
    apply_token_mask(want, mask)
    got = logits.to(device)
    triton_apply_token_mask(got, TokenMask(mask.rows.to(device), mask.bitmask.to(device)))
    assert torch.equal(got.cpu(), want)


PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
          SamplingParams(temperature=1.2, top_k=40, seed=2), SamplingParams(top_p=0.8, seed=3),
          SamplingParams(min_p=0.1, seed=4), SamplingParams(temperature=0.0, logprobs=3),
          SamplingParams(temperature=1.0, top_k=5, top_p=0.9, logprobs=2, seed=5)]


def samplers(device: str) -> list[Sampler]:
    """The device's sampler; on CPU also one running every Triton kernel (interpreter)."""
    if device == "cuda":
        with torch.device("cuda"):
            return [Sampler()]
    from nanovllm.sampling.candidate_walk import walk_sample
    from nanovllm.sampling.gumbel_max import gumbel_sample
    from nanovllm.sampling.token_mask_kernel import triton_apply_token_mask

    kernels = Sampler()
    kernels.gumbel_sample, kernels.walk_sample = gumbel_sample, walk_sample
    kernels.apply_token_mask = triton_apply_token_mask
    return [Sampler(), kernels]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", [PARAMS[:2], PARAMS[3:5], PARAMS],
                         ids=["plain", "top-p/min-p", "every-filter"])
def test_masked_rows_sample_allowed_tokens_and_the_rest_are_unchanged(device, params):
    """Each masked row's token is allowed and is the token the sampler picks from the logits with
    the mask applied beforehand (same noise keys); unmasked rows get the unmasked batch's tokens.
    Logprobs of masked rows are those of the masked logits (-inf where not allowed), as vLLM's."""
    vocab = 151_936 if device == "cuda" else 2_100
    rows = len(params)
    logits = (3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5))).to(device)
    keys = [row_key(7, r) for r in range(rows)]
    batch = SamplingBatch.build(params, keys, device, vocab)
    masked_rows = list(range(0, rows, 2))
    mask = random_mask(masked_rows, vocab, seed=6, density=0.01)
    device_mask = TokenMask(mask.rows.to(device), mask.bitmask.to(device))
    allowed = allowed_tokens(mask.bitmask, vocab)
    premasked = logits.clone()
    apply_token_mask(premasked, device_mask)
    for sampler in samplers(device):
        plain = sampler(logits.clone(), batch)
        want = sampler(premasked.clone(), batch)
        got = sampler(logits.clone(), batch, token_mask=device_mask)
        tokens = got.tokens.tolist()
        assert tokens == want.tokens.tolist()
        for i, r in enumerate(masked_rows):
            assert allowed[i, tokens[r]], (r, tokens[r])
        for r in set(range(rows)) - set(masked_rows):
            assert tokens[r] == plain.tokens[r].item()
        if got.logprobs is not None:
            assert torch.equal(got.logprobs.rows, want.logprobs.rows)
            assert torch.allclose(got.logprobs.top_logprobs, want.logprobs.top_logprobs)
            assert torch.isfinite(got.logprobs.sampled).all()
