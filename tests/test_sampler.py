"""CPU tests of nanovllm.sampling.sampler: greedy, distributions, filters, seeds, mixed batches,
logprobs, batch packing.

Statistical checks compare sampled frequencies with a float64 reference through a
chi-square statistic and a conservative threshold (Wilson-Hilferty quantile at
z = 5, i.e. a false-alarm rate below 1e-6); all torch seeds are fixed. Every row's
noise comes from its key: unseeded rows here take fresh random 63-bit keys.
"""

from __future__ import annotations

import math

import pytest
import torch

from nanovllm.config import DEFAULT_MAX_LOGPROBS
from nanovllm.layers.kernel_path import KernelRoutes, kernel_routes
from nanovllm.sampling.batch import KEY_BITS, SamplingBatch, SamplingPack, row_key
from nanovllm.sampling.gumbel_torch import torch_gumbel_sample
from nanovllm.sampling.row_logprobs import token_logprobs
from nanovllm.sampling.sampler import Sampler, takes_topk_path, top_k_top_p_threshold
from nanovllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
SAMPLER = Sampler()


# ----------------------------------------------------------------------------- helpers


def chi2_threshold(df: int, z: float = 5.0) -> float:
    """Upper chi-square quantile for a normal z-score (Wilson-Hilferty approximation)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom over the tokens with probs > 0."""
    support = probs > 0
    n = counts.sum().item()
    expected = probs[support] * n
    assert expected.min().item() >= 5, "test design: too few expected draws per token"
    observed = counts[support].double()
    return ((observed - expected) ** 2 / expected).sum().item(), int(support.sum().item()) - 1


def assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Sampled counts fit the float64 distribution ``probs``, with the support exact."""
    outside = counts[probs == 0].sum().item()
    assert outside == 0, f"{outside} draws outside the allowed set"
    assert bool((counts[probs > 0] > 0).all()), "an allowed token was never drawn"
    stat, df = chi2_stat(counts, probs)
    assert stat < chi2_threshold(df), f"chi2 {stat:.1f} >= {chi2_threshold(df):.1f} (df {df})"


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64 distribution after temperature, then vLLM V1's order: min-p, top-k, top-p over the
    survivors' mass (ties kept together).

    Written as plain Python over the sorted probabilities, independent of the sampler.
    Asserts that no top-p decision is within 1e-4 of its boundary, so float32 rounding
    in the sampler cannot flip it.
    """
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    keep = probs > -1.0
    if p.min_p > 0.0:
        floor = p.min_p * probs.max().item()
        assert (probs - floor).abs().min().item() > 1e-6, "test design: min-p boundary too close"
        keep &= probs >= floor
    values = sorted(probs[keep].tolist(), reverse=True)
    if p.top_k not in (0, -1) and p.top_k < len(values):
        keep &= probs >= values[p.top_k - 1]
    if p.top_p < 1.0:
        kept_values = sorted(probs[keep].tolist(), reverse=True)
        limit = p.top_p * sum(kept_values)
        before = 0.0
        for v in kept_values:
            assert abs(before - limit) > 1e-4 or before == 0.0, "test design: top-p boundary too close"
            if before >= limit:
                keep &= probs > v  # everything from here on (ties of v included) is dropped
                break
            before += v
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


# A row whose kept set depends on the order of min-p and top-p (min_p 0.2, top_p 0.5): min-p keeps
# tokens 0-4 (p 0.30, 0.12, 0.10, 0.09, 0.08: mass 0.69), and top-p over them keeps 0 and 1 (the mass
# before token 2, 0.42, reaches 0.5 x 0.69); over the whole row it would keep token 2 too (0.42 < 0.5).
ORDER_HEAD = (0.30, 0.12, 0.10, 0.09, 0.08)
ORDER_PARAMS = dict(temperature=1.0, top_p=0.5, min_p=0.2)
ORDER_KEPT = [0, 1]


