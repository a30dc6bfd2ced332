"""generate()'s default SamplingParams from a checkpoint's generation_config.json (vLLM's
generation_config="auto"), read with transformers' GenerationConfig.

Only the sampling keys the file sets count: temperature, top_k, top_p, min_p, repetition_penalty,
and max_new_tokens (as max_tokens); every other field keeps SamplingParams' default. They apply
when generate / chat get no sampling_params; explicit SamplingParams are used as given.
"""

from __future__ import annotations

import os

from nanovllm.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field
GENERATION_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GENERATION_FILE = "generation_config.json"


def generation_overrides(directory: str) -> dict:
    """The SamplingParams fields that `directory`'s generation_config.json sets ({} without one)."""
    if not os.path.isfile(os.path.join(directory, GENERATION_FILE)):
        return {}
    from transformers import GenerationConfig

    values = GenerationConfig.from_pretrained(directory).to_diff_dict()
    return {field: values[key] for key, field in GENERATION_KEYS.items() if values.get(key) is not None}


def default_sampling_params(source: str, model_dir: str) -> SamplingParams:
    """The defaults for LLM(generation_config=source): "vllm" SamplingParams(); "auto" the
    checkpoint's file; a directory that one's. Values SamplingParams refuses raise ValueError /
    TypeError naming the file."""
    if source == "vllm":
        return SamplingParams()
    directory = model_dir if source == "auto" else source
    try:  # transformers' own checks of the file (a bad max_new_tokens, not an object) included
        return SamplingParams(**generation_overrides(directory))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{os.path.join(directory, GENERATION_FILE)}: {e}") from e
