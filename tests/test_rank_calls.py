"""vLLM's LLM.apply_model(func) and LLM.collective_rpc(callable) (engine/rank_calls.py), on CPU at
tensor_parallel_size 1 and 2 (gloo): each rank's result in rank order, the rank's own module and
weight shard, model.load_weights reaching transformers' tokens of the loaded weights, errors
raised after every rank answered with the engine still serving."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from checkpoints import (
    GPU_SHAPE,
    assert_bf16_greedy_matches,
    assert_greedy_matches_reference,
    checkpoint_fixture,
    cpu_llm,
    load_reference,
    make_prompts,
)
from test_fp8_kv import engine_scales

from nanovllm import SamplingParams
from nanovllm.engine.rank_calls import Worker

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = make_prompts(21, 3, 10, 30)

ckpt = checkpoint_fixture("rank-calls-a", seed=5)
other_ckpt = checkpoint_fixture("rank-calls-b", seed=6)
gpu_ckpt = checkpoint_fixture("rank-calls-gpu-a", GPU_SHAPE, seed=7)
gpu_other_ckpt = checkpoint_fixture("rank-calls-gpu-b", GPU_SHAPE, seed=8)


# Module-level functions: they pickle, so they reach tensor-parallel workers.
def qkv_rows(model: torch.nn.Module) -> int:
    return model.model.layers[0].self_attn.qkv_proj.weight.shape[0]


def rank_and_scaled(worker: Worker, factor: int, offset: int = 0) -> tuple[int, int, str]:
    return worker.rank, worker.local_rank * factor + offset, type(worker.model_runner.model).__name__


def model_rows_by_get_model(worker: Worker) -> tuple[bool, int]:
    """A worker function written for vLLM's worker: the model through get_model() (the worker's and
    its model runner's, both the module its model runner holds), and that module's qkv rows."""
    model = worker.model_runner.get_model()
    return worker.get_model() is model is worker.model_runner.model, qkv_rows(model)


def served_len_and_dtype(worker: Worker) -> tuple[int, torch.dtype]:
    """What OpenRLHF's weight-sync worker checks a broadcast tensor against: the worker's model_config."""
    return worker.model_config.max_model_len, worker.model_config.dtype


def refuse(model: torch.nn.Module) -> None:
    raise ValueError("this function refuses")


def fail_on_rank(model: torch.nn.Module, rank: int) -> int:
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == rank:
        raise ValueError(f"rank {rank} refuses")
    return 0


class TwoArgError(Exception):
    """An exception that pickles but cannot be rebuilt from its args (its __init__ takes two)."""

    def __init__(self, a: int, b: int):
        super().__init__(f"{a} and {b}")


def raise_two_arg_error_on_rank_1(model: torch.nn.Module) -> None:
    if torch.distributed.get_rank() == 1:
        raise TwoArgError(1, 2)


def many_tensors(model: torch.nn.Module, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t + torch.distributed.get_rank() for t in tensors]


def sleep_on_rank_1(worker: Worker, seconds: float) -> int:
    if worker.rank == 1:
        time.sleep(seconds)
    return worker.rank


def load_state(model: torch.nn.Module, path: str) -> int:
    return len(model.load_weights(load_reference(path).state_dict().items()))


def received(state: dict[str, torch.Tensor]):
    """A weight receiver's generator reusing one buffer, as vLLM's RLHF worker extensions may write
    it: each weight is a view of the buffer, refilled (the broadcast) for the next one."""
    buffer = torch.empty(max(t.numel() for t in state.values()), dtype=next(iter(state.values())).dtype)
    for name, tensor in state.items():
        view = buffer[: tensor.numel()].view(tensor.shape)
        view.copy_(tensor)  # dist.broadcast(view, src=0)
        yield name, view


def load_received(worker: Worker, path: str) -> int:
    return len(worker.model_runner.model.load_weights(received(load_reference(path).state_dict())))


def keep_update_group(worker: Worker, name: str) -> None:
    """What a weight-sync function written for vLLM's worker does first (OpenRLHF's init_process_group,
    TRL's init_communicator): keep its process group on the worker for the calls that follow."""
    worker.model_update_group = (name, worker.rank)


def kept_update_group(worker: Worker) -> tuple[str, int]:
    return worker.model_update_group


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
        assert llm.collective_rpc(model_rows_by_get_model) == [(True, llm.apply_model(qkv_rows)[0])]
        assert llm.collective_rpc(lambda worker: worker.model_config is llm.llm_engine.model_config) == [True]
        assert llm.collective_rpc(served_len_and_dtype) == [(128, torch.float32)]
        # the driver worker's path (scripts, verl on NPUs): get_model() as its model_runner.model
        driver = llm.llm_engine.model_executor.driver_worker.worker
        assert driver.model_runner.get_model().load_weights([]) == set()
        assert next(driver.get_model().parameters()) is next(llm.model_runner.model.parameters())
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


