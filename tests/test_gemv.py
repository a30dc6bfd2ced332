"""CPU tests of the few-row GEMV kernel, plain and with SiLU-and-mul fused in (TRITON_INTERPRET=1,
set by conftest.py).

Each is checked against a float64 reference (a float64 matmul of the exact inputs) and against
the unfused torch path (SiluAndMul `forward_native`, then F.linear). Shapes are small: the
interpreter is slow.
"""

import pytest
import torch
import torch.nn.functional as F
from linear_refs import DTYPES, REF_TOL, near_torch, randn, rel_err

from nanovllm.kernels.gemv import MAX_ROWS, gemv, rms_norm_gemv, silu_mul_gemv
from nanovllm.kernels.gemv_plan import ACC_ELEMS, NARROW_TILING, TALL_TILING, WIDE_N, WIDE_TILING, Tiling, tiling
from nanovllm.kernels.pdl import RESIDENT_PER_SM
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.utils.ints import next_pow2

# Triton kernels on CPU tensors: these run where the interpreter is on (no CUDA; see conftest.py).
pytestmark = pytest.mark.interpreter


def ref_linear(a, w, bias):
    y = a.double() @ w.double().T
    return y if bias is None else y + bias.double()


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


def ref_rms_norm(s, g, eps):
    """float64 RMSNorm of rows s [M, K] with weight g."""
    s = s.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * g.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (2, 24, 300)])  # 300: a ragged last step
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rms_norm_gemv(dtype, m, n, k, with_residual, with_bias):
    """The add + RMSNorm in front of the GEMV: against float64 (the norm of the rounded sum, then
    the product) and against the unfused torch path (RMSNorm.forward_native, then F.linear); the
    summed residual comes back rounded as the norm kernel returns it."""
    gen = torch.Generator().manual_seed(m * 100 + k)
    x = randn((m, k + 4), gen, dtype)[:, :k]  # strided rows
    res = randn((m, k), gen, dtype) if with_residual else None
    g = randn((k,), gen, dtype, 0.5) + 1
    w = randn((n, k), gen, dtype, k ** -0.5)
    bias = randn((n,), gen, dtype) if with_bias else None
    out, s = rms_norm_gemv(x, res, g, 1e-6, w, bias)
    summed = x if res is None else (x.float() + res.float()).to(dtype)
    if res is None:
        assert s is None
    else:
        assert torch.equal(s, summed)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, ref_linear(ref_rms_norm(summed, g, 1e-6), w, bias)) < REF_TOL[dtype]
    norm = RMSNorm(k, 1e-6)
    norm.weight.data = g
    near_torch(out, F.linear(norm.forward_native(summed), w, bias))


def test_norm_in_gemv_reads_the_block_scaled_tiling():
    """Whether the norm runs inside a layer's GEMV depends on that GEMV's grid: a block-scaled FP8
    layer's two-row tiles (16 rows a program) make half the programs of the plain 8-row tiling."""
    from nanovllm.layers.kernel_path import KernelRoutes, plan_linear

    routes = KernelRoutes(norm_in_gemv_max_rows=2)  # wave at 100 SMs: 400 programs
    assert plan_linear(4096, 1024, routes, 100, takes_norm=True).norm_rows == 0  # 512 programs
    assert plan_linear(4096, 1024, routes, 100, takes_norm=True, block_scales=True).norm_rows == 2  # 256


