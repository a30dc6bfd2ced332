"""RoPE scalings beyond Llama 3's (layers/rope_scaling.py): YaRN (Qwen3's documented long-context
setting) and linear interpolation, their tables against transformers' own, engines with them
against transformers' greedy tokens, vLLM's derived maximum length, `hf_overrides` (vLLM's way to
turn YaRN on without editing config.json), and the refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoints import (
    LlamaShape,
    TinyShape,
    assert_greedy_matches_reference,
    build_checkpoint,
    build_llama_checkpoint,
    cpu_llm,
    generate_tokens,
    load_reference,
    make_prompts,
    rewrite_config,
    rewrite_config_published,
)

from nanovllm import SamplingParams
from nanovllm.config import Config
from nanovllm.layers.rope_scaling import LinearRopeScaling, YarnRopeScaling, parse_rope_scaling
from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_inv_freq
from nanovllm.models.model_config import ModelConfig

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# The tiny checkpoints' YaRN: an original context of 64 positions, 4x longer served (256), so the
# prompts of 100-200 tokens run where the scaling changes the rotation.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
YARN_POSITIONS = 256
# Qwen3's published setting (its model cards): 32,768 original positions, factor 4.
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("head_dim,theta,max_position,rope", [
    (128, 1e6, 40960, QWEN3_YARN),  # Qwen3-8B with its model card's YaRN
    (64, 1e4, 4096, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                     "mscale": 1.0, "mscale_all_dim": 0.5}),  # the attention factor from mscale / mscale_all_dim
    (64, 1e4, 4096, {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 512,
                     "truncate": False, "beta_fast": 16, "beta_slow": 2}),
    (64, 1e4, 4096, {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 512,
                     "attention_factor": 1.3}),
    (64, 1e4, 4096, {"rope_type": "yarn", "factor": None,
                     "original_max_position_embeddings": 1024}),  # factor from the lengths (4)
    (32, 1e4, 4096, {"rope_type": "linear", "factor": 2.0}),
])
def test_tables_match_transformers(head_dim, theta, max_position, rope):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = Qwen3Config(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                            max_position_embeddings=max_position, rope_parameters={**rope, "rope_theta": theta})
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, torch.device("cpu"))
    scaling = parse_rope_scaling(dict(rope), max_position, "config.json")
    ours = rope_inv_freq(head_dim, theta, scaling)
    # transformers computes in float32: agreement to float32 precision
    torch.testing.assert_close(ours, hf_inv_freq.double(), rtol=1e-6, atol=0)
    assert scaling.attention_factor == pytest.approx(hf_factor, rel=1e-12)
    plain = rope_inv_freq(head_dim, theta)
    if isinstance(scaling, YarnRopeScaling):  # every band: kept, divided by factor, ramped between
        ratio = ours / plain
        kept, divided = (ratio - 1).abs() < 1e-12, (ratio - 1 / scaling.factor).abs() < 1e-12
        assert kept.any() and divided.any() and (~kept & ~divided).any()
    # the table is (cos | sin) x the attention factor, float32
    table = RotaryEmbedding(head_dim, 64, theta, scaling).cos_sin_cache.double()
    angles = torch.outer(torch.arange(64, dtype=torch.float64), ours)
    expected = torch.cat([angles.cos(), angles.sin()], -1) * scaling.attention_factor
    torch.testing.assert_close(table, expected, rtol=0, atol=1e-6)


def test_served_positions_are_vllms_derived_lengths():
    assert parse_rope_scaling(QWEN3_YARN, 40960, "c").max_positions(40960) == 131072  # original x factor
    assert LinearRopeScaling(2.0).max_positions(4096) == 8192  # max_position_embeddings x factor
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    assert parse_rope_scaling(llama3, 131072, "c").max_positions(131072) == 131072  # as given


@pytest.fixture(scope="module")
def yarn_qwen3(tmp_path_factory):
    """A tiny Qwen3 with YaRN in transformers 5's spelling (rope_parameters)."""
    path = build_checkpoint(str(tmp_path_factory.mktemp("yarn")), TinyShape(), seed=3)
    rewrite_config(path, rope_parameters={**YARN, "rope_theta": 10000.0})
    return path


def test_yarn_engine_matches_transformers(yarn_qwen3):
    prompts = make_prompts(0, 4, 100, 200)
    outs, _ = generate_tokens(yarn_qwen3, prompts, GREEDY, max_model_len=YARN_POSITIONS)
    reference = load_reference(yarn_qwen3)
    assert reference.config.rope_parameters["rope_type"] == "yarn"
    for prompt, out in zip(prompts, outs):
        assert len(out) == GREEDY.max_tokens
        assert_greedy_matches_reference(reference, prompt, out)


