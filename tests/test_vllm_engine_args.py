"""LLM(...) as vLLM clients construct it: lm-evaluation-harness's vLLM backend and verl's rollout
pass keywords that have no setting here (engine_args.py); each is accepted with a value that asks
for what nanovllm does, and refused by name otherwise. The engine surface they read next:
`llm.llm_engine.model_config.max_model_len`, `get_tokenizer()`, `reset_prefix_cache()`,
TokensPrompt; vLLM's dtype spellings and a tokenizer from another directory."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest
import torch

from checkpoints import TinyShape, checkpoint_fixture, cpu_llm
import nanovllm
from nanovllm import LLM, SamplingParams, TokensPrompt, inputs
from nanovllm.config import Config
from nanovllm.engine_args import VLLM_ONLY_ARGS, strip_vllm_only_args

ckpt = checkpoint_fixture("engine-args")
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

# lm-eval's VLLM.__init__ model_args, its defaults (max_model_len / max_num_seqs None: vLLM's defaults)
LM_EVAL_ARGS = dict(gpu_memory_utilization=0.9, revision=None, dtype="auto", tokenizer_mode="auto",
                    tokenizer_revision=None, trust_remote_code=False, tensor_parallel_size=1, max_model_len=None,
                    max_num_seqs=None, swap_space=4, quantization=None, seed=1234, enable_lora=False,
                    max_lora_rank=16)
# verl's vLLMRollout LLM(...) keywords for a text model (its SPMD mode adds
# distributed_executor_backend="external_launcher": one engine per rank, as TRL's below)
VERL_ARGS = dict(enable_sleep_mode=True, tensor_parallel_size=1, dtype="float32", enforce_eager=True,
                 gpu_memory_utilization=0.5, disable_custom_all_reduce=True, disable_mm_preprocessor_cache=True,
                 limit_mm_per_prompt=None, skip_tokenizer_init=False, max_model_len=256, load_format="auto",
                 disable_log_stats=True, max_num_batched_tokens=512, enable_chunked_prefill=True,
                 enable_prefix_caching=True, trust_remote_code=False, seed=0)

# lighteval's vLLM backend (revision "main" always; one pipeline stage), OpenRLHF's and open-instruct's
# rollout engines at one rank ("uni"), TRL's GRPO colocate mode (a torchrun rank's own engine)
LIGHTEVAL_ARGS = dict(revision="main", dtype="float32", trust_remote_code=False, tensor_parallel_size=1,
                      data_parallel_size=1, pipeline_parallel_size=1, gpu_memory_utilization=0.5, max_model_len=256,
                      swap_space=4, seed=1, max_num_seqs=16, max_num_batched_tokens=512, enforce_eager=True)
OPENRLHF_ARGS = dict(distributed_executor_backend="uni", tensor_parallel_size=1, seed=0, enable_prefix_caching=None,
                     dtype="float32", max_model_len=256, enable_sleep_mode=True, download_dir=None)
TRL_ARGS = dict(distributed_executor_backend="external_launcher", tensor_parallel_size=1, gpu_memory_utilization=0.3,
                max_num_seqs=8, max_model_len=256, model_impl="vllm", logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                enable_sleep_mode=False, seed=0, max_num_batched_tokens=512)

# vLLM LLM() / EngineArgs keywords at their defaults (scripts spell out vLLM's signature): features
# nanovllm lacks, each asked for off
VLLM_DEFAULTS = dict(hf_token=None, mm_processor_kwargs=None, allowed_local_media_path="", allowed_media_domains=None,
                     speculative_config=None, logits_processors=None, enable_prompt_embeds=False, pooler_config=None,
                     override_pooler_config=None, convert="auto", enable_return_routed_experts=False,
                     scheduling_policy="fcfs", max_parallel_loading_workers=None, guided_decoding_backend="xgrammar",
                     structured_outputs_config={"backend": "auto", "disable_fallback": False,
                                                "disable_any_whitespace": False,
                                                "disable_additional_properties": False, "reasoning_parser": "",
                                                "reasoning_parser_plugin": "", "enable_in_reasoning": False})
REFUSED = [
    ("mm_processor_kwargs", {"num_crops": 4}), ("allowed_local_media_path", "/data"), ("allowed_media_domains", ["a.b"]),
    ("speculative_config", {"method": "ngram"}), ("logits_processors", ["my.Processor"]),
    ("enable_prompt_embeds", True), ("pooler_config", {"pooling_type": "MEAN"}), ("convert", "embed"),
    ("enable_return_routed_experts", True), ("scheduling_policy", "priority"), ("hf_token", 3),
    ("revision", "v1.1"), ("tokenizer_revision", "v2"), ("code_revision", "abc"), ("tokenizer_mode", "slow"),
    ("trust_remote_code", "yes"), ("swap_space", -1), ("swap_space", True), ("enable_lora", True),
    ("max_lora_rank", 1.5), ("enable_sleep_mode", None), ("distributed_executor_backend", "ray"),
    ("disable_custom_all_reduce", 0), ("disable_log_stats", "no"),
    ("enable_chunked_prefill", "on"), ("limit_mm_per_prompt", {"image": 1}),
    ("disable_mm_preprocessor_cache", None), ("download_dir", 3), ("model_impl", "transformers"),
    ("pipeline_parallel_size", 2), ("pipeline_parallel_size", 1.0), ("data_parallel_size", 4),
    ("compilation_config", "max"), ("max_seq_len_to_capture", 0), ("cpu_offload_gb", 4), ("served_model_name", 3),
    ("task", "embed"), ("runner", "pooling"), ("async_scheduling", "yes"),
    ("disable_async_output_proc", None), ("disable_sliding_window", None),
    ("num_scheduler_steps", 8), ("use_v2_block_manager", "v2"), ("preemption_mode", "swap"),
    ("worker_extension_cls", "nemo_rl.models.generation.vllm.VllmInternalWorkerExtension"),
    ("worker_cls", "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"),
    ("guided_decoding_backend", "guidance"), ("structured_outputs_config", {"backend": "outlines"}),
    ("structured_outputs_config", {"disable_any_whitespace": True}), ("structured_outputs_config", {"reasoning_parser": "qwen3"}),
    ("structured_outputs_config", {"backend": "xgrammar", "bogus": 1}), ("structured_outputs_config", "xgrammar"),
]
# Keywords verl, NeMo-RL and scripts pass to tune vLLM's own machinery, with values they use.
TUNING_ARGS = dict(compilation_config={"cudagraph_capture_sizes": [1, 2, 4]}, max_seq_len_to_capture=8192,
                   cpu_offload_gb=0, served_model_name="policy", task="generate", runner="generate",
                   enable_expert_parallel=False, async_scheduling=True, disable_async_output_proc=False,
                   calculate_kv_scales=True, disable_sliding_window=False, num_scheduler_steps=1,
                   use_v2_block_manager=True, preemption_mode="recompute", download_dir=pathlib.Path("/tmp/hf"))


def test_lm_eval_constructs_and_reads_the_context_length(ckpt):
    llm = cpu_llm(ckpt, tokenizer=ckpt, **LM_EVAL_ARGS)
    try:
        assert llm.llm_engine.model_config is llm.model_config and llm.llm_engine.tokenizer is llm.tokenizer
        # vLLM's None: the engine's default (here min(4096, max_position_embeddings))
        assert llm.llm_engine.model_config.max_model_len == llm.config.max_model_len == 1024
        assert llm.llm_engine.model_config.dtype == torch.float32
        # what older lighteval and RL / analysis scripts read there (vLLM's ModelConfig)
        served = llm.llm_engine.model_config
        assert served.hf_config.num_hidden_layers == served.hf_text_config.num_hidden_layers == TinyShape().num_hidden_layers
        assert served.get_vocab_size() == TinyShape().vocab_size and served.max_seq_len_to_capture == 1024
        assert llm.config.max_num_seqs == Config.max_num_seqs
        tok = llm.get_tokenizer()
        assert tok is llm.tokenizer and tok.decode(tok.encode("the dog")) == "the dog"
        out = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        # vLLM's import path of the prompt dicts (verl: `from vllm.inputs import TokensPrompt`)
        assert inputs.TokensPrompt is TokensPrompt and inputs.TextPrompt is nanovllm.TextPrompt
        by_text = llm.generate([inputs.TextPrompt(prompt="the dog")], GREEDY, use_tqdm=False)[0]
        assert by_text.prompt == "the dog" and len(by_text.outputs[0].token_ids) == 4
    finally:
        llm.exit()


def test_model_config_counts_layers_per_pipeline_stage(ckpt):
    """vLLM's ModelConfig.get_num_layers(parallel_config): the hidden layers of one pipeline stage,
    here the only one (all of them); anything but the engine's parallel config is refused by value.
    A full-precision checkpoint's quantization is None (tests/test_fp8.py: the others)."""
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256)
    try:
        served, parallel = llm.llm_engine.model_config, llm.llm_engine.vllm_config.parallel_config
        assert served.get_num_layers(parallel) == TinyShape().num_hidden_layers == 2
        assert served.quantization is None
        with pytest.raises(ValueError, match="parallel_config .*got None"):
            served.get_num_layers(None)
    finally:
        llm.exit()


