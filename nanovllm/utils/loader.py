"""Fills the model's parameters from named tensors: a checkpoint's files at start-up
(`load_model`: utils/checkpoint_files.py), or a training loop's state dict at run time (`update_weights`).

Names are Hugging Face checkpoint names. The model maps each onto a parameter and a shard
id (`map_checkpoint_name`: packed parameters such as qkv_proj are filled from several
checkpoint tensors); a parameter's `weight_slice` picks this rank's part of the tensor and
the part of the parameter it fills. Names the model ignores on purpose (`ignored_checkpoint_name`:
e.g. lm_head.weight of a tied model) are skipped; any other unknown name, or a wrong shape,
is a ValueError naming it. A parameter packed from many checkpoint tensors (`param.shard_ids`)
may also accept one tensor holding several of them (`param.shard_groups`: shard id -> the
shard ids it fills; e.g. all experts' gate and up projections fused in one 3-D tensor), so a
checkpoint of either form counts as complete.

    checkpoint name --map_checkpoint_name--> (parameter, shard id) --weight_slice--> (destination, source)

Each named tensor first passes through quantization/loading.QuantizedTensors: for a quantized
layer (its parameter carries `quant`) FP8 weights and their scales pass on or are dequantized,
full-precision ones (online FP8, update_weights) are quantized; elsewhere float8 tensors are
refused and the others pass on as they are.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.quantization.config import FP8_DTYPE, INPUT_SCALE, SCALE, SCALE_INV, LinearQuant
from nanovllm.quantization.loading import QuantizedTensors
from nanovllm.utils.checkpoint_files import checkpoint_files, open_checkpoint

# Std of the random normal weights for load_format="dummy" (typical init; values do not affect speed).
DUMMY_WEIGHT_STD = 0.02
# ... times this for attention's output projections (`o_proj`). At DUMMY_WEIGHT_STD, each layer's attention adds
# a mix of the sequence to every token of it, so a few layers on a prompt's tokens nearly coincide and a MoE
# router sends the whole prompt to one expert: 99-100% of a 512-token prompt's tokens on one expert from the 3rd of
# 24 layers (64 experts, top 8; uniform routing's busiest: ~16%). A random-weight Qwen3-30B-A3B prefill then read
# a fraction of the experts a trained model's does (time to first token under its weight roofline). At this
# scale the busiest takes 15-18% there (48 layers of 128 experts: 8-10%), as trained routers spread prompts.
DUMMY_ATTENTION_OUT_SCALE = 1e-3
# A generator's weights are checked and copied in chunks of about this many bytes (weight_chunks):
# the memory a sync holds beyond the model, whatever the model's size.
STREAMED_CHUNK_BYTES = 1 << 30
# Names listed in an error message before "and N more".
MAX_NAMES_SHOWN = 8

ParamKey = tuple[str, object]  # (parameter name, shard id or None)


@dataclass(frozen=True)
class _Fill:
    """One checkpoint tensor's destination: copy `source` into `destination`."""

    keys: tuple[ParamKey, ...]  # the (parameter, shard) pairs it fills
    destination: torch.Tensor
    source: torch.Tensor


def _names(items: Iterable[str]) -> str:
    items = sorted(items)
    extra = f" and {len(items) - MAX_NAMES_SHOWN} more" if len(items) > MAX_NAMES_SHOWN else ""
    return ", ".join(items[:MAX_NAMES_SHOWN]) + extra