def test_yarn_in_the_published_spelling_and_through_hf_overrides(yarn_qwen3, tmp_path):
    prompts = make_prompts(1, 3, 120, 200)
    expected, _ = generate_tokens(yarn_qwen3, prompts, GREEDY, max_model_len=YARN_POSITIONS)
    # the published spelling: rope_scaling beside a top-level rope_theta (Qwen3's model cards)
    published = build_checkpoint(str(tmp_path / "published"), TinyShape(), seed=3)
    rewrite_config(published, rope_parameters={**YARN, "rope_theta": 10000.0})
    rewrite_config_published(published)
    assert generate_tokens(published, prompts, GREEDY, max_model_len=YARN_POSITIONS)[0] == expected
    # hf_overrides on the plain checkpoint: vLLM's LLM(..., hf_overrides={"rope_scaling": ...})
    plain = build_checkpoint(str(tmp_path / "plain"), TinyShape(), seed=3)
    rewrite_config_published(plain)
    overrides = {"rope_scaling": YARN}
    assert generate_tokens(plain, prompts, GREEDY, max_model_len=YARN_POSITIONS, hf_overrides=overrides)[0] == expected
    assert generate_tokens(plain, prompts, GREEDY, max_model_len=YARN_POSITIONS)[0] != expected  # it did something
    llm = cpu_llm(plain, kvcache_block_size=16, hf_overrides=overrides)
    try:  # the derived length is the served one, and vLLM clients see the overridden config (the published theta kept)
        assert llm.llm_engine.model_config.max_model_len == YARN_POSITIONS
        hf_rope = llm.llm_engine.model_config.hf_config.rope_parameters
        assert (hf_rope["rope_type"], hf_rope["rope_theta"]) == ("yarn", llm.config.model_config.rope_theta)
    finally:
        llm.exit()
    with open(os.path.join(plain, "config.json")) as f:
        assert json.load(f)["rope_scaling"] is None  # the file itself is untouched


def test_an_hf_overrides_scaling_keeps_a_transformers_5_configs_theta(tmp_path):
    """transformers 5 writes theta inside rope_parameters only: a rope_scaling given by hf_overrides
    (which names no theta) keeps it, as the published spelling's top-level rope_theta is kept; and the
    caller's overrides dict is not edited by anything that reads it (transformers' AutoConfig does)."""
    path = build_checkpoint(str(tmp_path / "theta"), TinyShape(), seed=3)
    rewrite_config(path, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    overrides = {"rope_scaling": dict(YARN)}
    assert ModelConfig.from_pretrained(path, overrides).rope_theta == 1e6
    prompts = make_prompts(6, 2, 120, 200)
    published = build_checkpoint(str(tmp_path / "published"), TinyShape(), seed=3)
    rewrite_config(published, rope_parameters={**YARN, "rope_theta": 1e6})
    rewrite_config_published(published)
    expected, _ = generate_tokens(published, prompts, GREEDY, max_model_len=YARN_POSITIONS)
    llm = cpu_llm(path, kvcache_block_size=16, max_model_len=YARN_POSITIONS, hf_overrides=overrides)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        hf_rope = llm.llm_engine.model_config.hf_config.rope_parameters  # transformers', as if the file said so
        assert (hf_rope["rope_type"], hf_rope["rope_theta"]) == ("yarn", 1e6)
        assert overrides == {"rope_scaling": YARN}  # as given, after transformers read its copy
    finally:
        llm.exit()
    assert generate_tokens(path, prompts, GREEDY, max_model_len=YARN_POSITIONS, hf_overrides=overrides)[0] == expected


def test_linear_scaling_engine_matches_transformers(tmp_path):
    path = build_llama_checkpoint(str(tmp_path / "linear"), LlamaShape(), seed=4)
    rewrite_config(path, rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 10000.0})
    assert ModelConfig.from_pretrained(path).rope_scaling == LinearRopeScaling(3.0)
    prompts = make_prompts(2, 3, 100, 200)
    outs, _ = generate_tokens(path, prompts, GREEDY)
    reference = load_reference(path)
    for prompt, out in zip(prompts, outs):
        assert_greedy_matches_reference(reference, prompt, out)