def test_verl_constructs(ckpt):
    llm = cpu_llm(ckpt, **VERL_ARGS)
    try:
        assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.exit()


@pytest.mark.parametrize("args", [LIGHTEVAL_ARGS, OPENRLHF_ARGS, TRL_ARGS, TUNING_ARGS],
                         ids=["lighteval", "openrlhf", "trl", "tuning"])
def test_rl_and_eval_frameworks_construct(ckpt, args):
    llm = cpu_llm(ckpt, **args)
    try:
        assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.exit()


def test_one_rank_backends_are_refused_across_ranks(ckpt):
    """"uni" / "external_launcher" mean one engine in this process: a tensor-parallel engine is not that;
    enable_expert_parallel=True means the experts split over ranks, which one rank is anyway."""
    assert strip_vllm_only_args({"enable_expert_parallel": True}) == {}
    with pytest.raises(ValueError, match=r"LLM\(enable_expert_parallel=True\)"):
        strip_vllm_only_args({"enable_expert_parallel": True, "tensor_parallel_size": 2})
    for backend in ("uni", "external_launcher"):
        with pytest.raises(ValueError, match=rf"LLM\(distributed_executor_backend='{backend}'\)"):
            LLM(ckpt, device="cpu", distributed_executor_backend=backend, tensor_parallel_size=2)


