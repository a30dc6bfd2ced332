"""CUDA tests of nanovllm.sampling.sampler at serving size: B = 256, V = 151936.

Greedy exactness, filters never leaving the allowed set (float64 reference with a
small slack for float32 rounding), first-token frequencies, seeds independent of the
batch, the Triton kernel and the PyTorch noise giving the same tokens, logprobs against
a float64 reference, no host sync (CUDA sync debug mode), and sampling right after a
CUDA-graph replay.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from nanovllm.sampling.gumbel_max import gumbel_sample
from nanovllm.sampling.gumbel_torch import torch_gumbel_sample, torch_gumbel_uniforms
from nanovllm.sampling.logprobs_mode import LogprobsMode
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling.batch import KEY_BITS, SamplingBatch, row_key
from nanovllm.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

B, V = 256, 151_936
SLACK = 1e-4


def make_samplers() -> tuple[Sampler, Sampler]:
    """The sampler as the engine builds it on CUDA (Triton kernel), and one built on the CPU
    (the PyTorch noise), which runs on CUDA tensors just as well."""
    with torch.device("cuda"):
        kernel = Sampler()
    return kernel, Sampler()


SAMPLER, TWIN = make_samplers() if torch.cuda.is_available() else (None, None)
KINDS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=1),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=50),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.2, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=200, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=20, seed=5),
]


def device() -> torch.device:
    return torch.device("cuda")


def mixed_params(n: int = B) -> list[SamplingParams]:
    return [KINDS[i % len(KINDS)] for i in range(n)]


def build(params: list[SamplingParams], step: int = 0, rng: random.Random | None = None) -> SamplingBatch:
    """A batch for draw number `step`: seeded rows keyed by (seed, step), the others from `rng`
    (or the torch RNG), as the engine keys them."""
    draw = rng.getrandbits if rng is not None else (lambda bits: int(torch.randint(0, 2**bits - 1, ()).item()))
    keys = [row_key(p.seed, step) if p.seed is not None else draw(KEY_BITS) for p in params]
    return SamplingBatch.build(params, keys, device(), V)


def tokens(logits: torch.Tensor, batch: SamplingBatch, sampler: Sampler | None = None) -> torch.Tensor:
    return (sampler or SAMPLER)(logits, batch).tokens


def random_logits(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device()).manual_seed(seed)
    return (torch.randn(B, V, device=device(), generator=g) * 3).to(dtype)


def kept(row: torch.Tensor, p: SamplingParams, slack: float) -> torch.Tensor:
    """float64 mask of the tokens p's filters keep in one row, every limit moved by `slack` (> 0:
    looser, < 0: stricter).

    Per row (vLLM's order): min-p floor, sorted probabilities, top-k threshold, top-p prefix of
    the survivors found with searchsorted on their cumulative mass. Ties are kept together.
    """
    probs = torch.softmax(row.double() / p.temperature, dim=-1)
    values = probs.sort(descending=True).values
    floor = p.min_p * values[0].item() * (1 - slack) if p.min_p > 0.0 else 0.0
    if p.top_k not in (0, -1):
        floor = max(floor, values[min(p.top_k, V) - 1].item() * (1 - slack))
    if p.top_p < 1.0:
        survivors = values[values >= floor]
        cum = survivors.cumsum(0)
        target = torch.tensor([min(p.top_p + slack, 1.0) * cum[-1].item()], dtype=torch.float64, device=row.device)
        last = min(int(torch.searchsorted(cum, target).item()), len(survivors) - 1)
        floor = max(floor, survivors[last].item() * (1 - slack))
    return probs >= floor


def loose_allowed(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64 mask of tokens the sampler may pick for one row, loosened by SLACK."""
    return kept(row, p, SLACK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_exact_in_mixed_batch(dtype: torch.dtype) -> None:
    logits = random_logits(dtype)
    logits[3, 1000:1010] = 100.0  # ties: the first index wins
    params = mixed_params()
    params[3] = SamplingParams(temperature=0.0)
    greedy = torch.tensor([p.greedy for p in params], device=device())
    ids = tokens(logits, build(params))
    assert ids.dtype == torch.int64 and ids.shape == (B,)
    assert torch.equal(ids[greedy], logits.argmax(dim=-1)[greedy])
    assert ids[3].item() == 1000
    # greedy and plain rows only: the fused logits -> token path
    plain = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=0.9) for i in range(B)]
    plain[3] = SamplingParams(temperature=0.0)
    ids = tokens(logits, build(plain))
    odd = torch.arange(B, device=device()) % 2 == 1
    assert torch.equal(ids[odd], logits.argmax(dim=-1)[odd]) and ids[3].item() == 1000
    all_greedy = build([SamplingParams(temperature=0.0)] * B)
    assert torch.equal(tokens(logits, all_greedy), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filters_never_leave_allowed_set(dtype: torch.dtype) -> None:
    logits = random_logits(dtype, seed=1)
    params = mixed_params()
    draws = torch.stack([tokens(logits, build(params, step)) for step in range(20)], dim=1)
    for i, p in enumerate(params):
        if p.greedy or (p.top_k in (0, -1) and p.top_p == 1.0 and p.min_p == 0.0):
            continue
        allowed = loose_allowed(logits[i], p)
        assert bool(allowed[draws[i]].all()), f"row {i} ({p}) sampled outside its allowed set"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_token_frequencies(dtype: torch.dtype) -> None:
    # Ten live tokens scattered over the vocabulary; the rest have probability 0.
    g = torch.Generator(device=device()).manual_seed(2)
    live = torch.randperm(V, device=device(), generator=g)[:10]
    row = torch.full((V,), -1e4, device=device())
    row[live] = torch.linspace(-1.0, 1.5, 10, device=device())
    logits = row.to(dtype).expand(B, -1)
    for p in (SamplingParams(temperature=0.8), SamplingParams(top_k=6, top_p=0.8)):
        torch.manual_seed(3)
        # a key gives the same draw again: fresh keys per draw, 20480 draws
        ids = torch.cat([tokens(logits, build([p] * B, step)) for step in range(80)])
        counts = torch.bincount(ids, minlength=V).double()
        probs = torch.softmax(logits[0].double() / p.temperature, dim=-1)
        allowed = loose_allowed(logits[0], p)
        expected = torch.where(allowed, probs, 0.0)
        expected = expected / expected.sum()
        assert counts[expected == 0].sum().item() == 0
        support = expected > 0
        assert bool((counts[support] > 0).all())
        e = expected[support] * ids.numel()
        stat = ((counts[support] - e) ** 2 / e).sum().item()
        df = int(support.sum().item()) - 1
        c = 2.0 / (9.0 * df)
        assert stat < df * (1.0 - c + 5.0 * math.sqrt(c)) ** 3, f"chi2 {stat:.1f} (df {df}) for {p}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seeds_independent_of_batch(dtype: torch.dtype) -> None:
    logits = random_logits(dtype, seed=4)
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    row = logits[0].clone()

    def run(params: list[SamplingParams], pos: int, default_seed: int) -> torch.Tensor:
        batch_logits = logits.clone()
        batch_logits[pos] = row
        rng = random.Random(default_seed)
        return torch.stack([tokens(batch_logits[: len(params)], build(params, step, rng))[pos] for step in range(10)])

    base = run([target] + mixed_params(B - 1), 0, 0)
    other = [SamplingParams(temperature=1.0)] * (B - 1)
    moved = run(other[:200] + [target] + other[200:], 200, 1)
    alone = run([target], 0, 2)
    plain_target = SamplingParams(temperature=1.0, seed=77)  # alone: the fused logits path
    assert torch.equal(run([plain_target] + other, 0, 3), run([plain_target], 0, 4))
    assert torch.equal(base, moved) and torch.equal(base, alone)
    reseeded = run([SamplingParams(temperature=1.0, top_p=0.95, seed=78)], 0, 0)
    assert not torch.equal(base, reseeded)


def test_the_sampler_built_on_cuda_runs_the_kernel() -> None:
    assert SAMPLER.gumbel_sample is gumbel_sample and TWIN.gumbel_sample is torch_gumbel_sample


def test_kernel_and_torch_noise_give_the_same_tokens() -> None:
    """Seeded rows on fp32 logits: the Triton kernel (the engine's CUDA path) and the PyTorch noise
    (its CPU path) pick the same tokens. Their uniforms and 1 / T are identical; the kernel's log
    (libdevice's) might round differently from torch's, so a token may differ only at a float32
    near-tie of the float64 scores (and at most 2 of the 2,048 draws)."""
    logits = random_logits(torch.float32, seed=7)
    plain = [SamplingParams(temperature=0.3 + 0.2 * (i % 5), seed=1000 + i) for i in range(B)]
    filtered = [SamplingParams(**{**mixed_params()[i].__dict__, "seed": 2000 + i}) for i in range(B)]
    differ = 0
    for params in (plain, filtered):
        for step in range(4):
            batch = build(params, step)
            kernel, twin = tokens(logits, batch), tokens(logits, batch, TWIN)
            rows = torch.nonzero(kernel != twin).flatten().tolist()
            differ += len(rows)
            for r in rows:
                g = -torch.log(-torch.log(torch_gumbel_uniforms(batch.keys[r : r + 1], V)[0].double()))
                score = logits[r].double() / params[r].temperature + g
                a, b = score[kernel[r]].item(), score[twin[r]].item()
                assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (r, a, b)
    assert differ <= 2, differ


def assert_logprobs_match(logits: torch.Tensor, ids: torch.Tensor, rows: list[int], k: int, lp) -> None:
    """Against float64 log_softmax of the raw logits; bf16 logits tie often, so top ids are
    checked through their reference logprobs."""
    ref = torch.log_softmax(logits[rows].double(), dim=-1)  # [R, V]
    assert lp.rows.tolist() == rows and lp.top_ids.shape == (len(rows), k)
    sampled_ref = ref.gather(1, ids[rows].unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(lp.sampled.double(), sampled_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp.top_logprobs.double(), ref.topk(k).values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.gather(1, lp.top_ids), lp.top_logprobs.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_at_serving_size(dtype: torch.dtype) -> None:
    logits = random_logits(dtype, seed=8)
    some = [SamplingParams(**{**p.__dict__, "logprobs": 5 if i % 16 == 0 else None})
            for i, p in enumerate(mixed_params())]
    every = [SamplingParams(**{**p.__dict__, "logprobs": i % 6}) for i, p in enumerate(mixed_params())]
    for params in (some, every):
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        out = SAMPLER(logits, build(params))
        assert_logprobs_match(logits, out.tokens, rows, max(params[i].logprobs for i in rows), out.logprobs)
    assert SAMPLER(logits, build(mixed_params())).logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_processed_logprobs_at_serving_size(dtype: torch.dtype) -> None:
    """logprobs_mode "processed_logprobs": each row's log_softmax over the tokens its filters keep,
    of logits / T (greedy rows: raw): the sampled token's value lies between the float64 values
    over the strictly and the loosely kept sets (a float32 threshold may keep or drop a token at
    the limit), the top list is the largest kept logits with one normaliser, -inf past them."""
    with torch.device("cuda"):
        sampler = Sampler(LogprobsMode.PROCESSED_LOGPROBS)
    logits = random_logits(dtype, seed=9)
    params = [SamplingParams(**{**p.__dict__, "logprobs": 5}) for p in mixed_params()]
    out = sampler(logits, build(params))
    lp = out.logprobs
    assert lp.rows.tolist() == list(range(B))
    for i, p in enumerate(params):
        token = out.tokens[i].item()
        if p.greedy:
            x = logits[i].double()
            strict = loose = torch.ones_like(x, dtype=torch.bool)
        else:
            x = logits[i].double() / p.temperature
            strict, loose = kept(logits[i], p, -SLACK), kept(logits[i], p, SLACK)
        assert bool(loose[token]), f"row {i}: sampled token {token} outside its filters"
        strict[token] = True
        high = (x[token] - torch.logsumexp(x.masked_fill(~strict, -math.inf), 0)).item()
        low = (x[token] - torch.logsumexp(x.masked_fill(~loose, -math.inf), 0)).item()
        assert low - 1e-4 <= lp.sampled[i].item() <= high + 1e-4, (i, p, low, lp.sampled[i].item(), high)
        normaliser = x[token].item() - lp.sampled[i].item()
        finite = torch.isfinite(lp.top_logprobs[i])
        ids = lp.top_ids[i][finite]
        assert bool(loose[ids].all()) and not bool(strict[lp.top_ids[i][~finite]].any())
        torch.testing.assert_close(lp.top_logprobs[i][finite].double(), x[ids] - normaliser, rtol=0, atol=1e-4)
        assert x[ids].min().item() >= x.masked_fill(~strict, -math.inf).topk(len(ids)).values.min().item() - 1e-4


def test_no_host_sync() -> None:
    logits = random_logits(torch.bfloat16, seed=5)
    params = mixed_params()
    with_logprobs = [SamplingParams(**{**p.__dict__, "logprobs": 5 if i % 3 else None}) for i, p in enumerate(params)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            SAMPLER(logits, build(params, step, random.Random(0)))
        SAMPLER(logits, build(with_logprobs, 0, random.Random(0)))
        SAMPLER(logits, build([SamplingParams(top_k=40)] * B, 0, random.Random(0)))
        SAMPLER(logits, build([SamplingParams(temperature=0.5, logprobs=2)] * B, 0, random.Random(0)))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_after_cuda_graph_replay() -> None:
    src = random_logits(torch.bfloat16, seed=6)
    static_in = src.clone()
    static_out = torch.empty_like(src)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        static_out.copy_(static_in * 2)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out.copy_(static_in * 2)
    params = mixed_params()
    batch = build(params)
    greedy = torch.tensor([p.greedy for p in params], device=device())
    for step in range(3):
        static_in.copy_(random_logits(torch.bfloat16, seed=10 + step))
        graph.replay()
        before = static_out.clone()
        ids = tokens(static_out, batch)
        assert torch.equal(static_out, before)
        assert torch.equal(ids[greedy], (static_in * 2).argmax(dim=-1)[greedy])
        for i in (3, 4, 5, 6):
            assert bool(loose_allowed(static_out[i], params[i])[ids[i]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_take_the_argmax_on_every_kernel_path(dtype: torch.dtype) -> None:
    """Greedy rows (temperature 0, filters or not, or top_k 1) take the argmax beside the rows of each
    path the batch can take: the Gumbel-max kernel (plain rows), the candidate walk (top-p / min-p
    rows), the radix select (top-k and top-p rows, B >= 32), torch.topk's thresholds (top-k rows), and
    a batch of greedy rows alone. (A tiny positive temperature is raised to MIN_TEMPERATURE when the
    params are built, so no row divides its logits by one.)"""
    logits = random_logits(dtype, seed=11)
    argmax = logits.argmax(dim=-1)
    greedy = [SamplingParams(temperature=0, **f)
              for f in ({}, {"top_p": 0.9}, {"min_p": 0.1}, {"top_k": 50, "top_p": 0.8}, {"seed": 3})]
    greedy.append(SamplingParams(temperature=1.0, top_k=1, seed=4))
    others = {
        "gumbel": [SamplingParams(temperature=1.0)],
        "walk": [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7, min_p=0.05)],
        "radix": [SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.0, top_p=0.9)],
        "topk": [SamplingParams(temperature=1.0, top_k=50)],
        "alone": [],
    }
    for path, fill in others.items():
        params = [greedy[i % len(greedy)] if not fill or i % 2 else fill[i // 2 % len(fill)] for i in range(B)]
        rows = torch.tensor([p.greedy for p in params], device=device())
        for step in range(3):
            ids = tokens(logits, build(params, step))
            assert torch.equal(ids[rows], argmax[rows]), path
