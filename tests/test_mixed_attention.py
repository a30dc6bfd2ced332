"""A mixed step's attention through the Triton kernels (CPU interpreter) against the plain-PyTorch path.

With our kernels, a step's leading decode rows go to the decode kernel (a row count on the
device) and its prefill chunks to the prefill kernel (a query-tile table), both writing one
output; the torch path treats every row as a varlen chunk. Both read the inputs the model
runner builds (StepInputBuilder), at the step's exact size and padded to a graph bucket.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nanovllm.engine.scheduled_batch import StepKind
from nanovllm.engine.step_inputs import StepInputBuilder, VarlenLayout
from nanovllm.engine.step_plan import StepPlan
from nanovllm.kernels import torch_attention
from nanovllm.kernels.decode_attention import flash_attn_with_kvcache
from nanovllm.kernels.prefill_attention import flash_attn_varlen_func
from nanovllm.kernels.prefill_plan import LONG_HEAD_DIM, LONG_KEYS, LONG_MIN_QUERIES, query_tile_rows
from nanovllm.layers.attention import Attention
from nanovllm.layers.attention_backend import AttentionBackend
from nanovllm.utils.context import attention_context

# Triton kernels on CPU tensors: these run where the interpreter is on (no CUDA; see conftest.py).
pytestmark = pytest.mark.interpreter

BS, HQ, HKV, D = 16, 4, 2, 32
NUM_BLOCKS, WIDTH = 24, 5
CPU = torch.device("cpu")
TRITON = AttentionBackend("triton", flash_attn_varlen_func, flash_attn_with_kvcache)
TORCH = AttentionBackend("torch", torch_attention.flash_attn_varlen_func, torch_attention.flash_attn_with_kvcache)


def mixed_plan(g: torch.Generator) -> StepPlan:
    """3 decode rows (contexts 21, 36, 8), a 20-token chunk after 16 cached tokens, a fresh 9-token prompt."""
    starts, lens = [20, 35, 7, 16, 0], [1, 1, 1, 20, 9]
    blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, used = [], 0
    for a, n in zip(starts, lens):
        need = -(-(a + n) // BS)
        tables.append(blocks[used : used + need])
        used += need
    ids = torch.randint(0, 100, (sum(lens),), generator=g).tolist()
    return StepPlan(StepKind.MIXED, starts, lens, ids, tables, sampled=[True, True, True, True, True], num_decode=3)


def attend(backend: AttentionBackend, inputs, q, k, v, caches) -> torch.Tensor:
    layer = Attention(D**-0.5)
    layer.k_cache, layer.v_cache, layer.backend = caches[0].clone(), caches[1].clone(), backend
    with attention_context(inputs.meta):
        return layer(q, k, v)


def step_case(plan: StepPlan, g: torch.Generator):
    """Random q, k, v for `plan`'s tokens, random K / V caches, and the torch path's output on them."""
    n = plan.num_tokens
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
    caches = [torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g) for _ in range(2)]
    plain = StepInputBuilder(BS, CPU, WIDTH)
    ref = attend(TORCH, plain.varlen(plan, plain.varlen_copy(plan, plain.exact_layout(plan)), None), q, k, v, caches)
    return (q, k, v), caches, ref


# A graph bucket: 64 tokens, 8 sequences; padding rows are never attended.
BUCKET, BUCKET_SEQS = 64, 8


def bucket_inputs(builder: StepInputBuilder, plan: StepPlan, with_decode_rows: bool):
    """`plan`'s inputs padded as the BUCKET's graph reads them."""
    layout = VarlenLayout(BUCKET, BUCKET_SEQS, builder.tile_capacity(BUCKET, BUCKET_SEQS), WIDTH)
    staging = torch.from_numpy(builder.varlen_array(plan, layout))
    return builder.varlen_inputs(staging, layout, BUCKET, WIDTH * BS, sum(plan.sampled),
                                 with_decode_rows=with_decode_rows)


def padded(qkv, g: torch.Generator) -> list[torch.Tensor]:
    """q, k, v with random rows up to BUCKET."""
    return [torch.cat([t, torch.randn(BUCKET - t.shape[0], *t.shape[1:], generator=g)]) for t in qkv]


def test_mixed_step_attention_kernels_match_torch_path():
    g = torch.Generator().manual_seed(0)
    plan = mixed_plan(g)
    qkv, caches, ref = step_case(plan, g)

    builder = StepInputBuilder(BS, CPU, WIDTH, query_tile_rows(D, torch.float32))
    exact = builder.varlen(plan, builder.varlen_copy(plan, builder.exact_layout(plan)), None)
    assert exact.meta.decode_rows is not None and int(exact.meta.decode_rows.num_rows) == 3
    out = attend(TRITON, exact, *qkv, caches)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)

    out = attend(TRITON, bucket_inputs(builder, plan, with_decode_rows=True), *padded(qkv, g), caches)
    torch.testing.assert_close(out[:plan.num_tokens], ref, rtol=1e-4, atol=1e-4)


def _no_decode_kernel(*args, **kwargs):
    raise AssertionError("a step without decode rows launched the decode kernel")


def _tiled_prefill(*args, **kwargs):
    """The prefill kernel, called with the step's query-tile table (the graphs' capturable launch)."""
    assert kwargs.get("tile_seq") is not None and kwargs.get("out") is not None, "prefill kernel called untiled"
    return flash_attn_varlen_func(*args, **kwargs)


def test_prefill_step_attention_launches_no_decode_kernel():
    """A step without decode rows (the prefill graphs' steps, engine/varlen_graphs.py) has no
    decode_rows metadata, eager or padded to a bucket: its attention is the prefill kernel's
    alone, over the step's query-tile table, and matches the torch path."""
    g = torch.Generator().manual_seed(1)
    mixed = mixed_plan(g)
    d = mixed.num_decode
    plan = StepPlan(StepKind.PREFILL, mixed.starts[d:], mixed.num_new_tokens[d:], mixed.token_ids[d:],
                    mixed.block_tables[d:], sampled=mixed.sampled[d:])
    qkv, caches, ref = step_case(plan, g)

    prefill_only = AttentionBackend("triton", _tiled_prefill, _no_decode_kernel)
    builder = StepInputBuilder(BS, CPU, WIDTH, query_tile_rows(D, torch.float32))
    exact = builder.varlen(plan, builder.varlen_copy(plan, builder.exact_layout(plan)), None)
    assert exact.meta.decode_rows is None and exact.meta.query_tiles is not None
    torch.testing.assert_close(attend(prefill_only, exact, *qkv, caches), ref, rtol=1e-4, atol=1e-4)

    inputs = bucket_inputs(builder, plan, with_decode_rows=False)
    assert inputs.meta.decode_rows is None
    out = attend(prefill_only, inputs, *padded(qkv, g), caches)
    torch.testing.assert_close(out[:plan.num_tokens], ref, rtol=1e-4, atol=1e-4)
    # the same step padded with decode rows allowed launches the decode kernel (no rows to attend)
    with pytest.raises(AssertionError, match="launched the decode kernel"):
        attend(prefill_only, bucket_inputs(builder, plan, with_decode_rows=True), *padded(qkv, g), caches)


def chunk_plan(num_decode: int, cached: int, rows: int, decode_context: int = 8) -> StepPlan:
    """num_decode decode rows (context decode_context), then one chunk of `rows` rows after `cached` keys."""
    starts = [decode_context - 1] * num_decode + [cached]
    lens = [1] * num_decode + [rows]
    tables = [list(range(-(-(a + n) // BS))) for a, n in zip(starts, lens)]
    return StepPlan(StepKind.MIXED if num_decode else StepKind.PREFILL, starts, lens, [0] * sum(lens), tables,
                    sampled=[True] * len(lens), num_decode=num_decode)


def test_long_context_steps_take_the_long_tile_table():
    """A step takes the long tile when its chunks hold LONG_MIN_QUERIES query rows and the longest
    attends to LONG_KEYS keys (decode rows count for neither): its layout says so, its table is built
    at the long tile's height and the attention metadata carries the flag; other steps, and a builder
    without long_tile_rows (another backend, an FP8 cache), keep the 64-row table."""
    rows, long_rows = (query_tile_rows(LONG_HEAD_DIM, torch.bfloat16, long) for long in (False, True))
    assert long_rows == 2 * rows
    width = -(-(LONG_KEYS + LONG_MIN_QUERIES) // BS)
    builder = StepInputBuilder(BS, CPU, width, rows, long_tile_rows=long_rows)
    cases = {
        (0, LONG_KEYS - LONG_MIN_QUERIES, LONG_MIN_QUERIES): True,  # a chunk at both edges
        (3, LONG_KEYS - LONG_MIN_QUERIES, LONG_MIN_QUERIES): True,  # with decode rows
        (0, LONG_KEYS - LONG_MIN_QUERIES - 1, LONG_MIN_QUERIES): False,  # one key short
        (0, LONG_KEYS, LONG_MIN_QUERIES - 1): False,  # one query row short
        (LONG_MIN_QUERIES, 0, 100): False,  # the decode rows' count and contexts do not count
    }
    for (num_decode, cached, chunk), expected in cases.items():
        context = LONG_KEYS if num_decode == LONG_MIN_QUERIES else 8
        plan = chunk_plan(num_decode, cached, chunk, context)
        layout = builder.exact_layout(plan)
        assert layout.long_tiles is builder.long_tiles(plan) is expected, (num_decode, cached, chunk)
        inputs = builder.varlen(plan, builder.varlen_copy(plan, layout), None)
        tiles = inputs.meta.query_tiles
        height = long_rows if expected else rows
        assert tiles.long is expected
        assert int(tiles.num_tiles) == -(-chunk // height)  # the chunk's tiles alone, at the table's height
        assert sorted(tiles.tile_block[: int(tiles.num_tiles)].tolist()) == list(range(-(-chunk // height)))
        assert set(tiles.tile_seq[: int(tiles.num_tiles)].tolist()) == {num_decode}
        assert not StepInputBuilder(BS, CPU, width, rows).long_tiles(plan)
    decode_rows = chunk_plan(4, 0, 1, LONG_KEYS)
    assert not builder.long_tiles(replace(decode_rows, num_decode=5))  # decode rows alone
