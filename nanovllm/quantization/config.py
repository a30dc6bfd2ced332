"""Which weights are FP8, and how: the one place that decides the format of a layer's weights.

A QuantConfig (config.json's quantization_config and LLM(quantization=...), as
quantization/checkpoint_config.resolve_quantization reads them) holds the formats of the checkpoint's
config groups and its skip list. A layer built inside `quantization(config)` asks `linear_quant(names, ...)` with the checkpoint
module names it is built from (a packed layer: all of its parts) and keeps the answer:

    None                      full precision (no config, a skipped module, or a layer built
                              without names: the MoE router)
    LinearQuant(fmt, held)    held=True: the weight stays float8 with its scales (CUDA, bf16
                              compute, shapes the FP8 kernels take); held=False: the loader
                              dequantizes it into the compute dtype (CPU, and shapes the
                              kernels do not take)

MoE experts ask `expert_quant` instead: held where the layer runs the Triton MoE kernels (the
decode GEMVs dequantize FP8 weights in registers, W8A16; the grouped GEMMs run W8A8 with dynamic
per-token activation scales; so a static input_scale is dropped), with per-channel scales (tensor
scales spread over the rows) or block scales when this rank's part of the intermediate dimension
is whole blocks.

Skip-list entries match a module whose dotted name contains the entry as whole components
("lm_head", "mlp.gate", "model.layers.0.self_attn.o_proj"); "re:" entries are regular
expressions matched from the name's start (compressed-tensors' rule). A compressed-tensors
group's `targets` name the modules it quantizes as vLLM matches them: "Linear" every linear
layer, else a module's whole name or a "re:" regex; a module takes the first group with a target
naming it, else the first targeting "Linear", and stays in full precision where none does, as a
skipped one does.
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from nanovllm.kernels.checks import FP8_BLOCK, FP8_PER_WORD
from nanovllm.utils.scoped import scoped

FP8_DTYPE = torch.float8_e4m3fn
# Scale granularities: one per [FP8_BLOCK, FP8_BLOCK] block, per output row, per checkpoint tensor.
BLOCK, CHANNEL, TENSOR = "block", "channel", "tensor"
# Checkpoint names of a weight's scale: Qwen / DeepSeek block FP8, and every other layout.
SCALE_INV, SCALE = "weight_scale_inv", "weight_scale"
INPUT_SCALE = "input_scale"
# Skip-list and target entries that are regular expressions (matched from the module name's start) start so.
REGEX_PREFIX = "re:"
# compressed-tensors' target of every linear layer (a module class, which each of ours is).
LINEAR_TARGET = "Linear"
# torch._scaled_mm wants its operands' widths in multiples of 16 (K: measured on the H200).
FP8_GEMM_ALIGN = 16
# Held block-FP8 layers take widths (in and out) in multiples of this: weight-scale grids with
# sides a multiple of 4, like the activation scales' rows (cuBLAS's blockwise scaling refused
# other row counts on the H200); only such widths were checked there (every Qwen3 width is one).
BLOCKWISE_ALIGN = 4 * FP8_BLOCK


@dataclass(frozen=True)
class Fp8Format:
    """How a layer's weights are quantized, and so what its checkpoint holds."""

    scales: str  # BLOCK, CHANNEL or TENSOR
    scale_name: str  # the scale tensor's checkpoint name beside `weight`
    static_input: bool  # activations quantized with the checkpoint's per-tensor input_scale
    online: bool  # the checkpoint is full precision: weights are quantized at load
    # Per-token activation scales take each row's amax at most this (fbgemm_fp8's activation_scale_ub:
    # an outlier token saturates); None: unbounded.
    amax_ub: float | None = None

    @property
    def requant_scales(self) -> str:
        """Scales of weights quantized here (online loads, update_weights): the checkpoint's
        blocks, else one per output channel."""
        return BLOCK if self.scales == BLOCK else CHANNEL


# LLM(quantization="fp8") on a full-precision checkpoint: weights quantized at load per output channel.
ONLINE = Fp8Format(CHANNEL, SCALE, False, True)


@dataclass(frozen=True)
class LinearQuant:
    """A quantized layer's format, and whether its weight stays FP8 (else: dequantized at load)."""

    fmt: Fp8Format
    held: bool
    # Held weights multiply full-precision activations (the MoE kernels): no input_scale is used.
    weight_only: bool = False


def _names_module(target: str, name: str) -> bool:
    """Whether target `target` (a whole module name or a "re:" regex) names module `name`."""
    if target.startswith(REGEX_PREFIX):
        return re.match(target[len(REGEX_PREFIX):], name) is not None
    return target == name


@dataclass(frozen=True)
class QuantGroup:
    """The format of the modules `targets` name (a compressed-tensors config group)."""

    fmt: Fp8Format
    targets: tuple[str, ...] = (LINEAR_TARGET,)


