"""Decode rows sharing a prompt prefix (kernels/decode_groups.py): the host's grouping, and the decode
kernel reading a group's prefix once (Triton's interpreter on CPU, compiled on the GPU) against float64
attention over each row's own block table.
"""

import numpy as np
import pytest
import torch

from nanovllm.engine.scheduled_batch import StepKind
from nanovllm.engine.step_inputs import COL_MEMBERS, COL_SHARED, HostCopy, StepInputBuilder
from nanovllm.engine.step_plan import StepPlan
from nanovllm.kernels.decode_attention import flash_attn_with_kvcache
from nanovllm.kernels.decode_group_plan import GroupLimits, group_rows, max_group_rows
from nanovllm.kernels.decode_plan import heads_per_program
from nanovllm.utils.context import RowGroups

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
# bf16's own output rounding gives ~2-3e-3 relative error; fp32 (ieee dots) is far tighter.
TOL = {torch.float16: 2e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}


# ---------------------------------------------------------------- host: group_rows
def test_group_rows_by_hand():
    """Block size 4. Rows 0-3 share blocks [7, 8]; row 4 shares only block 7 with them; rows 5-6 share
    [9] but row 6's length leaves block 9 as its current block (not shared); rows 7-8 share [3]."""
    tables = np.array([[7, 8, 10, 0], [7, 8, 11, 0], [7, 8, 12, 0], [7, 8, 13, 0], [7, 14, 15, 0],
                       [9, 16, 0, 0], [9, 0, 0, 0], [3, 17, 0, 0], [3, 18, 0, 0]], dtype=np.int32)
    lens = np.array([9, 10, 12, 9, 11, 5, 4, 6, 8])
    members, shared = group_rows(tables, lens, 4, cap=8)
    assert members.tolist() == [4, 0, 0, 0, 1, 1, 1, 2, 0]
    assert shared.tolist() == [8, 0, 0, 0, 0, 0, 0, 4, 0]
    members, shared = group_rows(tables, lens, 4, cap=3)  # the cap splits the first run
    assert members.tolist() == [3, 0, 0, 2, 0, 1, 1, 2, 0]
    assert shared.tolist() == [8, 0, 0, 4, 0, 0, 0, 4, 0]
    members, shared = group_rows(tables, lens, 4, cap=1)
    assert members.tolist() == [1] * 9 and not shared.any()


