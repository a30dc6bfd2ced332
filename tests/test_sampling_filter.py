"""The Triton top-k/top-p threshold kernel (sampling/radix_filter.py) against a float64 sort-based
reference written here, and against the sampler's torch path (sampling/sampler.top_k_top_p_threshold).

top-k thresholds must be exact. A top-p threshold must equal the reference's, or, where float32
sums differ from float64 ones, be the exact answer for a limit within REL of the reference's
(checked from the float64 masses at and above the kernel's value, so a wrong value cannot pass).
Kernel runs on CPU tensors go through Triton's interpreter (small rows, small chunks, marked
`interpreter`); the `gpu` cases run the serving size (256 x 151,936).
"""

from __future__ import annotations

import pytest
import torch

from nanovllm.layers.kernel_path import KernelRoutes
from nanovllm.sampling.radix_filter import top_k_top_p_threshold
from nanovllm.sampling.gumbel_torch import torch_gumbel_uniforms
from nanovllm.sampling.sampler import Sampler, uses_radix
from nanovllm.sampling.sampler import top_k_top_p_threshold as torch_threshold
from nanovllm.sampling.batch import SamplingBatch, row_key
from nanovllm.sampling_params import SamplingParams

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
# Relative slack on a top-p limit that float32 sums (kernel, torch) may take against float64 ones.
REL = 1e-5
# Columns per chunk under the interpreter: several chunks (and a ragged last one) on small rows.
SMALL_BLOCK = 128


def reference(probs: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None):
    """float64, by sorting: (kth [B], limit [B], threshold [B]); kth 0 where top-k is off
    (k >= V), threshold = the top-p value where top_p < 1, else kth."""
    x = probs.double()
    batch, vocab = x.shape
    values = x.sort(dim=-1, descending=True).values  # [B, V]
    k = torch.full((batch,), vocab, device=x.device) if top_ks is None else top_ks.clamp(1, vocab)
    kth = torch.where(k < vocab, values.gather(1, (k - 1).unsqueeze(1)).squeeze(1), 0.0)  # [B]
    p = torch.ones(batch, dtype=torch.float64, device=x.device) if top_ps is None else top_ps.double()
    cum = torch.where(values >= kth.unsqueeze(1), values, 0.0).cumsum(dim=-1)  # [B, V] survivor mass
    limit = p * cum[:, -1]
    first = torch.searchsorted(cum, limit.unsqueeze(1)).clamp(max=vocab - 1)  # first cum >= limit
    pth = values.gather(1, first).squeeze(1)
    return kth, limit, torch.where(p < 1.0, pth, kth)


def check_thresholds(probs: torch.Tensor, top_ks, top_ps, got: torch.Tensor) -> int:
    """Asserts `got` [B, 1] against the reference; returns how many top-p rows differ from it
    (each within REL of its limit)."""
    assert got.shape == (probs.shape[0], 1) and got.dtype == torch.float32
    kth, limit, want = reference(probs, top_ks, top_ps)
    got = got.squeeze(1).double()
    x = probs.double()
    top_p_on = torch.zeros_like(kth, dtype=torch.bool) if top_ps is None else top_ps < 1.0
    assert torch.equal(got[~top_p_on], want[~top_p_on]), "top-k thresholds must be exact"
    differ = 0
    for r in torch.nonzero(top_p_on & (got != want)).flatten().tolist():
        t = got[r].item()
        row = x[r]
        assert bool((row == t).any()) and t >= kth[r].item(), f"row {r}: {t} is not a survivor's value"
        survivors = torch.where(row >= kth[r], row, 0.0)
        at_or_above, above = survivors[row >= t].sum().item(), survivors[row > t].sum().item()
        # t is the answer for the limits in (above, at_or_above]: one must lie within REL of the limit
        lim = limit[r].item()
        assert above < lim * (1 + REL) and at_or_above >= lim * (1 - REL), (r, t, want[r].item(), lim)
        differ += 1
    return differ


def check_against_torch(probs: torch.Tensor, top_ks, top_ps, got: torch.Tensor) -> int:
    """The kernel's thresholds `got` keep the tokens the sampler's torch path keeps, except on top-p
    rows where the two float32 sums fall on either side of a limit (then torch's threshold must
    pass the reference check too); equal values wherever the torch path filters. Returns how many
    rows differ."""
    want = torch_threshold(probs, batch_of(top_ks, top_ps, probs.shape[1]))
    rows = torch.nonzero(((probs < got) != (probs < want)).any(dim=1)).flatten()
    if rows.numel():
        assert top_ps is not None and bool((top_ps[rows] < 1.0).all())
        check_thresholds(probs[rows], None if top_ks is None else top_ks[rows], top_ps[rows], want[rows])
    same = torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
    same[rows] = False
    filters = same & (probs < want).any(dim=1)
    assert torch.equal(got[filters], want[filters])
    return rows.numel()