def test_vllm_block_size_is_the_kv_cache_block_size(ckpt):
    assert Config(ckpt, device="cpu", **strip_vllm_only_args({"block_size": 32})).kvcache_block_size == 32
    assert strip_vllm_only_args({"block_size": None}) == {}
    with pytest.raises(TypeError, match="both block_size .* and kvcache_block_size"):
        LLM(ckpt, device="cpu", block_size=16, kvcache_block_size=16)
    # a bad value is named as the caller passed it (it was "kvcache_block_size must be ...", a name vLLM lacks)
    for value, message in [(8, r">= 16, got 8"), (24, "a multiple of 16, got 24")]:
        with pytest.raises(ValueError, match=rf"kvcache_block_size \(vLLM's block_size\) must be {message}"):
            LLM(ckpt, device="cpu", block_size=value)
    with pytest.raises(ValueError, match=r"num_kvcache_blocks \(vLLM's num_gpu_blocks_override\) must be >= 1, got 0"):
        LLM(ckpt, device="cpu", num_gpu_blocks_override=0)


def test_vllm_num_gpu_blocks_override_is_num_kvcache_blocks(ckpt):
    # vLLM's name of the KV cache's block count (tests and scripts pin the cache with it)
    config = Config.from_kwargs(ckpt, {"device": "cpu", "block_size": 16, "num_gpu_blocks_override": 24})
    assert (config.kvcache_block_size, config.num_kvcache_blocks) == (16, 24)
    assert Config.from_kwargs(ckpt, {"device": "cpu", "num_gpu_blocks_override": None}).num_kvcache_blocks is None
    with pytest.raises(TypeError, match="both num_gpu_blocks_override .* and num_kvcache_blocks"):
        Config.from_kwargs(ckpt, {"device": "cpu", "num_gpu_blocks_override": 8, "num_kvcache_blocks": 8})
    llm = cpu_llm(ckpt, block_size=16, num_gpu_blocks_override=24, max_model_len=256)
    try:
        assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == 24
    finally:
        llm.exit()


