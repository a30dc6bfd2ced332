"""Start-up choices that need no GPU to check: attention backend selection, graph batch sizes."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from nanovllm.engine.cuda_graphs import GRAPH_BATCH_STEP, MAX_GRAPH_BATCH, DecodeGraphs, graph_batch_sizes
from nanovllm.layers.kernel_path import KernelRoutes
from nanovllm.layers.attention_backend import select_attention_backend


def test_auto_backend_is_torch_on_cpu_and_ours_on_cuda_without_flash_attn():
    assert select_attention_backend("auto", "cpu", 256, False, 128).name == "torch"
    expected = "flash_attn" if importlib.util.find_spec("flash_attn") else "triton"
    assert select_attention_backend("auto", "cuda", 256, False, 128).name == expected
    # flash-attn's paged KV needs block_size % 256 == 0: other sizes always get ours
    assert select_attention_backend("auto", "cuda", 16, False, 128).name == "triton"


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_forcing_missing_flash_attn_is_a_clear_error():
    with pytest.raises(ValueError, match="flash-attn package is not installed"):
        select_attention_backend("flash_attn", "cuda", 256, False, 128)


def test_forcing_a_gpu_backend_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="needs CUDA"):
        select_attention_backend("triton", "cpu", 16, False, 128)


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 7, 8, 9, 16, 40, 100, 255, 512, 513, 1000])
def test_graph_sizes_serve_every_batch_with_bounded_padding(max_num_seqs):
    """Every decode batch up to the graph limit replays a graph no more than one step larger;
    GEMV-sized batches replay a graph of their own size (no cuBLAS rows of padding)."""
    gemv_rows = KernelRoutes().gemv_max_rows
    sizes = graph_batch_sizes(max_num_seqs, gemv_rows)
    graphs = SimpleNamespace(sizes=sizes)
    limit = min(max_num_seqs, MAX_GRAPH_BATCH)
    assert sizes == sorted(set(sizes)) and sizes[-1] == limit
    for batch in range(1, limit + 1):
        padded = DecodeGraphs.padded_size(graphs, batch)
        assert batch <= padded < batch + GRAPH_BATCH_STEP
        if batch <= gemv_rows:
            assert padded == batch
    assert DecodeGraphs.padded_size(graphs, limit + 1) is None  # larger batches run eagerly


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("routes", [KernelRoutes(), KernelRoutes(skinny_max_rows=24, fp8_skinny_max_rows=40,
                                                                  fp8_w8a8_skinny_max_rows=200),
                                    # past the kernels' own limits (GEMV 4 rows, skinny 512): plan_linear
                                    # clamps them, and the clamped rows are graph sizes and buckets anyway
                                    KernelRoutes(gemv_max_rows=6, skinny_max_rows=600, fp8_skinny_max_rows=520,
                                                 fp8_w8a8_skinny_max_rows=700)])
def test_padded_replays_run_the_kernels_of_their_own_rows(routes, fp8):
    """A step replayed from a graph (decode: the batch size; prefill / mixed: the token bucket)
    runs its projections at the padded row count: the kernel each layer picks there must be the
    one an eager step of its own rows picks (else graphs and eager steps round differently).
    Steps under the smallest bucket (MIN_BUCKET) may take the GEMV eagerly and the skinny GEMM padded."""
    import torch

    from nanovllm.engine.varlen_graphs import MIN_BUCKET, token_buckets
    from nanovllm.layers.kernel_path import plan_linear

    # an FP8 model's layers, FP8 or left in 16 bits (modules_to_not_convert), narrow (K split) or wide
    paths = [plan_linear(n, k, routes, 132, takes_norm=True, fp8=f) for n, k in ((4096, 4096), (1024, 2048))
             for f in {fp8, False}]
    limits = routes.linear_row_limits(fp8)

    def kernel(rows):
        x = torch.empty(rows, 1)
        return [(p.norm_serves(x), p.gemv_serves(x), p.skinny_serves(x), p.w8a8_serves(x)) for p in paths]

    decode = graph_batch_sizes(512, routes.gemv_max_rows, limits)
    buckets = token_buckets(16384, limits)
    assert (fp8 and routes.fp8_w8a8_skinny_max_rows in decode + buckets) or not fp8
    for t in range(1, 16385):
        padded = [next(s for s in buckets if s >= t)] if t >= MIN_BUCKET else []
        padded += [next(s for s in decode if s >= t)] if t <= decode[-1] else []
        assert all(kernel(p) == kernel(t) for p in padded), (t, padded)
