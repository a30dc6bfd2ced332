"""Llama 3.x and Qwen2/2.5 on CPU against transformers' own classes; the model registry; the
llama3 RoPE table; config.json's two spellings; the published shapes in benchmarks/configs."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from checkpoints import (
    LlamaShape, Qwen2Shape, TinyShape, assert_greedy_matches_reference, build_llama_checkpoint, build_qwen2_checkpoint,
    build_shaped_checkpoint, check_greedy_tokens, check_scheduling_regimes, cpu_llm, generate_tokens,
    lazy_checkpoints_fixture, load_reference, make_prompts, rewrite_config, rewrite_config_published,
)
from nanovllm import SamplingParams
from nanovllm.layers.rope_scaling import Llama3RopeScaling
from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_inv_freq
from nanovllm.models.model_config import ModelConfig
from nanovllm.models.registry import SUPPORTED_ARCHITECTURES, build_model, model_class

CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# Llama shapes: original_max_position_embeddings is 64, so prompts of 100-200 tokens reach
# positions where llama3 scaling changes the rotation.
CHECKPOINTS = {
    "llama-tied-gqa2": LlamaShape(),  # head_dim 32 in config (not hidden / heads)
    "llama-untied-gqa4-derived-hd": LlamaShape(
        hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=None, tie_word_embeddings=False),
    "llama-biases": LlamaShape(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    "qwen2-tied": Qwen2Shape(),
    "qwen2-untied": Qwen2Shape(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    # Qwen2.5-0.5B's attention: 14 q heads over 2 kv heads of 64 (a group of 7), biases, tied, hidden 896
    "qwen2.5-0.5b-heads": Qwen2Shape(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                     intermediate_size=128),
}
# One checkpoint per family for the slower tests (scheduling regimes, tensor parallelism).
PER_FAMILY = ["llama-untied-gqa4-derived-hd", "qwen2-untied"]


def run(path, prompts, **kwargs):
    return generate_tokens(path, prompts, GREEDY, **kwargs)


checkpoints = lazy_checkpoints_fixture(CHECKPOINTS)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_matches_transformers(checkpoints, name):
    check_greedy_tokens(checkpoints(name), make_prompts(0, 4, 100, 200), GREEDY)


@pytest.mark.parametrize("name", PER_FAMILY)
def test_identical_under_every_scheduling_regime(checkpoints, name):
    path = checkpoints(name)
    shared = list(range(100, 148))  # 3 full blocks of 16 for the prefix cache
    prompts = [shared + p for p in make_prompts(1, 4, 60, 120)] + make_prompts(2, 3, 100, 160)
    # 14 blocks of 16 tokens: the longest request (< 184 tokens) fits, all seven together do not.
    check_scheduling_regimes(path, prompts, GREEDY, preempt_blocks=14)


@pytest.mark.parametrize("name", PER_FAMILY)
def test_tp2_matches_tp1(checkpoints, name):
    path = checkpoints(name)
    prompts = make_prompts(3, 4, 20, 120)
    single, _ = run(path, prompts)
    tp2, _ = run(path, prompts, tensor_parallel_size=2)
    assert tp2 == single


def test_fewer_kv_heads_than_ranks_are_replicated(checkpoints):
    """One KV head (with q/k/v biases) over 2 and 4 ranks: each rank holds a copy of it, as vLLM
    serves it (it was refused: tensor_parallel_size=2 does not divide num_key_value_heads=1)."""
    path = checkpoints("llama-biases")
    prompts = make_prompts(3, 3, 20, 120)
    single, _ = run(path, prompts)
    reference = load_reference(path)
    for tp in (2, 4):
        tokens, _ = run(path, prompts, tensor_parallel_size=tp)
        assert tokens == single, tp
        for prompt, out in zip(prompts, tokens):
            assert_greedy_matches_reference(reference, prompt, out)


def test_group_of_seven_over_two_ranks_and_refused_over_four(checkpoints):
    """Qwen2.5-0.5B's heads (14 q over 2 kv, biases): 2 ranks of 7 q heads over one kv head, with
    16-token prefill chunks and preemption, give one rank's tokens, transformers' argmaxes; 4 ranks
    do not divide 14 heads: refused naming the counts, as vLLM refuses them."""
    path = checkpoints("qwen2.5-0.5b-heads")
    prompts = make_prompts(3, 3, 20, 60)
    single, _ = run(path, prompts)
    reference = load_reference(path)
    for prompt, out in zip(prompts, single):
        assert_greedy_matches_reference(reference, prompt, out)
    # 8 blocks of 16: the longest request (< 76 tokens) fits, the three together do not
    tp2, llm = run(path, prompts, tensor_parallel_size=2, max_num_batched_tokens=16, num_kvcache_blocks=8)
    assert tp2 == single
    assert llm.scheduler.num_preemptions > 0
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide num_attention_heads=14"):
        cpu_llm(path, tensor_parallel_size=4)


@pytest.mark.parametrize("name", ["llama-tied-gqa2", "qwen2-untied"])
def test_both_config_spellings_give_identical_tokens(tmp_path, name):
    path = build_shaped_checkpoint(str(tmp_path / name), CHECKPOINTS[name])
    prompts = make_prompts(4, 3, 90, 150)
    new_spelling, _ = run(path, prompts)
    new_cfg = ModelConfig.from_pretrained(path)
    rewrite_config_published(path)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert "rope_parameters" not in raw and "dtype" not in raw and "rope_theta" in raw and "torch_dtype" in raw
    assert ModelConfig.from_pretrained(path) == new_cfg
    published, _ = run(path, prompts)
    assert published == new_spelling


def test_published_rope_scaling_is_read(tmp_path):
    """The top-level rope_scaling really reaches the model: another factor, other tokens."""
    path = build_llama_checkpoint(str(tmp_path / "llama"), LlamaShape())
    rewrite_config_published(path)
    prompts = make_prompts(5, 2, 150, 200)
    before, _ = run(path, prompts)
    with open(os.path.join(path, "config.json")) as f:
        scaling = json.load(f)["rope_scaling"]
    rewrite_config(path, rope_scaling={**scaling, "factor": 2.0})
    assert ModelConfig.from_pretrained(path).rope_scaling.factor == 2.0
    after, _ = run(path, prompts)
    assert after != before


def _hf_llama_config(head_dim: int, scaling: Llama3RopeScaling, theta: float, max_position: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=max_position,
        rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
                         "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
                         "original_max_position_embeddings": scaling.original_max_position_embeddings},
    )


@pytest.mark.parametrize("head_dim,theta,scaling,max_position", [
    (32, 500000.0, Llama3RopeScaling(8.0, 1.0, 4.0, 64), 512),  # the test checkpoints' table
    (128, 500000.0, Llama3RopeScaling(8.0, 1.0, 4.0, 8192), 16384),  # Llama 3.1's frequencies
    (64, 500000.0, Llama3RopeScaling(32.0, 1.0, 4.0, 8192), 16384),  # Llama 3.2's
])
def test_llama3_rope_table_matches_transformers(head_dim, theta, scaling, max_position):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = _hf_llama_config(head_dim, scaling, theta, max_position)
    hf_inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    assert attention_factor == 1.0
    ours = rope_inv_freq(head_dim, theta, scaling)  # float64
    # transformers computes in float32: agreement to float32 precision
    torch.testing.assert_close(ours, hf_inv_freq.double(), rtol=1e-6, atol=0)
    # every band of the scaling is exercised: kept, divided by factor, interpolated
    plain = rope_inv_freq(head_dim, theta)
    ratio = ours / plain
    kept, divided = (ratio - 1).abs() < 1e-12, (ratio - 1 / scaling.factor).abs() < 1e-12
    assert kept.any() and divided.any() and (~kept & ~divided).any()
    # the table is cos | sin of position x inv_freq, stored as float32
    rot = RotaryEmbedding(head_dim, max_position, theta, scaling)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), ours)
    torch.testing.assert_close(rot.cos_sin_cache.double(), torch.cat([angles.cos(), angles.sin()], -1),
                               rtol=0, atol=1e-7)
    # and transformers' rotary embedding (float32 angles: about 1e-4 at position 16k) gives the same
    hf_rot = LlamaRotaryEmbedding(hf_config)
    positions = torch.arange(max_position)[None]
    cos, sin = hf_rot(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, D] = the halves repeated
    half = head_dim // 2
    tol = 2 * max_position * torch.finfo(torch.float32).eps
    torch.testing.assert_close(rot.cos_sin_cache[:, :half], cos[0, :, :half], rtol=0, atol=tol)
    torch.testing.assert_close(rot.cos_sin_cache[:, half:], sin[0, :, :half], rtol=0, atol=tol)


def test_unsupported_architecture_is_refused_naming_it(tmp_path):
    path = build_qwen2_checkpoint(str(tmp_path / "q"), Qwen2Shape())
    rewrite_config(path, architectures=["GemmaForCausalLM"], model_type="gemma")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    with pytest.raises(ValueError, match=rf"unsupported architecture \['GemmaForCausalLM'\]; supported: {supported}"):
        cpu_llm(path)
    rewrite_config(path, architectures=None)
    with pytest.raises(ValueError, match="unsupported architecture None; supported: Qwen3ForCausalLM"):
        cpu_llm(path)
    with pytest.raises(ValueError, match="unsupported architecture 'Gemma'"):
        model_class("Gemma")


def test_registry_classes_carry_their_architecture_names():
    assert set(SUPPORTED_ARCHITECTURES) == {"Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                                            "Qwen2ForCausalLM", "Qwen3MoeForCausalLM"}
    for name in SUPPORTED_ARCHITECTURES:
        assert model_class(name).__name__ == name
    # the first supported entry of a list wins
    raw = json.loads((CONFIGS / "llama-3.2-1b" / "config.json").read_text())
    raw["architectures"] = ["SomethingElse", "LlamaForCausalLM"]
    assert ModelConfig.from_dict(raw).architecture == "LlamaForCausalLM"


# Published parameter counts (model cards / safetensors metadata of the hub checkpoints).
PUBLISHED_PARAMETERS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-0.5b": 494_032_768,  # tied embeddings, 14 / 2 heads of 64
}


def test_published_shapes_read_and_build():
    llama8 = ModelConfig.from_pretrained(str(CONFIGS / "llama-3.1-8b"))
    assert (llama8.architecture, llama8.head_dim, llama8.num_key_value_heads, llama8.tie_word_embeddings) == (
        "LlamaForCausalLM", 128, 8, False)
    assert llama8.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192) and llama8.rope_theta == 500000.0
    assert llama8.rms_norm_eps == 1e-5 and llama8.eos_token_ids == (128001, 128008, 128009)
    llama1 = ModelConfig.from_pretrained(str(CONFIGS / "llama-3.2-1b"))
    assert (llama1.head_dim, llama1.tie_word_embeddings, llama1.rope_scaling.factor) == (64, True, 32.0)
    qwen2 = ModelConfig.from_pretrained(str(CONFIGS / "qwen2.5-7b"))
    assert (qwen2.architecture, qwen2.head_dim, qwen2.rope_scaling, qwen2.eos_token_ids) == (
        "Qwen2ForCausalLM", 128, None, (151645,))
    for name, count in PUBLISHED_PARAMETERS.items():
        with torch.device("meta"):
            model = build_model(ModelConfig.from_pretrained(str(CONFIGS / name)))
        assert sum(p.numel() for p in model.parameters()) == count, name
    with torch.device("meta"):
        model = build_model(qwen2)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None and not attn.qk_norm


BASE = json.loads((CONFIGS / "llama-3.1-8b" / "config.json").read_text())


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope type 'longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     "missing factor"),
    ({"rope_scaling": {**BASE["rope_scaling"], "low_freq_factor": 4.0}}, "low_freq_factor=4.0, high_freq_factor=4.0"),
    ({"rope_scaling": {**BASE["rope_scaling"], "factor": 0}}, "factor must be > 0, got 0.0"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"hidden_size": 4001}, "no head_dim, and hidden_size=4001 is not a multiple of num_attention_heads=32"),
    # shapes the engine used to build and then fail on deep inside (a torch RuntimeError at start-up or in
    # the first step), or read silently wrong (1.5 positions as 1, a string through int())
    ({"vocab_size": -5}, r"vocab_size must be a positive int, got -5"),
    ({"num_hidden_layers": "two"}, r"num_hidden_layers must be a positive int, got 'two'"),
    ({"num_hidden_layers": 0}, r"num_hidden_layers must be a positive int, got 0"),
    ({"num_attention_heads": 0}, r"num_attention_heads must be a positive int, got 0"),
    ({"num_key_value_heads": 3}, r"num_attention_heads=32 is not a multiple of num_key_value_heads=3"),
    ({"intermediate_size": True}, r"intermediate_size must be a positive int, got True"),
    ({"head_dim": -64}, r"head_dim must be a positive int, got -64"),
    ({"max_position_embeddings": 1.5}, r"max_position_embeddings must be a positive int, got 1.5"),
    ({"max_position_embeddings": -1}, r"max_position_embeddings must be a positive int, got -1"),
    ({"rms_norm_eps": -1}, r"rms_norm_eps must be a positive finite number, got -1"),
    ({"eos_token_id": "x"}, r"eos_token_id must be a token id \(an int >= 0\) or a list of them, got 'x'"),
    ({"eos_token_id": [1, -1]}, r"eos_token_id must be a token id \(an int >= 0\) or a list of them, got \[1, -1\]"),
    # flags that are not JSON booleans: bool("false") read a hand-edited "false" as true, so a tied model's
    # lm_head was skipped (or an untied one's biases required) without a word, where no tokenizer is loaded
    # (with one, transformers' config validation raised a StrictDataclassFieldValidationError naming no file)
    ({"tie_word_embeddings": "false"}, r"config.json: tie_word_embeddings must be true or false, got 'false'"),
    ({"attention_bias": "true"}, r"attention_bias must be true or false, got 'true'"),
    ({"mlp_bias": 0}, r"mlp_bias must be true or false, got 0"),
    ({"use_sliding_window": "no", "sliding_window": 4096}, r"use_sliding_window must be true or false, got 'no'"),
    ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": "0"},
     r"max_window_layers must be an int >= 0 or null, got '0'"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 64, "norm_topk_prob": "false"}, r"^config.json: norm_topk_prob must be true or false, got 'false'"),
])
def test_config_refusals_name_the_value(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **change})


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("spellings", [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}, "rope_theta": 1e6},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}, "rope_scaling": LLAMA3, "rope_theta": 5e5},
    {"rope_parameters": LLAMA3, "rope_scaling": {"rope_type": "default"}, "rope_theta": 5e5},
    {"rope_scaling": LLAMA3, "rope_theta": 5e5, "original_max_position_embeddings": 16},
    {"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}, "rope_theta": 5e5},
    {"rope_scaling": None, "rope_theta": 2e5},
], ids=["dict-theta-wins", "scaling-over-parameters", "plain-scaling-over-parameters", "top-level-original-len",
        "original-len-defaults", "published-null"])
def test_rope_spellings_read_as_transformers_reads_them(spellings):
    """Configs carrying both spellings (a transformers-5 save edited by hand, Phi-3's top-level
    original_max_position_embeddings): theta and scaling are transformers' own reading of them."""
    from transformers import LlamaConfig

    raw = {**BASE, "max_position_embeddings": 2048, **spellings}
    for key in ("rope_scaling", "rope_parameters", "rope_theta"):
        if key not in spellings:
            raw.pop(key, None)
    ours = ModelConfig.from_dict(raw)
    config = LlamaConfig.from_dict(raw)
    config.standardize_rope_params()  # what the model's rotary embedding reads (the top-level length wins)
    theirs = config.rope_parameters
    assert ours.rope_theta == theirs["rope_theta"]
    if theirs["rope_type"] == "default":
        assert ours.rope_scaling is None
    else:
        assert ours.rope_scaling == Llama3RopeScaling(
            theirs["factor"], theirs["low_freq_factor"], theirs["high_freq_factor"],
            theirs["original_max_position_embeddings"])


