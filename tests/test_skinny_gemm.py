"""The batched-decode GEMM (kernels/skinny_gemm.py), plain and with SiLU-and-mul in front, against
a float64 matmul of the exact inputs and the unfused torch path: on CPU tensors under Triton's
interpreter (set by conftest.py; small shapes, it is slow) and compiled on CUDA."""

import pytest
import torch
import torch.nn.functional as F

from linear_refs import DTYPES, REF_TOL, near_torch, randn, rel_err

from nanovllm.kernels.skinny_gemm import MAX_ROWS, skinny_gemm
from nanovllm.kernels.skinny_plan import Operands, SkinnyTiling, skinny_tiling

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
# ragged rows / columns / reduction against the 16-64 tiles; 40 rows: a partial third row tile
@pytest.mark.parametrize("m,n,k", [(3, 40, 96), (17, 64, 72), (40, 100, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("tile", [SkinnyTiling(block_m=16, block_n=32, block_k=32, stages=2, num_warps=4, pdl=True),
                                  SkinnyTiling(16, 32, 16, 2, 4, pdl=True, split_k=3),
                                  SkinnyTiling(32, 16, 32, 2, 4, pdl=False, split_k=4),
                                  None], ids=["small-tiles", "split3", "split4", "default-tiles"])
def test_matches_linear(device, dtype, m, n, k, with_bias, tile):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = randn((m, k + 8), gen, dtype).to(device)[:, :k]  # strided rows, like a view into a wider tensor
    assert x.stride(0) == k + 8
    w = randn((n, k), gen, dtype, k ** -0.5).to(device)
    bias = randn((n,), gen, dtype).to(device) if with_bias else None
    out = skinny_gemm(x, w, bias, tile=tile)
    assert out.shape == (m, n) and out.dtype == dtype
    y = x.double() @ w.double().T
    assert rel_err(out, y if bias is None else y + bias.double()) < REF_TOL[dtype]
    near_torch(out, F.linear(x, w, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [64, 256, 512])
def test_serving_shapes_with_default_tiles(m):
    """Qwen3-0.6B's gate_up and down at decode batch sizes, bfloat16, default tiles."""
    gen = torch.Generator().manual_seed(m)
    x = randn((m, 1024), gen, torch.bfloat16).cuda()
    w = randn((6144, 1024), gen, torch.bfloat16, 1024 ** -0.5).cuda()
    out = skinny_gemm(x, w)
    assert rel_err(out, x.double() @ w.double().T) < REF_TOL[torch.bfloat16]
    near_torch(out, F.linear(x, w))
    wd = randn((1024, 3072), gen, torch.bfloat16, 3072 ** -0.5).cuda()
    act = out[:, :3072]
    out = skinny_gemm(act, wd)
    assert rel_err(out, act.double() @ wd.double().T) < REF_TOL[torch.bfloat16]


@pytest.mark.interpreter
def test_default_tiling_and_bad_inputs():
    gen = torch.Generator().manual_seed(1)
    x, w = randn((5, 64), gen, torch.float32), randn((24, 64), gen, torch.float32)
    assert rel_err(skinny_gemm(x, w), x.double() @ w.double().T) < REF_TOL[torch.float32]  # default tiles
    assert [skinny_tiling(m, 4096, 1024, 132).block_m for m in (1, 16, 17, 64)] == [16, 16, 64, 64]
    # narrow layers split K (0.6B o_proj: 32 tiles of 32 columns on 132 SMs), wide ones do not
    assert [skinny_tiling(m, 1024, 2048, 132).split_k for m in (16, 64)] == [8, 4]
    assert skinny_tiling(16, 4096, 1024, 132).split_k == 1
    assert skinny_tiling(16, 1024, 300, 132).split_k == 1  # slices would be shorter than 256 columns
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm(torch.zeros(MAX_ROWS + 1, 64), w)
    with pytest.raises(ValueError, match="does not match"):
        skinny_gemm(torch.zeros(2, 63), w)
    with pytest.raises(ValueError, match="rows"):
        skinny_gemm(torch.zeros(0, 64), w)
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm(x, w, torch.zeros(23))
    with pytest.raises(ValueError, match="stages"):
        skinny_gemm(x, w, tile=SkinnyTiling(16, 16, 16, 0, 4, pdl=False))
    with pytest.raises(TypeError, match="dtype"):
        skinny_gemm(x, w.double())
    with pytest.raises(ValueError, match="block_n"):
        skinny_gemm(x, w, tile=SkinnyTiling(16, 24, 32, 2, 4, pdl=False))
    with pytest.raises(TypeError, match="SkinnyTiling"):
        skinny_gemm(x, w, tile=(16, 16, 16))


def test_narrow_layers_take_the_skinny_gemm_between_the_gemv_and_cublas():
    """A narrow layer's path (4 SMs stand in for the GPU's) sends batches of gemv_max_rows + 1 ..
    skinny_max_rows rows to the skinny GEMM, fewer to the GEMV, more to F.linear; a wide layer
    never takes it; on CPU neither runs. Given that path (the interpreter runs the kernels), the
    down projection after the SiLU-and-mul gives F.linear's output."""
    import nanovllm.layers.linear as linear
    from nanovllm.layers.kernel_path import KernelRoutes, LinearPath, plan_linear

    routes = KernelRoutes()
    narrow = plan_linear(32, 512, routes, 4, takes_norm=False)
    assert narrow == LinearPath(routes.gemv_max_rows, 0, routes.skinny_max_rows)
    assert plan_linear(4096, 1024, routes, 4, takes_norm=False).skinny_rows == 0  # wide
    assert plan_linear(32, 512, KernelRoutes(skinny_max_rows=0), 4, takes_norm=False).skinny_rows == 0
    for rows, skinny, gemv in ((2, False, True), (5, True, False), (routes.skinny_max_rows + 1, False, False)):
        x = torch.empty(rows, 512)
        assert (narrow.skinny_serves(x), narrow.gemv_serves(x)) == (skinny, gemv), rows
    torch.manual_seed(0)
    up = linear.MergedColumnParallelLinear(512, [512, 512])
    down = linear.SiluMulRowParallelLinear(512, 32)
    assert down.path == LinearPath(0, 0, 0)  # built on CPU
    for layer in (up, down):
        layer.weight.data.normal_(0, 0.05)
    x = torch.randn(5, 512)
    ref = down(up(x))  # F.linear and SiluAndMul
    down.path = narrow  # the CUDA path's decision, under the interpreter
    torch.testing.assert_close(down(up(x)), ref, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [3, 8, 16])
def test_narrow_layer_on_cuda_in_graph_replays(rows):
    """Qwen3-0.6B's o_proj (1024 x 2048, narrow: K split 8 ways at 16 rows on an H200) built on
    CUDA takes the skinny GEMM at 3-16 rows: float64 agreement, and CUDA-graph replays into a
    poisoned output equal the eager call (a split tile's arrival counter left non-zero by the call
    before would leave the tile unsummed: NaN)."""
    import nanovllm.layers.linear as linear

    gen = torch.Generator().manual_seed(rows)
    with torch.device("cuda"):
        layer = linear.RowParallelLinear(2048, 1024).to(torch.bfloat16)
    layer.weight.data.copy_(randn((1024, 2048), gen, torch.bfloat16, 2048 ** -0.5))
    assert layer.path.skinny_serves(torch.empty(rows, 2048))
    x = randn((rows, 2048), gen, torch.bfloat16).cuda()
    eager = layer(x)
    assert rel_err(eager, x.double() @ layer.weight.double().T) < REF_TOL[torch.bfloat16]
    graph, static_x = torch.cuda.CUDAGraph(), x.clone()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    for _ in range(3):
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(3, 160, 300), (20, 128, 640)])  # ragged K (300) / rows (20)
@pytest.mark.parametrize("scales", ["row", "block"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_fp8_weights_match_dequantized(device, dtype, m, n, k, scales, split_k):
    """FP8 weights (W8A16: e4m3 converted to x's dtype in registers, exact) against a float64
    matmul on the dequantized weights, per-row and 128 x 128 block scales, split K."""
    from test_fp8_kernels import fp8_weight

    gen = torch.Generator().manual_seed(m + n + k)
    q, s, wd = fp8_weight(n, k, gen, scales)
    x = randn((m, k), gen, dtype)
    bias = randn((n,), gen, dtype)
    tile = SkinnyTiling(16, 32, 128, 2, 4, pdl=True, split_k=split_k)
    out = skinny_gemm(x.to(device), q.to(device), bias.to(device), tile=tile, weight_scale=s.to(device))
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out.cpu(), x.double() @ wd.T + bias.double()) < REF_TOL[dtype]
    if split_k == 1:  # the layers' FP8 tiling (skinny_tiling(..., Operands.W8A16): 64 columns, K split)
        out = skinny_gemm(x.to(device), q.to(device), bias.to(device), weight_scale=s.to(device))
        assert rel_err(out.cpu(), x.double() @ wd.T + bias.double()) < REF_TOL[dtype]


@pytest.mark.interpreter
def test_fp8_weights_refuse_bad_settings():
    from test_fp8_kernels import fp8_weight

    gen = torch.Generator().manual_seed(2)
    q, s, _ = fp8_weight(64, 256, gen, "block")
    x = randn((4, 256), gen, torch.bfloat16)
    with pytest.raises(ValueError, match="block-scaled weights need tile.block_k == 128"):
        skinny_gemm(x, q, tile=SkinnyTiling(16, 32, 64, 2, 4, pdl=False), weight_scale=s)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        skinny_gemm(x, q.to(torch.bfloat16), weight_scale=s)


def test_fp8_layers_take_the_skinny_gemm_past_the_gemv():
    """Every FP8 layer, wide or narrow, sends gemv_max_rows + 1 .. fp8_skinny_max_rows rows to the
    skinny GEMM; 0 turns it off (torch._scaled_mm beyond the GEMV)."""
    from nanovllm.layers.kernel_path import KernelRoutes, LinearPath, plan_linear

    routes = KernelRoutes()
    for n, k in ((4096, 1024), (32, 512)):
        assert plan_linear(n, k, routes, 132, takes_norm=False, fp8=True) == LinearPath(
            routes.gemv_max_rows, 0, routes.fp8_skinny_max_rows, routes.fp8_w8a8_skinny_max_rows)
    assert plan_linear(4096, 1024, KernelRoutes(fp8_skinny_max_rows=0), 132, takes_norm=False,
                       fp8=True).skinny_rows == 0
    off = plan_linear(4096, 1024, KernelRoutes(fp8_w8a8_skinny_max_rows=0), 132, takes_norm=False, fp8=True)
    x = torch.empty(64, 1024)
    assert off.w8a8_rows == 0 and not off.w8a8_serves(x)
    on = plan_linear(4096, 1024, routes, 132, takes_norm=False, fp8=True)
    assert on.w8a8_serves(x) and not on.w8a8_serves(x[:32]) and not on.skinny_serves(x)


def test_fp8_tiling_rule():
    """FP8 tilings (the 8B sweep's best at 4-32 rows): 16-row tiles up to 16 rows, 32 beyond; K
    split to ~4 programs an SM per 16 rows (at most 4); 6 stages only where K is not split."""
    tile = lambda m, n, k: skinny_tiling(m, n, k, 132, Operands.W8A16)
    assert [(t.block_m, t.block_n, t.block_k) for t in (tile(3, 6144, 4096), tile(32, 6144, 4096))] == [
        (16, 64, 128), (32, 64, 128)]
    # 8B qkv / o / down: 96 / 64 / 64 column tiles -> 4 slices; gate_up's 384 tiles: none at 16 rows, 2 at 32
    assert [tile(8, n, k).split_k for n, k in ((6144, 4096), (4096, 4096), (4096, 12288), (24576, 4096))] == [4, 4, 4, 1]
    assert tile(32, 24576, 4096).split_k == 2
    assert tile(16, 24576, 4096).stages == 6 and tile(16, 4096, 4096).stages == 4
    assert tile(8, 64, 200).split_k == 1  # slices would be shorter than 256 columns


def test_w8a8_tiling_rule():
    """W8A8 tilings (the 8B sweep's best at 48-128 rows): 64-row tiles of 64 columns, K split to ~2
    programs an SM; wide layers past one row tile (8B gate_up at 96-128 rows): 128 columns, 3 stages."""
    tile = lambda m, n, k: skinny_tiling(m, n, k, 132, Operands.W8A8)
    # 8B qkv / o / down at 48 and 128 rows: 96 / 64 / 64 column tiles a row tile
    assert [tile(48, n, k).split_k for n, k in ((6144, 4096), (4096, 4096), (4096, 12288))] == [2, 4, 4]
    assert [tile(128, n, k).split_k for n, k in ((6144, 4096), (4096, 4096), (4096, 12288))] == [1, 2, 2]
    assert (tile(48, 24576, 4096).block_n, tile(48, 24576, 4096).split_k) == (64, 1)
    wide = tile(96, 24576, 4096)
    assert (wide.block_m, wide.block_n, wide.stages, wide.split_k) == (64, 128, 3, 1)


@pytest.mark.parametrize("device", DEVICES)
# ragged K (300) / rows (70: two row tiles; 190: three, the most fp8_w8a8_skinny_max_rows sends)
@pytest.mark.parametrize("m,n,k", [(40, 160, 300), (70, 128, 640), (190, 96, 256)])
@pytest.mark.parametrize("scales", ["row", "block"])
@pytest.mark.parametrize("split_k", [1, 3, None])  # None: skinny_tiling(..., Operands.W8A8)
def test_w8a8_matches_dequantized_operands(device, m, n, k, scales, split_k):
    """e4m3 activations (per token with row-scaled weights, per
    128-column group with block-scaled ones, as fp8_linear pairs them) times FP8 weights, against a
    float64 matmul of the dequantized operands; rows past m in xq are padding, never read."""
    from test_fp8_kernels import fp8_weight

    from nanovllm.kernels.fp8_quant import RowQuant, quantize
    from nanovllm.kernels.skinny_gemm import skinny_gemm_w8a8

    gen = torch.Generator().manual_seed(m + n + k)
    q, s, wd = fp8_weight(n, k, gen, scales)
    x = randn((m, k), gen, torch.bfloat16)
    bias = randn((n,), gen, torch.bfloat16)
    xq = quantize(x.to(device), RowQuant(group=128 if scales == "block" else None, row_multiple=16))
    assert xq.q.shape[0] >= m
    x_scales = xq.scales[:m].double().cpu()  # [m, 1] or [m, K/128]
    xd = xq.q[:m].double().cpu() * (x_scales.repeat_interleave(128, dim=1)[:, :k] if scales == "block" else x_scales)
    tile = None if split_k is None else SkinnyTiling(64, 32, 128, 2, 4, pdl=True, split_k=split_k)
    out = skinny_gemm_w8a8(xq, q.to(device), s.to(device), bias.to(device), tile=tile)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_err(out.cpu(), xd @ wd.T + bias.double()) < REF_TOL[torch.bfloat16]


def test_w8a8_refuses_bad_operands():
    """skinny_gemm_w8a8 names what is wrong: not QuantizedRows, activations not e4m3, rows past
    what q holds, a weight of another width, scales of the other layout (all before any launch)."""
    from test_fp8_kernels import fp8_weight

    from nanovllm.kernels.fp8_quant import QuantizedRows, RowQuant, quantize
    from nanovllm.kernels.skinny_gemm import skinny_gemm_w8a8

    gen = torch.Generator().manual_seed(0)
    q, s, _ = fp8_weight(64, 256, gen, "row")
    xq = quantize(randn((8, 256), gen, torch.bfloat16), RowQuant())
    with pytest.raises(TypeError, match="QuantizedRows"):
        skinny_gemm_w8a8(xq.q, q, s)
    with pytest.raises(TypeError, match="x must be a 2-D float8_e4m3fn"):
        skinny_gemm_w8a8(QuantizedRows(xq.q.float(), xq.scales, 8, torch.bfloat16), q, s)
    with pytest.raises(ValueError, match="xq.m is 9, but xq.q holds 8 rows"):
        skinny_gemm_w8a8(QuantizedRows(xq.q, xq.scales, 9, torch.bfloat16), q, s)
    with pytest.raises(ValueError, match="does not match weight"):
        skinny_gemm_w8a8(xq, q[:, :128].contiguous(), s)
    qb, sb, _ = fp8_weight(64, 256, gen, "block")
    with pytest.raises(ValueError, match=r"xq.scales must be \[rows >= 8, 2\]"):
        skinny_gemm_w8a8(xq, qb, sb)
