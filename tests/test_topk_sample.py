"""The Triton top-k sampler (sampling/topk_sample.py) against a float64 reference: the sampler's filter
rules (sampling/sampler.py: top-k's k-th largest probability with ties kept, top-p's sorted prefix
over the top-k survivors' mass, min-p against the row's max) applied to softmax(logits / T), then
argmax of x / T + Gumbel noise over the kept tokens, the noise regenerated from Philox by
test_gumbel_sample's NumPy reference; and against the torch threshold path (a Sampler without the
kernel) on the same noise. Kernel runs on CPU go through Triton's interpreter (small shapes, the
chunk shrunk so rows span many chunks); the GPU ones use serving sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm.layers.kernel_path import KernelRoutes, kernel_routes
from nanovllm.sampling.batch import SamplingBatch, row_key
from nanovllm.sampling.sampler import Sampler, takes_topk_kernel
from nanovllm.sampling.topk_sample import LIST_SHAPES, MAX_K, MAX_VOCAB, list_shape, top_k_per_list, topk_sample
from nanovllm.sampling_params import SamplingParams
from test_gumbel_sample import reference_uniforms
from test_sampler import ORDER_KEPT, ORDER_PARAMS, order_row

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


def kept_tokens(x64: np.ndarray, top_k: int, top_p: float, min_p: float, slack: float = 0.0) -> np.ndarray:
    """Boolean [V]: the tokens the sampler's rules keep, in float64 (`slack`: thresholds lowered and
    top_p raised by that relative amount, the float32 rounding a kernel may differ by)."""
    p = np.exp(x64 - x64.max())
    p /= p.sum()
    floor = min_p * p.max()  # vLLM's order: min-p, then top-k, then top-p over the survivors
    order = np.argsort(-p, kind="stable")
    kth = p[order[top_k - 1]] if top_k < len(p) else 0.0
    threshold = kth
    if top_p < 1.0:
        survivors = np.where((p[order] >= kth) & (p[order] >= floor), p[order], 0.0)
        inclusive = np.cumsum(survivors)
        num_kept = 1 + int(np.sum(inclusive[:-1] < min(1.0, top_p * (1 + slack)) * inclusive[-1]))
        threshold = max(kth, p[order[num_kept - 1]])
    keep = p >= threshold * (1 - slack)
    if min_p > 0.0:
        keep &= p >= floor * (1 - slack)
    return keep


def check_rows(tokens, logits, keys, params, min_exact: float = 0.9):
    """Each token is the float64 filtered argmax, or within float32 rounding of it: kept by the
    loosened rules and scoring within rounding of the best kept score."""
    exact = 0
    for r, token in enumerate(tokens.cpu().tolist()):
        row = logits[r].double().cpu().numpy()
        p = params[r]
        if p.greedy:
            assert token == int(np.argmax(row)), r
            exact += 1
            continue
        x = row / p.temperature
        score = x - np.log(-np.log(reference_uniforms(keys[r], len(row))))
        keep = kept_tokens(x, p.top_k, p.top_p, p.min_p)
        best = int(np.argmax(np.where(keep, score, -np.inf)))
        if token == best:
            exact += 1
            continue
        assert kept_tokens(x, p.top_k, p.top_p, p.min_p, slack=1e-5)[token], (r, token, best)
        assert score[token] >= np.where(keep, score, -np.inf).max() - 1e-5 * max(1.0, abs(score[best])), (r, token)
    assert exact >= min_exact * len(tokens)


def mixed_params(rows: int, max_k: int = 20) -> list[SamplingParams]:
    """Every sampled row with a top-k (some with top-p, min-p or both), and greedy rows."""
    ks = [max_k, 1 + max_k // 4, 2, max_k // 2]
    return [SamplingParams(temperature=(0.6, 1.0, 1.3)[r % 3] if r % 7 != 3 else 0.0, top_k=ks[r % 4],
                           top_p=(0.95, 1.0, 0.5, 0.8, 0.3)[r % 5], min_p=(0.0, 0.05, 0.0, 0.2)[r % 4])
            for r in range(rows)]


def sample(device, logits, params, keys, **kwargs):
    """topk_sample of a batch built from `params` (the engine's tensors)."""
    batch = SamplingBatch.build(params, keys, torch.device(device), logits.shape[1])
    assert takes_topk_kernel(batch, logits.shape[1], MAX_K, MAX_VOCAB)
    return topk_sample(logits.to(device), batch.keys, batch.temperatures, batch.top_ks, batch.max_top_k,
                       batch.top_ps, batch.min_ps, **kwargs)


def chunk_args(device, max_k: int = 20) -> dict:
    """Interpreter runs: many chunks on a small vocabulary (the smallest chunk the list allows)."""
    return {"chunk": list_shape(max_k).groups} if device == "cpu" else {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale, max_k", [(3.0, 20), (0.3, 20), (3.0, 50), (0.3, 64), (3.0, 100)])  # peaked / flat rows
def test_matches_the_float64_filtered_argmax(device, scale, max_k):
    rows, vocab = (7, 1200) if device == "cpu" else (256, 151_936)
    g = torch.Generator().manual_seed(1)
    logits = scale * torch.randn(rows, vocab, generator=g)
    keys = [int(k) for k in torch.randint(0, 2**62, (rows,), generator=g)]
    params = mixed_params(rows, max_k)
    tokens = sample(device, logits, params, keys, **chunk_args(device, max_k))
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    check_rows(tokens, logits, keys, params)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_ks", [(20, 5, 30), (50, 5, 64)])  # the 32- and 64-entry lists
def test_ties_past_the_lists(device, top_ks):
    """Integer logits (many exact ties): ties of the k-th value past a chunk's list, past the row's
    list (the whole-row scan), and a chunk whose candidates overflow their slot (a run of ties)."""
    rows, vocab = (5, 1100) if device == "cpu" else (64, 151_936)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(rows, vocab, generator=g).mul(2).round()
    logits[0, 100:400] = 9.0  # 300 tied maxima: more than a slot holds, and the list past k
    logits[1, 7:1000:20] = 9.0  # 50 tied maxima spread over the chunks
    logits[2, :] = 0.0  # a flat row
    keys = [int(k) for k in torch.randint(0, 2**62, (rows,), generator=g)]
    params = [SamplingParams(temperature=(1.0, 0.7)[r % 2], top_k=top_ks[r % 3], top_p=(1.0, 0.5, 0.9)[r % 3],
                             min_p=(0.0, 0.0, 0.0, 0.1)[r % 4]) for r in range(rows)]
    tokens = sample(device, logits.to(torch.bfloat16), params, keys, **chunk_args(device, max(top_ks)))
    check_rows(tokens, logits, keys, params, min_exact=1.0)  # the bf16 values are the integers exactly


@pytest.mark.parametrize("device", DEVICES)
def test_a_chunk_overflowing_the_64_list_slot(device):
    """More candidates than the 64-entry list's slot holds (its 8K = 512) in one chunk: 700 tied maxima in
    the first of 1,024-column chunks, so that chunk takes the top-k of all its keys."""
    rows, vocab = 3, 2100
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=g).mul(2).round()
    logits[0, :700] = 9.0
    logits[1, 300:1000] = 9.0
    keys = [int(k) for k in torch.randint(0, 2**62, (rows,), generator=g)]
    params = [SamplingParams(temperature=1.0, top_k=(50, 64, 40)[r], top_p=(1.0, 0.9, 0.5)[r]) for r in range(rows)]
    assert list_shape(64).cap < 700
    tokens = sample(device, logits.to(torch.bfloat16), params, keys, chunk=1024)
    check_rows(tokens, logits, keys, params, min_exact=1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_agrees_with_the_torch_threshold_path(device):
    """The same batch through a Sampler that takes the threshold path (softmax, thresholds, Gumbel-max
    on probabilities, with the same noise) gives the same tokens but at float32 near-ties."""
    rows, vocab = (7, 1100) if device == "cpu" else (256, 151_936)
    g = torch.Generator().manual_seed(3)
    logits = (3.0 * torch.randn(rows, vocab, generator=g)).to(device)
    params = mixed_params(rows)
    keys = [row_key(r, 0) for r in range(rows)]
    with torch.device(device), kernel_routes(KernelRoutes(topk_kernel_max_k=0)):
        threshold_path = Sampler()
    assert threshold_path.topk_kernel_max_k == 0
    batch = SamplingBatch.build(params, keys, torch.device(device), vocab)
    reference = threshold_path(logits, batch).tokens
    kernel = sample(device, logits, params, keys, **chunk_args(device))
    assert (kernel == reference).float().mean().item() >= 0.95
    check_rows(reference, logits, keys, params)
    check_rows(kernel, logits, keys, params)


def test_a_batch_takes_the_shortest_list_that_holds_its_top_k():
    assert [list_shape(k).k for k in (1, 20, 32, 33, 50, 64, 65, MAX_K)] == [32, 32, 32, 64, 64, 64, 128, 128]
    for shape in LIST_SHAPES:  # launch 1's bound needs k group maxima, its slot k candidates
        assert shape.groups >= shape.k and shape.cap >= shape.k
    # the engine's warm-up samples with one top_k per list the routes let the kernel serve
    assert top_k_per_list(MAX_K) == (32, 64, 128)
    assert top_k_per_list(40) == (32, 40) and top_k_per_list(20) == (20,) and top_k_per_list(0) == ()


def test_routing_follows_the_batch_and_the_routes():
    vocab = 1000
    cpu = torch.device("cpu")
    cases = {  # params -> served by a kernel of max k 128
        (20,): True, (20, "greedy"): True, (128,): True, (129,): False, (20, None): False, ("greedy",): False,
    }
    for ks, served in cases.items():
        params = [SamplingParams(temperature=0.0) if k == "greedy" else SamplingParams(temperature=1.0, top_k=k or -1,
                                                                                        top_p=0.9) for k in ks]
        batch = SamplingBatch.build(params, [0] * len(params), cpu, vocab)
        assert takes_topk_kernel(batch, vocab, 128, MAX_VOCAB) == served, ks
        assert not takes_topk_kernel(batch, vocab, 0, MAX_VOCAB)  # routes off
        assert not takes_topk_kernel(batch, MAX_VOCAB + 1, 128, MAX_VOCAB)  # a vocabulary too large
    with torch.device("cpu"):
        assert Sampler().topk_kernel_max_k == 0  # off CUDA: the threshold path


def test_bad_arguments_are_refused():
    logits = torch.zeros(2, 300)
    keys, temps, ks = torch.zeros(2, dtype=torch.int64), torch.ones(2), torch.full((2,), 5)
    with pytest.raises(ValueError, match="max_top_k"):
        topk_sample(logits, keys, temps, ks, MAX_K + 1, None, None)
    with pytest.raises(ValueError, match="max_top_k"):
        topk_sample(logits, keys, temps, ks, 0, None, None)
    with pytest.raises(ValueError, match="vocab"):
        topk_sample(torch.zeros(2, 5), keys, temps, ks, 5, None, None)
    with pytest.raises(ValueError, match="chunk"):
        topk_sample(logits, keys, temps, ks, 5, None, None, chunk=100)
    with pytest.raises(TypeError, match="top_ks"):
        topk_sample(logits, keys, temps, ks.int(), 5, None, None)
    with pytest.raises(ValueError, match="top_ps"):
        topk_sample(logits, keys, temps, ks, 5, torch.ones(3), None)
    with pytest.raises(TypeError, match="temperatures"):
        topk_sample(logits, keys, None, ks, 5, None, None)


@pytest.mark.gpu
def test_cuda_graph_capture_replays_the_eager_tokens():
    """The kernel's launches (no host sync, scratch from the graph's pool) captured in a CUDA graph
    give the eager call's tokens on replay."""
    rows, vocab = 256, 151_936
    g = torch.Generator().manual_seed(4)
    logits = (3.0 * torch.randn(rows, vocab, generator=g)).to("cuda", torch.bfloat16)
    params = mixed_params(rows)
    batch = SamplingBatch.build(params, [row_key(r, 0) for r in range(rows)], torch.device("cuda"), vocab)
    with torch.device("cuda"):
        sampler = Sampler()
    assert takes_topk_kernel(batch, vocab, sampler.topk_kernel_max_k, sampler.topk_kernel_max_vocab)
    eager = sampler(logits, batch).tokens
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sampler(logits, batch)  # warm (compiled) before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            captured = sampler(logits, batch).tokens
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_comes_before_top_p(device):
    """Top-p weighs the survivors of min-p and top-k (vLLM's order), on a row where the order changes
    the kept set."""
    rows, vocab = (16, 1200) if device == "cpu" else (256, 151_936)
    logits = order_row(vocab).repeat(rows, 1)
    keys = [int(k) for k in torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(9))]
    params = [SamplingParams(**ORDER_PARAMS, top_k=20)] * rows
    assert np.flatnonzero(kept_tokens(logits[0].double().numpy(), 20, 0.5, 0.2)).tolist() == ORDER_KEPT
    tokens = sample(device, logits, params, keys, **chunk_args(device))
    check_rows(tokens, logits, keys, params, min_exact=1.0)
    assert sorted(set(tokens.tolist())) == ORDER_KEPT