@pytest.mark.parametrize("architecture,config_class", [
    ("LlamaForCausalLM", "LlamaConfig"), ("Qwen2ForCausalLM", "Qwen2Config"), ("Qwen3ForCausalLM", "Qwen3Config"),
])
def test_positions_a_config_leaves_out_are_its_familys_default(architecture, config_class):
    """No max_position_embeddings in config.json: transformers' default of the family's config
    class (Llama's 2048 capped max_model_len at 32768 before)."""
    import transformers

    raw = {**BASE, "architectures": [architecture]}
    raw.pop("max_position_embeddings", None)
    default = getattr(transformers, config_class).from_dict(raw).max_position_embeddings
    assert ModelConfig.from_dict(raw).max_position_embeddings == default


@pytest.mark.parametrize("architecture,config_class", [
    ("Qwen3ForCausalLM", "Qwen3Config"), ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"), ("Qwen2ForCausalLM", "Qwen2Config"),
    ("LlamaForCausalLM", "LlamaConfig"), ("MistralForCausalLM", "MistralConfig"),
])
def test_head_dim_a_config_leaves_out_is_read_as_transformers_reads_it(architecture, config_class):
    """No head_dim in config.json: Qwen3Config's default, 128 (hidden / heads read it as 64 here, so
    a checkpoint transformers and vLLM serve was refused at load on its k_norm's shape), the other
    families' hidden_size / num_attention_heads (their attention modules' rule)."""
    import transformers

    raw = {"architectures": [architecture], "vocab_size": 384, "hidden_size": 1024, "intermediate_size": 3072,
           "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 8, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    config = getattr(transformers, config_class).from_dict(raw)
    theirs = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert ModelConfig.from_dict(raw).head_dim == theirs


def test_qwen3_without_head_dim_matches_transformers(tmp_path):
    path = build_shaped_checkpoint(str(tmp_path / "qwen3"), TinyShape(head_dim=128))  # hidden 64 / 4 heads = 16
    rewrite_config(path, head_dim=None)
    check_greedy_tokens(path, make_prompts(0, 2, 40, 80), GREEDY)


def test_llama3_scaling_formula_by_hand():
    """The three bands on numbers worked out here: L = 64, low 1, high 4 -> wavelengths above 64
    divided by the factor, below 16 kept, at 32 (s = (64/32 - 1) / 3 = 1/3) interpolated."""
    scaling = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=64)
    wavelengths = torch.tensor([8.0, 16.0, 32.0, 64.0, 128.0], dtype=torch.float64)
    inv_freq = 2 * math.pi / wavelengths
    s32 = 1 / 3
    expected = torch.stack([
        inv_freq[0],  # short: kept
        inv_freq[1],  # at L / high (s = 1): kept
        (1 - s32) * inv_freq[2] / 8 + s32 * inv_freq[2],
        inv_freq[3] / 8,  # at L / low (s = 0): divided
        inv_freq[4] / 8,  # long: divided
    ])
    torch.testing.assert_close(scaling.scale(inv_freq, 500000.0), expected, rtol=1e-12, atol=0)
