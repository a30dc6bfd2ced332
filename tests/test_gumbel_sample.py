"""The Triton Gumbel-max sampler and its PyTorch twin against a float64 NumPy reference that
regenerates the same Philox4x32-10 noise (written from the Random123 definition), against each
other (bit-identical uniforms, identical tokens), plus distribution checks. Kernel runs on CPU
go through Triton's interpreter (small shapes, marked `interpreter`); the `gpu` ones use real
sizes; the PyTorch twin runs everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from nanovllm.sampling.gumbel_max import SUB, TILE, gumbel_sample, tile_uniforms
from nanovllm.sampling.gumbel_torch import torch_gumbel_sample, torch_gumbel_uniforms

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


# The kernel on CPU tensors runs where Triton's interpreter is on (no CUDA; see conftest.py).
DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
# (implementation, device): the kernel as above, and the PyTorch twin on the CPU.
SAMPLERS = [pytest.param((gumbel_sample, "cpu"), marks=pytest.mark.interpreter, id="kernel-interpreter"),
            pytest.param((gumbel_sample, "cuda"), marks=pytest.mark.gpu, id="kernel-cuda"),
            pytest.param((torch_gumbel_sample, "cpu"), id="torch-cpu")]
# Keys over the whole 63-bit range, the extremes included.
KEYS = [0, 1, 7919, 2**32 - 1, 2**32, 2**62 + 987_654_321, 2**63 - 1]


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
def test_tiles_per_chunk_changes_no_token(device):
    """Programs of 1 or 3 tiles (9 or 3 chunks a row, the last partial) pick the default's tokens."""
    rows, vocab = 5, 9 * TILE - 100
    g = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(rows, vocab, generator=g)).to(device)
    keys = torch.arange(1, rows + 1, device=device) * 104729
    t = torch.full((rows,), 0.8, device=device)
    default = gumbel_sample(x, keys, t)
    for tiles in (1, 3):
        assert torch.equal(gumbel_sample(x, keys, t, tiles_per_chunk=tiles), default), tiles
    with pytest.raises(ValueError, match="tiles_per_chunk"):
        gumbel_sample(x, keys, t, tiles_per_chunk=0)


@pytest.mark.parametrize("impl", SAMPLERS)
def test_ties_go_to_the_lowest_column(impl):
    sample, device = impl
    x = torch.zeros(2, 2 * TILE + 5, device=device)
    x[:, [7, TILE + 3, 2 * TILE + 1]] = 5.0
    tokens = sample(x, torch.tensor([1, 2], device=device), torch.zeros(2, device=device))
    assert tokens.tolist() == [7, 7]


@pytest.mark.parametrize("impl", SAMPLERS)
def test_a_row_does_not_depend_on_the_batch(impl):
    gumbel_sample, device = impl
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


