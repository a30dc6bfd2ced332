"""GPU tests of the few-row GEMV and its prologues at Qwen3-0.6B / 8B layer shapes (`pytest -m gpu`).

bf16, 1..4 rows; each call against a float64 reference and against the unfused path it replaces
(the Triton norm / SiLU kernels then cuBLAS), plus CUDA-graph capture.
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
EPS = 1e-6
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


@pytest.mark.parametrize("n,k", [(4096, 1024), (24576, 4096)])
@pytest.mark.parametrize("m", [1, 3])
def test_rms_norm_gemv_shapes(n, k, m):
    gen = torch.Generator(DEV).manual_seed(n + k + m)
    x, res = randn((m, k), gen, 4.0), randn((m, k), gen)
    g = randn((k,), gen, 0.2) + 1.0
    w = randn((n, k), gen, k ** -0.5)
    out, s = rms_norm_gemv(x, res, g, EPS, w)
    normed, s_ref = add_rms_norm(x, res, g, EPS)
    assert torch.equal(s, s_ref)
    s64 = x.double() + res.double()
    a64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS) * g.double()
    assert rel_err(out, a64 @ w.double().T) < REF_TOL
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
