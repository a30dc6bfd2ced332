"""vLLM's LLM.apply_model(func) and LLM.collective_rpc(callable) (engine/rank_calls.py), on CPU at
tensor_parallel_size 1 and 2 (gloo): each rank's result in rank order, the rank's own module and
weight shard, model.load_weights reaching transformers' tokens of the loaded weights, errors
raised after every rank answered with the engine still serving."""

from __future__ import annotations

import functools

import pytest
import torch
from checkpoints import assert_greedy_matches_reference, checkpoint_fixture, cpu_llm, load_reference, make_prompts

from nanovllm import SamplingParams
from nanovllm.engine.rank_calls import Worker

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = make_prompts(21, 3, 10, 30)

ckpt = checkpoint_fixture("rank-calls-a", seed=5)
other_ckpt = checkpoint_fixture("rank-calls-b", seed=6)


# Module-level functions: they pickle, so they reach tensor-parallel workers.
def qkv_rows(model: torch.nn.Module) -> int:
    return model.model.layers[0].self_attn.qkv_proj.weight.shape[0]


def rank_and_scaled(worker: Worker, factor: int, offset: int = 0) -> tuple[int, int, str]:
    return worker.rank, worker.local_rank * factor + offset, type(worker.model_runner.model).__name__


def refuse(model: torch.nn.Module) -> None:
    raise ValueError("this function refuses")


def fail_on_rank(model: torch.nn.Module, rank: int) -> int:
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == rank:
        raise ValueError(f"rank {rank} refuses")
    return 0


def load_state(model: torch.nn.Module, path: str) -> int:
    return len(model.load_weights(load_reference(path).state_dict().items()))


def engine(path, **kw):
    return cpu_llm(path, kvcache_block_size=16, max_model_len=128, **kw)


def test_one_rank_calls_see_the_model_and_load_weights_reaches_the_new_tokens(ckpt, other_ckpt):
    llm = engine(ckpt)
    try:
        cfg = llm.config.model_config
        assert llm.apply_model(qkv_rows) == [(cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim]
        assert llm.llm_engine.apply_model(lambda model: model is llm.model_runner.model) == [True]
        assert llm.collective_rpc(rank_and_scaled, args=(3,), kwargs={"offset": 1}) == [(0, 1, "Qwen3ForCausalLM")]
        assert llm.collective_rpc(lambda worker: worker.device) == [torch.device("cpu")]
        # a forward hook through apply_model fires on the engine's forwards
        seen = []
        handles = llm.apply_model(lambda model: model.model.layers[0].register_forward_hook(
            lambda module, args, out: seen.append(args[1].shape)))
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        handles[0].remove()
        assert seen and seen[0] == (len(PROMPTS[0]), cfg.hidden_size)  # the prefill's hidden states
        # vLLM's model.load_weights: the other checkpoint's weights, then its tokens
        before = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        names = llm.apply_model(functools.partial(load_state, path=other_ckpt))
        assert names == [len(load_reference(other_ckpt).state_dict())]
        llm.reset_prefix_cache()
        after = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert after != before
        reference = load_reference(other_ckpt)
        for prompt, out in zip(PROMPTS, after):
            assert_greedy_matches_reference(reference, prompt, out)
    finally:
        llm.exit()


def test_one_rank_errors_are_raised_and_the_engine_keeps_serving(ckpt):
    llm = engine(ckpt)
    try:
        want = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        with pytest.raises(ValueError, match="this function refuses"):
            llm.apply_model(refuse)
        with pytest.raises(TypeError, match="apply_model takes a function of the model, got 3"):
            llm.apply_model(3)
        with pytest.raises(TypeError, match="collective_rpc args must be a tuple"):
            llm.collective_rpc(rank_and_scaled, args=[3])
        with pytest.raises(NotImplementedError, match="'init_process_group' is not implemented"):
            llm.collective_rpc("init_process_group")
        llm.sleep(level=1)
        with pytest.raises(RuntimeError, match=r"apply_model\(\) called while the weights sleep"):
            llm.apply_model(qkv_rows)
        llm.wake_up()
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    finally:
        llm.exit()


def test_two_ranks_answer_in_rank_order_with_their_own_shards(ckpt, other_ckpt):
    llm = engine(ckpt, tensor_parallel_size=2)
    try:
        cfg = llm.config.model_config
        rows = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        assert llm.apply_model(qkv_rows) == [rows // 2, rows // 2]
        assert llm.collective_rpc(rank_and_scaled, args=(3,)) == [(0, 0, "Qwen3ForCausalLM"),
                                                                 (1, 3, "Qwen3ForCausalLM")]
        with pytest.raises(TypeError, match=r"apply_model\(\): the function runs on the tensor-parallel workers "
                                            r"too, so it must pickle"):
            llm.apply_model(lambda model: 0)
        with pytest.raises(ValueError, match="rank 1 refuses"):  # a worker's error, raised on rank 0
            llm.apply_model(functools.partial(fail_on_rank, rank=1))
        # every rank loads its shard of the other checkpoint: tp=2 gives its transformers tokens
        assert llm.apply_model(functools.partial(load_state, path=other_ckpt)) == [
            len(load_reference(other_ckpt).state_dict())] * 2
        llm.reset_prefix_cache()
        outs = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.exit()
    reference = load_reference(other_ckpt)
    for prompt, out in zip(PROMPTS, outs):
        assert_greedy_matches_reference(reference, prompt, out)