def order_row(vocab: int) -> torch.Tensor:
    """[vocab] float32 logits of that row (the rest of the mass spread evenly over the tail)."""
    tail = (1.0 - sum(ORDER_HEAD)) / (vocab - len(ORDER_HEAD))
    return torch.tensor(ORDER_HEAD + (tail,) * (vocab - len(ORDER_HEAD)), dtype=torch.float64).log().float()


def fresh_keys(n: int) -> list[int]:
    """n random noise keys over the whole 63-bit range (from the seeded torch RNG)."""
    return torch.randint(0, 2**KEY_BITS - 1, (n,)).tolist()


def build(params: list[SamplingParams], vocab: int, keys: list[int] | None = None) -> SamplingBatch:
    """A CPU batch; rows without given keys take fresh ones."""
    return SamplingBatch.build(params, fresh_keys(len(params)) if keys is None else keys, CPU, vocab)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The sampler's tokens, checking the output's types."""
    out = SAMPLER(logits, batch)
    assert out.tokens.dtype == torch.int64 and out.tokens.shape == (logits.shape[0],)
    assert (out.logprobs is None) == (batch.logprobs is None)
    return out.tokens


def sample_counts(logits: torch.Tensor, p: SamplingParams, n: int) -> torch.Tensor:
    """Counts of ``n`` first tokens drawn from a batch of ``n`` identical rows (distinct keys)."""
    ids = sample(logits.expand(n, -1), build([p] * n, logits.shape[-1]))
    assert ids.dtype == torch.int64 and ids.shape == (n,)
    return torch.bincount(ids, minlength=logits.shape[-1])


def small_logits(vocab: int = 12, seed: int = 0) -> torch.Tensor:
    """Distinct, well spread logits (no ties, every probability comfortably > 0)."""
    g = torch.Generator().manual_seed(seed)
    return torch.linspace(-1.5, 1.5, vocab)[torch.randperm(vocab, generator=g)]


@pytest.fixture(autouse=True)
def _fixed_seed() -> None:
    torch.manual_seed(1234)


# ----------------------------------------------------------------------------- greedy


def test_greedy_rows_return_argmax_in_mixed_batch() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g)
    logits[5, [7, 40, 200]] = 50.0  # ties: first index wins, as torch.argmax
    params = [
        SamplingParams(temperature=0.0) if i % 3 == 0
        else SamplingParams(temperature=1.3, top_k=1) if i % 3 == 1
        else SamplingParams(temperature=1.0, top_p=0.9)
        for i in range(64)
    ]
    params[5] = SamplingParams(temperature=0.0)
    expected = logits.argmax(dim=-1)
    for _ in range(5):
        batch = build(params, 300)
        assert not batch.all_greedy
        ids = sample(logits, batch)
        greedy = torch.tensor([p.greedy for p in params])
        assert torch.equal(ids[greedy], expected[greedy])
    assert ids[5].item() == 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_greedy_matches_argmax_any_dtype(dtype: torch.dtype) -> None:
    logits = torch.randn(16, 500).to(dtype)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, seed=3)] * 8
    batch = build(params, 500, [0, row_key(3, 0)] * 8)
    assert batch.all_greedy
    assert torch.equal(sample(logits, batch), logits.argmax(dim=-1))


# ----------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.8])
def test_plain_sampling_matches_softmax(temperature: float) -> None:
    logits = small_logits(12)
    p = SamplingParams(temperature=temperature)
    assert_matches(sample_counts(logits, p, 20_000), reference(logits, p))


def test_chi_square_check_can_fail() -> None:
    logits = small_logits(12)
    counts = sample_counts(logits, SamplingParams(temperature=1.0), 20_000)
    wrong = reference(logits, SamplingParams(temperature=0.7))
    stat, df = chi2_stat(counts, wrong)
    assert stat > chi2_threshold(df)
    with pytest.raises(AssertionError):
        assert_matches(counts, reference(logits, SamplingParams(top_k=11)))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=4),
        SamplingParams(temperature=0.9, top_k=-1, top_p=0.55),
        SamplingParams(temperature=1.2, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=0.8, top_k=7, top_p=0.7),
        SamplingParams(temperature=1.5, top_k=9, top_p=0.9, min_p=0.25),
        SamplingParams(temperature=1.0, top_k=20),  # larger than the vocabulary: off
    ],
    ids=["top_k", "top_p", "top_p_T", "min_p", "top_k_top_p", "all", "top_k_over_vocab"],
)
def test_filters_keep_exactly_the_allowed_set(params: SamplingParams) -> None:
    logits = small_logits(16, seed=3)
    expected = reference(logits, params)
    assert 1 < int((expected > 0).sum()) <= 16
    assert_matches(sample_counts(logits, params, 20_000), expected)


def test_top_p_always_keeps_top_token() -> None:
    logits = small_logits(10)
    logits[3] = 4.0  # top token holds most of the mass, still below top_p
    p = SamplingParams(top_p=0.01)
    counts = sample_counts(logits, p, 2_000)
    assert counts[3].item() == 2_000


def test_top_k_paths_agree() -> None:
    # max_top_k <= 1024 takes torch.topk; a larger k or a top-p row takes the full sort.
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2_000, generator=g) * 3
    for k in (50, 1500):
        p = SamplingParams(top_k=k)
        allowed = reference(logits, p) > 0
        for extra in ([], [SamplingParams(top_p=0.999)]):
            params = [p] * 300 + extra
            ids = sample(logits.expand(len(params), -1), build(params, 2_000))[:300]
            assert bool(allowed[ids].all())


def test_top_p_from_the_top_k_matches_the_full_sort() -> None:
    """Every top-p row also using top-k: thresholds from torch.topk's max_top_k largest equal the
    full sort's, tokens kept alike, with ties of the k-th value past max_top_k (a flat row) and
    rows with neither filter (greedy) in the batch."""
    g = torch.Generator().manual_seed(8)
    vocab = 3_000
    probs = torch.softmax(torch.randn(6, vocab, generator=g) * 3, dim=-1)
    probs[4] = 1.0 / vocab  # flat: every token ties the k-th value
    probs[5, :40] = probs[5, 40:].max() * 2  # 40 tied leaders, top_k 10 < 40 <= max_top_k 50
    params = [SamplingParams(top_k=50, top_p=0.9), SamplingParams(top_k=3, top_p=0.5),
              SamplingParams(top_k=20, top_p=1e-6), SamplingParams(temperature=0.0),
              SamplingParams(top_k=10, top_p=0.3), SamplingParams(top_k=10, top_p=0.95)]
    batch = build(params, vocab)
    assert batch.top_p_within_top_k and batch.max_top_k == 50
    assert takes_topk_path(batch, 50) and not takes_topk_path(batch, 49)
    fast = top_k_top_p_threshold(probs, batch, topk_max_k=50)
    slow = top_k_top_p_threshold(probs, batch, topk_max_k=49)  # max_top_k past it: the full sort
    assert torch.equal(probs < fast, probs < slow)
    assert torch.equal(fast[:3], slow[:3])  # no ties past the top: the same float32 sums
    assert fast[3].item() == 0.0  # neither filter (the sort gives the row's smallest value: also all kept)
    assert not build(params + [SamplingParams(top_p=0.9)], vocab).top_p_within_top_k


# ----------------------------------------------------------------------------- seeds


def run_steps(params: list[SamplingParams], logits: torch.Tensor, steps: int, seed: int = 0) -> torch.Tensor:
    """[rows, steps] tokens of `steps` draws, as the engine keys them: seeded rows by
    (seed, step), unseeded rows by fresh keys from a torch generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    draws = []
    for step in range(steps):
        keys = [row_key(p.seed, step) if p.seed is not None else int(torch.randint(0, 2**KEY_BITS - 1, (), generator=g))
                for p in params]
        draws.append(sample(logits[: len(params)], build(params, logits.shape[-1], keys)))
    return torch.stack(draws, dim=1)


