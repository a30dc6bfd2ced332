"""CPU tests of the few-row GEMV kernel, plain and with SiLU-and-mul fused in (TRITON_INTERPRET=1,
set by conftest.py).

Each is checked against a float64 reference (a float64 matmul of the exact inputs) and against
the unfused torch path (SiluAndMul `forward_native`, then F.linear). Shapes are small: the
interpreter is slow.
"""

import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels.gemv import (ACC_ELEMS, MAX_ROWS, NARROW_TILING, RESIDENT_PER_SM, TALL_TILING, WIDE_TILING,
                                   Tiling, gemv, silu_mul_gemv, tiling)
from nanovllm.layers.activation import SiluAndMul

# Triton kernels on CPU tensors: these run where the interpreter is on (no CUDA; see conftest.py).
pytestmark = pytest.mark.interpreter

DTYPES = [torch.float32, torch.bfloat16]
# Relative (Frobenius) error vs the float64 reference: the output's own rounding dominates.
REF_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def randn(shape, gen, dtype, scale=1.0):
    return (scale * torch.randn(shape, generator=gen)).to(dtype)


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "output has NaN (unwritten elements)"
    return ((out.double() - ref).norm() / ref.norm()).item()


def ref_linear(a, w, bias):
    y = a.double() @ w.double().T
    return y if bias is None else y + bias.double()


def near_torch(out, ref):
    """Within a few output ulp of the torch path (the float32 sums run in another order)."""
    tol = 1e-5 if out.dtype == torch.float32 else 4 * torch.finfo(out.dtype).eps
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 64, 256), (4, 33, 1000)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(dtype, m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = randn((m, k + 8), gen, dtype)[:, :k]  # strided rows, like a view into a wider tensor
    w = randn((n, k), gen, dtype, k ** -0.5)
    bias = randn((n,), gen, dtype) if with_bias else None
    out = gemv(x, w, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, ref_linear(x, w, bias)) < REF_TOL[dtype]
    near_torch(out, F.linear(x, w, bias))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 32, 64), (2, 20, 176)])
def test_silu_mul_gemv(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m + 3 * n + k)
    x = randn((m, 2 * k), gen, dtype, 2.0)
    w = randn((n, k), gen, dtype, k ** -0.5)
    out = silu_mul_gemv(x, w)
    gate, up = x.double().chunk(2, dim=-1)
    assert rel_err(out, (gate * torch.sigmoid(gate) * up) @ w.double().T) < REF_TOL[dtype]
    near_torch(out, F.linear(SiluAndMul.forward_native(x), w))


def test_tilings_agree():
    """Every (BLOCK_N, BLOCK_K) choice computes the same product (masks on both edges)."""
    gen = torch.Generator().manual_seed(1)
    x = randn((2, 300), gen, torch.float32)
    w = randn((37, 300), gen, torch.float32)
    ref = ref_linear(x, w, None)
    tilings = [(4, 64, 1, ""), (8, 128, 3, "evict_first"), (16, 256, 4, ""), (16, 512, 4, "")]
    for block_n, block_k, stages, evict in tilings:
        tile = Tiling(block_n=block_n, block_k=block_k, stages=stages, evict=evict)
        assert rel_err(gemv(x, w, tile=tile), ref) < 1e-5


def test_tiling_by_shape():
    """Wide layers take 8-row programs (16 where only that fits one wave), narrow ones 4;
    BLOCK_K fits the accumulator and K."""
    assert tiling(1, 4096, 1024) == WIDE_TILING
    h200_wave = 132 * RESIDENT_PER_SM
    assert tiling(1, 6144, 4096, h200_wave) == TALL_TILING  # 768 programs of 8 rows, 384 of 16
    assert tiling(1, 6144, 4096, None) == WIDE_TILING  # no GPU, no waves
    assert tiling(1, 4096, 4096, h200_wave) == WIDE_TILING  # 512 programs: one wave already
    assert tiling(1, 24576, 4096, h200_wave) == WIDE_TILING  # 1536 programs of 16 rows: still two waves
    assert tiling(1, 1024, 3072) == NARROW_TILING
    assert tiling(4, 4096, 4096).block_k == ACC_ELEMS // (4 * WIDE_TILING.block_n)
    assert tiling(1, 1024, 40).block_k == 64


def test_bad_inputs():
    x = torch.zeros(2, 16)
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="1..4 rows"):
        gemv(torch.zeros(MAX_ROWS + 1, 16), w)
    with pytest.raises(ValueError, match="columns"):
        gemv(torch.zeros(2, 15), w)
    with pytest.raises(TypeError, match="weight dtype"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.zeros(7))
    with pytest.raises(ValueError, match="32 columns"):
        silu_mul_gemv(x, w)
    with pytest.raises(TypeError, match="dtype"):
        gemv(x.int(), w)
    with pytest.raises(TypeError, match="Tiling"):
        gemv(x, w, tile={"block_n": 4})


def test_no_programmatic_dependent_launch_off_cuda():
    """PDL is a CUDA (Hopper+) launch attribute: CPU / interpreter launches never ask for it."""
    from nanovllm.kernels.pdl import pdl_launch_options

    assert pdl_launch_options(torch.zeros(1)) == {"PDL": False}