class _WeightMap:
    """The model's parameters as the loader sees them: which (parameter, shard) each
    checkpoint name fills, and every (parameter, shard) a complete checkpoint must fill."""

    def __init__(self, model: nn.Module):
        self.model = model
        # Tied parameters appear once, under their first name.
        self.params = dict(model.named_parameters())
        self.expected: set[ParamKey] = {
            (name, sid) for name, p in self.params.items() for sid in getattr(p, "shard_ids", (None,))
        }

    def quant_of(self, ckpt_name: str) -> LinearQuant | None:
        """The quantization of the parameter `ckpt_name` fills (None: none, or no such parameter)."""
        if self.model.ignored_checkpoint_name(ckpt_name):
            return None
        return getattr(self.params.get(self.model.map_checkpoint_name(ckpt_name)[0]), "quant", None)

    def converter(self, update: bool) -> QuantizedTensors:
        """The step named tensors pass through before `fill`; also where no parameter is quantized,
        so that float8 tensors are refused there too (they were copied in as they were, without
        their scales)."""
        return QuantizedTensors(self.quant_of, update, self.fill)

    def fill(self, ckpt_name: str, tensor: torch.Tensor) -> _Fill | None:
        """Where `tensor` goes; None for a name the model ignores; ValueError if unknown or misshapen."""
        if self.model.ignored_checkpoint_name(ckpt_name):
            return None
        target, shard_id = self.model.map_checkpoint_name(ckpt_name)
        param = self.params.get(target)
        groups = getattr(param, "shard_groups", {})
        keys = tuple((target, s) for s in groups[shard_id]) if shard_id in groups else ((target, shard_id),)
        if param is None or not all(key in self.expected for key in keys):
            raise ValueError(f"unknown weight {ckpt_name!r}: the model has no parameter for it")
        weight_slice = getattr(param, "weight_slice", None)
        try:
            if weight_slice is not None:
                destination, source = weight_slice(param, tensor, shard_id)
            else:
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
                destination, source = param.data, tensor
        except ValueError as e:
            raise ValueError(f"weight {ckpt_name!r}: {e}") from None
        return _Fill(keys, destination, source)


def checkpoint_tensors(path: str, load_format: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of the checkpoint's files in `path` that `load_format` reads
    (utils/checkpoint_files.py), read one at a time; a name held by two files (a stale copy: which
    one was served would depend on the order) is a ValueError naming both, a file that cannot be
    read one naming it."""
    files = checkpoint_files(path, load_format)
    if not files:
        wanted = "no *.safetensors nor pytorch_model*.bin" if load_format == "auto" else "no *.safetensors"
        raise ValueError(f"model directory {path!r} has no weights: {wanted} files (load_format={load_format!r})")
    held_by: dict[str, str] = {}
    for file in files:
        here = os.path.relpath(file, path)
        with open_checkpoint(file) as f:
            for name in f.keys():
                if name in held_by:
                    raise ValueError(f"checkpoint {path!r}: tensor {name!r} is in two files: {held_by[name]} and "
                                     f"{here} (remove the stale one)")
                held_by[name] = here
                yield name, f.get_tensor(name)


def load_model(model: nn.Module, path: str, load_format: str = "auto") -> None:
    """Fill every parameter from the checkpoint in `path` (the files `load_format` reads: "auto" or
    "safetensors"), streaming tensor by tensor; a
    missing tensor, an unknown one or a wrong shape is a ValueError naming it."""
    weights = _WeightMap(model)
    loaded: set[ParamKey] = set()
    convert = weights.converter(update=False)
    for ckpt_name, ckpt_tensor in checkpoint_tensors(path, load_format):
        for name, tensor in convert(ckpt_name, ckpt_tensor):
            fill = weights.fill(name, tensor)
            if fill is not None:
                fill.destination.copy_(fill.source)
                loaded.update(fill.keys)
    missing = {model.checkpoint_name_of(name, shard) for name, shard in weights.expected - loaded}
    # a weight waiting for its scale is there: its scale is what is missing
    missing = (missing - convert.waiting()) | convert.missing()
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing tensor(s): {_names(missing)}")


def _not_a_pair(item: object) -> str:
    """What an item of update_weights' weights that is not a (name, tensor) pair is, for its
    TypeError: a tuple's or list's element types (and the weight it names), else its type."""
    if not isinstance(item, (tuple, list)):
        return type(item).__name__
    shape = f"a {type(item).__name__} ({', '.join(type(x).__name__ for x in item)})"
    return f"{shape} for weight {item[0]!r}" if item and isinstance(item[0], str) else shape


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is torch.distributed's DTensor (FSDP2's parameters and state dicts), looked
    up where it is defined: a DTensor exists only once its module was imported, which loading this
    one does not do."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


@torch.inference_mode()
def update_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy `named_tensors` (checkpoint names, full unsharded tensors, e.g. a transformers
    model's `state_dict().items()`) into the parameters in place; any subset of the weights
    may be given. Every tensor is checked before any parameter changes: a tensor that is not a
    dense floating-point one, or is a DTensor (a shard: its full_tensor() is the weight), is a
    TypeError naming it; unknown names, wrong shapes, tensors without data (the meta device) and
    float8 ones (their values mean nothing without the scale beside them, which no parameter here
    takes: an FP8 engine quantizes full-precision weights itself) one ValueError naming all of them."""
    weights = _WeightMap(model)
    convert = weights.converter(update=True)
    fills: list[_Fill] = []
    errors: list[str] = []
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"weights must be (name, tensor) pairs (a str and a torch.Tensor), got {_not_a_pair(item)}")
        name, tensor = item
        if not tensor.is_floating_point() or tensor.layout is not torch.strided:
            raise TypeError(f"update_weights: weight {name!r} must be a dense floating-point tensor, got "
                            f"{tensor.dtype} ({tensor.layout}); none of these weights was loaded")
        if _is_dtensor(tensor):  # its values are this rank's shard, not the weight
            raise TypeError(f"update_weights: weight {name!r} is a DTensor (placements {tensor.placements}): pass "
                            "its gathered value, tensor.full_tensor(); none of these weights was loaded")
        if tensor.is_meta:
            errors.append(f"weight {name!r} is on the meta device: it holds no data to copy")
            continue
        if tensor.dtype.itemsize == 1:  # float8 (any variant): copied as it was, it loaded fp8 / scale values
            errors.append(f"weight {name!r}: update_weights takes full-precision weights (an FP8 engine quantizes "
                          f"them itself), got {tensor.dtype}")
            continue
        try:
            for name, tensor in convert(*item):
                fill = weights.fill(name, tensor)
                if fill is not None:
                    fills.append(fill)
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ValueError(f"update_weights: {len(errors)} bad weight(s), none of these weights was loaded: "
                         f"{'; '.join(errors[:MAX_NAMES_SHOWN])}")
    for fill in fills:
        fill.destination.copy_(fill.source)


