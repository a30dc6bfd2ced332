"""Checkpoint tensors -> the tensors a model with quantized layers takes (utils/loader.py passes
each named tensor through `QuantizedTensors`, also where no parameter of the model is quantized:
float8 tensors are refused there).

A quantized layer's weight parameter carries its LinearQuant (`param.quant`, set at
construction). By what it holds and where the tensor comes from:

                     FP8 checkpoint: weight + its scale      full precision: online FP8, update_weights
    held (CUDA)      passed on as they are                    quantized here (block scales, else per
                                                              channel), weight and scale passed on
    dequantized      paired up, then weight x scale           quantized, then dequantized here: the
                                                              engine sees the quantization error

Static input scales go to held layers and are dropped where the layer's activations stay in
full precision (dequantized layers, and held weight-only ones: the MoE experts). update_weights
takes full-precision weights into any FP8 layer, a static-scale one too: the new weight is
quantized with weight scales of its own (per block, else per output channel) and the layer keeps
the checkpoint's static input_scale (calibration, not derived from the weight). A float8
tensor for a module the config leaves in full precision, a full-precision one where the
checkpoint should be FP8, scales given to update_weights (a weight scale: computed here; an
input_scale: the checkpoint's stays, or the layer uses none on this engine), and a weight without
its scale or a scale without its weight (`missing`) are ValueErrors naming them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanovllm.moe.checkpoint_names import split_fused_experts
from nanovllm.quantization.config import BLOCK, FP8_DTYPE, INPUT_SCALE, SCALE, SCALE_INV, LinearQuant
from nanovllm.quantization.fp8 import dequantize_weight, quantize_weight

_WEIGHT = "weight"


def _block_grid(name: str, scale: torch.Tensor) -> torch.Tensor:
    """A block scale written [out_blocks, 1, in_blocks, 1] (ModelOpt's FP8_PB_WO) as the grid
    [out_blocks, in_blocks] the layers take; another 4-D shape is a ValueError naming it."""
    if scale.shape[1] != 1 or scale.shape[3] != 1:
        raise ValueError(f"{name}: a 4-D block scale must be [out_blocks, 1, in_blocks, 1], got {tuple(scale.shape)}")
    return scale.reshape(scale.shape[0], scale.shape[2])


class QuantizedTensors:
    """Calls map one (checkpoint name, tensor) to the (name, tensor) pairs the loader fills."""

    def __init__(self, quant_of: Callable[[str], LinearQuant | None], update: bool,
                 check_fits: Callable[[str, torch.Tensor], object]):
        """`quant_of(name)`: the LinearQuant of the parameter checkpoint tensor `name` fills
        (None: not quantized); `update`: tensors come from update_weights (full precision);
        `check_fits(name, tensor)`: raises ValueError unless the tensor fits its parameter (as an
        unquantized engine checks it), before a fused expert tensor is split per expert and before
        a full-precision weight is quantized (a misshapen one, e.g. [N, 0], is named as such)."""
        self.quant_of = quant_of
        self.check_fits = check_fits
        self.source = "update_weights" if update else "the checkpoint"
        self.update = update
        self.pending: dict[str, tuple[LinearQuant, dict[str, torch.Tensor]]] = {}  # module -> its half of a pair

    def __call__(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        module, _, leaf = name.rpartition(".")
        if leaf in (SCALE_INV, SCALE, INPUT_SCALE):
            return self._scale(name, module, leaf, tensor)
        quant = self.quant_of(name)
        if quant is None:
            if tensor.is_floating_point() and tensor.dtype.itemsize == 1:  # float8, any variant
                raise ValueError(f"weight {name!r} is float8, but its module is full precision here: the "
                                 f"quantization config keeps it so (or there is none), or it is one never "
                                 f"quantized (the embedding, lm_head, the MoE router)")
            return [(name, tensor)]
        if leaf != _WEIGHT:  # transformers 5's fused experts: quantized per expert and projection
            parts = split_fused_experts(name, tensor)
            if parts is None:
                return [(name, tensor)]
            self.check_fits(name, tensor)  # a wrong expert count would fill some experts and leave the rest
            return [out for part in parts for out in self(*part)]
        fp8 = tensor.dtype == FP8_DTYPE
        if self.update or quant.fmt.online:
            if fp8:
                raise ValueError(f"weight {name!r}: {self.source} takes full-precision weights for an FP8 engine "
                                 f"(they are quantized here), got float8")
            self.check_fits(name, tensor)  # the shape first: quantizing an [N, 0] weight raised an IndexError
            return self._quantized(name, module, tensor, quant)
        if not fp8:
            raise ValueError(f"weight {name!r} is {tensor.dtype}, but the checkpoint's quantization config makes "
                             f"module {module!r} FP8 (list modules kept in full precision in its "
                             f"modules_to_not_convert / ignore)")
        return [(name, tensor)] if quant.held else self._pair(module, quant, _WEIGHT, tensor)

    def _scale(self, name: str, module: str, leaf: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        quant = self.quant_of(f"{module}.{_WEIGHT}")
        if quant is None:
            return [(name, tensor)]  # no parameter takes it: the loader names it
        if self.update or quant.fmt.online:
            raise ValueError(self._refused_scale(name, module, leaf, quant))
        if leaf == INPUT_SCALE and quant.fmt.static_input and (not quant.held or quant.weight_only):
            return []  # the layer's activations stay in full precision: not quantized
        if leaf == quant.fmt.scale_name and quant.fmt.scales == BLOCK and tensor.dim() == 4:
            tensor = _block_grid(name, tensor)
        if quant.held or leaf != quant.fmt.scale_name:
            return [(name, tensor)]
        return self._pair(module, quant, "scale", tensor)

    def _refused_scale(self, name: str, module: str, leaf: str, quant: LinearQuant) -> str:
        """Why scale `name` of layer `module` is not taken from full-precision tensors (update_weights,
        an online-FP8 checkpoint)."""
        if leaf != INPUT_SCALE:
            return (f"{name!r}: {self.source} takes full-precision weights only: the weight scale of layer "
                    f"{module!r} is computed here, from its weight")
        if quant.fmt.static_input and quant.held and not quant.weight_only:
            return (f"{name!r}: layer {module!r} quantizes its inputs with the checkpoint's static input_scale "
                    f"(calibration), which {self.source} keeps as loaded: it takes full-precision weights only "
                    f"(quantized with weight scales of its own), so leave the input scales out")
        return (f"{name!r}: layer {module!r} uses no input_scale on this engine (its activations are quantized "
                f"per token or group, or stay in full precision); {self.source} takes full-precision weights "
                f"only, so leave the input scales out")

    def _pair(self, module: str, quant: LinearQuant, part: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Keep one half of a weight / scale pair; with both, the dequantized weight."""
        parts = self.pending.setdefault(module, (quant, {}))[1]
        parts[part] = tensor
        if len(parts) < 2:
            return []
        del self.pending[module]
        try:
            return [(f"{module}.{_WEIGHT}", dequantize_weight(parts[_WEIGHT], parts["scale"], quant.fmt.scales))]
        except ValueError as e:
            raise ValueError(f"{module}.{quant.fmt.scale_name}: {e}") from None

    def _quantized(self, name: str, module: str, tensor: torch.Tensor,
                   quant: LinearQuant) -> list[tuple[str, torch.Tensor]]:
        if tensor.dim() != 2:
            raise ValueError(f"weight {name!r} must be 2-D to be quantized, got shape {tuple(tensor.shape)}")
        q, s = quantize_weight(tensor, quant.fmt.requant_scales)
        if quant.held:
            return [(name, q), (f"{module}.{quant.fmt.scale_name}", s)]
        return [(name, dequantize_weight(q, s, quant.fmt.requant_scales))]

    def missing(self) -> set[str]:
        """The other halves of the pairs still waiting (at the end of a checkpoint: missing)."""
        return {f"{module}.{quant.fmt.scale_name if _WEIGHT in parts else _WEIGHT}"
                for module, (quant, parts) in self.pending.items()}

    def waiting(self) -> set[str]:
        """The halves received whose other half has not come (they filled nothing yet)."""
        return {f"{module}.{_WEIGHT if _WEIGHT in parts else quant.fmt.scale_name}"
                for module, (quant, parts) in self.pending.items()}