@pytest.mark.parametrize("tp", [1, 2])
def test_load_weights_takes_a_generator_reusing_its_buffer(ckpt, other_ckpt, tp):
    """model.load_weights(generator) where the generator refills one buffer for each weight it yields
    (vLLM copies each weight before asking for the next) loads every weight: through collective_rpc on
    every rank's module and through the driver worker's model (every weight but the last was the last
    one's values, silently: the pairs were held until the generator ended)."""
    reference = load_reference(other_ckpt)
    llm = engine(ckpt, tensor_parallel_size=tp)
    try:
        before = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert llm.collective_rpc(load_received, args=(other_ckpt,)) == [len(reference.state_dict())] * tp
        llm.reset_prefix_cache()
        after = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert after != before
        for prompt, out in zip(PROMPTS, after):
            assert_greedy_matches_reference(reference, prompt, out)
        llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(received(
            load_reference(ckpt).state_dict()))
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == before
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


@pytest.mark.parametrize("tp", [1, 2])
def test_what_a_function_keeps_on_its_worker_is_there_at_the_next_call(ckpt, tp):
    """vLLM runs a collective_rpc function on each rank's one worker object (run_method binds the
    rank's persistent worker), so state a function sets there, such as a weight-sync process group,
    is there for the next call, on that rank; here it was refused (a frozen Worker made per call)."""
    llm = engine(ckpt, tensor_parallel_size=tp)
    try:
        assert llm.collective_rpc(keep_update_group, args=("weights",)) == [None] * tp
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        assert llm.collective_rpc(kept_update_group) == [("weights", rank) for rank in range(tp)]
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
        assert llm.collective_rpc(model_rows_by_get_model) == [(True, rows // 2)] * 2
        assert llm.collective_rpc(served_len_and_dtype) == [(128, torch.float32)] * 2
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


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_two_ranks_survive_what_a_worker_cannot_send_or_rank_0_cannot_read(ckpt):
    """A worker exception that pickles but cannot be rebuilt, a worker result that does not pickle,
    and thousands of tensors each way: answers (or clear errors), the engine serving after, and no
    file descriptor per tensor (plain pickle, not shared memory)."""
    llm = engine(ckpt, tensor_parallel_size=2)
    try:
        want = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        with pytest.raises(TypeError, match="rank 1's answer cannot be read on rank 0"):
            llm.apply_model(raise_two_arg_error_on_rank_1)
        with pytest.raises(TypeError, match="rank 1's result cannot be sent to rank 0"):
            llm.apply_model(return_a_generator)
        tensors = [torch.full((4,), float(i)) for i in range(3000)]
        files = open_files()
        got = llm.apply_model(functools.partial(many_tensors, tensors=tensors))
        assert open_files() - files < 100
        assert [len(r) for r in got] == [3000, 3000]
        assert all(torch.equal(got[rank][i], tensors[i] + rank) for rank in (0, 1) for i in (0, 1234, 2999))
        assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    finally:
        llm.exit()


def return_a_generator(model: torch.nn.Module):
    return (x for x in range(3))  # a generator does not pickle


@pytest.mark.parametrize("cut", ["interrupt", "timeout"])
def test_a_call_cut_short_on_rank_0_leaves_the_group_out_of_step(ckpt, cut):
    """Ctrl-C (or collective_rpc's timeout) while a worker still runs the function: raised at once,
    not when the function returns; the late answer would be read by the next call, so every
    later call refuses, naming why, and exit() does not wait for the worker."""
    llm = engine(ckpt, tensor_parallel_size=2)
    try:
        start = time.monotonic()
        if cut == "timeout":
            with pytest.raises(TimeoutError, match="rank 1 did not answer within 1.0 s"):
                llm.collective_rpc(sleep_on_rank_1, timeout=1.0, args=(30.0,))
        else:
            previous = signal.signal(signal.SIGALRM, interrupt)
            try:
                signal.setitimer(signal.ITIMER_REAL, 1.0)
                with pytest.raises(KeyboardInterrupt):
                    llm.collective_rpc(sleep_on_rank_1, args=(30.0,))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
        assert time.monotonic() - start < 10
        with pytest.raises(RuntimeError, match="out of step"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        start = time.monotonic()
        llm.exit()
        assert time.monotonic() - start < 10


def interrupt(signum, frame):
    raise KeyboardInterrupt


_COMMAND_LINE_SCRIPT = """
import sys
sys.path[:0] = {paths!r}
from checkpoints import cpu_llm
from nanovllm import SamplingParams

def rows(model):  # defined in `python -c`: the workers cannot import it
    return 1

llm = cpu_llm({ckpt!r}, kvcache_block_size=16, max_model_len=128, tensor_parallel_size=2)
try:
    try:
        llm.apply_model(rows)
    except Exception as e:
        print("raised", type(e).__name__, e)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    print("served", len(out[0]["token_ids"]))
finally:
    llm.exit()
"""


def test_a_function_the_workers_cannot_import_is_a_clear_error(ckpt):
    """A function from `python -c` (or a notebook) pickles by name on rank 0 but cannot be found on
    the workers: the error says so and the engine serves on (the workers live)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    code = _COMMAND_LINE_SCRIPT.format(paths=[os.path.dirname(tests), tests], ckpt=ckpt)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "raised AttributeError Can't get attribute 'rows'" in proc.stdout, proc.stdout
    assert "served 3" in proc.stdout


def test_load_weights_sets_fp8_kv_scales_anew(ckpt, other_ckpt):
    """model.load_weights through apply_model on an FP8-KV engine: its scales are computed again
    from the next prefill's data, as after update_weights: a fresh engine's tokens."""
    llm = engine(ckpt, kv_cache_dtype="fp8")
    try:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # scales calibrated on ckpt's weights
        llm.apply_model(functools.partial(load_state, path=other_ckpt))
        llm.reset_prefix_cache()
        loaded = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.exit()
    fresh = engine(other_ckpt, kv_cache_dtype="fp8")
    try:
        assert loaded == [o["token_ids"] for o in fresh.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        fresh.exit()


def test_load_weights_while_requests_run_keeps_the_fp8_kv_scales_until_the_cache_is_empty(ckpt):
    """model.load_weights through apply_model while a request runs on an FP8-KV engine: the scales its
    KV was quantized under stay while any KV may be read again (the running request's, the prefix
    cache's), so the same weights loaded mid-request leave its tokens as an undisturbed run's (before,
    the next prefill, another request's, set the scales from its data and the running request's KV was
    read under them: its tokens changed). Once the requests end and reset_prefix_cache empties the
    cache, the next step sets them from the loaded weights' data: a fresh engine's tokens and scales."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first, second, third = make_prompts(31, 3, 24, 40)
    undisturbed = engine(ckpt, kv_cache_dtype="fp8", max_num_seqs=4)
    try:
        want = [undisturbed.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in (first, second)]
        scales = engine_scales(undisturbed)  # calibrated on the first prompt alone
    finally:
        undisturbed.exit()
    fresh = engine(ckpt, kv_cache_dtype="fp8", max_num_seqs=4)
    try:
        want_third = fresh.generate([third], params, use_tqdm=False)[0]["token_ids"]
        third_scales = engine_scales(fresh)
    finally:
        fresh.exit()
    assert third_scales != scales  # so the test tells which data set them

    llm = engine(ckpt, kv_cache_dtype="fp8", max_num_seqs=4)
    try:
        steps = llm.llm_engine
        steps.add_request("a", first, params)
        for _ in range(4):  # the first prompt's prefill (it sets the scales), then decode steps
            steps.step()
        llm.apply_model(functools.partial(load_state, path=ckpt))
        steps.add_request("b", second, params)  # a prefill step after the load, beside a's decode
        done = {}
        while steps.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0].token_ids) for o in steps.step() if o.finished)
        assert [done["a"], done["b"]] == want
        assert engine_scales(llm) == scales
        assert llm.reset_prefix_cache()
        assert llm.generate([third], params, use_tqdm=False)[0]["token_ids"] == want_third
        assert engine_scales(llm) == third_scales
    finally:
        llm.exit()


@pytest.mark.gpu
def test_load_weights_through_apply_model_on_the_gpu_with_graphs(gpu_ckpt, gpu_other_ckpt):
    """A bf16 CUDA engine with its graphs captured: model.load_weights through apply_model copies in
    place, so the graphs replay the loaded weights: transformers' tokens of the other checkpoint."""
    from transformers import AutoModelForCausalLM

    from nanovllm import LLM

    llm = LLM(gpu_ckpt, dtype="bfloat16", kvcache_block_size=16, max_model_len=256, num_kvcache_blocks=256,
              max_num_seqs=8, max_num_batched_tokens=256)
    try:
        assert llm.model_runner.graphs is not None
        before = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        llm.apply_model(functools.partial(load_state, path=gpu_other_ckpt))
        llm.reset_prefix_cache()
        after = [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.exit()
    assert after != before
    reference = AutoModelForCausalLM.from_pretrained(gpu_other_ckpt, dtype=torch.float32).cuda().eval()
    for prompt, out in zip(PROMPTS, after):
        assert_bf16_greedy_matches(reference, prompt, out)


def exit_on_rank_1(worker: Worker, code: int) -> int:
    if worker.rank == 1:
        os._exit(code)  # the worker process ends inside the call, without an answer
    return worker.rank


def test_a_worker_ending_inside_a_call_is_named_with_its_exit_code(ckpt):
    """A worker process that ends while it runs the function (os._exit, a crash) closes its pipe
    before its exit can be seen: rank 0 read the closed pipe as 'worker rank 1 is gone: ' with
    nothing after it. The error waits for the exit and names it, as a death inside a collective does."""
    llm = engine(ckpt, tensor_parallel_size=2)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 died \(exit code 3\)"):
            llm.collective_rpc(exit_on_rank_1, args=(3,))
        assert time.monotonic() - start < 30
        with pytest.raises(RuntimeError, match=r"worker rank 1 died \(exit code 3\)"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.exit()
