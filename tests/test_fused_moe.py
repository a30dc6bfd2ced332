"""The fused mixture-of-experts kernels (nanovllm/moe/grouped_gemm.py, align.py) against a float64 PyTorch
reference written here; moe_align's layout invariants; CUDA-graph replay; argument checks.
CPU runs go through Triton's interpreter (small shapes); the `gpu` ones use Qwen3-30B-A3B's
expert shape (E=128, K=8, H=2048, I=768)."""

from __future__ import annotations

import os
from dataclasses import replace
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanovllm.moe.align import MAX_EXPERTS, MAX_SLICES, moe_align
from nanovllm.moe.grouped_gemm import fused_moe
from nanovllm.moe.tiles import BLOCK_MS, DECODE_DOWN, DECODE_GATE_UP, PREFILL_WIDE, MoeTiles, block_m_for, moe_tiles

REPO = Path(__file__).resolve().parent.parent
DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
QWEN3_30B = dict(E=128, K=8, H=2048, I=768)
# Largest error allowed, relative to the reference's largest magnitude: float32 accumulates the
# same products in another order; half types round g, u, act and the output once each.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def reference_moe(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """float64 [T, H]: each expert some pair picked, on the rows that picked it."""
    x, inter = hidden.double(), w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = x[tokens] @ w13[e].double().T  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, (act @ w2[e].double().T) * topk_weights[tokens, slots, None].double())
    return out


def random_ids(t: int, e: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Router-like ids: the top-k of random logits, so a token's k experts are distinct."""
    return torch.randn(t, e, generator=g).topk(k, dim=1).indices


def make_case(t, e, k, h, i, dtype, device, ids=None, seed=0, row_pad=0):
    g = torch.Generator().manual_seed(seed)
    # The expert weights are drawn where they are used: at the 30B shape they are 600M values,
    # seconds of CPU time per test on a GPU host.
    gw = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(t, h + row_pad, generator=g).to(device, dtype)[:, :h]  # row_pad > 0: rows strided
    w13 = torch.randn(e, 2 * i, h, generator=gw, device=device) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=gw, device=device) / i ** 0.5
    ids = random_ids(t, e, k, g) if ids is None else torch.as_tensor(ids)
    weights = torch.rand(ids.shape, generator=g) + 0.1
    return (hidden, w13.to(dtype), w2.to(dtype), (weights / weights.sum(1, keepdim=True)).to(device), ids.to(device))


def assert_close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    err = (out.double() - ref).abs().max().item()
    assert err <= TOLERANCE[dtype] * ref.abs().max().item(), (err, ref.abs().max().item())


