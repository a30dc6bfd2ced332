"""Which files of a model directory hold its checkpoint, and how one is opened (utils/loader.py reads
the weights from them, utils/kv_scales.py the FP8 KV scales); its JSON files read as objects.

As vLLM reads a directory: its *.safetensors files (those model.safetensors.index.json lists, when
there is one), else its PyTorch pickles (pytorch_model*.bin, or those pytorch_model.bin.index.json
lists), read with torch.load(weights_only=True): tensors only, no code run. load_format="safetensors"
(vLLM's) reads the *.safetensors files only: a directory of pickles alone has no checkpoint then.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pickle
import zipfile
from collections.abc import Iterator
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open

# A sharded checkpoint's index (transformers' names): tensor name -> the file holding it.
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
# The files' own names without an index: transformers' (training_args.bin and the like are not weights).
_SAFETENSORS_FILES, _PICKLE_FILES = "*.safetensors", "pytorch_model*.bin"
# The kinds of file each load_format that reads a checkpoint looks for, in order: (index, files' pattern).
_KINDS = {"auto": ((SAFETENSORS_INDEX, _SAFETENSORS_FILES), (PICKLE_INDEX, _PICKLE_FILES)),
          "safetensors": ((SAFETENSORS_INDEX, _SAFETENSORS_FILES),)}


class CheckpointFile(Protocol):
    """An open checkpoint file: its tensor names, and one tensor by name (safetensors' safe_open)."""

    def keys(self) -> list[str]: ...
    def get_tensor(self, name: str) -> torch.Tensor: ...


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


def checkpoint_files(path: str, load_format: str = "auto") -> list[str]:
    """The checkpoint's files in `path`: its *.safetensors files, else (load_format "auto") its
    pytorch_model*.bin files; of either kind those its index lists when it has one (as vLLM reads it:
    a repository may also hold a consolidated or stale copy of the weights beside the shards), else
    every one. [] if none."""
    if load_format not in _KINDS:
        raise ValueError(f"load_format {load_format!r} reads no checkpoint files: one of {sorted(_KINDS)}")
    for index_name, pattern in _KINDS[load_format]:
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            return _indexed_files(path, index)
        files = sorted(glob.glob(os.path.join(glob.escape(path), pattern)))  # "run[1]/" is a name
        if files:
            return files
    return []


@contextlib.contextmanager
def open_checkpoint(file: str) -> Iterator[CheckpointFile]:
    """`file` opened for reading tensors (a safetensors file lazily, a pickle whole, memory-mapped); a
    file that cannot be read is a ValueError naming it."""
    if file.endswith(".bin"):
        try:
            # memory-mapped where it can be (torch's zip format; the legacy one, before torch 1.6, is read whole)
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
        except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as e:  # weights_only refuses code
            raise ValueError(f"checkpoint file {file!r} is not a readable PyTorch weights file ({e})") from None
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise ValueError(f"checkpoint file {file!r} does not hold a dict of tensor names to tensors")
        yield _TensorDict(state)
        return
    try:
        opened = safe_open(file, "pt", device="cpu")
    except SafetensorError as e:  # its message names no file
        raise ValueError(f"checkpoint file {file!r} is not a readable safetensors file ({e}): a download cut "
                         "short, or a git-lfs pointer (a clone without git-lfs)?") from None
    with opened as f:
        yield f


class _TensorDict:
    """A loaded pickle's {name: tensor} as a CheckpointFile."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self._state = state

    def keys(self) -> list[str]:
        return list(self._state)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._state[name]


def _indexed_files(path: str, index: str) -> list[str]:
    """The files `index` (in `path`) maps tensor names to; ValueError if it maps none or one is absent."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index} has no weight_map of tensor names to file names")
    files = sorted(os.path.join(path, name) for name in set(weight_map.values()))
    absent = [os.path.basename(f) for f in files if not os.path.isfile(f)]
    if absent:
        raise ValueError(f"{index} lists files that are not in {path!r}: {', '.join(absent)}")
    return files
