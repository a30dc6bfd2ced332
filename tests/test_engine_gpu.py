"""The engine on a CUDA device in bf16, against transformers on the same GPU: Qwen3, and each
other family (Llama 3 with llama3 RoPE scaling, Qwen2 with q/k/v biases)."""

from __future__ import annotations

import gc
import json
import shutil
from dataclasses import replace

import pytest
import torch

from checkpoints import (
    GPU_KV_TOKENS, GPU_MAX_NUM_SEQS, GPU_MAX_STEP_TOKENS, GPU_SHAPE, LlamaShape, Qwen2Shape, TinyShape,
    assert_bf16_greedy_matches, build_checkpoint, build_shaped_checkpoint, check_gpu_regimes, checkpoint_fixture,
    gpu_generate, gpu_reference_fixture, make_prompts,
)
from nanovllm import LLM, SamplingParams
from nanovllm.engine.scheduled_batch import StepKind
from nanovllm.kernels.prefill_plan import query_tile_rows, takes_long_tiles

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# Engines get checkpoints.gpu_generate's test-sized KV cache and graph sets; only the tests of
# memory sizing itself keep gpu_memory_utilization's cache.


ckpt = checkpoint_fixture("gpu", GPU_SHAPE)
reference = gpu_reference_fixture()


def generate(ckpt, ps, params=GREEDY, **kw):
    """Token ids of each prompt, and facts about the engine read before it exits."""
    outs, facts = gpu_generate(ckpt, [ps], params, **kw)
    return outs[0], facts


def test_bf16_greedy_matches_transformers(ckpt, reference):
    ps = make_prompts(0, 8, 1, 300)
    outs, facts = generate(ckpt, ps)
    assert facts["backend"] in ("triton", "flash_attn")
    for p, o in zip(ps, outs):
        assert_bf16_greedy_matches(reference, p, o)


