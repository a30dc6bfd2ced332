"""generate()'s default SamplingParams from a checkpoint's generation_config.json (vLLM's
generation_config="auto"), read with transformers' GenerationConfig.

Only the sampling keys the file sets count: temperature, top_k, top_p, min_p, repetition_penalty,
and max_new_tokens (as max_tokens); every other field keeps SamplingParams' default. They apply
when generate / chat get no sampling_params; explicit SamplingParams are used as given. The
file's eos_token_id is among the engine's EOS ids, config.json's in its place where there is no
file (utils/tokenizer.load_eos_token_ids).
LLM(override_generation_config={...}) (vLLM's option) sets those keys over the file's, and applies
under "vllm" too.
"""

from __future__ import annotations

import os

from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.checkpoint_files import read_json_object

# generation_config.json's sampling keys -> the SamplingParams fields they default (vLLM reads these six)
GENERATION_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GENERATION_FILE = "generation_config.json"


def check_generation_overrides(overrides: object) -> None:
    """LLM(override_generation_config=...): a dict of GENERATION_KEYS' keys (vLLM reads no others;
    an unknown key, a typo most likely, would change nothing, so it is refused)."""
    if not isinstance(overrides, dict):
        raise TypeError(f"override_generation_config must be None or a dict, got {overrides!r}")
    unknown = sorted(map(str, set(overrides) - set(GENERATION_KEYS)))
    if unknown:
        raise ValueError(f"override_generation_config keys must be among {sorted(GENERATION_KEYS)}, got {unknown}")


def has_generation_config(directory: str) -> bool:
    """Whether `directory` holds a generation_config.json (vLLM reads config.json's eos_token_id
    only where it does not: GenerationConfig.from_model_config)."""
    return os.path.isfile(os.path.join(directory, GENERATION_FILE))


def read_generation_config(directory: str) -> dict:
    """The keys `directory`'s generation_config.json sets ({} without one), read with transformers'
    GenerationConfig; a file that is not a JSON object (empty, cut short, a list), or one transformers
    refuses (a bad max_new_tokens), raises ValueError / TypeError naming it."""
    if not has_generation_config(directory):
        return {}
    path = os.path.join(directory, GENERATION_FILE)
    # read here, not by GenerationConfig.from_pretrained: its error for text that is not JSON is an
    # OSError, as for no file, naming neither
    values = read_json_object(path)
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_dict(values).to_diff_dict()
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: {e}") from e


def default_sampling_params(source: str, directory: str, values: dict, overrides: dict | None = None) -> SamplingParams:
    """The defaults for LLM(generation_config=source): `overrides` over those `values`
    (read_generation_config of `directory`, Config.generation_dir) set, or over nothing under
    "vllm" (SamplingParams() without overrides). Values SamplingParams refuses raise ValueError /
    TypeError naming where they came from."""
    merged = ({} if source == "vllm" else dict(values)) | (overrides or {})
    fields = {field: merged[key] for key, field in GENERATION_KEYS.items() if merged.get(key) is not None}
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        where = "override_generation_config" if overrides else os.path.join(directory, GENERATION_FILE)
        if overrides and source != "vllm" and values:
            where += f" over {os.path.join(directory, GENERATION_FILE)}"
        raise type(e)(f"{where}: {e}") from e
