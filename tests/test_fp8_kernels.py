"""CPU tests of the FP8 kernels (TRITON_INTERPRET=1, set by conftest.py): the GEMV's FP8 variant
(weights per row or per 128 x 128 block, with the SiLU-and-mul and RMSNorm prologues) against a
float64 matmul on the dequantized weights, and the activation quantization against the same
arithmetic written out in torch (bit for bit), standalone and inside the RMSNorm and SiLU-and-mul
kernels that quantize their own outputs; fp8_linear's per-token path with a bias."""

import pytest
import torch

from fp8_checkpoints import dequantize_blocks, quantize_blocks, quantize_channels
from linear_refs import DTYPES, REF_TOL, randn, rel_err

from nanovllm.kernels.fp8_quant import RowQuant, quantize_rows
from nanovllm.kernels.fused_activation import silu_and_mul, silu_and_mul_fp8
from nanovllm.kernels.fused_norm import add_rms_norm, rms_norm, rms_norm_both, rms_norm_fp8
from nanovllm.kernels.gemv import gemv, rms_norm_gemv, silu_mul_gemv
from nanovllm.kernels.gemv_plan import Tiling, tiling
from nanovllm.quantization.fp8 import Fp8Weights, fp8_linear

pytestmark = pytest.mark.interpreter
FP8 = torch.float8_e4m3fn


def fp8_weight(n, k, gen, scales):
    """(fp8 weight, its scale as the kernel takes it, the dequantized float64 weight); rows and
    columns spread so that blocks' scales differ."""
    w = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen)) * torch.exp(
        torch.randn(1, k, generator=gen)) * k ** -0.5
    if scales == "block":
        q, s = quantize_blocks(w)
        return q, s, dequantize_blocks(q, s).double()
    q, s = quantize_channels(w)
    return q, s.reshape(-1), q.double() * s.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 300, 200), (2, 40, 1000), (4, 256, 384)])
@pytest.mark.parametrize("scales", ["block", "row"])
def test_fp8_gemv_matches_dequantized_weights(dtype, m, n, k, scales):
    gen = torch.Generator().manual_seed(m + n + k)
    q, s, wd = fp8_weight(n, k, gen, scales)
    x = randn((m, k), gen, dtype)
    bias = randn((n,), gen, dtype)
    out = gemv(x, q, bias, weight_scale=s)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, x.double() @ wd.T + bias.double()) < REF_TOL[dtype]


@pytest.mark.parametrize("scales", ["block", "row"])
def test_fp8_gemv_prologues(scales):
    """SiLU-and-mul (the down projection) and add + RMSNorm (qkv / gate_up) in front."""
    gen = torch.Generator().manual_seed(7)
    q, s, wd = fp8_weight(72, 320, gen, scales)
    x = randn((2, 640), gen, torch.float32)
    gate, up = x.double().chunk(2, dim=-1)
    out = silu_mul_gemv(x, q, weight_scale=s)
    assert rel_err(out, (gate * torch.sigmoid(gate) * up) @ wd.T) < REF_TOL[torch.float32]
    h, res, g = randn((2, 320), gen, torch.float32), randn((2, 320), gen, torch.float32), randn((320,), gen, torch.float32)
    out, summed = rms_norm_gemv(h, res, g, 1e-6, q, weight_scale=s)
    sd = (h + res).double()
    assert torch.equal(summed, h + res)
    normed = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6) * g.double()
    assert rel_err(out, normed @ wd.T) < REF_TOL[torch.float32]


def test_fp8_gemv_tall_tiles_and_bad_scales():
    gen = torch.Generator().manual_seed(3)
    q, s, wd = fp8_weight(256, 256, gen, "block")
    x = randn((1, 256), gen, torch.float32)
    tall = Tiling(block_n=16, block_k=256, stages=2, evict="")
    assert rel_err(gemv(x, q, tile=tall, weight_scale=s), x.double() @ wd.T) < REF_TOL[torch.float32]
    with pytest.raises(ValueError, match="block_n dividing 128"):
        gemv(x, q, tile=Tiling(block_n=256, block_k=16, stages=1, evict=""), weight_scale=s)
    with pytest.raises(ValueError, match=r"\(256,\) per row or \(2, 2\)"):
        gemv(x, q, weight_scale=s[:1])
    with pytest.raises(TypeError, match="weight_scale must be a float32"):
        gemv(x, q, weight_scale=s.half())
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        gemv(x, wd.float(), weight_scale=s)
    with pytest.raises(TypeError, match="weight dtype"):
        gemv(x, q)  # an FP8 weight needs its scale
    # rows read as int32 words: K (and the row stride) a multiple of 4
    q6, s6, _ = fp8_weight(8, 130, gen, "row")
    with pytest.raises(ValueError, match="multiples of 4"):
        gemv(randn((1, 130), gen, torch.float32), q6, weight_scale=s6)


