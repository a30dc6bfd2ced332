"""CPU tests of nanovllm.layers.sampler: greedy, distributions, filters, seeds, mixed batches.

Statistical checks compare sampled frequencies with a float64 reference through a
chi-square statistic and a conservative threshold (Wilson-Hilferty quantile at
z = 5, i.e. a false-alarm rate below 1e-6); all torch seeds are fixed.
"""

from __future__ import annotations

import math

import pytest
import torch

from nanovllm.layers.sampler import Sampler, SamplingBatch, make_generator, row_key
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
    """float64 distribution after temperature, top-k, top-p, min-p (ties kept together).

    Written as plain Python over the sorted probabilities, independent of the sampler.
    Asserts that no top-p decision is within 1e-4 of its boundary, so float32 rounding
    in the sampler cannot flip it.
    """
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    values = sorted(probs.tolist(), reverse=True)
    keep = probs > -1.0
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
    if p.min_p > 0.0:
        floor = p.min_p * probs.max().item()
        assert (probs - floor).abs().min().item() > 1e-6, "test design: min-p boundary too close"
        keep &= probs >= floor
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


def sample_counts(logits: torch.Tensor, p: SamplingParams, n: int) -> torch.Tensor:
    """Counts of ``n`` first tokens drawn from a batch of ``n`` identical rows."""
    batch = SamplingBatch.build([p] * n, [None] * n, CPU, logits.shape[-1])
    ids = SAMPLER(logits.expand(n, -1), batch)
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
    batch = SamplingBatch.build(params, [None] * 64, CPU, 300)
    assert not batch.all_greedy
    expected = logits.argmax(dim=-1)
    for _ in range(5):
        ids = SAMPLER(logits, batch)
        greedy = torch.tensor([p.greedy for p in params])
        assert torch.equal(ids[greedy], expected[greedy])
    assert ids[5].item() == 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_greedy_matches_argmax_any_dtype(dtype: torch.dtype) -> None:
    logits = torch.randn(16, 500).to(dtype)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, seed=3)] * 8
    gens = [None, make_generator(3, CPU)] * 8
    batch = SamplingBatch.build(params, gens, CPU, 500)
    assert batch.all_greedy and batch.generators is None
    assert torch.equal(SAMPLER(logits, batch), logits.argmax(dim=-1))


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
            batch = SamplingBatch.build(params, [None] * len(params), CPU, 2_000)
            ids = SAMPLER(logits.expand(len(params), -1), batch)[:300]
            assert bool(allowed[ids].all())


# ----------------------------------------------------------------------------- seeds


def run_steps(params: list[SamplingParams], logits: torch.Tensor, steps: int) -> torch.Tensor:
    gens = [None if p.seed is None else make_generator(p.seed, CPU) for p in params]
    batch = SamplingBatch.build(params, gens, CPU, logits.shape[-1])
    return torch.stack([SAMPLER(logits[: len(params)], batch) for _ in range(steps)], dim=1)


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
        torch.manual_seed(default_seed)  # the engine RNG must not matter to seeded rows
        results.append(run_steps(params, batch_logits, 20)[pos])
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])

    other = SamplingParams(**{**target.__dict__, "seed": 43})
    different = run_steps([other], row.unsqueeze(0), 20)[0]
    assert not torch.equal(results[0], different)


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
    gens = [None if p.seed is None else make_generator(p.seed + i, CPU) for i, p in enumerate(params)]
    batch = SamplingBatch.build(params, gens, CPU, 16)
    assert batch.top_ks is not None and batch.top_ps is not None and batch.min_ps is not None
    ids = SAMPLER(logits.expand(len(params), -1), batch).view(reps, len(kinds))
    for j, p in enumerate(kinds):
        if p.greedy:
            assert bool((ids[:, j] == logits.argmax()).all())
        else:
            assert_matches(torch.bincount(ids[:, j], minlength=16), reference(logits, p))


# ----------------------------------------------------------------------------- batch building


def test_build_flags_and_tensors() -> None:
    params = [SamplingParams(), SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2, seed=1)]
    gens = [None, make_generator(1, CPU)]
    batch = SamplingBatch.build(params, gens, CPU, 100)
    assert batch.top_ks is None and batch.top_ps is None and batch.min_ps is None
    assert batch.generators is None and not batch.all_greedy
    assert batch.temperatures.dtype == torch.float32
    assert batch.temperatures.tolist() == [1.0, 0.0]

    params = [SamplingParams(top_k=-1), SamplingParams(top_k=7, top_p=0.9, min_p=0.1, seed=2),
              SamplingParams(top_k=500)]
    batch = SamplingBatch.build(params, [None, make_generator(2, CPU), None], CPU, 100)
    assert batch.top_ks.dtype == torch.int64 and batch.top_ks.tolist() == [100, 7, 100]
    assert batch.top_ps.dtype == torch.float32 and batch.top_ps.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert batch.min_ps.tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert batch.generators is not None and batch.generators[0] is None and batch.max_top_k == 7
    with pytest.raises(ValueError):
        SamplingBatch.build(params, [None], CPU, 100)


def test_logits_not_modified() -> None:
    logits = torch.randn(4, 50)
    before = logits.clone()
    params = [SamplingParams(top_p=0.7), SamplingParams(min_p=0.1), SamplingParams(), SamplingParams(top_k=3)]
    SAMPLER(logits, SamplingBatch.build(params, [None] * 4, CPU, 50))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_precision_logits_respect_filters(dtype: torch.dtype) -> None:
    logits = small_logits(16, seed=2).to(dtype)
    p = SamplingParams(temperature=0.9, top_k=8, top_p=0.75)
    allowed = reference(logits.float(), p) > 0
    ids = SAMPLER(logits.expand(4_000, -1), SamplingBatch.build([p] * 4_000, [None] * 4_000, CPU, 16))
    assert bool(allowed[ids].all()) and int(torch.bincount(ids, minlength=16)[allowed].gt(0).sum()) == int(allowed.sum())


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


@pytest.mark.interpreter
def test_keyed_batches_use_the_triton_sampler() -> None:
    """Keys route sampling through gumbel_sample (Triton's interpreter here): greedy rows
    stay exact, filtered rows stay in their set, a seeded row ignores its batch."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 2048, generator=g) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
              SamplingParams(top_k=5), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(top_p=0.5, seed=4), SamplingParams(min_p=0.3)]
    keys = [11, 12, 13, row_key(3, 0), row_key(4, 0), 16]
    ids = SAMPLER(logits, SamplingBatch.build(params, [None] * 6, CPU, 2048, keys=keys))
    assert ids[0].item() == logits[0].argmax().item()
    for row in (2, 4, 5):
        allowed = reference(logits[row], params[row]) > 0
        assert bool(allowed[ids[row]])
    # rows 1 and 3 alone (no filters in the batch: the fused logits path) give the same tokens
    alone = SAMPLER(logits[[1, 3]], SamplingBatch.build([params[1], params[3]], [None] * 2, CPU, 2048,
                                                        keys=[keys[1], keys[3]]))
    assert alone.tolist() == [ids[1].item(), ids[3].item()]
    with pytest.raises(ValueError, match="2 keys for 6 rows"):
        SamplingBatch.build(params, [None] * 6, CPU, 2048, keys=[1, 2])