def expected_rows(n_pairs: int, e: int, block_m: int) -> int:
    return -(-(n_pairs + min(e, n_pairs) * (block_m - 1)) // block_m) * block_m


def check_alignment(align, ids: torch.Tensor, e: int, block_m: int) -> None:
    """The layout of the module docstring, checked element by element."""
    flat, n = ids.reshape(-1).cpu().long(), ids.numel()
    rows = expected_rows(n, e, block_m)
    for name in ("sorted_pair_ids", "block_expert", "num_used_blocks"):
        assert getattr(align, name).dtype == torch.int32, name
    assert align.sorted_pair_ids.shape == (rows,) and align.block_expert.shape == (rows // block_m,)
    assert align.num_used_blocks.shape == (1,) and align.block_m == block_m
    srt = align.sorted_pair_ids.cpu().long()
    assert srt[srt != n].sort().values.tolist() == list(range(n))  # every pair once; the rest padding
    counts = torch.bincount(flat, minlength=e)
    used = int(align.num_used_blocks)
    assert used == int((-(-counts // block_m)).sum())
    blocks, owner = srt.view(-1, block_m), align.block_expert.cpu().long()
    assert owner.min() >= 0 and owner.max() < e
    assert torch.all(blocks[used:] == n)
    assert torch.all(owner[:used].diff() >= 0)  # ordered by expert
    for b in range(used):
        real = blocks[b][blocks[b] < n]
        assert 0 < len(real) and torch.all(blocks[b][len(real):] == n)  # pairs first, then padding
        assert torch.all(flat[real] == owner[b])
    for x in range(e):  # stable: each expert's pairs ascending, in as few blocks as fit
        mine = [p for b in range(used) if owner[b] == x for p in blocks[b][blocks[b] < n].tolist()]
        assert mine == (flat == x).nonzero().flatten().tolist()
        assert int((owner[:used] == x).sum()) == -(-int(counts[x]) // block_m)


ALIGN_CASES = {  # name: (T, K, E, block_m, ids or None for random)
    "random": (6, 2, 8, 16, None),
    "one-expert-many-blocks": (40, 1, 4, 16, [[2]] * 40),
    "duplicates-in-a-token": (3, 4, 5, 16, [[1, 1, 4, 1], [0, 4, 4, 4], [1, 0, 1, 0]]),
    "single-expert-model": (5, 1, 1, 32, [[0]] * 5),
    "qwen3-30b-many-slices": (300, 8, 128, 16, None),
    "block-m-64": (50, 4, 16, 64, None),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ALIGN_CASES)
def test_moe_align_invariants(device, case):
    t, k, e, block_m, ids = ALIGN_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    ids = random_ids(t, e, k, g) if ids is None else torch.tensor(ids)
    for dtype in (torch.int64, torch.int32):
        check_alignment(moe_align(ids.to(device, dtype), e, block_m), ids, e, block_m)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_align_slices_of_several_chunks(device):
    # 400 pairs in 32-pair chunks: 3 slices of 5 chunks, some past the end
    ids = random_ids(50, 128, 8, torch.Generator().manual_seed(7))
    check_alignment(moe_align(ids.to(device), 128, 16, max_slices=3), ids, 128, 16)
    with pytest.raises(ValueError, match="max_slices"):
        moe_align(ids.to(device), 128, 16, max_slices=0)


ALIGN_SHARE_CASES = {  # name: (T, K, E, block_m, max_slices)
    # 400 pairs, 145 blocks (2,320 rows): 2 programs of 73 blocks (1,168 rows), the second past the
    # end for 1 of them: 3 table steps of 32 blocks (the last partial), 2 FILL steps (the last partial)
    "uneven-shares": (50, 8, 128, 16, 2),
    # one program owns all 145 blocks: 5 table steps and 3 FILL steps, the last ones partial
    "one-program-all-blocks": (50, 8, 128, 16, 1),
    # 12,289 pairs of one expert in 4 slices of 4,096, 3 blocks of 8,192 rows: the last program owns none
    "a-program-without-blocks": (12289, 1, 1, 8192, MAX_SLICES),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ALIGN_SHARE_CASES)
def test_moe_align_splits_padding_and_block_table_over_programs(device, case):
    """The count programs pad, and the scatter programs label, blocks in per-program shares."""
    t, k, e, block_m, max_slices = ALIGN_SHARE_CASES[case]
    ids = random_ids(t, e, k, torch.Generator().manual_seed(t))
    check_alignment(moe_align(ids.to(device), e, block_m, max_slices=max_slices), ids, e, block_m)


FUSED_CASES = {  # name: (T, E, K, H, I, dtype, ids or None for random)
    "random-fp32": (5, 8, 2, 64, 32, torch.float32, None),
    "odd-sizes": (7, 6, 4, 96, 40, torch.float32, None),
    "top-1-bf16": (3, 4, 1, 32, 16, torch.bfloat16, None),
    "all-one-expert": (20, 4, 1, 32, 16, torch.float32, [[2]] * 20),  # 20 pairs: two blocks of 16
    "experts-nobody-picks-fp16": (6, 8, 2, 64, 64, torch.float16, [[1, 5], [6, 1], [5, 6], [1, 5], [1, 6], [6, 5]]),
    "top-4-bf16": (8, 8, 4, 64, 64, torch.bfloat16, None),
    # the slot sum: K not a power of two, H over one program's SLOT_SUM_COLUMNS (a partial second one)
    "top-3-wide-hidden": (4, 8, 3, 1100, 32, torch.float32, None),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FUSED_CASES)
def test_small_shapes_match_reference(device, case):
    t, e, k, h, i, dtype, ids = FUSED_CASES[case]
    args = make_case(t, e, k, h, i, dtype, device, ids=ids, row_pad=8 if case == "odd-sizes" else 0)
    assert_close(fused_moe(*args), reference_moe(*args), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_int32_ids_strided_rows_and_explicit_tiles(device):
    hidden, w13, w2, weights, ids = make_case(4, 8, 2, 64, 48, torch.float32, device, row_pad=16, seed=3)
    ref = reference_moe(hidden, w13, w2, weights, ids)
    assert_close(fused_moe(hidden, w13, w2, weights, ids.int()), ref, torch.float32)
    tiles = MoeTiles(32, DECODE_GATE_UP, DECODE_DOWN)  # a block height the batch rule would not pick here
    assert_close(fused_moe(hidden, w13, w2, weights, ids, tiles=tiles), ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_major", [False, True])
def test_wide_prefill_tiling_in_either_launch_order(device, n_major):
    """The bf16 wide prefill tiling (128-row blocks past a small case's pairs: mostly padding rows)
    gives the reference's output launched blocks-fastest or N-major."""
    args = make_case(40, 4, 2, 256, 136, torch.float32, device, seed=5)
    tiles = replace(PREFILL_WIDE[None], n_major=n_major)
    assert_close(fused_moe(*args, tiles=tiles), reference_moe(*args), torch.float32)


def test_n_major_launch_only_while_the_blocks_fit_the_grids_second_axis():
    from nanovllm.kernels.checks import MAX_GRID_YZ
    from nanovllm.moe.grouped_gemm import launch_n_major

    wide = PREFILL_WIDE[None]
    assert launch_n_major(wide, MAX_GRID_YZ) and not launch_n_major(wide, MAX_GRID_YZ + 1)
    assert not launch_n_major(replace(wide, n_major=False), 8)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 64, 256, 1000, 4096, 16384])
def test_qwen3_30b_shape_bf16(t):
    args = make_case(t, QWEN3_30B["E"], QWEN3_30B["K"], QWEN3_30B["H"], QWEN3_30B["I"], torch.bfloat16, "cuda", seed=t)
    out, ref = fused_moe(*args), reference_moe(*args)
    assert_close(out, ref, torch.bfloat16)
    assert (out.double() - ref).abs().mean() <= 1e-2 * ref.abs().mean()  # typical error: a few bf16 roundings


@pytest.mark.gpu
@pytest.mark.parametrize("t", [7, 64, 300])
def test_qwen3_30b_shape_fp32(t):
    args = make_case(t, QWEN3_30B["E"], QWEN3_30B["K"], QWEN3_30B["H"], QWEN3_30B["I"], torch.float32, "cuda", seed=t)
    assert_close(fused_moe(*args), reference_moe(*args), torch.float32)


@pytest.mark.gpu
def test_cuda_graph_replay_follows_new_routing():
    t, e, k, h, i = 64, QWEN3_30B["E"], QWEN3_30B["K"], QWEN3_30B["H"], QWEN3_30B["I"]
    hidden, w13, w2, weights, ids = make_case(t, e, k, h, i, torch.bfloat16, "cuda", seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        fused_moe(hidden, w13, w2, weights, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(hidden, w13, w2, weights, ids)
    for seed in (2, 3):
        g = torch.Generator().manual_seed(seed)
        ids.copy_(random_ids(t, e, k, g))
        hidden.copy_(torch.randn(t, h, generator=g))
        weights.copy_(torch.softmax(torch.randn(t, k, generator=g), dim=1))
        graph.replay()
        assert_close(out, reference_moe(hidden, w13, w2, weights, ids), torch.bfloat16)


def test_block_m_follows_pairs_per_expert():
    assert block_m_for(64 * 8, 128) == 16 and block_m_for(128 * 8, 128) == 16  # decode: 4-8 pairs per expert
    assert block_m_for(256 * 8, 128) == 32 and block_m_for(4096 * 8, 128) == BLOCK_MS[-1] == 64
    assert moe_tiles(1, 128).block_m == 16 and moe_tiles(4096 * 8, 128).gate_up != DECODE_GATE_UP


def test_no_tokens_give_empty_results():
    hidden, w13, w2, weights, ids = make_case(3, 4, 2, 32, 16, torch.float32, "cpu")
    out = fused_moe(hidden[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, 32) and out.dtype == torch.float32
    align = moe_align(ids[:0], 4, 16)
    assert align.sorted_pair_ids.numel() == 0 and int(align.num_used_blocks) == 0


def test_bad_arguments_are_named():
    hidden, w13, w2, weights, ids = make_case(3, 4, 2, 32, 16, torch.float32, "cpu")
    bad = {  # argument index -> (replacement, error, message fragment)
        "hidden int": (0, hidden.long(), TypeError, "hidden"),
        "hidden 3-D": (0, hidden[None], ValueError, "hidden"),
        "w13 dtype": (1, w13.double(), TypeError, "w13"),
        "w13 2-D": (1, w13[0], ValueError, "w13"),
        "w13 hidden size": (1, w13[:, :, :16], ValueError, "w13"),
        "w13 odd rows": (1, w13[:, :31], ValueError, "w13"),
        "w13 strided last dim": (1, w13.transpose(1, 2).contiguous().transpose(1, 2), ValueError, "w13"),
        "w2 shape": (2, w2[:, :, :8], ValueError, "w2"),
        "w2 dtype": (2, w2.half(), TypeError, "w2"),
        "weights dtype": (3, weights.double(), TypeError, "topk_weights"),
        "weights shape": (3, weights[:, :1], ValueError, "topk_weights"),
        "ids dtype": (4, ids.float(), TypeError, "topk_ids"),
        "ids 1-D": (4, ids[:, 0], ValueError, "topk_ids"),
        "ids rows": (4, ids[:2], ValueError, "topk_ids"),
        "ids strided": (4, ids.t().contiguous().t(), ValueError, "topk_ids"),
        "ids out of range": (4, ids + 4, ValueError, "topk_ids"),
        "w2 device": (2, w2.to("meta"), ValueError, "w2 is on meta"),
    }
    for name, (index, value, error, match) in bad.items():
        args = [hidden, w13, w2, weights, ids]
        args[index] = value
        with pytest.raises(error, match=match):
            fused_moe(*args)
    with pytest.raises(TypeError, match="tiles"):
        fused_moe(hidden, w13, w2, weights, ids, tiles=(16, 64))
    for block_m, error in ((8, ValueError), (24, ValueError), (16.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="block_m"):
            moe_align(ids, 4, block_m)
    for num_experts in (0, MAX_EXPERTS + 1, 4.0):
        with pytest.raises(ValueError, match="num_experts"):
            moe_align(ids, num_experts, 16)


def test_benchmark_without_cuda_exits_with_one_line():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kernels" / "bench_moe.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0], proc.stderr


def test_prefill_sweep_picks_the_tiling_that_wins_at_every_size_from_its_threshold():
    """moe_prefill_sweep.pick on made-up times (us; each T's first row the baseline): a tiling must beat
    the baseline by PICK_MARGIN at every T from its T0 on; of those the least mean ratio wins."""
    from benchmarks.kernels.moe_prefill_sweep import PICK_MARGIN, pick

    def row(mode, t, block_m, us, n_major=False):
        return dict(mode=mode, tokens=t, block_m=block_m, gate_up=(128, 64, 8, 3), down=(128, 64, 8, 3),
                    n_major=n_major, us=us)

    ts = (2048, 4096, 8192)
    rows = [row("a", t, 64, 100.0) for t in ts]  # the baselines
    rows += [row("a", t, 128, us) for t, us in zip(ts, (99.0, 90.0, 90.0))]  # wins from 4,096: ratio 0.90
    rows += [row("a", t, 64, 95.0, n_major=True) for t in ts]  # wins everywhere, by less: 0.95
    rows += [row("a", t, 128, us, n_major=True) for t, us in zip(ts, (80.0, 80.0, 100.0))]  # loses at the largest
    rows += [row("b", t, 64, 100.0) for t in ts] + [row("b", t, 128, 100.0 * (1 - PICK_MARGIN / 2)) for t in ts]
    picked = pick(rows)
    assert picked["a"] == ((128, (128, 64, 8, 3), (128, 64, 8, 3), False), 4096)
    assert picked["b"] is None  # within the margin everywhere: the baseline stays


@pytest.mark.interpreter
def test_bench_align_mode_parses_and_its_check_catches_a_wrong_alignment():
    """bench_moe_align.py (GPU only) on CPU: its defaults, and the check it runs before timing, on a right
    alignment and on one with a pair dropped."""
    from benchmarks.harness.moe_cases import E, K
    from benchmarks.kernels import bench_moe_align

    assert bench_moe_align.parse_args([]).tokens == list(bench_moe_align.TOKENS)
    ids = random_ids(5, E, K, torch.Generator().manual_seed(3))
    align = moe_align(ids, E, 16)
    bench_moe_align.check_alignment(align, ids, 16)
    align.sorted_pair_ids[align.sorted_pair_ids == 0] = ids.numel()  # pair 0 becomes padding
    with pytest.raises(SystemExit, match="wrong alignment"):
        bench_moe_align.check_alignment(align, ids, 16)


@pytest.mark.gpu
def test_bench_align_mode_times_every_block_height(tmp_path):
    import json

    from benchmarks.kernels import bench_moe_align

    out = tmp_path / "align.json"
    bench_moe_align.main(["--tokens", "1", "300", "--json", str(out)])
    _, *rows = json.loads(out.read_text())
    assert [(r["tokens"], r["block_m"]) for r in rows] == [(t, m) for t in (1, 300) for m in BLOCK_MS]
    assert all(r["us"] > 0 for r in rows) and sum(r["picked"] for r in rows) == 2


def test_tiles_depend_on_the_size_class_so_graph_replays_round_like_eager_steps():
    """A step replayed from a CUDA graph runs at a padded token count (decode: the graph batch
    size; prefill / mixed: the token bucket). fused_moe must choose every tile for the padded
    count exactly as for the step's own count, or the two would round differently."""
    from nanovllm.engine.cuda_graphs import graph_batch_sizes
    from nanovllm.layers.kernel_path import KernelRoutes
    from nanovllm.engine.varlen_graphs import token_buckets
    from nanovllm.moe.tiles import plan_tiles

    def padded(sizes, t):
        return next(s for s in sizes if s >= t)

    routes = KernelRoutes()
    limits = routes.linear_row_limits(fp8=True)  # an FP8 engine's sizes: the 16-bit ones and more
    decode, buckets = graph_batch_sizes(512, routes.gemv_max_rows, limits), token_buckets(16384, limits)
    for e, k, h, inter in ((128, 8, 2048, 768), (32, 8, 256, 128)):
        for t in range(1, 16385):
            sizes = [padded(buckets, t)] + ([padded(decode, t)] if t <= decode[-1] else [])
            for p in sizes:
                assert plan_tiles(t, k, e, h, inter, 132) == plan_tiles(p, k, e, h, inter, 132), (e, t, p)
    # and the choice still follows the batch: decode tiles at small counts, prefill tiles at large, the
    # wide N-major prefill tiles at the largest
    small, large = plan_tiles(8, 8, 128, 2048, 768, 132), plan_tiles(2048, 8, 128, 2048, 768, 132)
    wide = plan_tiles(4096, 8, 128, 2048, 768, 132)
    assert small[0].block_m == 16 and large[0].block_m == 64 and small[1] != large[1]
    assert wide[0] == PREFILL_WIDE[None] and large[0].n_major and not small[0].n_major
    # one token (8 pairs, 8 blocks of one pair) still launches >= MIN_PROGRAMS_PER_SM programs per SM
    from nanovllm.moe.tiles import MIN_PROGRAMS_PER_SM
    from nanovllm.moe.align import aligned_blocks

    tiles, gate_up, down = plan_tiles(1, 8, 128, 2048, 768, 132)
    used = aligned_blocks(8, 128, tiles.block_m)
    assert used * -(-768 // gate_up.block_n) >= MIN_PROGRAMS_PER_SM * 132
    assert used * -(-2048 // down.block_n) >= MIN_PROGRAMS_PER_SM * 132