@pytest.mark.parametrize(
    "target",
    [SamplingParams(seed=42), SamplingParams(seed=42, temperature=0.8, top_k=100, top_p=0.9, min_p=0.01)],
    ids=["plain", "filtered"],
)
def test_seed_reproducible_across_batch_compositions(target: SamplingParams) -> None:
    g = torch.Generator().manual_seed(9)
    row = torch.randn(1_000, generator=g)
    others_a = [SamplingParams(), SamplingParams(top_k=5)]
    others_b = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5, seed=7),
                SamplingParams(min_p=0.1), SamplingParams(), SamplingParams(seed=43)]
    logits = torch.randn(8, 1_000, generator=g)
    results = []
    for others, pos, default_seed in ((others_a, 0, 1), (others_b, 3, 2), ([], 0, 3)):
        params = others[:pos] + [target] + others[pos:]
        batch_logits = logits.clone()
        batch_logits[pos] = row
        # the other rows' keys (and whether the batch is filtered) must not matter to seeded rows
        results.append(run_steps(params, batch_logits, 20, default_seed)[pos])
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    assert len(set(results[0].tolist())) > 1  # it samples, step by step

    other = SamplingParams(**{**target.__dict__, "seed": 43})
    different = run_steps([other], row.unsqueeze(0), 20)[0]
    assert not torch.equal(results[0], different)