def test_column_layers_take_the_norm_into_the_gemv():
    """A column-parallel layer whose path takes the norm into its GEMV (the routes' one row; the
    interpreter runs the kernel) gives what the norm then the layer give, with and without a
    residual (a decoder's first layer); 2 and 3 rows take the norm's own path."""
    from nanovllm.layers.kernel_path import KernelRoutes, LinearPath, plan_linear
    from nanovllm.layers.linear import MergedColumnParallelLinear

    routes = KernelRoutes()
    path = plan_linear(48, 64, routes, 4, takes_norm=True)
    assert path == LinearPath(routes.gemv_max_rows, routes.norm_in_gemv_max_rows, 0)
    assert plan_linear(48, 64, routes, 4, takes_norm=False).norm_rows == 0  # a row-parallel layer
    assert plan_linear(48, 64, KernelRoutes(norm_in_gemv_max_rows=0), 4, takes_norm=True).norm_rows == 0
    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(64, [24, 24])
    layer.weight.data.normal_(0, 0.1)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.normal_(1, 0.2)
    assert layer.path == LinearPath(0, 0, 0)  # built on CPU
    for rows in (1, 2, 3):
        assert path.norm_serves(torch.empty(rows, 64)) == (rows <= routes.norm_in_gemv_max_rows)
        for residual in (None, torch.randn(rows, 64)):
            x = torch.randn(rows, 64)
            layer.path = LinearPath(0, 0, 0)
            ref, ref_s = layer.forward_normed(x, residual, norm)  # CPU: norm, then F.linear
            layer.path = path  # the CUDA path's decision, under the interpreter
            got, s = layer.forward_normed(x, residual, norm)
            assert torch.equal(s, ref_s)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_rms_norm_gemv_bad_inputs():
    x, w, g = torch.zeros(1, 64), torch.zeros(8, 64), torch.ones(64)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_gemv(x, torch.zeros(2, 64), g, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight"):
        rms_norm_gemv(x, None, torch.ones(63), 1e-6, w)
    with pytest.raises(ValueError, match="eps"):
        rms_norm_gemv(x, None, g, -1.0, w)
    with pytest.raises(ValueError, match="rows x K"):
        rms_norm_gemv(torch.zeros(1, 8200), None, torch.ones(8200), 1e-6, torch.zeros(8, 8200))
    with pytest.raises(ValueError, match="rows x K"):  # 4 rows of 4096: twice what the prologue holds
        rms_norm_gemv(torch.zeros(4, 4096), None, torch.ones(4096), 1e-6, torch.zeros(8, 4096))


def test_tilings_agree():
    """Every (BLOCK_N, BLOCK_K) choice, the kernel's own tilings among them, computes the same
    product (masks on both edges)."""
    gen = torch.Generator().manual_seed(1)
    x = randn((2, 300), gen, torch.float32)
    w = randn((37, 300), gen, torch.float32)
    ref = ref_linear(x, w, None)
    tilings = [Tiling(block_n=4, block_k=64, stages=1, evict=""),
               Tiling(block_n=8, block_k=128, stages=3, evict="evict_first"),
               NARROW_TILING, WIDE_TILING, TALL_TILING]
    for tile in tilings:
        assert rel_err(gemv(x, w, tile=tile), ref) < 1e-5, tile


# Wave sizes: None (no GPU), smaller than most grids, an H200's (132 SMs), larger than any grid.
WAVES = [None, 64, 132 * RESIDENT_PER_SM, 1 << 20]


@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
def test_tiling_fits_registers_and_waves(rows):
    """For every shape: one of the kernel's tilings; the accumulator within ACC_ELEMS; a step no
    wider than K needs; and a wide layer's grid in one wave whenever a tiling can make it fit
    (TALL_TILING only at one row)."""
    kernel_tilings = {(t.block_n, t.stages, t.evict) for t in (NARROW_TILING, WIDE_TILING, TALL_TILING)}
    for n_out in (1, 33, 1024, 4095, 4096, 6144, 24576):
        for k_in in (1, 40, 300, 4096):
            for wave in WAVES:
                t = tiling(rows, n_out, k_in, wave)
                assert (t.block_n, t.stages, t.evict) in kernel_tilings
                assert rows == 1 or t.block_n != TALL_TILING.block_n
                assert t.block_k & (t.block_k - 1) == 0 and t.block_k >= 16
                assert next_pow2(rows) * t.block_n * t.block_k <= ACC_ELEMS
                assert t.block_k <= max(16, next_pow2(k_in))
                fitting = (WIDE_TILING, TALL_TILING) if rows == 1 else (WIDE_TILING,)  # TALL: one row only
                if wave is not None and any(-(-n_out // o.block_n) <= wave for o in fitting):
                    assert n_out < WIDE_N or -(-n_out // t.block_n) <= wave, (n_out, wave, t)


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
