"""The candidate-walk sampler (sampling/candidate_walk.py) against a float64 reference: the sampler's
filter rules (sampling/sampler.py: the sorted prefix for top-p with ties kept, min-p against the
row's max) applied to softmax(logits / T), then argmax of
x / T + Gumbel noise over
the kept tokens, the noise regenerated from Philox by test_gumbel_sample's NumPy reference.
Kernel runs on CPU go through Triton's interpreter (small shapes); the GPU ones use real sizes."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from nanovllm.sampling.candidate_walk import walk_sample
from test_gumbel_sample import reference_uniforms
from test_sampler import ORDER_KEPT, ORDER_PARAMS, order_row

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


def kept_tokens(x64: np.ndarray, top_p: float, min_p: float) -> np.ndarray:
    """Boolean [V]: the tokens the sampler's min-p, then top-p (over min-p's survivors) keep, in float64."""
    p = np.exp(x64 - x64.max())
    p /= p.sum()
    keep = p >= min_p * p.max() if min_p > 0.0 else np.ones_like(p, dtype=bool)
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        inclusive = np.cumsum(np.where(keep, p, 0.0)[order])
        num_kept = 1 + int(np.sum(inclusive[:-1] < top_p * inclusive[-1]))
        keep &= p >= p[order[num_kept - 1]]
    return keep


def check_rows(tokens, logits, keys, temps, top_ps, min_ps):
    """Each token is the float64 filtered argmax, or within float32 rounding of it: kept (or at the
    edge of the kept set) and scoring within rounding of the best kept score."""
    exact = 0
    for r, token in enumerate(tokens.cpu().tolist()):
        row = logits[r].double().numpy()
        if temps[r] == 0.0:
            assert token == int(np.argmax(row))
            exact += 1
            continue
        x = row / temps[r]
        score = x - np.log(-np.log(reference_uniforms(keys[r], len(row))))
        keep = kept_tokens(x, top_ps[r], min_ps[r])
        best = int(np.argmax(np.where(keep, score, -np.inf)))
        if token == best:
            exact += 1
            continue
        # a different token: only a float32 near-tie of the scores or of a filter's limit explains it
        loose = kept_tokens(x, min(1.0, top_ps[r] * (1 + 1e-5)), min_ps[r] * (1 - 1e-5))
        assert loose[token], (r, token, best)
        assert score[token] >= np.where(keep, score, -np.inf).max() - 1e-5 * max(1.0, abs(score[best])), (r, token)
    assert exact >= 0.9 * len(tokens)


def make_case(rows: int, vocab: int, scale: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(rows, vocab, generator=g)
    keys = [int(k) for k in torch.randint(0, 2**62, (rows,), generator=g)]
    temps = [0.0 if r % 7 == 3 else (0.6, 1.0, 1.3)[r % 3] for r in range(rows)]
    top_ps = [(0.9, 1.0, 0.5, 0.95, 0.3)[r % 5] for r in range(rows)]
    min_ps = [(0.0, 0.05, 0.0, 0.2)[r % 4] for r in range(rows)]
    return logits, keys, temps, top_ps, min_ps


def run(device, logits, keys, temps, top_ps=None, min_ps=None):
    """walk_sample with the filters given (None: off for the whole batch)."""
    f32 = dict(dtype=torch.float32, device=device)
    return walk_sample(logits.to(device), torch.tensor(keys, device=device), torch.tensor(temps, **f32),
                       None if top_ps is None else torch.tensor(top_ps, **f32),
                       None if min_ps is None else torch.tensor(min_ps, **f32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [3.0, 0.3])  # peaked rows (few tokens hold the mass) and flat ones
def test_matches_the_float64_filtered_argmax(device, scale):
    rows, vocab = (14, 2500) if device == "cpu" else (256, 151_936)
    logits, keys, temps, top_ps, min_ps = make_case(rows, vocab, scale, seed=1)
    tokens = run(device, logits, keys, temps, top_ps=top_ps, min_ps=min_ps)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    check_rows(tokens, logits, keys, temps, top_ps, min_ps)


@pytest.mark.parametrize("device", DEVICES)
def test_one_filter_at_a_time_and_bfloat16(device):
    rows, vocab = (8, 2100) if device == "cpu" else (64, 151_936)
    logits, keys, temps, top_ps, min_ps = make_case(rows, vocab, 1.0, seed=2)
    logits = logits.to(torch.bfloat16)
    off_p, off_min = [1.0] * rows, [0.0] * rows
    check_rows(run(device, logits, keys, temps, top_ps=top_ps), logits, keys, temps, top_ps, off_min)
    check_rows(run(device, logits, keys, temps, min_ps=min_ps), logits, keys, temps, off_p, min_ps)


@pytest.mark.parametrize("device", DEVICES)
def test_long_walks_on_flat_rows(device):
    """A small top_p on near-uniform rows: the first candidates are rejected many times over."""
    rows, vocab = (4, 20_000) if device == "cpu" else (32, 151_936)
    logits, keys, _, _, _ = make_case(rows, vocab, 0.05, seed=3)
    temps, top_ps, min_ps = [1.0] * rows, [0.002, 0.01, 0.02, 0.05] * (rows // 4), [0.0] * rows
    check_rows(run(device, logits, keys, temps, top_ps=top_ps), logits, keys, temps, top_ps, min_ps)


@pytest.mark.parametrize("device", DEVICES)
def test_unfiltered_rows_are_plain_gumbel_samples(device):
    """top_p 1 and min_p 0 on every row: the kernel's token is gumbel_sample's."""
    from nanovllm.sampling.gumbel_max import gumbel_sample

    rows, vocab = (5, 2048) if device == "cpu" else (64, 151_936)
    logits, keys, temps, _, _ = make_case(rows, vocab, 2.0, seed=4)
    tokens = run(device, logits, keys, temps, top_ps=[1.0] * rows, min_ps=[0.0] * rows)
    plain = gumbel_sample(logits.to(device), torch.tensor(keys, device=device),
                          torch.tensor(temps, dtype=torch.float32, device=device))
    assert torch.equal(tokens, plain)


def test_bad_filter_tensors_are_refused():
    logits = torch.zeros(2, 8)
    keys, temps = torch.zeros(2, dtype=torch.int64), torch.ones(2)
    with pytest.raises(TypeError, match="top_ps"):
        walk_sample(logits, keys, temps, torch.ones(2, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="min_ps"):
        walk_sample(logits, keys, temps, None, torch.zeros(3))
    with pytest.raises(TypeError, match="temperatures"):
        walk_sample(logits, keys, None, None, None)


@pytest.mark.gpu
def test_cuda_sampler_walks_and_agrees_with_the_threshold_path():
    """A CUDA-built Sampler sends a batch filtered by top-p / min-p alone through the walk; a
    CPU-built one (threshold path, PyTorch noise) on the same CUDA tensors picks the same seeded
    tokens but at float32 near-ties (of a score or of a filter's limit)."""
    from nanovllm.sampling.sampler import Sampler
    from nanovllm.sampling.batch import SamplingBatch, row_key
    from nanovllm.sampling_params import SamplingParams

    from nanovllm.sampling.candidate_walk import walk_sample

    with torch.device("cuda"):
        walker = Sampler()
    assert walker.walk_sample is walk_sample
    rows, vocab = 128, 151_936
    logits, _, temps, top_ps, min_ps = make_case(rows, vocab, 3.0, seed=5)
    params = [SamplingParams(temperature=temps[r], top_p=top_ps[r], min_p=min_ps[r], seed=r) for r in range(rows)]
    keys = [row_key(r, 0) for r in range(rows)]
    batch = SamplingBatch.build(params, keys, torch.device("cuda"), vocab)
    walked = walker(logits.cuda(), batch).tokens
    threshold = Sampler()(logits.cuda(), batch).tokens
    assert (walked == threshold).float().mean().item() >= 0.97
    check_rows(walked, logits, keys, temps, top_ps, min_ps)


@pytest.mark.interpreter
def test_rows_with_nan_or_inf_end():
    """A NaN or -inf logit must not trap the walk (a hung kernel would stall the engine)."""
    logits = torch.randn(3, 1500)
    logits[0, 7] = float("nan")
    logits[1, :] = float("-inf")
    logits[1, 3] = 0.0
    logits[2, 100:] = float("-inf")
    tokens = run("cpu", logits, [1, 2, 3], [1.0] * 3, top_ps=[0.2] * 3, min_ps=[0.5] * 3)
    assert tokens[1].item() == 3 and 0 <= tokens[2].item() < 100


# Seconds a walk over a few 700-column rows may take before it counts as hung (interpreter: ~2 s).
WALK_DEADLINE_S = 120


def within_deadline(fn):
    """fn() run in a daemon thread; fails the test if it has not returned by WALK_DEADLINE_S (a
    hung walk would otherwise stall the suite), re-raises what it raised."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed to the test's thread
            result["error"] = exc

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(WALK_DEADLINE_S)
    assert not worker.is_alive(), f"walk_sample did not return within {WALK_DEADLINE_S} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_p, min_p", [(0.9, None), (None, 0.1), (0.5, 0.2)])
def test_rows_of_non_finite_logits_end_on_a_token_of_the_row(device, top_p, min_p):
    """The walk's termination argument (candidate_walk's docstring) where softmax has no meaning:
    a row of all -inf, rows with NaN (all NaN, one NaN, NaN at the max), rows with +inf, under top-p
    alone, min-p alone and both. Each walk returns a column of the row; never a NaN one where the
    row has another; the first +inf column where there is one (its noisy score is +inf, the
    highest, and nothing lies above it); the one finite logit of an otherwise -inf row."""
    inf, nan = float("inf"), float("nan")
    vocab = 700
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    rows = {
        "all -inf": torch.full((vocab,), -inf),
        "all NaN": torch.full((vocab,), nan),
        "NaN at 5": base.clone().index_fill_(0, torch.tensor([5]), nan),
        "NaN at the max": base.clone().index_fill_(0, base.argmax().view(1), nan),
        "+inf at 90 and 37": base.clone().index_fill_(0, torch.tensor([90, 37]), inf),
        "NaN, +inf, -inf": base.clone().index_fill_(0, torch.tensor([1]), nan).index_fill_(0, torch.tensor([2]), inf)
                           .index_fill_(0, torch.tensor([3]), -inf),
        "-inf but 400": torch.full((vocab,), -inf).index_fill_(0, torch.tensor([400]), 1.0),
        "greedy, +inf at 90 and 37": base.clone().index_fill_(0, torch.tensor([90, 37]), inf),
    }
    logits = torch.stack(list(rows.values()))
    n = len(rows)
    temps = [0.8] * (n - 1) + [0.0]
    tokens = dict(zip(rows, within_deadline(lambda: run(
        device, logits, list(range(11, 11 + n)), temps, None if top_p is None else [top_p] * n,
        None if min_p is None else [min_p] * n)).tolist()))
    assert all(0 <= t < vocab for t in tokens.values()), tokens
    assert tokens["NaN at 5"] != 5 and tokens["NaN, +inf, -inf"] == 2, tokens
    assert not torch.isnan(rows["NaN at the max"][tokens["NaN at the max"]]), tokens
    assert tokens["+inf at 90 and 37"] == tokens["greedy, +inf at 90 and 37"] == 37, tokens
    assert tokens["-inf but 400"] == 400, tokens


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_comes_before_top_p(device):
    """Top-p weighs min-p's survivors (vLLM's order), on a row where the order changes the kept set."""
    rows, vocab = (16, 2500) if device == "cpu" else (256, 151_936)
    logits = order_row(vocab).repeat(rows, 1)
    keys = [int(k) for k in torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(9))]
    temps, top_ps, min_ps = ([ORDER_PARAMS[name]] * rows for name in ("temperature", "top_p", "min_p"))
    assert np.flatnonzero(kept_tokens(logits[0].double().numpy(), top_ps[0], min_ps[0])).tolist() == ORDER_KEPT
    tokens = run(device, logits, keys, temps, top_ps=top_ps, min_ps=min_ps)
    check_rows(tokens, logits, keys, temps, top_ps, min_ps)
    assert sorted(set(tokens.tolist())) == ORDER_KEPT