def test_seeded_row_is_the_noise_of_its_key() -> None:
    """A seeded row's token is torch_gumbel_sample of its logits and row_key(seed, position):
    the same function the Triton kernel computes, so the token does not depend on the device."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5_000, generator=g)
    params = [SamplingParams(temperature=0.7, seed=5), SamplingParams(seed=6), SamplingParams(temperature=0.0)]
    keys = [row_key(5, 17), row_key(6, 17), 99]
    ids = sample(logits, build(params, 5_000, keys))
    expected = torch_gumbel_sample(logits, torch.tensor(keys), torch.tensor([0.7, 1.0, 0.0]))
    assert ids.tolist() == expected.tolist()


def test_unseeded_rows_differ_between_rows() -> None:
    logits = torch.zeros(2, 1_000)
    ids = run_steps([SamplingParams(), SamplingParams()], logits, 10)
    assert not torch.equal(ids[0], ids[1])


# ----------------------------------------------------------------------------- mixed batch


def test_mixed_batch_all_kinds() -> None:
    logits = small_logits(16, seed=7)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.6, top_k=1),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.1, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.35),
        SamplingParams(temperature=1.3, top_k=10, top_p=0.85, min_p=0.1),
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.9, top_k=6, seed=12),
    ]
    reps = 2_500
    params = kinds * reps
    keys = [row_key(p.seed + i, 0) if p.seed is not None else k for i, (p, k) in enumerate(zip(params, fresh_keys(len(params))))]
    batch = build(params, 16, keys)
    assert batch.top_ks is not None and batch.top_ps is not None and batch.min_ps is not None
    ids = sample(logits.expand(len(params), -1), batch).view(reps, len(kinds))
    for j, p in enumerate(kinds):
        if p.greedy:
            assert bool((ids[:, j] == logits.argmax()).all())
        else:
            assert_matches(torch.bincount(ids[:, j], minlength=16), reference(logits, p))


# ----------------------------------------------------------------------------- batch building


def test_build_flags_and_tensors() -> None:
    params = [SamplingParams(), SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2, seed=1)]
    batch = build(params, 100, [5, 2**KEY_BITS - 1])
    assert batch.top_ks is None and batch.top_ps is None and batch.min_ps is None and batch.logprobs is None
    assert not batch.all_greedy
    assert batch.temperatures.dtype == torch.float32 and batch.temperatures.tolist() == [1.0, 0.0]
    assert batch.keys.dtype == torch.int64 and batch.keys.tolist() == [5, 2**KEY_BITS - 1]

    params = [SamplingParams(top_k=-1, logprobs=2), SamplingParams(top_k=7, top_p=0.9, min_p=0.1, seed=2),
              SamplingParams(top_k=500, logprobs=0)]
    batch = build(params, 100, [1, 2, 3])
    assert batch.top_ks.dtype == torch.int64 and batch.top_ks.tolist() == [100, 7, 100]
    assert batch.top_ps.dtype == torch.float32 and batch.top_ps.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert batch.min_ps.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert batch.max_top_k == 7 and batch.keys.tolist() == [1, 2, 3]
    assert batch.logprobs.rows.dtype == torch.int64 and batch.logprobs.rows.tolist() == [0, 2]
    assert batch.logprobs.k == 2
    with pytest.raises(ValueError, match="2 keys for 3 rows"):
        SamplingBatch.build(params, [1, 2], CPU, 100)
    for bad in (-1, 2**KEY_BITS):
        with pytest.raises(ValueError, match="keys must be in"):
            SamplingBatch.build(params, [1, bad, 3], CPU, 100)


def test_build_makes_one_copy_of_one_buffer() -> None:
    """Every tensor of a batch is a view of the pack's words as they reached the device (one
    copy: `unpack` adds none), and so of one buffer in a built batch."""
    params = [SamplingParams(top_k=3, top_p=0.8, min_p=0.05, logprobs=1), SamplingParams(temperature=0.3)]
    pack = SamplingPack.of(params, [7, 8], 50)
    words = torch.from_numpy(pack.words.copy())  # what the host-to-device copy delivers

    def storages(batch: SamplingBatch) -> set[int]:
        tensors = [batch.temperatures, batch.keys, batch.top_ks, batch.top_ps, batch.min_ps, batch.logprobs.rows]
        return {t.untyped_storage().data_ptr() for t in tensors}

    batch = pack.unpack(words)
    assert storages(batch) == {words.untyped_storage().data_ptr()} and len(storages(build(params, 50, [7, 8]))) == 1
    assert batch.keys.tolist() == [7, 8]
    assert batch.temperatures.tolist() == pytest.approx([1.0, 0.3]) and batch.top_ks.tolist() == [3, 50]
    assert batch.top_ps.tolist() == pytest.approx([0.8, 1.0]) and batch.min_ps.tolist() == pytest.approx([0.05, 0.0])
    empty = build([], 50, [])
    assert empty.all_greedy and empty.keys.shape == (0,) and SAMPLER(torch.zeros(0, 50), empty).tokens.shape == (0,)


def test_logits_not_modified() -> None:
    logits = torch.randn(4, 50)
    before = logits.clone()
    params = [SamplingParams(top_p=0.7), SamplingParams(min_p=0.1, logprobs=3), SamplingParams(), SamplingParams(top_k=3)]
    SAMPLER(logits, build(params, 50))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_precision_logits_respect_filters(dtype: torch.dtype) -> None:
    logits = small_logits(16, seed=2).to(dtype)
    p = SamplingParams(temperature=0.9, top_k=8, top_p=0.75)
    allowed = reference(logits.float(), p) > 0
    ids = sample(logits.expand(4_000, -1), build([p] * 4_000, 16))
    assert bool(allowed[ids].all()) and int(torch.bincount(ids, minlength=16)[allowed].gt(0).sum()) == int(allowed.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plain_sampling_of_any_dtype_is_the_float32_noise(dtype: torch.dtype) -> None:
    """float64 logits sample as their float32 rounding (the noise implementations read float32)."""
    logits = torch.randn(6, 700, dtype=dtype)
    keys = fresh_keys(6)
    temperatures = torch.tensor([0.0, 0.5, 1.0, 1.0, 1.5, 2.0])
    params = [SamplingParams(temperature=float(t)) for t in temperatures]
    expected = torch_gumbel_sample(logits.float(), torch.tensor(keys), temperatures)
    assert sample(logits, build(params, 700, keys)).tolist() == expected.tolist()


# ----------------------------------------------------------------------------- keyed noise (the CUDA path)


# splitmix64's first outputs from state 1234567 (the test vector of Rosetta Code's Splitmix64 task):
# output i mixes 1234567 + i * gamma, which is row_key's input for seed i at position 1234566.
SPLITMIX64_STATE = 1234567
SPLITMIX64_OUTPUTS = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                      16408922859458223821]


def test_row_keys_are_splitmix64_distinct_and_fit_int64() -> None:
    keys = {row_key(seed, pos) for seed in range(50) for pos in range(50)}
    assert len(keys) == 2500
    assert all(0 <= k < 2**63 for k in keys)
    # the same keys in every process and release (a seeded request's tokens depend on them):
    # splitmix64's published outputs, top 63 bits
    position = SPLITMIX64_STATE - 1
    assert [row_key(i, position) for i in range(1, 6)] == [out >> 1 for out in SPLITMIX64_OUTPUTS]


def test_sampler_picks_the_noise_implementation_of_its_device() -> None:
    assert Sampler().gumbel_sample is torch_gumbel_sample  # built on the CPU
    assert Sampler().token_logprobs is token_logprobs
    assert Sampler().walk_sample is None  # the threshold path serves every filter
    with torch.device("meta"):
        assert Sampler().gumbel_sample is torch_gumbel_sample  # any device but CUDA: the PyTorch twin


def test_the_logprobs_route_is_on_or_off() -> None:
    """KernelRoutes.logprobs_kernel takes a bool only; a sampler built off CUDA takes torch's path either way."""
    with pytest.raises(TypeError, match="kernel_routes.logprobs_kernel must be a bool, got 1"):
        KernelRoutes(logprobs_kernel=1)
    for on in (True, False):
        with kernel_routes(KernelRoutes(logprobs_kernel=on)):
            assert Sampler().token_logprobs is token_logprobs


