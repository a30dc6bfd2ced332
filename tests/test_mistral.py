"""Mistral (MistralForCausalLM): Llama's decoder under its own name, against transformers' own
Mistral class; its sliding window served where it masks nothing (max_model_len <= window), and
refused past it, as Qwen2's and Qwen3's use_sliding_window is."""

from __future__ import annotations

import pytest
import torch

from checkpoints import _save_checkpoint, check_greedy_tokens, cpu_llm, make_prompts, rewrite_config
from nanovllm import SamplingParams
from nanovllm.models.model_config import ModelConfig

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def build_mistral_checkpoint(path: str, sliding_window: int | None, seed: int = 0) -> str:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, sliding_window=sliding_window,
        tie_word_embeddings=False, rms_norm_eps=1e-5, eos_token_id=0, bos_token_id=None, pad_token_id=None,
        initializer_range=0.2,  # spread logits: argmax ties are rare
    )
    return _save_checkpoint(path, MistralForCausalLM(config), None)


@pytest.mark.parametrize("window", [None, 512])  # Mistral 7B v0.3 (none) / v0.1's kind (4,096 there)
def test_mistral_matches_transformers(tmp_path, window):
    path = build_mistral_checkpoint(str(tmp_path / "mistral"), window)
    assert ModelConfig.from_pretrained(path).architecture == "MistralForCausalLM"
    check_greedy_tokens(path, make_prompts(0, 4, 100, 200), GREEDY)  # max_model_len 512: the window masks nothing


def test_a_window_that_would_mask_is_refused_and_bounds_the_default_length(tmp_path):
    path = build_mistral_checkpoint(str(tmp_path / "mistral"), 300)
    with pytest.raises(ValueError, match=r"max_model_len=512 exceeds the model's attention window \(sliding_window=300"):
        cpu_llm(path, max_model_len=512)
    llm = cpu_llm(path, kvcache_block_size=16)
    try:
        assert llm.llm_engine.model_config.max_model_len == 300
    finally:
        llm.exit()


def test_qwen_use_sliding_window_is_read_as_a_window(tmp_path):
    """Qwen2 / Qwen3 write sliding_window beside use_sliding_window: a true flag makes it one for the
    layers from max_window_layers on; transformers 5's layer_types say per layer."""
    path = build_mistral_checkpoint(str(tmp_path / "m"), None)
    rewrite_config(path, architectures=["Qwen2ForCausalLM"], sliding_window=256, use_sliding_window=False)
    assert ModelConfig.from_pretrained(path).sliding_window is None
    rewrite_config(path, use_sliding_window=True, max_window_layers=0)
    assert ModelConfig.from_pretrained(path).sliding_window == 256
    rewrite_config(path, max_window_layers=2)  # Qwen2: layers from max_window_layers on slide; it has 2 layers
    assert ModelConfig.from_pretrained(path).sliding_window is None
    rewrite_config(path, max_window_layers=1)
    assert ModelConfig.from_pretrained(path).sliding_window == 256
    rewrite_config(path, layer_types=["full_attention", "full_attention"])  # transformers 5 writes them out
    assert ModelConfig.from_pretrained(path).sliding_window is None
    rewrite_config(path, layer_types=["full_attention", "sliding_attention"])
    assert ModelConfig.from_pretrained(path).sliding_window == 256
    rewrite_config(path, sliding_window=-4)
    with pytest.raises(ValueError, match="sliding_window must be a positive int or null, got -4"):
        ModelConfig.from_pretrained(path)


# transformers' config class of each windowed family, and whether its attention reads the window in every layer
# (Mistral's and Qwen3-MoE's) or in the layers its layer_types name (Qwen2's and Qwen3's).
WINDOW_FAMILIES = {"MistralForCausalLM": ("MistralConfig", True), "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", True),
                   "Qwen2ForCausalLM": ("Qwen2Config", False), "Qwen3ForCausalLM": ("Qwen3Config", False)}


@pytest.mark.parametrize("architecture", list(WINDOW_FAMILIES))
@pytest.mark.parametrize("keys", [
    {}, {"sliding_window": None}, {"sliding_window": 256}, {"use_sliding_window": False, "sliding_window": 256},
    {"use_sliding_window": True}, {"use_sliding_window": True, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": 256}, {"use_sliding_window": True, "sliding_window": 256,
                                                          "max_window_layers": 1},
    {"use_sliding_window": True, "sliding_window": 256, "max_window_layers": 2},
    {"use_sliding_window": True, "sliding_window": 256, "layer_types": ["full_attention"] * 2},
    {"use_sliding_window": False, "sliding_window": 256, "layer_types": ["full_attention", "sliding_attention"]},
])
def test_the_window_is_read_as_transformers_reads_it(architecture, keys):
    """A family's window keys (and their absence: the config class's defaults, sliding_window 4096,
    use_sliding_window false, max_window_layers 28) give the window transformers' model of the family
    attends with in some layer: Mistral's read sliding_window alone (no key: 4096, once served unmasked
    past it), Qwen2 / Qwen3's only under use_sliding_window (a window beside an absent flag bounded
    max_model_len)."""
    import transformers

    config_class, every_layer = WINDOW_FAMILIES[architecture]
    raw = {"architectures": [architecture], "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 32768, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           **keys}
    config = getattr(transformers, config_class).from_dict(raw)
    slides = every_layer or "sliding_attention" in config.layer_types
    assert ModelConfig.from_dict(raw).sliding_window == (config.sliding_window if slides else None)
