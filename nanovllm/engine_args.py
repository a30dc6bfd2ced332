"""vLLM's `LLM(...)` keywords that need no setting here, accepted so that code written for vLLM
(lm-eval's vLLM backend, verl's rollout) can build an engine.

Each one is accepted only with a value that asks for what nanovllm does anyway. Any other value is
a ValueError that names the keyword and says what nanovllm does instead:

    revision, tokenizer_revision, code_revision   None / "main": the model is a local directory
    download_dir                                  None or a path: nothing is downloaded
    tokenizer_mode                                "auto" / "hf": transformers' AutoTokenizer
    trust_remote_code                             a bool: no checkpoint code runs (built-in families only)
    model_impl                                    "auto" / "vllm": the built-in model classes
    swap_space                                    a number >= 0: preempted requests are recomputed, never swapped
    enable_lora                                   False: no LoRA (max_lora_rank, max_loras: any int, unused)
    enable_sleep_mode                             a bool: sleep() / wake_up() always work
    distributed_executor_backend                  None / "mp": tensor-parallel ranks are this engine's processes;
                                                  "uni" / "external_launcher" at tensor_parallel_size 1 (one
                                                  engine in this process, as each rank of a torchrun job builds)
    pipeline_parallel_size, data_parallel_size    1: one pipeline stage, one replica (Ray Data scales out)
    disable_custom_all_reduce, disable_log_stats  a bool: torch.distributed's all-reduce; no stats log
    enable_chunked_prefill                        None / a bool: prompts over the step budget are always chunked
    limit_mm_per_prompt                           None / {} / all counts 0: text models only
    disable_mm_preprocessor_cache                 a bool: text models only
    compilation_config, max_seq_len_to_capture,   vLLM's own machinery's tuning (graphs, torch.compile,
    cpu_offload_gb (0), served_model_name, task,  scheduler and output processing): nanovllm's does the
    runner ("generate"), enable_expert_parallel,  same job (each value accepted is one that asks for what
    async_scheduling, disable_async_output_proc,  it does: VLLM_ONLY_ARGS says why)
    disable_sliding_window,
    num_scheduler_steps (1), use_v2_block_manager,
    preemption_mode ("recompute")
    worker_extension_cls, worker_cls              None: no worker classes of the caller's (collective_rpc(func))
    hf_token                                      None, a bool or a str: nothing is downloaded
    mm_processor_kwargs, allowed_local_media_path,  None / {} / "" / []: text models only
    allowed_media_domains
    speculative_config (None), logits_processors  features nanovllm lacks, asked for off (SamplingParams'
    (None / []), enable_prompt_embeds (False),    logit_bias / allowed_token_ids / bad_words rules still
    pooler_config, override_pooler_config (None), apply); scheduling_policy "fcfs": arrival order
    convert ("auto" / "none"),
    enable_return_routed_experts (False), scheduling_policy ("fcfs"),
    max_parallel_loading_workers (None / an int)
    guided_decoding_backend                       None / "auto" / "xgrammar": xgrammar is the only grammar backend
    structured_outputs_config                     None or a dict of StructuredOutputsConfig's fields asking for
                                                  xgrammar (STRUCTURED_OUTPUTS_CONFIG); compact JSON is asked per
                                                  request (StructuredOutputsParams.disable_any_whitespace)

vLLM's rope_scaling and rope_theta (EngineArgs keywords its ModelConfig sets into hf_overrides, over a same
key there: rope_scaling when truthy, rope_theta when not None) are such hf_overrides keys here too (HF_OVERRIDE_ARGS).

Keywords vLLM sets to None for "the default" (max_model_len, max_num_seqs, max_num_batched_tokens,
enable_prefix_caching) take the default here too (config.Config); vLLM's `block_size` is
`kvcache_block_size`, its `num_gpu_blocks_override` is `num_kvcache_blocks` (RENAMED).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real


@dataclass(frozen=True)
class _Accepted:
    """A vLLM keyword: which values mean what nanovllm does (`ok`; `one_rank`: also these at
    tensor_parallel_size 1), said as `expects`, and why."""

    ok: Callable[[object], bool]
    expects: str
    why: str
    one_rank: tuple[object, ...] = ()


def _is_bool(v: object) -> bool:
    return isinstance(v, bool)


def _no_media(v: object) -> bool:
    return v is None or (isinstance(v, dict) and all(n == 0 for n in v.values()))


_LOCAL = _Accepted(lambda v: v in (None, "main"), "None or 'main'",
                   "the model and tokenizer are read from local directories")
_UNUSED_INT = _Accepted(lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)), "None or an int",
                        "no LoRA adapters are served")

GRAMMAR_BACKEND_WHY = "xgrammar is the only grammar backend (engine/structured_outputs.py)"
# vLLM's StructuredOutputsConfig fields: the values that ask for what this engine does (see VLLM_ONLY_ARGS).
STRUCTURED_OUTPUTS_CONFIG: dict[str, Callable[[object], bool]] = {
    "backend": lambda v: v in ("auto", "xgrammar"),
    "disable_fallback": _is_bool,  # no other backend to fall back to
    "disable_additional_properties": _is_bool,  # xgrammar's strict mode, as StructuredOutputsParams' field
    "disable_any_whitespace": lambda v: v is False,  # engine-wide compact JSON is not kept: per request here
    "reasoning_parser": lambda v: v in (None, ""),
    "reasoning_parser_plugin": lambda v: v in (None, ""),
    "enable_in_reasoning": _is_bool,  # without a reasoning parser the grammar applies from the first token anyway
}

VLLM_ONLY_ARGS: dict[str, _Accepted] = {
    "revision": _LOCAL,
    "tokenizer_revision": _LOCAL,
    "code_revision": _LOCAL,
    "tokenizer_mode": _Accepted(lambda v: v in ("auto", "hf"), "'auto' or 'hf'", "transformers' AutoTokenizer loads it"),
    "trust_remote_code": _Accepted(_is_bool, "a bool", "no checkpoint code runs: the model families are built in"),
    "swap_space": _Accepted(lambda v: isinstance(v, Real) and not isinstance(v, bool) and v >= 0, "a number >= 0",
                            "preempted requests are recomputed, never swapped"),
    "enable_lora": _Accepted(lambda v: v is False or v is None, "False", "LoRA adapters are not supported"),
    "max_lora_rank": _UNUSED_INT,
    "max_loras": _UNUSED_INT,
    "enable_sleep_mode": _Accepted(_is_bool, "a bool", "sleep() and wake_up() always work"),
    "download_dir": _Accepted(lambda v: v is None or isinstance(v, (str, os.PathLike)), "None or a path",
                              "the model is a local directory: nothing is downloaded"),
    "model_impl": _Accepted(lambda v: v in ("auto", "vllm"), "'auto' or 'vllm'", "the model families are built in"),
    # "uni" / "external_launcher": one engine in this process, as each rank of a torchrun job builds
    "distributed_executor_backend": _Accepted(lambda v: v in (None, "mp"), "None or 'mp' (also 'uni' or "
                                              "'external_launcher' at tensor_parallel_size=1)",
                                              "tensor-parallel ranks are processes this engine spawns",
                                              one_rank=("uni", "external_launcher")),
    "pipeline_parallel_size": _Accepted(lambda v: type(v) is int and v == 1, "1",
                                        "no pipeline parallelism: tensor_parallel_size splits the model"),
    "data_parallel_size": _Accepted(lambda v: type(v) is int and v == 1, "1",
                                    "one replica per engine: nanovllm.ray_data runs several"),
    "disable_custom_all_reduce": _Accepted(_is_bool, "a bool", "ranks all-reduce through torch.distributed"),
    "disable_log_stats": _Accepted(_is_bool, "a bool", "no stats are logged"),
    "enable_chunked_prefill": _Accepted(lambda v: v is None or _is_bool(v), "None or a bool",
                                        "prompts longer than the step budget are always chunked"),
    "limit_mm_per_prompt": _Accepted(_no_media, "None or zero counts", "only text models are served"),
    "disable_mm_preprocessor_cache": _Accepted(_is_bool, "a bool", "only text models are served"),
    # Tuning of vLLM's own machinery (verl, NeMo-RL and scripts pass them): nanovllm's does the same job.
    "compilation_config": _Accepted(lambda v: v is None or isinstance(v, (int, dict)), "None, an int or a dict",
                                    "no torch.compile: CUDA graphs are nanovllm's own (enforce_eager, prefill_graphs)"),
    "max_seq_len_to_capture": _Accepted(lambda v: type(v) is int and v >= 1, "an int >= 1",
                                        "decode graphs serve every length up to max_model_len"),
    "cpu_offload_gb": _Accepted(lambda v: isinstance(v, Real) and not isinstance(v, bool) and v == 0, "0",
                                "the weights stay on the device"),
    "served_model_name": _Accepted(lambda v: v is None or isinstance(v, (str, list)), "None, a str or a list",
                                   "a server's display name: nothing is served"),
    "task": _Accepted(lambda v: v in ("auto", "generate"), "'auto' or 'generate'", "only text generation is served"),
    "runner": _Accepted(lambda v: v in ("auto", "generate"), "'auto' or 'generate'",
                        "only text generation is served"),
    "enable_expert_parallel": _Accepted(lambda v: v is False, "False (also True at tensor_parallel_size=1)",
                                        "a MoE's experts are split by tensor parallelism", one_rank=(True,)),
    "async_scheduling": _Accepted(lambda v: v is None or _is_bool(v), "None or a bool",
                                  "overlap scheduling queues each step before the last one's tokens are read"),
    "disable_async_output_proc": _Accepted(_is_bool, "a bool",
                                           "outputs are processed while the device runs the next step"),
    "disable_sliding_window": _Accepted(_is_bool, "a bool", "sequences are served up to a model's attention "
                                        "window, which is what True asks (sliding-window attention is not implemented)"),
    "num_scheduler_steps": _Accepted(lambda v: type(v) is int and v == 1, "1", "one scheduling step per forward"),
    "use_v2_block_manager": _Accepted(_is_bool, "a bool", "the paged block manager is nanovllm's"),
    "preemption_mode": _Accepted(lambda v: v in (None, "recompute"), "None or 'recompute'",
                                 "preempted requests are recomputed, never swapped"),
    # Classes vLLM mixes into its workers (NeMo-RL, SkyRL, open-instruct: collective_rpc("method") weight syncs).
    "worker_extension_cls": _Accepted(lambda v: v in (None, ""), "None", "no worker extensions: "
                                      "collective_rpc(func) runs a top-level function of each rank's worker, and "
                                      "update_weights / model.load_weights take the new weights"),
    "worker_cls": _Accepted(lambda v: v in (None, "auto"), "None or 'auto'", "the workers are nanovllm's: "
                            "collective_rpc(func) runs a top-level function of each rank's worker"),
    # vLLM keywords at their defaults (scripts spelling out vLLM's LLM(...) signature): features not here, asked off.
    "hf_token": _Accepted(lambda v: v is None or isinstance(v, (bool, str)), "None, a bool or a str",
                          "the model is a local directory: nothing is downloaded"),
    "mm_processor_kwargs": _Accepted(lambda v: v is None or v == {}, "None or {}", "only text models are served"),
    "allowed_local_media_path": _Accepted(lambda v: v in (None, ""), "''", "only text models are served"),
    "allowed_media_domains": _Accepted(lambda v: v is None or v == [], "None", "only text models are served"),
    "speculative_config": _Accepted(lambda v: v is None, "None", "no speculative decoding"),
    "logits_processors": _Accepted(lambda v: v is None or v == [], "None", "no logits-processor plugins: SamplingParams' "
                                   "logit_bias, allowed_token_ids, bad_words and structured_outputs cover the usual ones"),
    "enable_prompt_embeds": _Accepted(lambda v: v is False, "False", "prompts are text or token ids"),
    "pooler_config": _Accepted(lambda v: v is None, "None", "only text generation is served"),
    "override_pooler_config": _Accepted(lambda v: v is None, "None", "only text generation is served"),
    "convert": _Accepted(lambda v: v in ("auto", "none"), "'auto' or 'none'", "only text generation is served"),
    "enable_return_routed_experts": _Accepted(lambda v: v is False, "False", "routed experts are not reported"),
    "scheduling_policy": _Accepted(lambda v: v == "fcfs", "'fcfs'", "requests are served in arrival order"),
    "max_parallel_loading_workers": _Accepted(lambda v: v is None or (type(v) is int and v >= 1), "None or an int >= 1",
                                              "each rank loads its own shards"),
    # vLLM's engine-wide structured-outputs settings (its older guided_decoding_backend, its StructuredOutputsConfig).
    "guided_decoding_backend": _Accepted(lambda v: v in (None, "auto", "xgrammar"), "None, 'auto' or 'xgrammar'",
                                         GRAMMAR_BACKEND_WHY),
    "structured_outputs_config": _Accepted(
        lambda v: v is None or (isinstance(v, dict) and all(k in STRUCTURED_OUTPUTS_CONFIG and STRUCTURED_OUTPUTS_CONFIG[k](x)
                                                            for k, x in v.items())),
        "None or a dict of vLLM's StructuredOutputsConfig fields: backend 'auto' / 'xgrammar', disable_fallback, "
        "disable_additional_properties and enable_in_reasoning a bool, disable_any_whitespace False, reasoning_parser "
        "and reasoning_parser_plugin '' / None",
        GRAMMAR_BACKEND_WHY + "; StructuredOutputsParams(disable_any_whitespace=True) makes a request's JSON compact; "
        "no reasoning parsers"),
}

# Keywords whose None means "the engine's default" in vLLM.
NONE_MEANS_DEFAULT = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching")
# vLLM's shorthands of hf_overrides keys (its ModelConfig: `hf_overrides_kw.update({"rope_scaling": ...})`).
HF_OVERRIDE_ARGS = ("rope_scaling", "rope_theta")
# vLLM's names of settings that have another name here.
RENAMED = {"block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks"}


def strip_vllm_only_args(kwargs: dict) -> dict:
    """`kwargs` without the VLLM_ONLY_ARGS (each checked: ValueError naming a value that asks for
    something nanovllm does not do), without NONE_MEANS_DEFAULT keywords set to None, and with
    HF_OVERRIDE_ARGS set into hf_overrides (as vLLM sets them: over its same keys)."""
    kept = {}
    overrides = {}
    one_rank = kwargs.get("tensor_parallel_size", 1) == 1
    for name, value in kwargs.items():
        accepted = VLLM_ONLY_ARGS.get(name)
        if name in RENAMED:
            if RENAMED[name] in kwargs:
                raise TypeError(f"LLM() got both {name} (vLLM's name) and {RENAMED[name]}: pass one")
            if value is not None:
                kept[RENAMED[name]] = value
        elif name in HF_OVERRIDE_ARGS:
            given = bool(value) if name == "rope_scaling" else value is not None  # vLLM's test of each
            if given:
                overrides[name] = value
        elif accepted is None:
            if not (name in NONE_MEANS_DEFAULT and value is None):
                kept[name] = value
        elif not (accepted.ok(value) or (one_rank and value in accepted.one_rank)):
            raise ValueError(f"LLM({name}={value!r}): nanovllm takes {accepted.expects} here ({accepted.why})")
    base = kept.get("hf_overrides")
    if overrides and base is None:
        kept["hf_overrides"] = overrides
    elif overrides and isinstance(base, dict):
        kept["hf_overrides"] = {**base, **overrides}
    # (a hf_overrides that is not a dict stays as given: Config refuses it, naming it)
    return kept
