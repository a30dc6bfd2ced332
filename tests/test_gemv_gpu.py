"""GPU tests of the few-row GEMV (plain and with SiLU-and-mul) at Qwen3-0.6B / 8B layer shapes
(`pytest -m gpu`).

bf16, 1..4 rows; each call against a float64 reference and against the path it replaces (the
Triton SiLU kernel then cuBLAS), plus CUDA-graph capture (with programmatic dependent launch).
"""

import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels.fused_activation import silu_and_mul
from nanovllm.kernels.fused_norm import add_rms_norm
from nanovllm.kernels.gemv import gemv, rms_norm_gemv, silu_mul_gemv

pytestmark = pytest.mark.gpu
DEV = "cuda"
DT = torch.bfloat16
# (N, K) of qkv, o, gate_up, down for Qwen3-0.6B and Qwen3-8B
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
          (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
# bf16 output rounding (2^-8 relative per element) bounds the error vs float64 and vs cuBLAS.
REF_TOL = 8e-3


def randn(shape, gen, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, device=DEV)).to(DT)


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 4])
def test_gemv_shapes(n, k, m):
    gen = torch.Generator(DEV).manual_seed(n + k + m)
    x = randn((m, k), gen)
    w = randn((n, k), gen, k ** -0.5)
    out = gemv(x, w)
    assert rel_err(out, x.double() @ w.double().T) < REF_TOL
    assert rel_err(out, F.linear(x, w)) < REF_TOL


# (N, K) of the projections that take the norm in front: 0.6B qkv / gate_up, 8B qkv, 30B-A3B qkv
@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 1024), (6144, 4096), (5120, 2048)])
@pytest.mark.parametrize("m", [1, 2])
def test_rms_norm_gemv_shapes(n, k, m):
    """Add + RMSNorm inside the GEMV vs float64 and vs the norm kernel then cuBLAS; the summed
    residual equals the norm kernel's."""
    gen = torch.Generator(DEV).manual_seed(n + k + m)
    x, res, w = randn((m, k), gen), randn((m, k), gen), randn((n, k), gen, k ** -0.5)
    g = randn((k,), gen, 0.3) + 1
    out, s = rms_norm_gemv(x, res, g, 1e-6, w)
    normed, summed = add_rms_norm(x, res, g, 1e-6)
    assert torch.equal(s, summed)
    sd = summed.double()
    ref = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6) * g.double()
    assert rel_err(out, ref @ w.double().T) < REF_TOL
    assert rel_err(out, F.linear(normed, w)) < REF_TOL


@pytest.mark.parametrize("n,k", [(1024, 3072), (4096, 12288)])
@pytest.mark.parametrize("m", [1, 2])
def test_silu_mul_gemv_shapes(n, k, m):
    gen = torch.Generator(DEV).manual_seed(n + k + m)
    x = randn((m, 2 * k), gen, 2.0)
    w = randn((n, k), gen, k ** -0.5)
    out = silu_mul_gemv(x, w)
    gate, up = x.double().chunk(2, dim=-1)
    assert rel_err(out, (gate * torch.sigmoid(gate) * up) @ w.double().T) < REF_TOL
    assert rel_err(out, F.linear(silu_and_mul(x), w)) < REF_TOL


def test_gemv_in_cuda_graph():
    from nanovllm.kernels.pdl import pdl_launch_options

    if torch.cuda.get_device_capability() >= (9, 0):  # Hopper: the decode kernels launch with PDL
        assert pdl_launch_options(torch.empty(1, device=DEV)) == {"PDL": True, "launch_pdl": True}
    gen = torch.Generator(DEV).manual_seed(0)
    x, w = randn((2, 1024), gen), randn((4096, 1024), gen, 1 / 32)
    expected = gemv(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w)
    x.copy_(randn((2, 1024), gen))
    graph.replay()
    assert not torch.equal(out, expected)
    assert rel_err(out, x.double() @ w.double().T) < REF_TOL


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (24576, 4096), (1024, 2048)])
def test_gemv_after_producer_in_graph(n, k):
    """A kernel writes x, then the GEMV reads it, replayed in a graph: the GEMV must wait for its
    producer whether it launches early (one-wave grids: PDL, weight lines prefetched before the
    wait) or not (the 8B gate_up grid); 8B qkv takes 16-row programs to fit one wave."""
    from nanovllm.kernels.fused_norm import rms_norm
    from nanovllm.kernels.gemv_plan import TALL_TILING, tiling
    from nanovllm.kernels.pdl import one_wave

    wave = one_wave(torch.device(DEV))
    if n == 6144 and 384 <= wave < 768:  # H100 / H200 (132 SMs)
        assert tiling(1, n, k, wave) == TALL_TILING
    gen = torch.Generator(DEV).manual_seed(n)
    h, g = randn((1, k), gen), randn((k,), gen)
    w = randn((n, k), gen, k ** -0.5)
    graph = torch.cuda.CUDAGraph()
    gemv(rms_norm(h, g, 1e-6), w)  # compile outside the capture
    with torch.cuda.graph(graph):
        out = gemv(rms_norm(h, g, 1e-6), w)
    for _ in range(3):
        h.copy_(randn((1, k), gen))
        graph.replay()
        hd = h.double()
        x = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6)).to(DT).double() * g.double()
        assert rel_err(out, x @ w.double().T) < REF_TOL
