"""sleep / wake_up on a CUDA device with CUDA graphs on (decode and prefill / mixed-step graphs): the
graphs are dropped at sleep and captured again at wake_up, and the tokens after waking (level 1, and
level 2 refilled by update_weights) are those of before and transformers' bf16 greedy ones; the
device memory a Qwen3-0.6B-shaped engine holds awake, asleep at each level and woken again is
printed (run with -s) and checked against what sleep must give back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from checkpoints import (
    GPU_MAX_NUM_SEQS, GPU_MAX_STEP_TOKENS, GPU_SHAPE, assert_bf16_greedy_matches, checkpoint_fixture, load_reference,
    make_prompts,
)
from nanovllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

QWEN3_06B = Path(__file__).resolve().parent.parent / "benchmarks" / "configs" / "qwen3-0.6b"  # config.json only
# Greedy rows, and seeded ones (an unseeded row's noise keys depend on the engine's earlier calls).
PARAMS = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, max_tokens=32, ignore_eos=True)]
# Device bytes the checks allow beyond the weights and KV cache: allocated ones are the step-input
# buffers and sampler workspaces the engine keeps asleep (and a woken engine's differences from the
# first capture); reserved ones add the allocator's shared 20 MB segments that such a buffer keeps.
ALLOCATED_SLACK_BYTES = 64 * 2**20
RESERVED_SLACK_BYTES = 256 * 2**20


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), kvcache_block_size=16, max_model_len=2048, dtype="bfloat16", max_num_seqs=GPU_MAX_NUM_SEQS,
               max_num_batched_tokens=GPU_MAX_STEP_TOKENS, **kwargs)


def tokens(llm: LLM, prompts) -> list[list[int]]:
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


ckpt = checkpoint_fixture("sleep_gpu", GPU_SHAPE)


def test_sleep_and_wake_up_under_cuda_graphs_give_the_same_tokens(ckpt):
    from transformers import Qwen3ForCausalLM

    reference = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    state = load_reference(ckpt).state_dict()  # the checkpoint's float32 tensors, as an RL trainer would pass
    # 8 prompts decode in graphs; their prefill (< 1,024 tokens) replays a prefill graph
    prompts = make_prompts(0, 8, 20, 120)
    llm = engine(ckpt, num_kvcache_blocks=512)
    try:
        runner = llm.model_runner
        assert runner.graphs is not None and runner.varlen_graphs is not None
        first = tokens(llm, prompts)
        for p, o in zip(prompts[::2], first[::2]):
            assert_bf16_greedy_matches(reference, p, o)
        llm.sleep(level=1)
        assert runner.graphs is None and runner.varlen_graphs is None
        llm.wake_up()
        assert runner.graphs is not None and runner.varlen_graphs is not None
        assert tokens(llm, prompts) == first
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.update_weights(state.items())
        llm.wake_up(tags=["kv_cache"])
        assert tokens(llm, prompts) == first
    finally:
        llm.exit()


def _memory() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _report(label: str, memory: tuple[int, int], seconds: float | None = None) -> None:
    took = f", {seconds:.3f} s" if seconds is not None else ""
    print(f"[sleep 0.6B] {label:24s} allocated {memory[0] / 2**30:7.3f} GiB, reserved {memory[1] / 2**30:7.3f} GiB{took}")


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_back_the_weights_and_kv_cache_of_a_06b_engine(level):
    """Asleep, this process holds at most what it held awake minus the weights and the KV cache
    (the graphs' pools go too), and the allocator's reserve shrinks by as much; woken, it holds
    about what it held before."""
    llm = engine(QWEN3_06B, load_format="dummy", num_kvcache_blocks=1024)  # 16,384 tokens: 1.75 GiB of KV
    try:
        prompts = make_prompts(1, 8, 20, 120, vocab=100_000)
        first = tokens(llm, prompts)
        model = llm.model_runner.model
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*model.parameters(), *model.buffers()]}
        weight_bytes, kv_bytes = sum(storages.values()), llm.model_runner.kv_cache.untyped_storage().nbytes()
        awake = _memory()
        _report("awake", awake)
        start = time.perf_counter()
        llm.sleep(level=level)
        asleep = _memory()
        _report(f"asleep (level {level})", asleep, time.perf_counter() - start)
        start = time.perf_counter()
        llm.wake_up()
        woken = _memory()
        _report("woken", woken, time.perf_counter() - start)
        print(f"[sleep 0.6B] weights {weight_bytes / 2**30:.3f} GiB, KV cache {kv_bytes / 2**30:.3f} GiB")
        assert asleep[0] <= awake[0] - weight_bytes - kv_bytes + ALLOCATED_SLACK_BYTES
        assert asleep[1] <= awake[1] - weight_bytes - kv_bytes + RESERVED_SLACK_BYTES
        assert abs(woken[0] - awake[0]) <= ALLOCATED_SLACK_BYTES
        if level == 1:
            assert tokens(llm, prompts) == first
    finally:
        llm.exit()