@pytest.mark.interpreter
def test_the_triton_logprobs_kernel_gives_the_samplers_logprobs() -> None:
    """The sampler's logprobs through the Triton kernel (interpreter) equal the PyTorch path's."""
    from nanovllm.sampling.logprobs_kernel import row_logprobs

    g = torch.Generator().manual_seed(10)
    logits = torch.randn(5, 3_000, generator=g) * 3
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(seed=1),
              SamplingParams(seed=2, logprobs=0), SamplingParams(temperature=0.5, top_k=9, seed=3, logprobs=5),
              SamplingParams(seed=4)]
    batch = SamplingBatch.build(params, [row_key(i, 7) for i in range(5)], "cpu", logits.shape[1])
    kernel_sampler = Sampler()
    kernel_sampler.token_logprobs = row_logprobs
    want, got = Sampler()(logits, batch), kernel_sampler(logits, batch)
    assert torch.equal(want.tokens, got.tokens) and torch.equal(want.logprobs.rows, got.logprobs.rows)
    assert torch.allclose(want.logprobs.sampled, got.logprobs.sampled, atol=1e-5)
    assert torch.equal(want.logprobs.ranks, got.logprobs.ranks)
    assert torch.equal(want.logprobs.top_ids, got.logprobs.top_ids)
    assert torch.allclose(want.logprobs.top_logprobs, got.logprobs.top_logprobs, atol=1e-5)