@pytest.mark.parametrize("name,value", REFUSED, ids=[f"{n}={v!r}" for n, v in REFUSED])
def test_values_nanovllm_cannot_honour_are_refused_by_name(ckpt, name, value):
    with pytest.raises(ValueError, match=rf"LLM\({name}="):
        LLM(ckpt, device="cpu", **{name: value})


def test_vllm_keywords_at_their_defaults_construct(ckpt):
    llm = cpu_llm(ckpt, max_model_len=256, **{**VLLM_DEFAULTS, "hf_token": "hf_xxx", "mm_processor_kwargs": {},
                                              "logits_processors": [], "convert": "none"})
    try:
        assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.exit()


def test_every_vllm_only_argument_accepts_what_nanovllm_does():
    accepted = {"revision": None, "tokenizer_revision": "main", "code_revision": None, "tokenizer_mode": "hf",
                "trust_remote_code": True, "swap_space": 0.5, "enable_lora": False, "max_lora_rank": 64,
                "max_loras": None, "enable_sleep_mode": False, "distributed_executor_backend": "mp",
                "disable_custom_all_reduce": False, "disable_log_stats": False, "enable_chunked_prefill": None,
                "limit_mm_per_prompt": {"image": 0}, "disable_mm_preprocessor_cache": False,
                "download_dir": None, "model_impl": "auto", "pipeline_parallel_size": 1, "data_parallel_size": 1,
                "compilation_config": 3, "max_seq_len_to_capture": 1, "cpu_offload_gb": 0.0,
                "served_model_name": ["a", "b"], "task": "auto", "runner": "auto", "enable_expert_parallel": False,
                "async_scheduling": None, "disable_async_output_proc": True,
                "disable_sliding_window": True, "num_scheduler_steps": 1, "use_v2_block_manager": False,
                "preemption_mode": None, "worker_extension_cls": None, "worker_cls": "auto", **VLLM_DEFAULTS}
    assert set(accepted) == set(VLLM_ONLY_ARGS)
    assert strip_vllm_only_args({**accepted, "max_model_len": None, "max_num_seqs": 8,
                                 "enable_prefix_caching": None}) == {"max_num_seqs": 8}


