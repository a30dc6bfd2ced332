"""FP8 expert weights in the fused MoE kernels (moe/grouped_gemm.py, moe/decode.py): which scale
mode a launch takes, checked once at the wrapper, never in the kernels' loops.

The kernels take the stacked experts in the compute dtype (hidden's), or as float8_e4m3fn with
float32 scales (weight = e4m3 value x scale), dequantized in registers: W8A16, the activations
stay in hidden's dtype and every product accumulates in float32 (or, the grouped GEMMs' W8A8
variant, quantized per row too: moe/grouped_gemm.py).

    ScaleMode.NONE     w13 [E, 2I, H], w2 [E, H, I] in hidden's dtype, no scales (the bf16 path)
    ScaleMode.CHANNEL  w13_scale [E, 2I], w2_scale [E, H]: one per output row of each expert
    ScaleMode.BLOCK    w13_scale [E, cdiv(2I, 128), cdiv(H, 128)], w2_scale [E, cdiv(H, 128),
                       cdiv(I, 128)]: each expert matrix's grid of 128 x 128 blocks

A kernel takes the mode as a constexpr (its int value): NONE compiles exactly the bf16 code.
"""

from __future__ import annotations

import torch

from nanovllm.kernels.checks import FP8_BLOCK, ScaleMode
from nanovllm.quantization.config import FP8_DTYPE
from nanovllm.utils.ints import cdiv


def scale_shapes(mode: ScaleMode, experts: int, inter: int, hidden: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(w13_scale, w2_scale) shapes of `experts` stacked experts of intermediate size `inter`
    (w13 [E, 2 inter, H], w2 [E, H, inter]) under `mode` (CHANNEL or BLOCK: module docstring)."""
    if mode == ScaleMode.BLOCK:
        return ((experts, cdiv(2 * inter, FP8_BLOCK), cdiv(hidden, FP8_BLOCK)),
                (experts, cdiv(hidden, FP8_BLOCK), cdiv(inter, FP8_BLOCK)))
    return (experts, 2 * inter), (experts, hidden)


def scale_args(mode: ScaleMode, scale: torch.Tensor | None, placeholder: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """A kernel's scale tensor (`placeholder` without scales, never read) and the keyword arguments
    that go with it: its expert and row-of-blocks strides, the mode (W_SCALE) and the block size."""
    return (placeholder if scale is None else scale,
            dict(stride_se=0 if scale is None else scale.stride(0),
                 stride_sn=scale.stride(1) if mode == ScaleMode.BLOCK else 0, W_SCALE=int(mode), SCALE_BLOCK=FP8_BLOCK))


def scales_per_step(mode: ScaleMode, block_k: int) -> bool:
    """Whether block scales multiply each K step's product (block_k divides FP8_BLOCK: the step lies
    in one column of blocks) rather than each weight element."""
    return mode == ScaleMode.BLOCK and FP8_BLOCK % block_k == 0


def expert_scale_mode(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                      w2_scale: torch.Tensor | None) -> ScaleMode:
    """The mode of stacked experts w13 [E, 2I, H] / w2 [E, H, I] (shapes checked by the caller)
    beside hidden; a TypeError / ValueError naming the tensor that does not fit one."""
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("w13_scale and w2_scale come together (FP8 experts) or not at all")
    if w13_scale is None:
        for name, w in (("w13", w13), ("w2", w2)):
            if w.dtype != hidden.dtype:
                raise TypeError(f"{name} dtype {w.dtype} != hidden dtype {hidden.dtype} (FP8 weights take "
                                f"w13_scale / w2_scale)")
        return ScaleMode.NONE
    e, two_i, h = w13.shape
    channel = dict(zip(("w13_scale", "w2_scale"), scale_shapes(ScaleMode.CHANNEL, e, two_i // 2, h)))
    block = dict(zip(("w13_scale", "w2_scale"), scale_shapes(ScaleMode.BLOCK, e, two_i // 2, h)))
    mode = ScaleMode.BLOCK if w13_scale.dim() == 3 else ScaleMode.CHANNEL
    want = block if mode == ScaleMode.BLOCK else channel
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != FP8_DTYPE:
            raise TypeError(f"{name} must be {FP8_DTYPE} with scales, got {w.dtype}")
    for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor, got {getattr(s, 'dtype', type(s))}")
        if tuple(s.shape) != want[name] or not s.is_contiguous():
            raise ValueError(f"{name} must be contiguous {want[name]} (per channel {channel[name]}, per "
                             f"{FP8_BLOCK}x{FP8_BLOCK} block {block[name]}), got {tuple(s.shape)} strides {s.stride()}")
        if s.device != hidden.device:
            raise ValueError(f"{name} is on {s.device}, hidden on {hidden.device}")
    return mode