@pytest.mark.parametrize("block_size", [16, 256])
def test_scheduling_regimes_match_transformers(ckpt, reference, block_size):
    shared = list(range(100, 372))  # more than one block even at block size 256
    ps = [shared + p for p in make_prompts(1, 6, 1, 80)] + make_prompts(2, 6, 50, 400)
    regimes = {
        "plain": {"enable_prefix_caching": False},
        "prefix-cache": {},
        "chunked": {"max_num_batched_tokens": 64},
        "preempt": {"num_kvcache_blocks": -(-(400 + 32) // block_size) + 1},
    }
    check_gpu_regimes(ckpt, reference, ps, GREEDY, regimes, kvcache_block_size=block_size)


def test_cuda_graph_and_eager_decode_identical(ckpt):
    """At a captured batch size the graph runs the same kernels on the same shapes as eager
    (batches 1 and 2 with the Triton GEMV projections, the others with cuBLAS): batches of
    1, 2, 8, 16 and 48 requests, one after another on one engine of each kind."""
    batches = [make_prompts(3, batch, 20, 200) for batch in (1, 2, 8, 16, 48)]
    graph, facts = gpu_generate(ckpt, batches, GREEDY)
    assert facts["graphs"]
    eager, facts = gpu_generate(ckpt, batches, GREEDY, enforce_eager=True)
    assert not facts["graphs"]
    assert graph == eager


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_small_batch_graph_replay_matches_transformers(ckpt, reference, batch):
    """Batches 1 and 2 replay their own graphs (projections through the Triton GEMV); batch 3
    replays the 8-row graph with padding rows. Tokens must be argmaxes of transformers' logits."""
    ps = make_prompts(4, batch, 20, 200)
    outs, facts = generate(ckpt, ps)
    assert facts["graphs"]
    for p, o in zip(ps, outs):
        assert_bf16_greedy_matches(reference, p, o)


def test_reaching_max_model_len_under_graphs(ckpt, reference):
    llm = LLM(ckpt, kvcache_block_size=16, max_model_len=100, dtype="bfloat16", num_kvcache_blocks=32, max_num_seqs=8)
    ps = [[5] * 90, [6] * 40, [7] * 99 ]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True), use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [10, 60, 1]
    assert all(o["finish_reason"] == "length" for o in outs)
    assert llm.model_runner.graphs.block_tables.shape[1] * 16 >= 100
    llm.exit()
    assert llm.model_runner.graphs is None and llm.model_runner.kv_cache is None
    for p, o in zip(ps, outs):
        assert_bf16_greedy_matches(reference, p, o["token_ids"])


def test_auto_dtype_runs_a_float32_checkpoint_in_bfloat16(ckpt):
    """vLLM's rule for dtype="auto" on CUDA: a float32 checkpoint (the test checkpoints are saved
    so) runs in bfloat16, the tokens those of dtype="bfloat16"; dtype="float32" keeps it."""
    with open(f"{ckpt}/config.json") as f:
        stored = json.load(f)
    assert (stored.get("dtype") or stored.get("torch_dtype")) == "float32"
    ps = make_prompts(3, 4, 20, 60)
    auto, auto_facts = generate(ckpt, ps, dtype="auto")
    bf16, bf16_facts = generate(ckpt, ps)
    assert (auto_facts["dtype"], bf16_facts["dtype"]) == (torch.bfloat16, torch.bfloat16)
    assert auto == bf16
    _, fp32_facts = generate(ckpt, ps[:1], GREEDY, dtype="float32", enforce_eager=True)
    assert fp32_facts["dtype"] == torch.float32


@pytest.mark.parametrize("stored", ["float64", "float8_e4m3fn"])
def test_auto_dtype_runs_a_checkpoint_of_another_dtype_in_bfloat16(ckpt, tmp_path, stored):
    """A config.json dtype neither 16-bit float nor float32 (a float64 save; float8_e4m3fn, which FP8
    checkpoints may write) is served, as vLLM serves it: dtype="auto" on CUDA falls back to its platform's
    dtype, bfloat16 here, the tokens those of dtype="bfloat16". It was refused ("unsupported dtype")."""
    path = tmp_path / stored
    shutil.copytree(ckpt, path)
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = stored
    (path / "config.json").write_text(json.dumps(config))
    ps = make_prompts(3, 2, 20, 60)
    auto, auto_facts = generate(str(path), ps, dtype="auto", enforce_eager=True)
    bf16, _ = generate(ckpt, ps, enforce_eager=True)
    assert auto_facts["dtype"] == torch.bfloat16
    assert auto == bf16


def test_seeded_sampling_reproducible_on_gpu(ckpt):
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    a, _ = generate(ckpt, [[1, 2, 3]], sp)
    b, _ = generate(ckpt, [[4, 4, 4, 4], [1, 2, 3]], [SamplingParams(max_tokens=5), sp])
    assert a[0] == b[1]


def test_kv_cache_sized_from_own_peak(ckpt):
    llm = LLM(ckpt, kvcache_block_size=256, max_model_len=2048, gpu_memory_utilization=0.5, max_num_seqs=8)
    total = torch.cuda.get_device_properties(0).total_memory
    cache_bytes = llm.model_runner.kv_cache.numel() * llm.model_runner.kv_cache.element_size()
    assert 0.3 * total < cache_bytes < 0.5 * total
    llm.exit()
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(ckpt, kvcache_block_size=256, gpu_memory_utilization=0.0001, max_num_seqs=8)


def test_exit_returns_gpu_memory_for_the_next_engine(tmp_path):
    """The failure seen on the H200 (2026-12-01) running tests/test_engine.py on CUDA was a test
    keeping one engine alive while it built a second one (each takes most of the card). exit()
    itself gives the memory back; a second engine beside a live one gets an error that says so."""
    path = build_checkpoint(str(tmp_path / "fp32"), TinyShape())
    baseline = torch.cuda.memory_allocated()
    # a small step budget: prefill graphs for 64 tokens, not for the default 16,384 (the test is
    # about memory, not graphs; the default cost ~15 s on the H200)
    # 256-token blocks: the card holds ~16x fewer of them than of 16-token ones (at 16, building the
    # block table took most of this test's 25 s on the H200)
    llm = LLM(path, kvcache_block_size=256, max_model_len=40, max_num_seqs=8, max_num_batched_tokens=64)
    outs = llm.generate([[3] * 30, [4] * 5], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [10, 35]
    # The first engine took 90% of the card: a second one allowed 50% has no room at all.
    with pytest.raises(ValueError, match="already allocated in this process.*exit"):
        LLM(path, kvcache_block_size=256, max_model_len=512, gpu_memory_utilization=0.5, max_num_seqs=8)
    llm.exit()
    assert torch.cuda.memory_allocated() - baseline < 2**30
    second = LLM(path, kvcache_block_size=256, max_model_len=512, max_num_batched_tokens=32, max_num_seqs=8)
    assert second.num_kvcache_blocks > 1000
    second.exit()


def test_a_dropped_engine_returns_gpu_memory(tmp_path):
    """vLLM users free an engine by dropping it (`del llm; gc.collect()`), not by exit(): its
    weights, cache and graphs go back to the card all the same."""
    path = build_checkpoint(str(tmp_path / "fp32"), TinyShape())
    baseline = torch.cuda.memory_allocated()
    llm = LLM(path, kvcache_block_size=256, max_model_len=40, max_num_seqs=8, max_num_batched_tokens=64)
    assert llm.generate([[3] * 30], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].token_ids
    assert torch.cuda.memory_allocated() - baseline > 2**33  # most of the card: the KV cache
    del llm
    gc.collect()
    assert torch.cuda.memory_allocated() - baseline < 2**30


def test_samples_of_a_prompt_decode_as_groups(ckpt, reference):
    """n = 8 greedy samples of 50 prompts: 400 decode rows, in groups (of 8 on a 132-SM card) reading their
    prompt's shared blocks once (kernels/decode_groups.py). Every sample of a prompt is the same and transformers' argmax,
    under graphs and eager alike."""
    ps = make_prompts(12, 50, 40, 150)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, n=8)
    for eager in (False, True):
        llm = LLM(ckpt, kvcache_block_size=16, max_model_len=256, dtype="bfloat16", max_num_seqs=400,
                  num_kvcache_blocks=6000, max_num_batched_tokens=GPU_MAX_STEP_TOKENS, enforce_eager=eager)
        try:
            assert llm.model_runner.inputs.group_limits.cap(400) > 1  # groups form at this batch on any card
            outs = llm.generate(ps, params, use_tqdm=False)
        finally:
            llm.exit()
        for p, o in zip(ps, outs):
            samples = [c.token_ids for c in o.outputs]
            assert len(samples) == 8 and all(s == samples[0] for s in samples)
            assert_bf16_greedy_matches(reference, p, samples[0])


def test_mixed_steps_under_graphs_match_transformers(ckpt, reference):
    """Requests arrive while others decode: mixed steps (decode rows + prefill chunks) replay
    the token-bucket graphs, chunked by a small budget; eager gives transformers' tokens too."""
    ps = make_prompts(6, 20, 5, 600)
    for eager in (False, True):
        llm = LLM(ckpt, kvcache_block_size=16, max_model_len=2048, dtype="bfloat16", num_kvcache_blocks=1024,
                  max_num_seqs=16, max_num_batched_tokens=512, enforce_eager=eager)
        assert (llm.model_runner.varlen_graphs is None) == eager
        ids, outs, kinds = {}, {}, set()
        for i, p in enumerate(ps):
            ids[llm.add_request(p, GREEDY)] = i
            if i % 3 == 2:  # a few steps between arrivals
                for _ in range(2):
                    result = llm.step()
                    kinds.add(result.kind)
                    outs.update({ids[o.request_id]: o.token_ids for o in result.finished})
        while not llm.is_finished():
            result = llm.step()
            kinds.add(result.kind)
            outs.update({ids[o.request_id]: o.token_ids for o in result.finished})
        llm.exit()
        assert StepKind.MIXED in kinds
        for i, p in enumerate(ps):
            assert len(outs[i]) == GREEDY.max_tokens
            assert_bf16_greedy_matches(reference, p, outs[i])


def test_prefill_graph_buckets_at_their_edges(ckpt, reference):
    """A step of exactly a bucket's size, and one token more (the next bucket, padded)."""
    llm = LLM(ckpt, kvcache_block_size=16, max_model_len=2048, dtype="bfloat16", num_kvcache_blocks=256,
              max_num_seqs=8, max_num_batched_tokens=1024, enable_prefix_caching=False)
    buckets = llm.model_runner.varlen_graphs.buckets
    assert 16 in buckets and 256 in buckets and buckets[-1] == 1024
    # each bucket: a graph for mixed steps and one for steps without decode rows (these steps')
    assert set(llm.model_runner.varlen_graphs.graphs) == {(t, mixed) for t in buckets for mixed in (True, False)}
    g = torch.Generator().manual_seed(8)
    for n in (15, 16, 17, 255, 256, 257, 1024):
        p = torch.randint(1, 384, (n,), generator=g).tolist()
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
        assert_bf16_greedy_matches(reference, p, out["token_ids"])
    llm.exit()


def test_long_prompts_take_the_long_prefill_tile(tmp_path_factory):
    """Prompts long enough for the long-context tile (kernels/prefill_plan.takes_long_tiles) give
    transformers' greedy tokens, with the prefill graphs on (such steps run eagerly) and off: one of
    7,000 tokens in one step, one of 12,000 in two chunks (8,192 rows over 8,192 keys, then 3,808 over
    12,000), and a short one after them (the 64-row tile again)."""
    from transformers import AutoModelForCausalLM

    path = build_shaped_checkpoint(str(tmp_path_factory.mktemp("gpu-long")),
                                   replace(GPU_SHAPE, max_position_embeddings=16384))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    reference = reference.cuda().eval()
    g = torch.Generator().manual_seed(10)
    ps = [torch.randint(1, 384, (n,), generator=g).tolist() for n in (7000, 12000, 300)]
    assert takes_long_tiles(7000, 7000) and takes_long_tiles(3808, 12000) and not takes_long_tiles(300, 300)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for eager in (False, True):
        llm = LLM(path, kvcache_block_size=256, max_model_len=12288, dtype="bfloat16", num_kvcache_blocks=64,
                  max_num_seqs=8, max_num_batched_tokens=8192, enforce_eager=eager)
        assert llm.model_runner.inputs.long_tile_rows == query_tile_rows(GPU_SHAPE.head_dim, torch.bfloat16, long=True)
        assert (llm.model_runner.varlen_graphs is None) == eager
        outs = [llm.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in ps]
        llm.exit()
        for p, o in zip(ps, outs):
            assert_bf16_greedy_matches(reference, p, o)


def unit_score_init(hidden: int) -> float:
    """initializer_range that gives attention scores of std about 1 without a q/k norm."""
    return hidden**-0.5


# The other families at small widths: tied and untied heads, head_dim 64 and 128 (derived from
# hidden / heads in one), GQA groups 4, 4, 2 and 7. Llama's llama3 RoPE has an original context
# of 256 tokens, below most prompts here. Without Qwen3's q/k norm, attention scores have std
# about initializer_range^2 * hidden: at the CPU tests' 0.2 that is 10-20, softmax is nearly
# one-hot and bf16 rounding (ours or transformers') flips which key wins (a CPU bf16 run of these
# shapes: 6-10% of the logit range off transformers' argmax); unit_score_init makes it about 1.
FAMILY_SHAPES = {
    "llama3-tied-hd64": LlamaShape(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=512, max_position_embeddings=4096, original_max_position_embeddings=256,
        initializer_range=unit_score_init(256)),
    "llama3-untied-hd128-derived": LlamaShape(
        hidden_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=None,
        intermediate_size=1024, tie_word_embeddings=False, max_position_embeddings=4096,
        original_max_position_embeddings=256, initializer_range=unit_score_init(512)),
    "qwen2-tied-hd128": Qwen2Shape(
        hidden_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1024,
        max_position_embeddings=4096, initializer_range=unit_score_init(512)),
    # Qwen2.5-0.5B's attention geometry (14 q heads, 2 kv heads, head_dim 64), untied
    "qwen2-untied-hd64-group7": Qwen2Shape(
        hidden_size=896, num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2, intermediate_size=1024,
        tie_word_embeddings=False, max_position_embeddings=4096, initializer_range=unit_score_init(896)),
}


@pytest.fixture(scope="module", params=list(FAMILY_SHAPES))
def family(request, tmp_path_factory):
    """(checkpoint path, transformers' bf16 model of it on CUDA)."""
    from transformers import AutoModelForCausalLM

    path = build_shaped_checkpoint(str(tmp_path_factory.mktemp(request.param)), FAMILY_SHAPES[request.param])
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    return path, reference.cuda().eval()


def test_family_bf16_greedy_matches_transformers_with_and_without_graphs(family):
    """Every family on the GPU path (fused RMSNorm, RoPE + KV write without the q/k norm, SiLU,
    GEMV with biases at 1-2 rows, our attention kernels): tokens are within tolerance of
    transformers' argmax with CUDA graphs and without, and identical between the two at
    captured batch sizes (1 and 2: GEMV graphs; 8: cuBLAS)."""
    path, reference = family
    for batch, seed in ((8, 9), (2, 10), (1, 11)):
        ps = make_prompts(seed, batch, 1, 600)
        graph, facts = generate(path, ps)
        assert facts["graphs"] and facts["backend"] in ("triton", "flash_attn")
        eager, facts = generate(path, ps, enforce_eager=True)
        assert not facts["graphs"]
        assert graph == eager
        for p, o in zip(ps, graph):
            assert_bf16_greedy_matches(reference, p, o)


def test_family_scheduling_regimes_match_transformers(family):
    """Prefix cache, chunked prefill and preemption on the GPU path of every family."""
    path, reference = family
    shared = list(range(100, 372))
    ps = [shared + p for p in make_prompts(12, 4, 1, 80)] + make_prompts(13, 4, 50, 400)
    check_gpu_regimes(path, reference, ps, GREEDY, {"prefix-cache": {}, "chunked": {"max_num_batched_tokens": 64},
                                                    "preempt": {"num_kvcache_blocks": -(-(400 + 32) // 16) + 1}})


def test_sampled_lists_only_kept_tokens_under_overlap_and_graphs(ckpt):
    """Overlap scheduling with CUDA graphs: a request ended by a stop token at step k was queued for
    step k + 1 already; that step's token is dropped and the request is not in its `sampled`. So
    each request is listed once per token it returns, never after the step that returned it."""
    ps = make_prompts(14, 8, 20, 200)
    free, _ = generate(ckpt, ps)
    # stop tokens the requests really produce, at different steps
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[out[3 + 3 * i]])
              for i, out in enumerate(free)]
    llm = LLM(ckpt, kvcache_block_size=16, max_model_len=2048, dtype="bfloat16", max_num_seqs=GPU_MAX_NUM_SEQS,
              max_num_batched_tokens=GPU_MAX_STEP_TOKENS, num_kvcache_blocks=GPU_KV_TOKENS // 16)
    try:
        assert llm.model_runner.graphs is not None and llm.config.overlap_scheduling
        ids = [llm.add_request(p, sp) for p, sp in zip(ps, params)]
        seen = dict.fromkeys(ids, 0)
        outputs = {}
        while not llm.is_finished():
            result = llm.step()
            assert not outputs.keys() & set(result.sampled)
            for i in result.sampled:
                seen[i] += 1
            outputs.update((o.request_id, o) for o in result.finished)
    finally:
        llm.exit()
    assert [seen[i] for i in ids] == [len(outputs[i].token_ids) for i in ids]
    stopped = [(outputs[i], sp) for i, sp in zip(ids, params) if outputs[i].finish_reason == "stop"]
    assert len(stopped) >= 4  # bf16 steps at other batch sizes may pick other tokens, but not in most requests
    assert all(out.token_ids[-1] in sp.stop_token_ids for out, sp in stopped)


def test_tensor_parallel_size_above_the_gpu_count_is_refused(ckpt):
    too_many = torch.cuda.device_count() + 1
    if GPU_SHAPE.num_key_value_heads % too_many:
        pytest.skip(f"{too_many} ranks do not divide the test model's heads (refused for that first)")
    with pytest.raises(ValueError, match=f"tensor_parallel_size={too_many} exceeds the {too_many - 1} visible CUDA"):
        LLM(ckpt, tensor_parallel_size=too_many)