def test_max_model_len_past_the_served_positions_is_refused(yarn_qwen3):
    with pytest.raises(ValueError, match=f"max_model_len=257 exceeds the {YARN_POSITIONS} positions the model "
                                         "serves with its RoPE scaling"):
        cpu_llm(yarn_qwen3, max_model_len=YARN_POSITIONS + 1)


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope type 'dynamic' is not supported \(plain RoPE or one of"),
    ({"rope_type": "linear"}, "linear rope scaling is missing factor"),
    ({"rope_type": "linear", "factor": -1.0}, "linear rope factor must be > 0, got -1.0"),
    ({**YARN, "beta_fast": 1, "beta_slow": 32}, "yarn rope needs beta_fast > beta_slow > 0"),
    ({**YARN, "attention_factor": 0}, "yarn rope attention_factor must be > 0, got 0"),
    ({**YARN, "original_max_position_embeddings": -5}, "yarn rope original_max_position_embeddings must be > 0"),
    ("x", "rope_scaling must be an object .or null., got 'x'"),
    # transformers 5's per-layer-type spelling (which these families' rotary embeddings cannot read): read as
    # plain RoPE of theta 10000, whatever thetas it held
    ({"full_attention": {"rope_type": "default", "rope_theta": 1e6},
      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
     r"rope_scaling nested by layer type \['full_attention', 'sliding_attention'\] is not supported"),
])
def test_bad_scalings_are_refused_naming_the_value(rope, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 32, "hidden_size": 64,
                               "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                               "rope_scaling": rope}, source="config.json")


@pytest.mark.parametrize("overrides", [lambda config: config, {1: "x"}, [("rope_scaling", YARN)]])
def test_hf_overrides_must_be_a_dict_of_keys(yarn_qwen3, overrides):
    with pytest.raises(TypeError, match="hf_overrides must be a dict of config.json keys"):
        cpu_llm(yarn_qwen3, hf_overrides=overrides)


def test_a_bad_override_is_named_with_the_file(yarn_qwen3):
    with pytest.raises(ValueError, match=r"config.json with hf_overrides \['rope_scaling'\]: rope type 'su'"):
        cpu_llm(yarn_qwen3, hf_overrides={"rope_scaling": {"rope_type": "su"}})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_yarn_bf16_on_the_gpu_matches_transformers_with_and_without_graphs(tmp_path):
    """The GPU path reads the same table (fused q/k norm + RoPE + KV write): YaRN's frequencies and
    its attention factor reach it. An original context of 256, prompts up to 600 tokens."""
    from checkpoints import GPU_SHAPE, assert_bf16_greedy_matches, gpu_generate
    from transformers import AutoModelForCausalLM

    path = build_checkpoint(str(tmp_path / "yarn_gpu"), GPU_SHAPE)
    rewrite_config(path, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                          "rope_theta": 10000.0})
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    reference = reference.cuda().eval()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = make_prompts(7, 8, 1, 600)
    (graphed,), _ = gpu_generate(path, [prompts], params, max_model_len=1024)
    (eager,), _ = gpu_generate(path, [prompts], params, max_model_len=1024, enforce_eager=True)
    assert graphed == eager
    with torch.no_grad():
        for prompt, out in zip(prompts, graphed):
            assert_bf16_greedy_matches(reference, prompt, out)


def test_vllms_rope_scaling_and_rope_theta_keywords_are_hf_overrides(tmp_path):
    """vLLM's LLM(rope_scaling=..., rope_theta=...): EngineArgs keywords its ModelConfig sets into hf_overrides,
    over a same key there (`hf_overrides_kw.update({"rope_scaling": ...})`; rope_scaling when truthy, rope_theta
    when not None), so served as a checkpoint whose config.json says so. They were unknown keywords (TypeError)."""
    prompts = make_prompts(7, 2, 120, 200)
    published = build_checkpoint(str(tmp_path / "published"), TinyShape(), seed=3)
    rewrite_config(published, rope_parameters={**YARN, "rope_theta": 1e6})
    rewrite_config_published(published)
    expected, _ = generate_tokens(published, prompts, GREEDY, max_model_len=YARN_POSITIONS)
    plain = build_checkpoint(str(tmp_path / "plain"), TinyShape(), seed=3)
    rewrite_config_published(plain)
    assert generate_tokens(plain, prompts, GREEDY, max_model_len=YARN_POSITIONS)[0] != expected
    for overrides in (None, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 5.0}):
        outs, llm = generate_tokens(plain, prompts, GREEDY, max_model_len=YARN_POSITIONS, rope_scaling=dict(YARN),
                                    rope_theta=1e6, hf_overrides=overrides)
        assert outs == expected and llm.config.model_config.max_positions == YARN_POSITIONS
    for unset in ({"rope_scaling": None, "rope_theta": None}, {"rope_scaling": {}}):  # ask for nothing
        assert Config.from_kwargs(plain, {"device": "cpu", **unset}).hf_overrides is None