@pytest.mark.parametrize("rows,n,k", [(1, 6144, 4096), (1, 24576, 4096), (2, 4096, 12288), (1, 2048, 4096),
                                      (2, 2048, 4096), (2, 1024, 64), (2, 24576, 4096), (2, 6144, 4096)])
def test_fp8_tilings(rows, n, k):
    """FP8 tilings (wave 528: 132 SMs). Block scales, any width: 32 x 128 where 32-row programs fill a
    wave (8B gate_up), else 16 x 128 at two rows (one scale a step) and the tall tiling at one.
    Per-row scales from 4,096 outputs at two rows: 32 x 128 where it fills a wave, 1,024-column
    steps where 8-row programs fit one wave, else the tall tiling; at one row the plain rule (the
    words' accumulator budget aside), but 1,024-column steps where neither 8- nor 16-row programs
    fit one wave (8B gate_up), where the plain rule takes the 8 x 512 tiling."""
    wave = 528
    block, row, plain = (tiling(rows, n, k, wave=wave, block_scales=True, fp8=True),
                         tiling(rows, n, k, wave=wave, fp8=True), tiling(rows, n, k, wave=wave))
    tall = (16, min(256, k))
    fills = n >= 32 * wave
    assert (block.block_n, block.block_k) == ((32, 128) if fills else (16, min(128, k)) if rows > 1 else tall)
    assert 128 % block.block_n == 0
    if rows > 1 and n >= 4096:
        assert (row.block_n, row.block_k) == ((32, 128) if fills else (8, 1024) if -(-n // 8) <= wave else tall)
    elif rows == 1 and n >= 4096 and -(-n // 16) > wave:
        assert (row.block_n, row.block_k, row.stages) == (8, 1024, 3)
        assert (plain.block_n, plain.block_k) == (8, 512)
    else:
        assert (row.block_n, row.stages) == (plain.block_n, plain.stages)


def ref_quantize(x, group, static=None, amax_ub=None):
    """Per-token / per-group / static FP8 quantization written out: (fp8 values, scales [M, G]);
    `amax_ub`: each row's amax taken at most this (per token)."""
    x = x.float()
    m, k = x.shape
    size = k if group is None else group
    q, scales = torch.empty(m, k, dtype=FP8), torch.empty(m, -(-k // size))
    for r in range(m):
        for g in range(scales.shape[1]):
            part = x[r, g * size:(g + 1) * size]
            amax = part.abs().max().item() if amax_ub is None else min(part.abs().max().item(), amax_ub)
            s = static if static is not None else max(amax / 448.0, 1e-12)
            scales[r, g] = s
            q[r, g * size:(g + 1) * size] = (part / scales[r, g]).clamp(-448, 448).to(FP8)
    return q, scales


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(3, 200), (1, 4100), (5, 128)])
@pytest.mark.parametrize("group,amax_ub", [(None, None), (128, None), (None, 40.0)])
def test_activation_quantization_bit_for_bit(dtype, m, k, group, amax_ub):
    """amax_ub (fbgemm_fp8's activation_scale_ub) bounds the rows' amax: rows past it saturate."""
    gen = torch.Generator().manual_seed(m * k)
    x = randn((m, k), gen, dtype, 30.0)
    x[0, : min(k, 128)] = 0  # an all-zero group (per token at k = 128): the scale floor
    rows = m + 3  # padding rows, as the blockwise GEMM takes
    q, s = quantize_rows(x, group=group, rows=rows, amax_ub=amax_ub)
    ref_q, ref_s = ref_quantize(x, group, amax_ub=amax_ub)
    if amax_ub is not None:  # the bound is reached: saturated values, and no scale past it
        assert (s[:m] == amax_ub / 448.0).any() and (q[:m].float().abs() == 448).sum() > m and s.max() <= amax_ub / 448
    assert q.shape == (rows, k) and s.shape == (rows, ref_s.shape[1])
    assert torch.equal(q[:m].float(), ref_q.float()) and torch.equal(s[:m], ref_s)
    assert not q[m:].float().any()
    if group is not None:  # column-major: torch._scaled_mm's blockwise layout
        assert s.stride() == (1, rows)


@pytest.mark.parametrize("m", [3, 16, 40])
def test_per_token_fp8_linear_with_bias(m):
    """fp8_linear's per-token path (quantize, then torch._scaled_mm with rowwise scales, bias and
    fast accumulation; on the H200 cuBLAS refused that at 3-16 rows x 12,288 columns with a bias,
    and the promoted call serves those): the float64 product of the e4m3 operands plus the bias."""
    gen = torch.Generator().manual_seed(m)
    q, s, wd = fp8_weight(96, 640, gen, "row")
    x = randn((m, 640), gen, torch.bfloat16, 3.0)
    bias = randn((96,), gen, torch.bfloat16)
    out = fp8_linear(x, Fp8Weights(q, s, None), bias)
    xq, xs = ref_quantize(x, None)
    assert out.shape == (m, 96) and out.dtype == torch.bfloat16
    assert rel_err(out, (xq.double() * xs.double()) @ wd.T + bias.double()) < REF_TOL[torch.bfloat16]


@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("k", [300, 4100])  # one step / the two-pass walk (per token)
def test_moe_padding_rows_are_skipped(group, k):
    """Rows of an aligned MoE activation whose pair id is >= num_pairs are padding: skipped (here
    they hold NaN and inf, as torch.empty's bytes may); the other rows quantize as without pair_ids."""
    gen = torch.Generator().manual_seed(k)
    x = randn((6, k), gen, torch.bfloat16, 30.0)
    pair_ids = torch.tensor([0, 9, 3, 9, 9, 1], dtype=torch.int32)  # num_pairs 9: rows 1, 3, 4 padding
    x[1], x[3], x[4] = float("nan"), float("inf"), float("-inf")
    q, s = quantize_rows(x, group=group, pair_ids=pair_ids, num_pairs=9)
    live = [0, 2, 5]
    ref_q, ref_s = ref_quantize(x[live], group)
    assert torch.equal(q[live].float(), ref_q.float()) and torch.equal(s[live], ref_s)
    with pytest.raises(ValueError, match="pair_ids must be a contiguous int32 \\[6\\]"):
        quantize_rows(x, pair_ids=pair_ids.long(), num_pairs=9)
    with pytest.raises(ValueError, match="pair_ids must be a contiguous int32 \\[6\\]"):
        quantize_rows(x, pair_ids=pair_ids[:4], num_pairs=9)
    with pytest.raises(ValueError, match="rows must be x's 6"):
        quantize_rows(x, pair_ids=pair_ids, num_pairs=9, rows=8)
    with pytest.raises(TypeError, match="num_pairs must be an int, got 9.0"):
        quantize_rows(x, pair_ids=pair_ids, num_pairs=9.0)


@pytest.mark.parametrize("parts", [[0.05], [0.02, 0.05], [0.03, 0.05, 0.01]])
def test_static_activation_scale_and_bad_arguments(parts):
    """A packed layer's parts' static scales: the largest quantizes the activation (one matmul)."""
    gen = torch.Generator().manual_seed(1)
    x = randn((4, 300), gen, torch.bfloat16, 100.0)
    scale = torch.tensor(parts)
    q, s = quantize_rows(x, static_scale=scale)
    ref_q, _ = ref_quantize(x, None, 0.05)
    assert torch.equal(q.float(), ref_q.float()) and torch.equal(s, torch.full((4, 1), 0.05))
    assert q.float().abs().max() == 448  # clamped, not NaN
    with pytest.raises(ValueError, match="group must be None"):
        quantize_rows(x, group=64)
    with pytest.raises(ValueError, match="takes no group"):
        quantize_rows(x, group=128, static_scale=scale)
    for bad in (torch.ones(5), torch.ones(2, 1), torch.ones(0), torch.ones(2, dtype=torch.float64),
                torch.ones(4)[::2]):
        with pytest.raises(ValueError, match="contiguous float32 tensor of 1 to 4 parts' scales"):
            quantize_rows(x, static_scale=bad)
    with pytest.raises(ValueError, match="rows must be an int >= x's 4 rows"):
        quantize_rows(x, rows=2)


QUANTS = {"token": lambda: RowQuant(), "group": lambda: RowQuant(128, row_multiple=4),
          "static": lambda: RowQuant(static_scale=torch.tensor([0.01, 0.02, 0.005])),  # parts: the largest, 0.02
          "bounded": lambda: RowQuant(amax_ub=2.5)}  # per token, amax at most 2.5: these rows pass it


def check_quantized(got, out16, how, mode):
    """got (QuantizedRows) is out16 [m, K] quantized as `how` says: the written-out reference on
    its rows, zero padding rows (group: the scale floor), _scaled_mm's layouts."""
    m, k = out16.shape
    ref_q, ref_s = ref_quantize(out16, how.group, 0.02 if mode == "static" else None, how.amax_ub)
    rows = how.rows(m)
    assert got.m == m and got.dtype == out16.dtype and got.q.shape == (rows, k)
    assert torch.equal(got.q[:m].float(), ref_q.float()) and torch.equal(got.scales[:m], ref_s)
    assert not got.q[m:].float().any() and (got.scales[m:] == 1e-12).all()
    if how.amax_ub is not None:  # some row reached the bound
        assert (ref_s == how.amax_ub / 448.0).any()
    if how.group is not None:
        assert got.scales.shape == (rows, -(-k // 128)) and got.scales.stride() == (1, rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", QUANTS)
@pytest.mark.parametrize("h", [200, 640])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantizes_its_output(dtype, mode, h, with_residual):
    """rms_norm_fp8 = the 16-bit RMSNorm (and residual sum) quantized: bit for bit, padding rows too;
    rms_norm_both writes the 16-bit rows as well."""
    gen = torch.Generator().manual_seed(h)
    x, w = randn((5, h), gen, dtype, 3.0), randn((h,), gen, dtype)
    res = randn((5, h), gen, dtype) if with_residual else None
    x[1] = 0  # without a residual, a zero row: the scale floor
    how = QUANTS[mode]()
    got, summed = rms_norm_fp8(x, res, w, 1e-6, how)
    kept, both, both_summed = rms_norm_both(x, res, w, 1e-6, how)
    if with_residual:
        out16, ref_sum = add_rms_norm(x, res, w, 1e-6)
        assert torch.equal(summed, ref_sum) and torch.equal(both_summed, ref_sum)
    else:
        out16 = rms_norm(x, w, 1e-6)
        assert summed is None and both_summed is None
    check_quantized(got, out16, how, mode)
    check_quantized(both, out16, how, mode)  # rms_norm_both: the same e4m3 rows and the 16-bit ones beside them
    assert kept.dtype == dtype and torch.equal(kept, out16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", QUANTS)
@pytest.mark.parametrize("inter", [200, 5000])
def test_silu_and_mul_quantizes_its_output(dtype, mode, inter):
    """silu_and_mul_fp8 = silu_and_mul quantized: bit for bit, padding rows too (per token by the
    two kernels, per group and static in one)."""
    gen = torch.Generator().manual_seed(inter)
    x = randn((3, 2 * inter), gen, dtype, 4.0)
    x[2, :inter] = 0  # silu(0) = 0: a zero row
    how = QUANTS[mode]()
    check_quantized(silu_and_mul_fp8(x, how), silu_and_mul(x), how, mode)


def test_producers_refuse_other_quant_specs():
    x = torch.ones(2, 256)
    with pytest.raises(TypeError, match="quant must be a RowQuant, got dict"):
        rms_norm_fp8(x, None, torch.ones(256), 1e-6, {"group": 128})
    with pytest.raises(TypeError, match="quant must be a RowQuant, got dict"):
        rms_norm_both(x, None, torch.ones(256), 1e-6, {"group": 128})
    with pytest.raises(TypeError, match="quant must be a RowQuant, got NoneType"):
        silu_and_mul_fp8(x, None)
    with pytest.raises(ValueError, match="row_multiple must be"):
        RowQuant(row_multiple=0)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1200"):  # fbgemm_fp8's activation_scale_ub
        with pytest.raises(ValueError, match="amax_ub must be a positive finite number"):
            RowQuant(amax_ub=bad)
    with pytest.raises(ValueError, match="amax_ub bounds a per-token scale"):
        RowQuant(128, amax_ub=1200.0)
    with pytest.raises(ValueError, match="amax_ub bounds a per-token scale"):
        RowQuant(static_scale=torch.tensor([0.5]), amax_ub=1200.0)