@pytest.mark.interpreter
def test_the_triton_kernel_samples_the_same_tokens() -> None:
    """A sampler running the Triton kernels (Triton's interpreter here) gives the tokens of the
    CPU sampler, through every path: logits -> tokens, filtered probabilities -> tokens, and the
    candidate walk of batches filtered by top-p / min-p alone."""
    from nanovllm.sampling.candidate_walk import walk_sample
    from nanovllm.sampling.gumbel_max import gumbel_sample

    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 2_100, generator=g) * 3
    kernel_sampler = Sampler()
    kernel_sampler.gumbel_sample, kernel_sampler.walk_sample = gumbel_sample, walk_sample
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(seed=3),
             SamplingParams(temperature=1.7), SamplingParams(temperature=0.3), SamplingParams(seed=4)]
    filtered = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50),
                SamplingParams(top_p=0.9, seed=3), SamplingParams(min_p=0.01), SamplingParams(top_k=600, top_p=0.95),
                SamplingParams(temperature=1.2, seed=4)]
    top_p_only = [SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(temperature=0.8, top_p=0.9),
                  SamplingParams(top_p=0.3, seed=3), SamplingParams(min_p=0.05), SamplingParams(top_p=0.7, min_p=0.1),
                  SamplingParams(temperature=1.2, seed=4)]
    keys = [11, 2**KEY_BITS - 1, row_key(3, 0), 2**62 + 12345, 0, row_key(4, 9)]
    for params in (plain, filtered, top_p_only):
        batch = build(params, 2_100, keys)
        assert SAMPLER(logits, batch).tokens.tolist() == kernel_sampler(logits, batch).tokens.tolist()


