"""Loads safetensors checkpoints (one file or shards) into the model, tensor by tensor.

Checkpoint names map onto parameters directly, or onto a shard of a packed
parameter through the model's `packed_modules_mapping`. Every expected parameter
(and every shard of a packed one) must be filled; a missing tensor or a wrong shape
is a ValueError naming it.
"""

from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open
from torch import nn

# Std of the random normal weights for load_format="dummy" (typical init; values do not affect speed).
DUMMY_WEIGHT_STD = 0.02


def _param_loader(param: nn.Parameter):
    return getattr(param, "weight_loader", None)


def load_model(model: nn.Module, path: str) -> None:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {path!r} has no *.safetensors files")
    # Tied parameters appear once, under their first name (lm_head.weight of a tied model is skipped).
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    expected: set[tuple[str, object]] = set()
    for name in params:
        module_name = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        shards = [sid for packed_name, sid in packed.values() if packed_name == module_name]
        expected.update((name, sid) for sid in shards or [None])
    loaded: set[tuple[str, object]] = set()
    for file in files:
        with safe_open(file, "pt", device="cpu") as f:
            for ckpt_name in f.keys():
                target, shard_id = ckpt_name, None
                for ckpt_part, (packed_name, sid) in packed.items():
                    if f".{ckpt_part}." in ckpt_name:
                        target, shard_id = ckpt_name.replace(f".{ckpt_part}.", f".{packed_name}."), sid
                        break
                if target not in params:
                    continue  # e.g. lm_head.weight of a tied checkpoint
                param = params[target]
                tensor = f.get_tensor(ckpt_name)
                loader = _param_loader(param)
                if loader is not None:
                    loader(param, tensor, shard_id)
                else:
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(
                            f"weight {ckpt_name}: expected shape {tuple(param.shape)}, checkpoint has {tuple(tensor.shape)}"
                        )
                    param.data.copy_(tensor)
                loaded.add((target, shard_id))
    missing = sorted(f"{n}" + (f" (shard {s})" if s is not None else "") for n, s in expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing tensor(s): {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights for benchmarks: normal(0, DUMMY_WEIGHT_STD), norms at one."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.data.normal_(0.0, DUMMY_WEIGHT_STD, generator=generators[param.device])
