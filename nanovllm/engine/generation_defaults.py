"""generate()'s default SamplingParams from a checkpoint's generation_config.json (vLLM's
generation_config="auto"), read with transformers' GenerationConfig.

Only the sampling keys the file sets count: temperature, top_k, top_p, min_p, repetition_penalty,
and max_new_tokens (as max_tokens); every other field keeps SamplingParams' default. They apply
when generate / chat get no sampling_params; explicit SamplingParams are used as given. The
file's eos_token_id is among the engine's EOS ids (utils/tokenizer.load_eos_token_ids).
"""

from __future__ import annotations

import os

from nanovllm.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field
GENERATION_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GENERATION_FILE = "generation_config.json"


def read_generation_config(directory: str) -> dict:
    """The keys `directory`'s generation_config.json sets ({} without one), read with transformers'
    GenerationConfig; a file transformers refuses (a bad max_new_tokens, not an object) raises
    ValueError / TypeError naming it."""
    path = os.path.join(directory, GENERATION_FILE)
    if not os.path.isfile(path):
        return {}
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(directory).to_diff_dict()
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: {e}") from e


def default_sampling_params(source: str, directory: str, values: dict) -> SamplingParams:
    """The defaults for LLM(generation_config=source): "vllm" SamplingParams(); otherwise those
    `values` (read_generation_config of `directory`, Config.generation_dir) set. Values
    SamplingParams refuses raise ValueError / TypeError naming the file."""
    if source == "vllm":
        return SamplingParams()
    overrides = {field: values[key] for key, field in GENERATION_KEYS.items() if values.get(key) is not None}
    try:
        return SamplingParams(**overrides)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{os.path.join(directory, GENERATION_FILE)}: {e}") from e