def batch_of(top_ks, top_ps, vocab: int) -> SamplingBatch:
    """A batch with these filters as SamplingPack builds it (a filter no row uses is None;
    max_top_k picks the torch path's branch)."""
    rows = (top_ks if top_ks is not None else top_ps).shape[0]
    device = (top_ks if top_ks is not None else top_ps).device
    on = top_ks[top_ks < vocab] if top_ks is not None else None
    return SamplingBatch(temperatures=torch.ones(rows, device=device),
                         keys=torch.zeros(rows, dtype=torch.int64, device=device),
                         top_ks=top_ks if on is not None and on.numel() else None,
                         top_ps=top_ps if top_ps is not None and bool((top_ps < 1.0).any()) else None,
                         min_ps=None, logprobs=None, all_greedy=False,
                         max_top_k=int(on.max()) if on is not None and on.numel() else 0,
                         top_p_within_top_k=top_ps is None or top_ks is None
                         or bool((top_ks[top_ps < 1.0] < vocab).all()))


def softmax_rows(batch: int, vocab: int, seed: int, scale: float = 3.0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(batch, vocab, generator=g) * scale, dim=-1).to(device)


def settings(batch: int, vocab: int, seed: int, device: str):
    """Per-row top_k (1, V, off = V, small, large) and top_p (off, tiny, common, near 1) mixed."""
    g = torch.Generator().manual_seed(seed)
    ks = [1, vocab, vocab, 2, 20, max(1, vocab // 3), vocab - 1, 50]
    ps = [1.0, 1e-7, 0.9, 0.5, 1.0, 0.95, 0.999, 0.3]
    order = torch.randperm(batch, generator=g).tolist()
    top_ks = torch.tensor([min(max(ks[i % len(ks)], 1), vocab) for i in order], dtype=torch.int64, device=device)
    top_ps = torch.tensor([ps[(i * 3) % len(ps)] for i in order], dtype=torch.float32, device=device)
    return top_ks, top_ps


def run_all_flag_combinations(probs: torch.Tensor, top_ks, top_ps, block: int | None = None) -> tuple[int, int]:
    """Both filters, top-k only, top-p only: (top-p rows off the float64 reference, rows off the
    torch path), each within float rounding of its limit."""
    differ = torch_differ = 0
    kwargs = {} if block is None else {"block": block}
    for ks, ps in ((top_ks, top_ps), (top_ks, None), (None, top_ps)):
        got = top_k_top_p_threshold(probs, ks, ps, **kwargs)
        differ += check_thresholds(probs, ks, ps, got)
        torch_differ += check_against_torch(probs, ks, ps, got)
    return differ, torch_differ


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab, block, rows", [(1, 64, 3), (3, 64, 4), (7, 64, 4), (64, 64, 8), (200, 64, 8),
                                                (1000, 256, 6), (2047, 4096, 8)])  # 4096: the default 16 tiles