def test_skip_tokenizer_init_loads_none(ckpt):
    """vLLM's skip_tokenizer_init=True (NeMo-RL's token-id path): token-id prompts give the tokens
    of an engine with its tokenizer, texts stay empty, and a text prompt or chat() says why not."""
    with_tokenizer = cpu_llm(ckpt)
    try:
        want = [o.outputs[0].token_ids for o in with_tokenizer.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)]
    finally:
        with_tokenizer.exit()
    llm = cpu_llm(ckpt, skip_tokenizer_init=True)
    try:
        assert llm.get_tokenizer() is None
        outs = llm.generate([[1, 2, 3], [4, 5]], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want and [o.outputs[0].text for o in outs] == ["", ""]
        with pytest.raises(ValueError, match=r"no tokenizer is loaded .*skip_tokenizer_init=True.*token ids"):
            llm.generate(["the dog"], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=r"skip_tokenizer_init=True\), so chat\(\) cannot render"):
            llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
        for params in (SamplingParams(stop=["x"]), SamplingParams(bad_words=["x"])):
            with pytest.raises(ValueError, match=r"the model directory has none, or skip_tokenizer_init=True"):
                llm.generate([[1, 2, 3]], params, use_tqdm=False)
    finally:
        llm.exit()
    with pytest.raises(TypeError, match="skip_tokenizer_init must be a bool"):
        cpu_llm(ckpt, skip_tokenizer_init="yes")


def test_older_generate_spellings_as_lm_eval_and_openrlhf_pass_them(ckpt):
    """generate(prompt_token_ids=...) (vLLM before 0.11: lm-eval, lighteval, OpenRLHF): a list of ids
    is one prompt, a list of lists one each; with text prompts too, the texts are generated (and the
    two must be as many). tokenization_kwargs=None; del llm_engine.model_executor (distilabel)."""
    llm = cpu_llm(ckpt)
    try:
        ids = [[1, 2, 3], [7, 8, 9, 10]]
        want = [o.outputs[0].token_ids for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], GREEDY,
                                                              use_tqdm=False)]
        outs = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False, lora_request=None)
        assert [o.outputs[0].token_ids for o in outs] == want and [o.prompt_token_ids for o in outs] == ids
        (one,) = llm.generate(sampling_params=GREEDY, prompt_token_ids=ids[1], use_tqdm=False)
        assert one.outputs[0].token_ids == want[1]
        texts = llm.generate(["the dog", "a cat"], GREEDY, prompt_token_ids=ids, use_tqdm=False)
        assert [o.prompt for o in texts] == ["the dog", "a cat"]
        assert texts[0].prompt_token_ids == llm.get_tokenizer().encode("the dog")
        assert llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False, tokenization_kwargs=None)
        for kwargs, error, message in [
            (dict(prompts=["a"], prompt_token_ids=ids), ValueError, "got 1 prompts and 2 prompt_token_ids lists"),
            (dict(prompt_token_ids=[]), ValueError, "prompt_token_ids is empty"),
            (dict(prompt_token_ids="1 2 3"), TypeError, "prompt_token_ids must be a list of token ids"),
            (dict(prompts=["a"], prompt_token_ids=[["x"]]), TypeError, "prompt_token_ids must be a list of token ids"),
            (dict(prompts={"prompt": "a"}, prompt_token_ids=[1, 2]), TypeError, "prompts must be text"),
            (dict(), TypeError, r"generate\(\) needs prompts"),
            (dict(prompts=["a"], tokenization_kwargs={"truncation": True}), ValueError, "tokenization_kwargs"),
        ]:
            with pytest.raises(error, match=message):
                llm.generate(sampling_params=GREEDY, use_tqdm=False, **kwargs)
        assert llm.is_finished()
        vllm_config = llm.llm_engine.vllm_config  # TRL's vllm_serve reads the tensor-parallel size there
        assert vllm_config.parallel_config.tensor_parallel_size == vllm_config.parallel_config.world_size == 1
        assert vllm_config.model_config is llm.model_config
        assert vllm_config.scheduler_config.max_model_len == llm.config.max_model_len
        assert (vllm_config.cache_config.block_size, vllm_config.cache_config.num_gpu_blocks) == (
            llm.config.kvcache_block_size, llm.num_kvcache_blocks)
        del llm.llm_engine.model_executor  # distilabel's unload: harmless, the path still there
        assert llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights
        out = outs[0]
        assert (out.encoder_prompt, out.encoder_prompt_token_ids, out.kv_transfer_params) == (None, None, None)
        assert out.outputs[0].lora_request is None
    finally:
        llm.exit()


