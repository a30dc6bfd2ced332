"""Which *.safetensors files of a model directory hold its checkpoint (utils/loader.py reads the
weights from them, utils/kv_scales.py the FP8 KV scales), and its JSON files read as objects."""

from __future__ import annotations

import glob
import json
import os

# A sharded checkpoint's index (transformers' name): tensor name -> the file holding it.
SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_json_object(file: str) -> dict:
    """The JSON object in `file` (config.json, an index); ValueError naming the file if it holds
    anything else (text cut short, a list)."""
    with open(file) as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as e:  # its message names no file
            raise ValueError(f"{file} is not a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} is not a JSON object: it holds a {type(value).__name__}")
    return value


def checkpoint_files(path: str) -> list[str]:
    """The checkpoint's *.safetensors files in `path`: those its model.safetensors.index.json lists
    when it has one (as vLLM reads it: a repository may also hold a consolidated or stale copy of
    the weights beside the shards), else every one."""
    index = os.path.join(path, SAFETENSORS_INDEX)
    if not os.path.isfile(index):
        return sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))  # "run[1]/" is a name
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index} has no weight_map of tensor names to file names")
    files = sorted(os.path.join(path, name) for name in set(weight_map.values()))
    absent = [os.path.basename(f) for f in files if not os.path.isfile(f)]
    if absent:
        raise ValueError(f"{index} lists files that are not in {path!r}: {', '.join(absent)}")
    return files