@dataclass(frozen=True)
class QuantConfig:
    groups: tuple[QuantGroup, ...]  # in the config's order (format_of: which one a module takes)
    skip: tuple[str, ...]  # modules kept in full precision (module docstring: how entries match)

    def skipped(self, name: str) -> bool:
        """Whether a skip entry names module `name`."""
        for entry in self.skip:
            if entry.startswith(REGEX_PREFIX):
                if re.match(entry[len(REGEX_PREFIX):], name):
                    return True
            elif f".{entry}." in f".{name}.":
                return True
        return False

    def format_of(self, name: str) -> Fp8Format | None:
        """Module `name`'s format; None (full precision) where a skip entry or no group names it.
        As vLLM matches targets: the first group with a target naming the module (whole name or
        regex), else the first targeting every linear layer ("Linear")."""
        if self.skipped(name):
            return None
        group = (next((g for g in self.groups if any(_names_module(t, name) for t in g.targets)), None)
                 or next((g for g in self.groups if LINEAR_TARGET in g.targets), None))
        return None if group is None else group.fmt

    def format_for(self, names: tuple[str, ...]) -> Fp8Format | None:
        """The format of a layer built from checkpoint modules `names`; None: full precision.
        A packed layer's parts must agree (ValueError naming them otherwise)."""
        formats = [self.format_of(n) for n in names]
        if all(f is None for f in formats):
            return None
        if any(f is None for f in formats):
            kept = [n for n, f in zip(names, formats) if f is None]
            raise ValueError(f"modules {list(names)} are packed into one layer, but the quantization config "
                             f"keeps {kept} in full precision and quantizes the others")
        if len(set(formats)) > 1:
            raise ValueError(f"modules {list(names)} are packed into one layer, but the quantization config "
                             f"gives them different formats: {dict(zip(names, formats))}")
        return formats[0]


_QUANT: ContextVar[QuantConfig | None] = ContextVar("quantization", default=None)


def quantization(config: QuantConfig | None) -> AbstractContextManager[QuantConfig | None]:
    """Layers constructed inside this block take their formats from `config` (reset on exit)."""
    return scoped(_QUANT, config)


def layer_format(names: tuple[str, ...] | None) -> Fp8Format | None:
    """The format of a layer built now from checkpoint modules `names` (None: never quantized)."""
    config = _QUANT.get()
    return None if config is None or names is None else config.format_for(names)


def linear_quant(names: tuple[str, ...] | None, out_parts: list[int], in_features: int,
                 device: torch.device) -> LinearQuant | None:
    """A linear layer's quantization: its format, and whether its weight [sum(out_parts),
    in_features] (this rank's part; out_parts: its packed parts' rows) stays FP8. It does on
    CUDA with bf16 compute where torch._scaled_mm takes the shapes: block scales need every
    part in whole blocks (the parts' grids then stack into the layer's) and both widths in
    multiples of BLOCKWISE_ALIGN, the others widths in multiples of 16."""
    fmt = layer_format(names)
    if fmt is None:
        return None
    if fmt.scales == BLOCK:
        fits = (in_features % BLOCKWISE_ALIGN == 0 and sum(out_parts) % BLOCKWISE_ALIGN == 0
                and all(rows % FP8_BLOCK == 0 for rows in out_parts))
    else:
        fits = in_features % FP8_GEMM_ALIGN == 0 and sum(out_parts) % FP8_GEMM_ALIGN == 0
    return LinearQuant(fmt, device.type == "cuda" and torch.get_default_dtype() == torch.bfloat16 and fits)


def expert_quant(names: tuple[str, ...] | None, local_inter: int, kernels: bool, hidden: int) -> LinearQuant | None:
    """MoE experts' quantization (`names`: every expert's projection modules; `local_inter`: I/tp,
    this rank's part of the intermediate dimension; `hidden`: H). Held where the layer runs the
    Triton MoE kernels (`kernels`: layers/kernel_path.uses_triton), any compute dtype, for channel
    and tensor scales (held per output channel) and for block scales when local_inter is a multiple
    of FP8_BLOCK: this rank's rows of gate_proj and up_proj and its columns of down_proj are then
    whole blocks of the checkpoint's grids, which stack into the layer's (the block grid of
    w13 [2 I/tp, H] needs the up half to start on a block), and H a multiple of FP8_PER_WORD (the
    decode gate_up reads those rows as int32 words, moe/decode.py). Otherwise (e.g. I=768 over 4
    ranks: 192 rows) the loader dequantizes them."""
    fmt = layer_format(names)
    if fmt is None:
        return None
    if fmt.amax_ub is not None:  # the MoE kernels take no amax bound (vLLM's fbgemm_fp8 quantizes linears only)
        raise ValueError(f"fbgemm_fp8 MoE experts are not supported (their activation_scale_ub): {names[0]} and "
                         f"the layer's other experts; supported for linear layers, or list the experts in "
                         f"modules_to_not_convert")
    fits = fmt.requant_scales != BLOCK or (local_inter % FP8_BLOCK == 0 and hidden % FP8_PER_WORD == 0)
    return LinearQuant(fmt, kernels and fits, weight_only=True)
