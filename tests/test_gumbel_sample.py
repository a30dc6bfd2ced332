"""The Triton Gumbel-max sampler against a float64 NumPy reference that regenerates the
same Philox4x32-10 noise (written from the Random123 definition), plus distribution checks.
CPU runs go through Triton's interpreter (small shapes); the `gpu` ones use real sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm.kernels.gumbel_max import SUB, TILE, gumbel_sample

# Triton kernels on CPU tensors: these run where the interpreter is on (no CUDA; see conftest.py).
pytestmark = pytest.mark.interpreter

M32 = 0xFFFFFFFF
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85  # Weyl key increments


def philox4x32(counter: np.ndarray, key: int, rounds: int = 10) -> list[np.ndarray]:
    """Four uint32 words per counter (counter words 1..3 are zero), key split lo/hi."""
    c0 = counter.astype(np.uint64)
    c1 = np.zeros_like(c0)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = key & M32, (key >> 32) & M32
    for _ in range(rounds):
        p0 = np.uint64(ROUND_B) * c2  # < 2**64: exact in uint64
        p1 = np.uint64(ROUND_A) * c0
        c0, c1, c2, c3 = ((p0 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p0 & np.uint64(M32),
                          (p1 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p1 & np.uint64(M32))
        k0, k1 = (k0 + KEY_A) & M32, (k1 + KEY_B) & M32
    return [c0, c1, c2, c3]


def reference_uniforms(key: int, vocab: int) -> np.ndarray:
    """u(key, v) for v < vocab, laid out as the kernel documents."""
    cols = np.arange(vocab)
    tile_start = cols // TILE * TILE
    word = (cols - tile_start) // SUB
    counter = tile_start // 4 + (cols - tile_start) % SUB
    words = philox4x32(np.arange(counter.max() + 1), key)
    picked = np.choose(word, [w[counter] for w in words])
    return ((picked >> np.uint64(9)).astype(np.float64) + 0.5) / 2.0**23


def reference_scores(x: torch.Tensor, keys: list[int], temperatures: list[float] | None) -> np.ndarray:
    x64 = x.double().cpu().numpy()
    out = np.empty_like(x64)
    for r, key in enumerate(keys):
        gumbel = -np.log(-np.log(reference_uniforms(key, x.shape[1])))
        if temperatures is None:
            with np.errstate(divide="ignore"):
                out[r] = np.log(x64[r]) + gumbel
        elif temperatures[r] == 0.0:
            out[r] = x64[r]
        else:
            out[r] = x64[r] / temperatures[r] + gumbel
    return out


def assert_matches_reference(tokens: torch.Tensor, scores: np.ndarray) -> None:
    """Each token is the float64 argmax, or within float32 rounding of it."""
    tokens = tokens.cpu().numpy()
    best = scores.max(axis=1)
    picked = scores[np.arange(len(tokens)), tokens]
    gap = best - picked
    assert np.all(gap <= 1e-5 * np.maximum(1.0, np.abs(best))), gap.max()
    assert np.mean(tokens == scores.argmax(axis=1)) >= 0.95


DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


def small_or_real(device: str) -> tuple[int, int]:
    return (5, 9000) if device == "cpu" else (256, 151_936)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_match_the_float64_reference(device, dtype):
    rows, vocab = small_or_real(device)
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    keys = [int(k) for k in torch.randint(0, 2**62, (rows,), generator=g)]
    temps = [0.0 if r % 4 == 0 else 0.3 + r % 3 for r in range(rows)]
    tokens = gumbel_sample(x.to(device), torch.tensor(keys, device=device),
                           torch.tensor(temps, dtype=torch.float32, device=device))
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert_matches_reference(tokens, reference_scores(x, keys, temps))
    greedy = [r for r in range(rows) if temps[r] == 0.0]
    assert tokens[greedy].cpu().tolist() == x[greedy].float().argmax(dim=1).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_filtered_probabilities_never_pick_a_zero(device):
    rows, vocab = small_or_real(device)
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(rows, vocab, generator=g), dim=-1)
    keep = torch.rand(rows, vocab, generator=g) < 0.01
    keep[:, 0] = True
    probs = torch.where(keep, probs, 0.0)
    keys = list(range(100, 100 + rows))
    tokens = gumbel_sample(probs.to(device), torch.tensor(keys, device=device), is_probs=True)
    assert keep[torch.arange(rows), tokens.cpu()].all()
    assert_matches_reference(tokens, reference_scores(probs, keys, None))


@pytest.mark.parametrize("device", DEVICES)
def test_ties_go_to_the_lowest_column(device):
    x = torch.zeros(2, 2 * TILE + 5, device=device)
    x[:, [7, TILE + 3, 2 * TILE + 1]] = 5.0
    tokens = gumbel_sample(x, torch.tensor([1, 2], device=device), torch.zeros(2, device=device))
    assert tokens.tolist() == [7, 7]


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_does_not_depend_on_the_batch(device):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3000, generator=g).to(device)
    t = torch.ones(4, device=device)
    keys = torch.tensor([11, 22, 33, 44], device=device)
    full = gumbel_sample(x, keys, t)
    for r in range(4):
        assert gumbel_sample(x[r : r + 1], keys[r : r + 1], t[r : r + 1]).item() == full[r].item()
    flipped = gumbel_sample(x.flip(0), keys.flip(0), t)
    assert flipped.flip(0).tolist() == full.tolist()
    other_keys = gumbel_sample(x, keys + 1, t)
    assert other_keys.tolist() != full.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_frequencies_follow_softmax(device, monkeypatch):
    n = 1500 if device == "cpu" else 200_000
    if device == "cpu":  # the interpreter pays per column: one tile per program covers this vocabulary
        import nanovllm.kernels.gumbel_max as gm
        monkeypatch.setattr(gm, "TILES_PER_CHUNK", 1)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5])
    temperature = 0.7
    x = logits.expand(n, -1).contiguous().to(device)
    tokens = gumbel_sample(x, torch.arange(n, device=device) * 7919, torch.full((n,), temperature, device=device))
    freq = torch.bincount(tokens.cpu(), minlength=8).double() / n
    expected = torch.softmax(logits.double() / temperature, dim=0)
    assert freq[6] == 0  # -inf logit
    # 5 standard errors per token
    assert torch.all((freq - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt() + 1e-12), (freq, expected)


def test_bad_arguments_are_named():
    x = torch.randn(2, 64)
    keys = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="keys"):
        gumbel_sample(x, keys.int(), torch.ones(2))
    with pytest.raises(TypeError, match="temperatures"):
        gumbel_sample(x, keys, torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous last dim"):
        gumbel_sample(x.t(), keys, torch.ones(64))
    with pytest.raises(TypeError, match="dtype"):
        gumbel_sample(x.long(), keys, torch.ones(2))
    with pytest.raises(ValueError, match="temperatures apply to logits"):
        gumbel_sample(x, keys, torch.ones(2), is_probs=True)