def _held(item: object) -> object:
    """A generator's (name, tensor) pair as a chunk holds it: a copy of the tensor, since a generator
    may refill what it yielded for its next pair (a receive buffer, as vLLM's RLHF worker extensions
    broadcast into: vLLM copies each weight before asking for the next); anything else as it is
    (update_weights names what is wrong with it)."""
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
        return item[0], item[1].detach().clone()
    return item


def weight_chunks(named_tensors: Iterable[tuple[str, torch.Tensor]],
                  max_bytes: int = STREAMED_CHUNK_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The pairs update_weights is to copy, in the chunks it checks and copies one at a time: all
    of them at once when they are held already (a list, tuple or dict view: one check before any
    change), else (a generator, as verl's all-gathering sync yields) chunks of about `max_bytes`
    of copies of its tensors (_held), so no more than one chunk is alive at a time, whatever the
    generator does with what it yielded (vLLM streams them too).
    An empty generator is one empty chunk, as an empty list is (update_weights counts it as an
    update either way: FP8 KV scales computed from the data are set anew). Anything not iterable
    is a TypeError naming it; so is a dict (its iteration gives names alone: its items() are the pairs)."""
    if not isinstance(named_tensors, Iterable):
        raise TypeError(f"weights must be an iterable of (name, tensor) pairs, got {named_tensors!r:.200}")
    if isinstance(named_tensors, Mapping):
        raise TypeError(f"weights must be an iterable of (name, tensor) pairs, got a {type(named_tensors).__name__} "
                        "(its iteration gives names alone): pass its .items()")
    if isinstance(named_tensors, Collection):
        yield list(named_tensors)
        return
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    first = True  # no chunk yielded yet
    for item in named_tensors:
        item = _held(item)  # before the generator is asked for its next pair
        chunk.append(item)
        tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else None
        size += tensor.nbytes if isinstance(tensor, torch.Tensor) and not tensor.is_meta else 0
        if size >= max_bytes:
            yield chunk
            chunk, size, first = [], 0, False
    if chunk or first:
        yield chunk


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights for benchmarks: normal(0, DUMMY_WEIGHT_STD), attention's output projections
    DUMMY_ATTENTION_OUT_SCALE times that, norms at one; FP8 weights normal(0, 1) with their scales at
    that std (static input scales at one)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith(INPUT_SCALE):
            param.data.fill_(1.0)
            continue
        std = DUMMY_WEIGHT_STD * (DUMMY_ATTENTION_OUT_SCALE if name.rsplit(".", 1)[0].endswith("o_proj") else 1.0)
        if name.endswith((SCALE, SCALE_INV)):
            param.data.fill_(std)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        if param.dtype == FP8_DTYPE:
            param.data.copy_(torch.randn(param.shape, generator=generators[param.device], device=param.device))
            continue
        param.data.normal_(0.0, std, generator=generators[param.device])
