"""Start-up choices that need no GPU to check: attention backend selection, graph batch sizes."""

from __future__ import annotations

import importlib.util

import pytest

from nanovllm.engine.cuda_graphs import graph_batch_sizes
from nanovllm.layers.attention_backend import select_attention_backend


def test_auto_backend_is_torch_on_cpu_and_ours_on_cuda_without_flash_attn():
    assert select_attention_backend("auto", "cpu", 256).name == "torch"
    expected = "flash_attn" if importlib.util.find_spec("flash_attn") else "triton"
    assert select_attention_backend("auto", "cuda", 256).name == expected
    # flash-attn's paged KV needs block_size % 256 == 0: other sizes always get ours
    assert select_attention_backend("auto", "cuda", 16).name == "triton"


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_forcing_missing_flash_attn_is_a_clear_error():
    with pytest.raises(ValueError, match="flash-attn package is not installed"):
        select_attention_backend("flash_attn", "cuda", 256)


def test_forcing_a_gpu_backend_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="needs CUDA"):
        select_attention_backend("triton", "cpu", 16)


def test_graph_batch_sizes():
    assert graph_batch_sizes(512) == [1, 2, 8] + list(range(16, 513, 16))
    assert graph_batch_sizes(1000)[-1] == 512
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(2) == [1, 2]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 8]
    assert graph_batch_sizes(40) == [1, 2, 8, 16, 32, 40]