# ----------------------------------------------------------------------------- logprobs


def log_softmax64(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def assert_logprobs_match(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], k: int,
                          sampled: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> None:
    """Logprobs of `rows` equal the float64 log_softmax of the raw logits: the sampled token's,
    and the k largest, ids in descending order of logprob."""
    ref = log_softmax64(logits)[rows]  # [R, V]
    assert sampled.dtype == torch.float32 and top_logprobs.dtype == torch.float32 and top_ids.dtype == torch.int64
    assert sampled.shape == (len(rows),) and top_ids.shape == top_logprobs.shape == (len(rows), k)
    torch.testing.assert_close(sampled.double(), ref.gather(1, tokens[rows].unsqueeze(1)).squeeze(1),
                               rtol=1e-5, atol=1e-5)
    # by descending logit, the lower id first among equal ones (bf16 logits tie)
    expected_ids = torch.sort(logits.double()[rows], dim=-1, descending=True, stable=True).indices[:, :k]
    assert top_ids.tolist() == expected_ids.tolist()
    torch.testing.assert_close(top_logprobs.double(), ref.gather(1, expected_ids), rtol=1e-5, atol=1e-5)
    assert bool((top_logprobs[:, :-1] >= top_logprobs[:, 1:]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_logprobs_of_the_rows_that_ask(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 3_000, generator=g) * 4).to(dtype)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.9),
              SamplingParams(top_k=20, top_p=0.9, logprobs=2), SamplingParams(min_p=0.1),
              SamplingParams(temperature=1.3, seed=2, logprobs=0), SamplingParams(temperature=0.0),
              SamplingParams(top_k=1, logprobs=DEFAULT_MAX_LOGPROBS), SamplingParams(top_p=0.5, logprobs=1),
              SamplingParams(temperature=0.7)]
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out = SAMPLER(logits, build(params, 3_000))
    lp = out.logprobs
    assert lp.rows.tolist() == rows
    assert_logprobs_match(logits.float() if dtype != torch.float64 else logits, out.tokens, rows, DEFAULT_MAX_LOGPROBS,
                          lp.sampled, lp.top_ids, lp.top_logprobs)
    # greedy rows sampled the argmax: their sampled logprob is the largest
    for i, row in enumerate(rows):
        if params[row].greedy:
            assert out.tokens[row].item() == logits[row].argmax().item()
            assert lp.sampled[i].item() == lp.top_logprobs[i, 0].item()


def test_logprobs_every_row_and_k_zero() -> None:
    logits = torch.randn(4, 200)
    params = [SamplingParams(logprobs=0), SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(top_k=3, logprobs=0), SamplingParams(seed=1, logprobs=0)]
    out = SAMPLER(logits, build(params, 200))
    assert out.logprobs.rows.tolist() == [0, 1, 2, 3] and out.logprobs.top_ids.shape == (4, 0)
    assert_logprobs_match(logits, out.tokens, [0, 1, 2, 3], 0, out.logprobs.sampled, out.logprobs.top_ids,
                          out.logprobs.top_logprobs)


def test_logprobs_k_is_capped_at_the_vocabulary() -> None:
    logits = small_logits(12).unsqueeze(0)
    batch = build([SamplingParams(logprobs=DEFAULT_MAX_LOGPROBS)], 12)
    assert batch.logprobs.k == 12
    lp = SAMPLER(logits, batch).logprobs
    assert sorted(lp.top_ids[0].tolist()) == list(range(12))