def test_group_rows_keeps_each_groups_invariants():
    """Random tables with runs of shared leading blocks: every group's rows hold the leader's blocks for
    its shared keys, those keys lie before each member's current block, no group exceeds the cap, and
    every row is attended exactly once (led by itself or inside one group)."""
    rng = np.random.default_rng(3)
    bs, n = 4, 60
    tables = np.zeros((n, 8), dtype=np.int32)
    lens = rng.integers(1, 30, size=n)
    nxt = 100
    i = 0
    while i < n:  # runs of 1-6 rows share 0-3 blocks
        run, k = int(rng.integers(1, 7)), int(rng.integers(0, 4))
        prefix = list(range(nxt, nxt + k)); nxt += k
        for r in range(i, min(n, i + run)):
            lens[r] = max(lens[r], k * bs + 1)  # the shared blocks lie before its current token's
            own = (lens[r] + bs - 1) // bs
            tables[r, :own] = prefix + list(range(nxt, nxt + own - k)); nxt += own - k
        i += run
    for cap in (2, 5, 8):
        members, shared = group_rows(tables, lens, bs, cap)
        covered = np.zeros(n, dtype=int)
        for b in np.flatnonzero(members):
            k, s = int(members[b]), int(shared[b])
            assert 1 <= k <= cap and s % bs == 0 and (k > 1 or s == 0)
            covered[b : b + k] += 1
            for r in range(b, b + k):
                assert (tables[r, : s // bs] == tables[b, : s // bs]).all()
                assert s <= (lens[r] - 1) // bs * bs
        assert (covered == 1).all()
        assert (members > 1).any()


def test_group_cap_and_max_rows():
    assert [max_group_rows(g) for g in (1, 2, 4, 7, 8, 16, 32)] == [16, 8, 4, 2, 2, 1, 1]
    # 512 rows x 8 kv heads on 132 SMs: the tile's 8; 128 rows: 1024 / 396 programs -> 2; 32 rows: none
    limits = GroupLimits(gqa_group=2, num_kv_heads=8, sm_count=132)
    assert limits.cap(512) == 8 and limits.cap(128) == 2 and limits.cap(32) == 1
    with pytest.raises(ValueError, match="num_kv_heads must be an int >= 1, got 0"):
        GroupLimits(gqa_group=2, num_kv_heads=0, sm_count=132)
    # an FP8 cache's narrow heads, two a program (heads_per_program): a tile's rows over 2 x the group, half
    # the programs. Qwen2.5-0.5B (7 / 1 of 64 at 2 kv heads): 14 rows of 16, one member a tile
    assert [heads_per_program(True, 64, h) for h in (1, 2, 3, 8)] == [1, 2, 1, 2]
    assert heads_per_program(True, 32, 8) == 4 and heads_per_program(True, 128, 8) == 1
    assert heads_per_program(False, 64, 8) == 1
    packed = GroupLimits(gqa_group=2, num_kv_heads=8, sm_count=132, heads_per_program=2)
    assert packed.cap(512) == 4 and packed.cap(256) == 2
    assert GroupLimits(gqa_group=7, num_kv_heads=2, sm_count=132, heads_per_program=2).cap(512) == 1
    with pytest.raises(ValueError, match="heads_per_program must be an int >= 1, got 0"):
        GroupLimits(gqa_group=2, num_kv_heads=8, sm_count=132, heads_per_program=0)


def test_decode_inputs_carry_the_groups():
    """The engine's decode step packs each row's group beside its table (StepInputBuilder.decode_rows),
    as group_rows gives them at the step's cap, and hands them to attention; without limits (any other
    backend than ours) the columns stay 0 and the metadata has no groups. Samples 0-2 of one prompt
    (blocks [5, 6] shared, each its own third block), then a row on its own."""
    tables = [[5, 6, 7], [5, 6, 8], [5, 6, 9], [10, 11]]
    starts = [9, 9, 10, 5]  # positions of the new tokens: lengths 10, 10, 11, 6 at block size 4
    plan = StepPlan(StepKind.DECODE, starts=starts, num_new_tokens=[1] * 4, token_ids=[1, 2, 3, 4],
                    block_tables=tables, sampled=[True] * 4, num_decode=4)
    limits = GroupLimits(gqa_group=2, num_kv_heads=2, sm_count=1)  # 4 rows x 2 heads / 3 per SM: cap 2
    for given, members, shared in ((limits, [2, 0, 1, 1], [8, 0, 0, 0]), (None, None, None)):
        builder = StepInputBuilder(4, torch.device("cpu"), decode_table_width=4, group_limits=given)
        rows = builder.decode_rows(plan, 5)  # a padding row past the batch
        inputs = builder.decode(plan, HostCopy.of(rows[:4], None), None)
        if given is None:
            assert inputs.meta.decode_groups is None and not rows[:, COL_MEMBERS:COL_SHARED + 1].any()
            continue
        assert rows[:, COL_MEMBERS].tolist() == members + [1] and rows[:, COL_SHARED].tolist() == shared + [0]
        assert inputs.meta.decode_groups.members.tolist() == members
        assert inputs.meta.decode_groups.shared.tolist() == shared
    assert limits.cap(4) == 2


# ---------------------------------------------------------------- kernel
def shared_paged(prompts, gens, samples, block_size, hkv, d, dtype, gen):
    """Caches and a block table for len(prompts) x samples rows: a prompt's full blocks are shared by its
    samples, every other block is a row's own. Returns (k_cache, v_cache, table, lens)."""
    rows, lens, nxt = [], [], 0
    for p, g in zip(prompts, gens):
        full = p // block_size
        prompt_blocks = list(range(nxt, nxt + full)); nxt += full
        for s in range(samples):
            n = p + g + s  # samples at different lengths too
            own = -(-n // block_size) - full
            rows.append(prompt_blocks + list(range(nxt, nxt + own))); nxt += own
            lens.append(n)
    perm = torch.randperm(nxt + 2, generator=gen)
    table = torch.zeros((len(rows), max(map(len, rows)) + 1), dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = perm[r].int()
    k_cache = torch.randn((nxt + 2, block_size, hkv, d), generator=gen).to(dtype)
    v_cache = torch.randn((nxt + 2, block_size, hkv, d), generator=gen).to(dtype)
    return k_cache, v_cache, table, lens


def reference(q, k_cache, v_cache, table, lens, scale):
    """float64 attention of each row's query over its own block table's keys: [batch, 1, Hq, D]."""
    out = []
    for i, n in enumerate(lens):
        t = torch.arange(n)
        k = k_cache[table[i].long()[t // k_cache.shape[1]], t % k_cache.shape[1]].double()
        v = v_cache[table[i].long()[t // v_cache.shape[1]], t % v_cache.shape[1]].double()
        rep = q.shape[2] // k.shape[1]
        s = torch.einsum("hd,khd->hk", q[i, 0].double(), k.repeat_interleave(rep, 1)) * scale
        out.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), v.repeat_interleave(rep, 1)))
    return torch.stack(out)[:, None]


def grouped(table, lens, block_size, cap):
    members, shared = group_rows(table.numpy(), np.asarray(lens), block_size, cap)
    return RowGroups(torch.from_numpy(members).to(DEV), torch.from_numpy(shared).to(DEV))


@pytest.mark.interpreter
@pytest.mark.parametrize("block_size,d,hq,hkv,dtype,fp8", [
    (16, 64, 4, 2, torch.bfloat16, False), (64, 64, 8, 2, torch.float16, False), (32, 64, 4, 1, torch.float32, False),
    (16, 64, 14, 2, torch.bfloat16, False),  # a group of 7 heads: two rows fill 14 of the tile's 16
    (16, 64, 4, 2, torch.bfloat16, True), (16, 64, 14, 2, torch.bfloat16, True)])  # over FP8 caches
def test_decode_groups_interpreter(block_size, d, hq, hkv, dtype, fp8):
    """Groups of up to the tile's rows (and a capped split of them), prompts shorter than a block
    (nothing shared), samples at different lengths: each row's float64 attention over its own table
    (of the dequantized cache, for an FP8 one), and the ungrouped call's output within rounding. Rows
    another row leads are written too."""
    gen = torch.Generator().manual_seed(block_size + hq)
    k_cache, v_cache, table, lens = shared_paged([70, 10, 130], [1, 5, 3], 3, block_size, hkv, d, dtype, gen)
    q = torch.randn((len(lens), 1, hq, d), generator=gen).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    scales = {}
    if fp8:
        scales = {"k_scale": torch.tensor([0.01]), "v_scale": torch.tensor([0.02])}
        k_cache = (k_cache.float() / 0.01).clamp(-448, 448).to(FP8)
        v_cache = (v_cache.float() / 0.02).clamp(-448, 448).to(FP8)
        ref = reference(q, k_cache.double() * 0.01, v_cache.double() * 0.02, table, lens, 0.3)
    else:
        ref = reference(q, k_cache, v_cache, table, lens, 0.3)
    for cap in (max_group_rows(hq // hkv), 2):
        groups = grouped(table, lens, block_size, cap)
        assert (groups.members > 1).any()
        out = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, softmax_scale=0.3, num_splits=1,
                                      out=torch.full_like(q, float("nan")), groups=groups, **scales)
        assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[dtype]
    plain = flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, softmax_scale=0.3, num_splits=1, **scales)
    assert ((plain.double() - out.double()).norm() / ref.norm()).item() < TOL[dtype]


@pytest.mark.interpreter
@pytest.mark.parametrize("hq,hkv,fp8", [(4, 2, False), (14, 2, True)])
def test_a_group_larger_than_the_tile_takes_several_passes(hq, hkv, fp8):
    """Ten samples of one prompt given as one group, more members than a program's tile holds (8 at a
    GQA group of 2; 1 where an FP8 cache's two heads of 64 share a program, 14 query heads of 16 rows):
    each row's float64 attention, every row written."""
    gen = torch.Generator().manual_seed(hq)
    k_cache, v_cache, table, lens = shared_paged([40], [3], 10, 16, hkv, 64, torch.bfloat16, gen)
    q = torch.randn((len(lens), 1, hq, 64), generator=gen).to(torch.bfloat16)
    scales = {}
    ref = reference(q, k_cache, v_cache, table, lens, 0.2)
    if fp8:
        scales = {"k_scale": torch.tensor([0.01]), "v_scale": torch.tensor([0.02])}
        k_cache = (k_cache.float() / 0.01).to(FP8)
        v_cache = (v_cache.float() / 0.02).to(FP8)
        ref = reference(q, k_cache.double() * 0.01, v_cache.double() * 0.02, table, lens, 0.2)
    groups = grouped(table, lens, 16, 10)
    assert groups.members[0] == 10
    out = flash_attn_with_kvcache(q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), table,
                                  softmax_scale=0.2, num_splits=1, out=torch.full_like(q, float("nan")),
                                  groups=groups, **scales)
    assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[torch.bfloat16]


@pytest.mark.interpreter
def test_decode_groups_padding_rows_give_zero():
    """A CUDA graph's padding rows (length 0, each on its own: StepInputBuilder.decode_rows) are written
    as 0, as without groups; a group before them is unaffected."""
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, table, lens = shared_paged([40], [1], 2, 16, 2, 64, torch.float32, gen)
    table = torch.cat([table, torch.zeros_like(table[:2])])
    q = torch.randn((4, 1, 4, 64), generator=gen)
    groups = RowGroups(torch.tensor([2, 0, 1, 1], dtype=torch.int32), torch.tensor([32, 0, 0, 0], dtype=torch.int32))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, torch.tensor(lens + [0, 0], dtype=torch.int32), table,
                                  num_splits=1, out=torch.full_like(q, float("nan")), groups=groups)
    assert (out[2:] == 0).all()
    ref = reference(q[:2], k_cache, v_cache, table, lens, 64 ** -0.5)
    assert ((out[:2].double() - ref).norm() / ref.norm()).item() < TOL[torch.float32]


@pytest.mark.interpreter
def test_decode_groups_fp8_cache_and_split_calls():
    """An FP8 cache (scales folded as ungrouped), and a split call given groups: it attends each row by
    itself, so rows another leads are still computed."""
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache, table, lens = shared_paged([40, 33], [2, 1], 4, 16, 2, 64, torch.float32, gen)
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([1.5])
    k8 = (k_cache * 30 / k_scale).clamp(-448, 448).to(FP8)
    v8 = (v_cache * 30 / v_scale).clamp(-448, 448).to(FP8)
    q = torch.randn((len(lens), 1, 4, 64), generator=gen).to(torch.bfloat16)
    ref = reference(q, k8.double() * 0.02, v8.double() * 1.5, table, lens, 0.1)
    groups = grouped(table, lens, 16, 8)
    assert groups.members.tolist()[:5] == [4, 0, 0, 0, 4]
    for splits in (1, 3):
        out = flash_attn_with_kvcache(q, k8, v8, torch.tensor(lens, dtype=torch.int32), table, softmax_scale=0.1,
                                      num_splits=splits, k_scale=k_scale, v_scale=v_scale, groups=groups)
        assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[torch.bfloat16]


def test_decode_groups_bad_inputs():
    q = torch.zeros((2, 1, 4, 64))
    cache = torch.zeros((4, 16, 2, 64))
    table = torch.zeros((2, 2), dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    ok = torch.ones(2, dtype=torch.int32)
    with pytest.raises(TypeError, match="RowGroups"):
        flash_attn_with_kvcache(q, cache, cache, lens, table, groups=(ok, ok))
    with pytest.raises(ValueError, match="groups.members"):
        flash_attn_with_kvcache(q, cache, cache, lens, table, groups=RowGroups(ok[:1], ok))
    with pytest.raises(TypeError, match="groups.shared"):
        flash_attn_with_kvcache(q, cache, cache, lens, table, groups=RowGroups(ok, ok.long()))
    with pytest.raises(ValueError, match="num_seqs"):
        flash_attn_with_kvcache(q, cache, cache, lens, table, groups=RowGroups(ok, ok),
                                num_seqs=torch.ones(1, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("block_size,hq,dtype", [(256, 16, torch.bfloat16), (16, 32, torch.bfloat16),
                                                 (256, 16, torch.float16)])
@pytest.mark.parametrize("fp8", [False, True])
def test_decode_groups_gpu(block_size, hq, dtype, fp8):
    """Compiled, at Qwen3's geometry (8 kv heads, head_dim 128; GQA 2 and 4): 40 prompts of 100-1,000
    tokens x 8 samples, groups as the engine forms them at 320 rows, against float64 per row."""
    gen = torch.Generator().manual_seed(block_size + hq)
    prompts = torch.randint(100, 1000, (40,), generator=gen).tolist()
    gens = torch.randint(1, 300, (40,), generator=gen).tolist()
    k_cache, v_cache, table, lens = shared_paged(prompts, gens, 8, block_size, 8, 128, dtype, gen)
    q = torch.randn((len(lens), 1, hq, 128), generator=gen).to(dtype)
    scales = {}
    if fp8:
        scales = {"k_scale": torch.tensor([0.01], device=DEV), "v_scale": torch.tensor([0.02], device=DEV)}
        k_cache = (k_cache.float() / 0.01).clamp(-448, 448).to(FP8)
        v_cache = (v_cache.float() / 0.02).clamp(-448, 448).to(FP8)
        ref = reference(q, k_cache.double() * 0.01, v_cache.double() * 0.02, table, lens, 0.125)
    else:
        ref = reference(q, k_cache, v_cache, table, lens, 0.125)
    cap = GroupLimits(hq // 8, 8, torch.cuda.get_device_properties(0).multi_processor_count).cap(len(lens))
    groups = grouped(table, lens, block_size, cap)
    assert groups.members.max() == cap > 1 and (groups.members == cap).sum() >= 20
    out = flash_attn_with_kvcache(q.to(DEV), k_cache.to(DEV), v_cache.to(DEV), torch.tensor(lens, device=DEV,
                                  dtype=torch.int32), table.to(DEV), softmax_scale=0.125, num_splits=1,
                                  out=torch.full_like(q, float("nan"), device=DEV), groups=groups, **scales)
    assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < TOL[dtype]