def test_token_ids_in_use_tqdms_place_are_refused_naming_prompt_token_ids(ckpt):
    """vLLM before 0.11 took prompt_token_ids as generate's third argument (`llm.generate(None, params,
    ids)`), where use_tqdm is now: a list there is refused naming it (it was taken as use_tqdm=True, the
    call then refused as "needs prompts", or its texts generated with the ids unchecked); a bool, an int
    flag (use_tqdm=verbose) or a tqdm factory serve as before."""
    llm = cpu_llm(ckpt)
    try:
        ids = [[1, 2, 3], [7, 8, 9, 10]]
        want = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False)
        for call in (lambda: llm.generate(None, GREEDY, ids), lambda: llm.generate(["a", "b"], GREEDY, ids),
                     lambda: llm.chat([{"role": "user", "content": "a"}], GREEDY, (1, 2))):
            with pytest.raises(TypeError, match=r"use_tqdm must be a bool or a tqdm-like factory, got a "
                                                r"(list|tuple).*prompt_token_ids="):
                call()
        assert llm.is_finished()
        assert llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=0) == want
    finally:
        llm.exit()


def test_tokenization_kwargs_truncate_prompt_tokens_as_vllm_0_17_passes_it(ckpt):
    """vLLM 0.17 moved SamplingParams.truncate_prompt_tokens into generate's tokenization_kwargs
    ({"truncate_prompt_tokens": k}, -1: max_model_len); it keeps the prompt's last k tokens as the
    SamplingParams field does, on generate and on llm_engine.add_request, the caller's params left as
    they are. A different value in the params, a bad value or another key is refused by name."""
    llm = cpu_llm(ckpt, max_model_len=64)
    try:
        prompt = list(range(1, 12))
        [want] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                       truncate_prompt_tokens=3), use_tqdm=False)
        assert want.prompt_token_ids == prompt[-3:]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = llm.generate([prompt, prompt], params, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 3})
        assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs] == [
            (prompt[-3:], want.outputs[0].token_ids)] * 2
        assert params.truncate_prompt_tokens is None  # the caller's params as given
        same = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=3)
        [out] = llm.generate([prompt], same, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 3})
        assert out.prompt_token_ids == prompt[-3:]
        [whole] = llm.generate([prompt], params, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": -1})
        [none] = llm.generate([prompt], params, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": None})
        assert whole.prompt_token_ids == none.prompt_token_ids == prompt
        # a NumPy count, as SamplingParams.truncate_prompt_tokens takes it (vLLM too): it was a TypeError
        [drawn] = llm.generate([prompt], params, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": np.int64(3)})
        assert (drawn.prompt_token_ids, drawn.outputs[0].token_ids) == (prompt[-3:], want.outputs[0].token_ids)
        engine = llm.llm_engine
        engine.add_request("t", prompt, params, tokenization_kwargs={"truncate_prompt_tokens": 3})
        finals = []
        while engine.has_unfinished_requests():
            finals += [o for o in engine.step() if o.finished]
        assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in finals] == [
            (prompt[-3:], want.outputs[0].token_ids)]
        for kwargs, error, message in [
            (dict(sampling_params=same, tokenization_kwargs={"truncate_prompt_tokens": 5}), ValueError,
             r"truncate_prompt_tokens.*5.*3"),
            (dict(tokenization_kwargs={"truncate_prompt_tokens": 0}), ValueError, r"tokenization_kwargs.*0"),
            (dict(tokenization_kwargs={"truncate_prompt_tokens": "3"}), TypeError, r"tokenization_kwargs.*'3'"),
            (dict(tokenization_kwargs={"truncate_prompt_tokens": 3, "truncation": True}), ValueError,
             "tokenization_kwargs=.*truncation"),
        ]:
            with pytest.raises(error, match=message):
                llm.generate([prompt], **{"sampling_params": params, **kwargs}, use_tqdm=False)
            with pytest.raises(error, match=message):
                engine.add_request("bad", prompt, kwargs.get("sampling_params", params),
                                   tokenization_kwargs=kwargs["tokenization_kwargs"])
        assert llm.is_finished() and not engine.has_unfinished_requests()
        assert llm.generate([prompt], params, use_tqdm=False)[0].prompt_token_ids == prompt
    finally:
        llm.exit()


def test_unknown_keywords_stay_type_errors(ckpt):
    with pytest.raises(TypeError, match="unknown keyword argument.*max_lenn"):
        LLM(ckpt, device="cpu", max_lenn=5)


@pytest.mark.parametrize("typo,meant", [("max_num_seq", "max_num_seqs"), ("gpu_memory_utilisation", "gpu_memory_utilization"),
                                        ("enable_prefix_cache", "enable_prefix_caching"), ("tokenizer_revison", "tokenizer_revision"),
                                        ("kv_cache_dtpye", "kv_cache_dtype"), ("blocksize", "block_size")])
def test_unknown_keyword_names_the_one_meant(ckpt, typo, meant):
    # a misspelt keyword (nanovllm's, or one of vLLM's it takes) is named with the likely intended one
    with pytest.raises(TypeError, match=rf"unknown keyword argument\(s\): {typo} \(did you mean {meant}\?\)"):
        Config.from_kwargs(ckpt, {"device": "cpu", typo: 1})


def test_unknown_keyword_without_a_near_name_points_at_the_list(ckpt):
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\): speculative_decoding_magic \(.*engine_args\.py"):
        Config.from_kwargs(ckpt, {"device": "cpu", "speculative_decoding_magic": 1})


@pytest.mark.parametrize("given,name", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"),
                                        (torch.bfloat16, "bfloat16"), (torch.float32, "float32")])
def test_vllm_dtype_spellings(ckpt, given, name):
    assert Config(ckpt, dtype=given, device="cpu").dtype == name


@pytest.mark.parametrize("bad", ["double", torch.float64, ["float32"]])
def test_other_dtypes_are_refused(ckpt, bad):
    with pytest.raises(ValueError, match="dtype must be"):
        Config(ckpt, dtype=bad, device="cpu")


def test_tokenizer_from_another_directory(ckpt, tmp_path):
    """vLLM's tokenizer=...: prompts are tokenized and outputs decoded with it, the chat template
    read from it; the model directory's own tokenizer is not consulted."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{ckpt}/{name}", tok_dir / name)
    bare = tmp_path / "model"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json", "vocab.json",
                                                              "merges.txt"))
    alone = cpu_llm(str(bare), max_model_len=128)
    try:
        assert alone.get_tokenizer() is None
    finally:
        alone.exit()
    llm = cpu_llm(str(bare), tokenizer=str(tok_dir), max_model_len=128)
    try:
        assert llm.llm_engine.model_config.tokenizer == str(tok_dir)
        out = llm.generate(["the dog"], GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == llm.get_tokenizer().encode("the dog") and out.outputs[0].text
    finally:
        llm.exit()
    with pytest.raises(ValueError, match="tokenizer path"):
        LLM(ckpt, device="cpu", tokenizer=str(tmp_path / "missing"))


def check_reset_forgets(llm, prompt: list[int], first: list[int]) -> None:
    """reset_prefix_cache() resets (True) and `prompt` then finds no cached block, its greedy tokens `first` again."""
    assert llm.reset_prefix_cache() is True
    hits = llm.block_manager.num_prefix_hit_blocks
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    assert llm.block_manager.num_prefix_hit_blocks == hits


def test_reset_prefix_cache(ckpt):
    """After reset_prefix_cache() (RL clients call it after a weight sync) a repeated prompt finds
    nothing cached; before, it does; the tokens are the same either way."""
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256)
    try:
        prompt = list(range(1, 50))  # three full blocks of 16
        first = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        hits = llm.block_manager.num_prefix_hit_blocks
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
        assert llm.block_manager.num_prefix_hit_blocks > hits
        check_reset_forgets(llm, prompt, first)
    finally:
        llm.exit()
    with pytest.raises(RuntimeError):
        llm.reset_prefix_cache()


def test_reset_prefix_cache_takes_vllms_options(ckpt):
    """vLLM's reset_prefix_cache(reset_running_requests=False, reset_connector=False), as scripts call
    it before a measurement and after a weight sync (a TypeError before), on the LLM and on
    llm.llm_engine. With nothing pending, reset_running_requests=True empties the cache like False; with
    requests pending it is refused (their KV would need recomputing, which this engine does not do)."""
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256)
    try:
        prompt = list(range(1, 50))  # three full blocks of 16
        first = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        for reset in (lambda: llm.reset_prefix_cache(reset_running_requests=True),
                      lambda: llm.reset_prefix_cache(False, True),
                      lambda: llm.llm_engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True)):
            assert reset() is True
            hits = llm.block_manager.num_prefix_hit_blocks
            assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
            assert llm.block_manager.num_prefix_hit_blocks == hits  # nothing was cached
        with pytest.raises(TypeError, match="reset_running_requests must be a bool, got 'yes'"):
            llm.reset_prefix_cache(reset_running_requests="yes")
        with pytest.raises(TypeError, match="reset_connector must be a bool, got 1"):
            llm.llm_engine.reset_prefix_cache(reset_connector=1)
        llm.llm_engine.add_request("pending", [1, 2, 3], GREEDY)
        assert llm.reset_prefix_cache() is True  # the cache only: the pending request keeps its blocks
        with pytest.raises(RuntimeError, match=r"reset_running_requests=True\) while requests are pending"):
            llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
        llm.llm_engine.abort_request(["pending"])
        assert llm.reset_prefix_cache(reset_running_requests=True) is True
    finally:
        llm.exit()


def test_reset_prefix_cache_is_false_while_running_requests_hold_blocks(ckpt):
    """vLLM's KV cache manager resets only while no block is held: with a running request holding
    blocks reset_prefix_cache() returns False and the cache is kept (a repeated prompt still hits
    it); once the request ends, True and nothing is cached. A waiting request holds no block."""
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=256)
    try:
        engine = llm.llm_engine
        prompt = list(range(1, 50))  # three full blocks of 16
        first = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        engine.add_request("waiting", [7, 8, 9], GREEDY)
        assert llm.reset_prefix_cache() is True  # no block held yet
        engine.abort_request("waiting")
        llm.generate([prompt], GREEDY, use_tqdm=False)  # cached again
        engine.add_request("running", [7, 8, 9], GREEDY)
        engine.step()  # its prefill: it holds a block until its last token
        assert engine.has_unfinished_requests() and llm.block_manager.num_free_blocks < len(llm.block_manager.blocks)
        assert llm.reset_prefix_cache() is False and engine.reset_prefix_cache() is False
        while engine.has_unfinished_requests():
            engine.step()
        hits = llm.block_manager.num_prefix_hit_blocks
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
        assert llm.block_manager.num_prefix_hit_blocks > hits  # the refused reset kept the cache
        check_reset_forgets(llm, prompt, first)
    finally:
        llm.exit()


def test_seed_none_is_vllms_seed_0(ckpt):
    """vLLM V1's LLM(seed=None) is seed 0 ("In V1, the seed parameter defaults to 0 ... It is impossible to
    un-specify a seed for V1": vLLM's docs/usage/reproducibility.md, PR #17929), so two such engines sample
    the same tokens as seed=0 does; another seed samples apart. (It was drawn from the OS: runs differed.)"""
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    samples, seeds = [], []
    for seed in (None, None, 0, 1):
        llm = cpu_llm(ckpt, seed=seed)
        try:
            seeds.append(llm.config.seed)
            samples.append(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids)
        finally:
            llm.exit()
    assert seeds == [0, 0, 0, 1]
    assert samples[0] == samples[1] == samples[2] != samples[3]