def test_logprobs_ignore_temperature_and_filters() -> None:
    """Logprobs are of the raw logits: the same for every sampling setting of a row."""
    row = torch.randn(1_000, generator=torch.Generator().manual_seed(3)) * 2
    settings = [SamplingParams(temperature=0.0, logprobs=4), SamplingParams(temperature=0.2, logprobs=4),
                SamplingParams(temperature=2.5, top_k=2, logprobs=4), SamplingParams(top_p=0.3, logprobs=4),
                SamplingParams(temperature=1.5, min_p=0.5, top_k=10, logprobs=4)]
    lp = SAMPLER(row.expand(len(settings), -1), build(settings, 1_000)).logprobs
    for i in range(1, len(settings)):
        assert torch.equal(lp.top_ids[i], lp.top_ids[0]) and torch.equal(lp.top_logprobs[i], lp.top_logprobs[0])
    torch.testing.assert_close(lp.top_logprobs[0].double(), log_softmax64(row).topk(4).values, rtol=1e-5, atol=1e-5)


def ops_run(fn) -> set[str]:
    """The names of the aten ops that fn() runs (torch's profiler records them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


def test_no_logprob_work_when_no_row_asks() -> None:
    """A batch where no row asks for logprobs runs no log_softmax; one row asking runs it."""
    params = [SamplingParams(), SamplingParams(top_k=5), SamplingParams(temperature=0.0)]
    logits = torch.randn(3, 100)
    outputs = []
    quiet = ops_run(lambda: outputs.append(SAMPLER(logits, build(params, 100))))
    assert outputs[0].logprobs is None and not any("log_softmax" in op for op in quiet)
    asking = ops_run(lambda: SAMPLER(logits, build(params[:2] + [SamplingParams(logprobs=1)], 100)))
    assert any("log_softmax" in op for op in asking)


def test_token_logprobs_standalone() -> None:
    """The function the engine scores prompt tokens with: any rows, any float dtype."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 400, generator=g, dtype=torch.float64) * 3
    targets = torch.tensor([0, 399, 17, 17, 250])
    for x in (logits, logits.float(), logits.bfloat16()):
        chosen, ranks, top_ids, top_logprobs = token_logprobs(x, targets, 3)
        assert_logprobs_match(x.double(), targets, [0, 1, 2, 3, 4], 3, chosen, top_ids, top_logprobs)
        # ranks: each target's place in a full descending sort of its row (ties: the worse place)
        desc = x.double().sort(dim=1, descending=True).values
        own = x.double().gather(1, targets[:, None])
        assert ranks.tolist() == torch.searchsorted(-desc, -own, right=True).squeeze(1).tolist()
    chosen, _, top_ids, _ = token_logprobs(logits, targets, 0)
    assert top_ids.shape == (5, 0) and chosen.shape == (5,)
    with pytest.raises(TypeError, match="k must be an int"):
        token_logprobs(logits, targets, True)
    with pytest.raises(ValueError, match="k must be in"):
        token_logprobs(logits, targets, 401)
    with pytest.raises(TypeError, match="token_ids"):
        token_logprobs(logits, targets.int(), 1)
    with pytest.raises(ValueError, match="2-D float"):
        token_logprobs(logits[0], targets[:1], 1)


@pytest.mark.parametrize("top_k", [-1, 20])
def test_min_p_comes_before_top_p_as_in_vllm(top_k):
    """vLLM V1 applies min-p (a logits processor) before top-k / top-p: top-p weighs min-p's survivors."""
    vocab, rows = 100, 400
    p = SamplingParams(**ORDER_PARAMS, top_k=top_k)
    row = order_row(vocab)
    assert (reference(row, p) > 0).nonzero().flatten().tolist() == ORDER_KEPT
    assert sorted(set(sample(row.repeat(rows, 1), build([p] * rows, vocab)).tolist())) == ORDER_KEPT
