"""Checkpoint spellings of mixture-of-experts weights (Qwen3-MoE) and the stacked parameters of
moe/layer.MoeExperts they fill.

Published checkpoints hold one tensor per expert and projection,
`...mlp.experts.{e}.{gate,up,down}_proj.weight` (FP8 ones also `.weight_scale_inv` or
`.weight_scale`): shard (e, "gate_proj") etc. of w13 / w2 (or of their scale parameters).
transformers 5's in-memory state dict (what update_weights gets from a transformers model) fuses
them into `...mlp.experts.gate_up_proj` [E, 2I, H] and `...mlp.experts.down_proj` [E, H, I], each
filling a whole parameter (shard ids FUSED_GATE_UP / FUSED_DOWN).
"""

from __future__ import annotations

import re

import torch

# Per-expert checkpoint projections -> (stacked parameter, part of its expert's slice).
GATE_PROJ, UP_PROJ, DOWN_PROJ = "gate_proj", "up_proj", "down_proj"
# Shard ids of the fused (transformers 5) tensors, each filling a whole parameter.
FUSED_GATE_UP, FUSED_DOWN = "gate_up_proj", "down_proj"
_PER_EXPERT_NAME = re.compile(r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                              r"\.(?P<leaf>weight|weight_scale|weight_scale_inv)")
_STACKED_NAME = re.compile(r"(?P<prefix>.+\.experts)\.(?:w13|w2)(?:_(?P<leaf>weight_scale_inv|weight_scale))?")
_FUSED_NAME = re.compile(r"(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)")


def map_expert_name(name: str) -> tuple[str, tuple[int, str] | str] | None:
    """A checkpoint's expert tensor name -> (stacked parameter name, shard id); None for a name
    that is not an expert tensor.

        model.layers.3.mlp.experts.17.gate_proj.weight -> (model.layers.3.mlp.experts.w13, (17, "gate_proj"))
        model.layers.3.mlp.experts.17.down_proj.weight -> (model.layers.3.mlp.experts.w2, (17, "down_proj"))
        ...experts.17.up_proj.weight_scale_inv         -> (...experts.w13_weight_scale_inv, (17, "up_proj"))
        model.layers.3.mlp.experts.gate_up_proj        -> (model.layers.3.mlp.experts.w13, "gate_up_proj")
    """
    m = _PER_EXPERT_NAME.fullmatch(name)
    if m is not None:
        param = "w2" if m["proj"] == DOWN_PROJ else "w13"
        suffix = "" if m["leaf"] == "weight" else f"_{m['leaf']}"
        return f"{m['prefix']}.{param}{suffix}", (int(m["expert"]), m["proj"])
    m = _FUSED_NAME.fullmatch(name)
    if m is not None:
        param = "w2" if m["proj"] == FUSED_DOWN else "w13"
        return f"{m['prefix']}.{param}", m["proj"]
    return None


def expert_checkpoint_name(param_name: str, shard_id: object) -> str | None:
    """map_expert_name's inverse for one expert's shard (error messages); None for any other
    parameter or shard. (model.layers.3.mlp.experts.w13, (17, "up_proj")) -> ...experts.17.up_proj.weight"""
    m = _STACKED_NAME.fullmatch(param_name)
    if m is None or not isinstance(shard_id, tuple):
        return None
    expert, proj = shard_id
    return f"{m['prefix']}.{expert}.{proj}.{m['leaf'] or 'weight'}"


def split_fused_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """A fused expert tensor (transformers 5) -> the published per-expert tensors it holds; None
    for another name. (Quantized experts are quantized one expert and projection at a time.)

        ...experts.gate_up_proj [E, 2I, H] -> ...experts.{e}.gate_proj.weight, ...experts.{e}.up_proj.weight [I, H]
        ...experts.down_proj [E, H, I]     -> ...experts.{e}.down_proj.weight [H, I]
    """
    m = _FUSED_NAME.fullmatch(name)
    if m is None:
        return None
    if tensor.dim() != 3 or (m["proj"] == FUSED_GATE_UP and tensor.shape[1] % 2):
        raise ValueError(f"fused expert tensor {name!r} must be [experts, rows, columns] (gate_up: even rows), "
                         f"got {tuple(tensor.shape)}")
    if m["proj"] == FUSED_DOWN:
        return [(f"{m['prefix']}.{e}.{DOWN_PROJ}.weight", t) for e, t in enumerate(tensor)]
    gate, up = tensor.chunk(2, dim=1)
    return [(f"{m['prefix']}.{e}.{proj}.weight", t[e]) for e in range(tensor.shape[0])
            for proj, t in ((GATE_PROJ, gate), (UP_PROJ, up))]