@pytest.mark.parametrize("impl", SAMPLERS)
def test_frequencies_follow_softmax(impl):
    sample, device = impl
    n = 1500 if device == "cpu" else 200_000
    # The interpreter pays per column: the kernel's programs there take one tile, which covers this vocabulary.
    options = {"tiles_per_chunk": 1} if sample is gumbel_sample and device == "cpu" else {}
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5])
    temperature = 0.7
    x = logits.expand(n, -1).contiguous().to(device)
    tokens = sample(x, torch.arange(n, device=device) * 7919, torch.full((n,), temperature, device=device), **options)
    freq = torch.bincount(tokens.cpu(), minlength=8).double() / n
    expected = torch.softmax(logits.double() / temperature, dim=0)
    assert freq[6] == 0  # -inf logit
    # 5 standard errors per token
    assert torch.all((freq - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt() + 1e-12), (freq, expected)


@pytest.mark.parametrize("gumbel_sample", [gumbel_sample, torch_gumbel_sample], ids=["kernel", "torch"])
def test_bad_arguments_are_named(gumbel_sample):
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


# ----------------------------------------------------------------------------- the PyTorch twin


@pytest.mark.parametrize("vocab", [1, 300, TILE, TILE + 1, 3 * TILE - 17])
def test_torch_uniforms_equal_the_numpy_philox_reference(vocab):
    u = torch_gumbel_uniforms(torch.tensor(KEYS), vocab)
    assert u.dtype == torch.float32 and u.shape == (len(KEYS), vocab)
    for r, key in enumerate(KEYS):
        assert np.array_equal(u[r].numpy(), reference_uniforms(key, vocab).astype(np.float32)), key
    assert 0.0 < u.min().item() and u.max().item() < 1.0


@triton.jit
def uniforms_kernel(key_ptr, u_ptr, vocab, stride_u, SUB: tl.constexpr):
    """u[row, v] = u(keys[row], v) for the tile at program_id(1), drawn by the sampling kernels' tile_uniforms."""
    row = tl.program_id(0)
    t0 = tl.program_id(1) * (4 * SUB)
    u_row = u_ptr + row.to(tl.int64) * stride_u
    j = tl.arange(0, SUB)
    u0, u1, u2, u3 = tile_uniforms(tl.load(key_ptr + row), t0, j)
    c = t0 + j
    tl.store(u_row + c, u0, mask=c < vocab)
    tl.store(u_row + c + SUB, u1, mask=c + SUB < vocab)
    tl.store(u_row + c + 2 * SUB, u2, mask=c + 2 * SUB < vocab)
    tl.store(u_row + c + 3 * SUB, u3, mask=c + 3 * SUB < vocab)


def kernel_uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32: the uniforms the sampling kernels draw for `keys` [B] int64."""
    u = torch.empty(keys.shape[0], vocab, dtype=torch.float32, device=keys.device)
    uniforms_kernel[(keys.shape[0], triton.cdiv(vocab, TILE))](keys, u, vocab, u.stride(0), SUB=SUB)
    return u


def device_vocabs(device: str) -> list[int]:
    return [1, 300, TILE + 1, 9000] if device == "cpu" else [151_936]


@pytest.mark.parametrize("device", DEVICES)
def test_torch_uniforms_are_the_kernels_bit_for_bit(device):
    keys = torch.tensor(KEYS, device=device)
    for vocab in device_vocabs(device):
        kernel = kernel_uniforms(keys, vocab)
        twin = torch_gumbel_uniforms(keys, vocab)
        assert kernel.shape == twin.shape == (len(KEYS), vocab)
        assert torch.equal(kernel.view(torch.int32), twin.view(torch.int32)), vocab


def assert_same_tokens(kernel: torch.Tensor, twin: torch.Tensor, scores: np.ndarray, device: str) -> None:
    """Identical tokens. On CUDA the kernel's log (libdevice's) might round differently from torch's
    (the uniforms are still identical), so a rare row may differ, but only at a float32 near-tie."""
    kernel, twin = kernel.cpu().numpy(), twin.cpu().numpy()
    if device == "cpu":
        assert kernel.tolist() == twin.tolist()
        return
    differ = np.nonzero(kernel != twin)[0]
    assert len(differ) <= max(1, len(kernel) // 1000), differ
    for r in differ:
        best = max(scores[r, kernel[r]], scores[r, twin[r]])
        assert abs(scores[r, kernel[r]] - scores[r, twin[r]]) <= 1e-5 * max(1.0, abs(best)), r


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_twin_samples_the_kernels_tokens(device, dtype):
    rows, vocab = (7, 3 * TILE - 17) if device == "cpu" else (256, 151_936)
    g = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    keys = [(KEYS[r % len(KEYS)] + r // len(KEYS)) % 2**63 for r in range(rows)]  # int64 keys
    temps = [0.0 if r % 5 == 0 else 0.25 + 0.3 * (r % 4) for r in range(rows)]
    x_d, keys_d = x.to(device), torch.tensor(keys, device=device)
    temps_d = torch.tensor(temps, dtype=torch.float32, device=device)
    assert_same_tokens(gumbel_sample(x_d, keys_d, temps_d), torch_gumbel_sample(x_d, keys_d, temps_d),
                       reference_scores(x, keys, temps), device)
    probs = torch.softmax(x.float(), dim=-1)
    probs = torch.where(probs >= probs.amax(dim=-1, keepdim=True) * 1e-3, probs, 0.0)  # a filtered row
    probs_d = probs.to(device)
    assert_same_tokens(gumbel_sample(probs_d, keys_d, is_probs=True), torch_gumbel_sample(probs_d, keys_d, is_probs=True),
                       reference_scores(probs, keys, None), device)