def test_random_rows_match_the_reference(device: str, vocab: int, block: int, rows: int) -> None:
    probs = softmax_rows(rows, vocab, seed=vocab)
    probs[-1] = 1.0 / vocab  # uniform: every element in one bin at every pass
    top_ks, top_ps = settings(rows, vocab, seed=vocab, device=device)
    assert run_all_flag_combinations(probs.to(device), top_ks, top_ps, block) == (0, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_zeros_and_flat_rows(device: str) -> None:
    vocab = 300
    g = torch.Generator().manual_seed(1)
    rows = [
        torch.full((vocab,), 1.0 / vocab),  # uniform: every threshold is the one value
        torch.tensor([0.25, 0.25, 0.125, 0.125, 0.125, 0.125] + [0.0] * (vocab - 6)),  # exact ties, zeros
        torch.cat([torch.full((10,), 0.05), torch.full((100,), 0.005), torch.zeros(vocab - 110)]),
        torch.cat([torch.zeros(vocab - 1), torch.ones(1)]),  # one token holds everything
        # half masked, scattered
        torch.cat([torch.full((150,), 2.0 / vocab), torch.zeros(150)])[torch.randperm(vocab, generator=g)],
        softmax_rows(1, vocab, seed=5, scale=0.01)[0],  # nearly flat
    ]
    probs = torch.stack(rows).to(device)
    # k inside tie groups, k beyond the nonzeros (kth = 0), top-p limits landing inside tie groups
    top_ks = torch.tensor([7, 3, 50, 2, 200, vocab], dtype=torch.int64, device=device)
    top_ps = torch.tensor([0.5, 0.6, 0.7, 0.1, 1.0, 0.9], dtype=torch.float32, device=device)
    assert run_all_flag_combinations(probs, top_ks, top_ps, SMALL_BLOCK) == (0, 0)
    got = top_k_top_p_threshold(probs, top_ks, top_ps, block=SMALL_BLOCK).squeeze(1)
    # row 4: k past the nonzeros
    assert got[:5].tolist() == [probs[0, 0].item(), 0.125, probs[2, 10].item(), 1.0, 0.0]


@pytest.mark.parametrize("device", DEVICES)
def test_both_filters_bind(device: str) -> None:
    """Rows where top-p cuts inside the top-k survivors (and the survivors lie in a few chunks)."""
    probs = softmax_rows(6, 2_500, seed=11, scale=2.0, device=device)
    top_ks = torch.tensor([40, 600, 2_500, 5, 1, 300], dtype=torch.int64, device=device)
    top_ps = torch.tensor([0.5, 0.8, 0.9, 0.6, 0.9, 1.0], dtype=torch.float32, device=device)
    got = top_k_top_p_threshold(probs, top_ks, top_ps, block=512)
    assert check_thresholds(probs, top_ks, top_ps, got) == 0 and check_against_torch(probs, top_ks, top_ps, got) == 0
    kth, _, want = reference(probs, top_ks, top_ps)
    assert bool((want[:4] > kth[:4]).all())  # top-p cuts above the k-th value


def test_the_check_rejects_wrong_thresholds() -> None:
    """check_thresholds cannot pass vacuously: the next value above or below fails it."""
    probs = softmax_rows(3, 500, seed=2)
    top_ps = torch.tensor([0.9, 0.5, 0.7], dtype=torch.float32)
    _, _, want = reference(probs, None, top_ps)
    values = probs.double().sort(dim=-1, descending=True).values
    assert check_thresholds(probs, None, top_ps, want.float().unsqueeze(1)) == 0
    for step in (-1, 1):  # the neighbouring distinct value
        wrong = []
        for r in range(3):
            pos = int(torch.nonzero(values[r] == want[r])[0 if step < 0 else -1]) + step
            wrong.append(values[r, pos].item())
        with pytest.raises(AssertionError):
            check_thresholds(probs, None, top_ps, torch.tensor(wrong, dtype=torch.float32).unsqueeze(1))
    with pytest.raises(AssertionError):  # top-k is exact
        top_ks = torch.tensor([3, 3, 3])
        kth = values[:, 2].float().nextafter(torch.tensor(1.0)).unsqueeze(1)
        check_thresholds(probs, top_ks, None, kth)


def test_arguments_are_checked() -> None:
    probs = torch.rand(2, 10)
    ks, ps = torch.tensor([1, 2]), torch.tensor([0.5, 0.5])
    with pytest.raises(TypeError, match="probs must be float32"):
        top_k_top_p_threshold(probs.double(), ks, ps)
    with pytest.raises(ValueError, match="2-D"):
        top_k_top_p_threshold(probs[0], ks, ps)
    with pytest.raises(TypeError, match="top_ks"):
        top_k_top_p_threshold(probs, ks.int(), ps)
    with pytest.raises(ValueError, match="top_ps"):
        top_k_top_p_threshold(probs, ks, torch.tensor([0.5, 0.5, 0.5]))
    with pytest.raises(ValueError, match="contiguous last dim"):
        top_k_top_p_threshold(torch.rand(10, 2).t(), ks, ps)
    with pytest.raises(ValueError, match="block"):
        top_k_top_p_threshold(probs, ks, ps, block=48)
    assert torch.equal(top_k_top_p_threshold(probs, None, None), torch.zeros(2, 1))  # nothing to filter
    assert top_k_top_p_threshold(torch.empty(0, 5), torch.empty(0, dtype=torch.int64), None).shape == (0, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("scale, max_differ", [
    # 3: flat rows. Near the limit each value weighs ~1e-5 of the row, about REL of the limit, so
    # float32 sums decide many rows (44 and 81 of 1,024 checks on the H200): each is checked within REL.
    (3.0, 256),
    (8.0, 256 // 8),  # peaked rows, top-p keeps few tokens: a few rows at most
])
def test_serving_size_matches_the_reference_and_the_torch_path(scale: float, max_differ: int) -> None:
    batch, vocab = 256, 151_936
    probs = softmax_rows(batch, vocab, seed=3, scale=scale, device="cuda")
    probs[::16] = 1.0 / vocab  # uniform rows
    probs[1::16, vocab // 2:] = 0.0  # half masked
    top_ks, top_ps = settings(batch, vocab, seed=3, device="cuda")
    differ, torch_differ = run_all_flag_combinations(probs, top_ks, top_ps)
    # float32 sums against float64 (or torch's float32) ones: a few rows, each checked within REL
    assert differ <= max_differ and torch_differ <= max_differ, (differ, torch_differ)


@pytest.mark.gpu
def test_sampler_on_cuda_samples_the_torch_paths_tokens() -> None:
    """The CUDA sampler (Triton thresholds and noise) and the CPU-built one (torch thresholds and
    noise) on CUDA tensors give the same seeded tokens. Each row has 40 live tokens whose
    probabilities are ~10% apart and top-p limits midway between partial sums, so no float32
    rounding decides a threshold; the two noise paths may differ only at float32 near-ties of the
    Gumbel scores (as in test_sampler_gpu)."""
    batch, vocab = 64, 151_936
    with torch.device("cuda"):
        kernel_sampler = Sampler()
    torch_sampler = Sampler()
    assert kernel_sampler.radix_min_rows == KernelRoutes().radix_min_rows and torch_sampler.radix_min_rows is None
    g = torch.Generator().manual_seed(6)
    logits = torch.full((batch, vocab), -1e4)
    levels = torch.linspace(4.0, 0.0, 40)  # exp steps of ~10%: well-separated probabilities
    for r in range(batch):
        logits[r, torch.randperm(vocab, generator=g)[:40]] = levels
    logits = logits.cuda()
    params = []
    for r in range(batch):
        top_k = [5, 20, 0, 1000][r % 4]
        # top_p midway between two partial sums of the (top-k) survivors' masses
        survivors = torch.softmax(levels[: top_k if 0 < top_k < 40 else 40].double(), dim=0).cumsum(0)
        i = [0, 2, 3][r % 3]
        top_p = (survivors[i] + survivors[i + 1]).item() / 2 if r % 5 else 1.0
        params.append(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=r))
    differ = 0
    for step in range(8):
        keys = [row_key(p.seed, step) for p in params]
        sampled = SamplingBatch.build(params, keys, torch.device("cuda"), vocab)
        kernel, twin = kernel_sampler(logits, sampled).tokens, torch_sampler(logits, sampled).tokens
        for r in torch.nonzero(kernel != twin).flatten().tolist():  # only a Gumbel near-tie may differ
            g = -torch.log(-torch.log(torch_gumbel_uniforms(sampled.keys[r : r + 1], vocab)[0].double()))
            score = logits[r].double() + g
            a, b = score[kernel[r]].item(), score[twin[r]].item()
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (r, a, b)
            differ += 1
    assert differ <= 2, differ


@pytest.mark.interpreter
def test_kernel_thresholds_keep_the_torch_paths_tokens() -> None:
    """The radix select's thresholds (Triton's interpreter) keep exactly the tokens the torch
    path's keep, top-k/top-p rows mixed, so a sampler draws the same tokens with either."""
    g = torch.Generator().manual_seed(12)
    probs = torch.softmax(torch.randn(6, 2_100, generator=g) * 3, dim=-1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50, seed=1),
              SamplingParams(top_p=0.9, seed=2), SamplingParams(min_p=0.01, top_k=7, seed=3),
              SamplingParams(top_k=600, top_p=0.95, seed=4), SamplingParams(temperature=1.2, top_k=20, top_p=0.8)]
    batch = SamplingBatch.build(params, [row_key(i, 0) for i in range(len(params))], torch.device("cpu"),
                                probs.shape[1])
    kernel = top_k_top_p_threshold(probs, batch.top_ks, batch.top_ps)
    assert torch.equal(probs >= kernel, probs >= torch_threshold(probs, batch))


@pytest.mark.parametrize("rows, top_k, top_p, radix_min_rows, radix", [
    (32, 0, 0.9, 32, True),  # a large batch that would sort: the select
    (31, 0, 0.9, 32, False),  # a small one: the sort
    (32, 50, 0.9, 32, False),  # top-p bounded by a small top-k: torch.topk
    (32, 0, 0.9, None, False),  # a sampler without the select (CPU)
])
def test_thresholds_take_the_select_only_where_a_sort_would_be_slower(
        rows: int, top_k: int, top_p: float, radix_min_rows: int | None, radix: bool) -> None:
    params = [SamplingParams(top_k=top_k, top_p=top_p, seed=r) for r in range(rows)]
    batch = SamplingBatch.build(params, [row_key(r, 0) for r in range(rows)], torch.device("cpu"), 300)
    assert uses_radix(rows, batch, radix_min_rows, KernelRoutes().topk_max_k) == radix
