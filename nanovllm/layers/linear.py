"""Linear layers split across tensor-parallel ranks.

Column-parallel layers split the output features (each rank computes a slice);
row-parallel layers split the input features and all-reduce the partial sums; a replicated
layer keeps the whole weight on every rank.
Every parameter carries a `weight_slice(param, loaded, shard_id) -> (destination, source)`:
the part of the parameter a checkpoint tensor fills on this rank and the part of the tensor
that fills it (weights and 1-D biases alike), shapes checked, nothing copied yet (the loader
copies; utils/loader.py). Packed layers (QKV, gate/up) list their checkpoint tensors in
`param.shard_ids`; the shard id names which one is being loaded.

    qkv_proj.weight rows: [ q: Hq_local*D | k: Hkv_local*D | v: Hkv_local*D ]   (bias: same rows)
    gate_up_proj rows:    [ gate: I_local | up: I_local ]

Which kernel serves a call (the Triton GEMV, with or without the norm in front, the skinny GEMM,
or F.linear) is decided once, at construction, by layers/kernel_path.linear_path; a call only
compares its row count with the answer.

FP8: a layer built with its checkpoint name (`prefix`; a packed layer's parts follow from it)
asks quantization/config.linear_quant for its format once, at construction. A layer that holds
FP8 (CUDA) keeps `weight` float8 [out, in] beside its scale, registered under the checkpoint's
name (`weight_scale_inv` / `weight_scale`: float32 [out] per row, per-tensor scales spread over
their part's rows; or the block grid [out/128, in/128]) and, for static activations,
`input_scale` [parts]; the scales slice over ranks and parts like the weight, in rows (grids: in
blocks). Its 1-2 row calls run the GEMV's FP8 variant, 3-32 rows (KernelRoutes.fp8_skinny_max_rows)
the skinny GEMM's (both W8A16: activations stay 16-bit), larger ones quantization/fp8.fp8_linear
(W8A8: the skinny GEMM's e4m3 MMAs up to KernelRoutes.fp8_w8a8_skinny_max_rows, torch._scaled_mm
beyond). There the RMSNorm in front (forward_normed), and the down
projection's SiLU-and-mul per group or with a static scale, quantize their own outputs for it (one
kernel each, no 16-bit activation written and read back). A layer whose weights the loader
dequantizes stays as is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.checks import FP8_BLOCK
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.kernel_path import construction_device, linear_path
from nanovllm.quantization.config import BLOCK, FP8_DTYPE, INPUT_SCALE, linear_quant
from nanovllm.quantization.fp8 import Fp8Weights, fp8_linear
from nanovllm.utils.distributed import kv_heads_per_rank, tp_rank, tp_size

def check_loaded_shape(what: str, expected: tuple[int, ...] | torch.Size, loaded: torch.Tensor) -> None:
    """Refuse a checkpoint tensor `loaded` for `what` unless its shape is `expected`."""
    if tuple(expected) != tuple(loaded.shape):
        raise ValueError(f"{what}: expected shape {tuple(expected)}, checkpoint has {tuple(loaded.shape)}")


def _rank_part(name: str, loaded: torch.Tensor, dim: int, size: int, part: int, parts: int) -> torch.Tensor:
    """Part `part` (this rank's: its rank, or its replicated KV head's index) of `parts`, `size`
    entries of `loaded` along `dim`, which must hold exactly size * parts (checked on the full
    tensor, so a wrong size fails on every rank alike)."""
    if parts == 1:
        return loaded
    if loaded.dim() <= dim or loaded.shape[dim] != size * parts:
        raise ValueError(f"weight {name}: expected {size * parts} entries along dim {dim} "
                         f"({parts} parts x {size}), checkpoint has shape {tuple(loaded.shape)}")
    return loaded.narrow(dim, part * size, size)


class _LinearBase(nn.Module):
    # Column-parallel layers may take the norm in front into their GEMV (forward_normed).
    takes_norm = False
    # The weight's dim split over ranks: 0 (rows: column-parallel), 1 (columns: row-parallel), None.
    split_dim: int | None = None
    # The checkpoint modules a packed layer is built from, beside it, in shard order (None: itself).
    checkpoint_parts: tuple[str, ...] | None = None
    # The checkpoint tensors one parameter is packed from ((None,): one tensor, unpacked).
    shard_ids: tuple[str | int | None, ...] = (None,)

    def __init__(self, in_features: int, out_features: int, bias: bool, prefix: str | None = None):
        """`prefix`: the layer's checkpoint name (for a packed layer its own, e.g. `...qkv_proj`),
        by which it asks for its weight format; None: full precision always."""
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.out_features = out_features
        parts = [self.shard_rows(sid)[1] for sid in self.shard_ids]
        self.quant = linear_quant(self.checkpoint_names(prefix), parts, in_features, construction_device())
        held = self.quant is not None and self.quant.held
        dtype = FP8_DTYPE if held else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_slice = self.weight_slice
                param.shard_ids = self.shard_ids
        if self.quant is not None:
            self.weight.quant = self.quant  # the loader quantizes / dequantizes by it
        self.fp8 = self._fp8_parameters(in_features) if held else None
        self.path = linear_path(out_features, in_features, self.weight.device, takes_norm=self.takes_norm,
                                block_scales=self.fp8 is not None and self.fp8.blocks, fp8=self.fp8 is not None)

    def checkpoint_names(self, prefix: str | None) -> tuple[str, ...] | None:
        """The checkpoint modules this layer is built from (None without a prefix)."""
        if prefix is None or self.checkpoint_parts is None:
            return None if prefix is None else (prefix,)
        parent = prefix.rpartition(".")[0]
        return tuple(f"{parent}.{part}" for part in self.checkpoint_parts)

    def shard_rows(self, shard_id: str | int | None) -> tuple[int, int]:
        """(first row, rows) of checkpoint shard `shard_id` in this rank's weight."""
        if shard_id not in self.shard_ids:
            raise ValueError(f"{type(self).__name__} shard id must be one of {self.shard_ids}, got {shard_id!r}")
        return 0, self.out_features

    def rank_part(self, shard_id: str | int | None) -> tuple[int, int]:
        """(this rank's part, parts) of checkpoint shard `shard_id` along the split dimension:
        (rank, tp), unless ranks share a part (QKVParallelLinear's replicated KV heads)."""
        return self.tp_rank, self.tp_size

    def weight_slice(self, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: str | int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._slice(param, loaded, shard_id, 1)

    def _slice(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None,
               unit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the part of `param` that checkpoint shard `shard_id` fills on this rank, this rank's
        part of `loaded`); `unit` weight rows / columns per entry of `param` (a block grid: 128)."""
        offset, rows = (n // unit for n in self.shard_rows(shard_id))
        what = f"{type(self).__name__} shard {shard_id}" if shard_id is not None else type(self).__name__
        target = param.data.narrow(0, offset, rows)
        if self.split_dim == 0:
            loaded = _rank_part(what, loaded, 0, rows, *self.rank_part(shard_id))
        elif self.split_dim == 1 and param.dim() == 2:
            loaded = _rank_part(what, loaded, 1, param.shape[1], self.tp_rank, self.tp_size)
        check_loaded_shape(f"weight {what}", target.shape, loaded)
        return target, loaded

    def _fp8_parameters(self, in_features: int) -> Fp8Weights:
        """The scale (and static input scale) parameters beside an FP8 weight, registered under
        their checkpoint names."""
        fmt = self.quant.fmt
        shape = ((self.out_features // FP8_BLOCK, in_features // FP8_BLOCK) if fmt.scales == BLOCK
                 else (self.out_features,))
        scale = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
        scale.weight_slice, scale.shard_ids = self.scale_slice, self.shard_ids
        self.register_parameter(fmt.scale_name, scale)
        input_scale = None
        if fmt.static_input:
            input_scale = nn.Parameter(torch.empty(len(self.shard_ids), dtype=torch.float32), requires_grad=False)
            input_scale.weight_slice, input_scale.shard_ids = self.input_scale_slice, self.shard_ids
            self.register_parameter(INPUT_SCALE, input_scale)
        return Fp8Weights(self.weight, scale, input_scale, fmt.amax_ub)

    def scale_slice(self, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: str | int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """weight_slice for the weight's scale: a block grid in blocks; per row, a channel
        scale [rows, 1] or [rows], a tensor scale [1] or [] spread over its shard's rows."""
        if param.dim() == 2:
            return self._slice(param, loaded, shard_id, FP8_BLOCK)
        if loaded.numel() == 1 and loaded.dim() <= 1:
            full = self.shard_rows(shard_id)[1] * (self.rank_part(shard_id)[1] if self.split_dim == 0 else 1)
            loaded = loaded.reshape(1).expand(full)
        elif loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded.reshape(-1)
        return self._slice(param, loaded, shard_id, 1)

    def input_scale_slice(self, param: nn.Parameter, loaded: torch.Tensor,
                          shard_id: str | int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A static activation scale (one per checkpoint shard, [1] or [])."""
        self.shard_rows(shard_id)  # checks the shard id
        if loaded.numel() != 1 or loaded.dim() > 1:
            raise ValueError(f"input_scale must hold one value, checkpoint has shape {tuple(loaded.shape)}")
        i = self.shard_ids.index(shard_id)
        return param.data[i : i + 1], loaded.reshape(1)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias): `[*, in] -> [*, out]`, through the GEMV or the skinny GEMM for the
        batches they serve (both take FP8 weights as they are: W8A16), else fp8_linear or cuBLAS."""
        scale = None if self.fp8 is None else self.fp8.scale
        if self.path.gemv_serves(x):
            from nanovllm.kernels.gemv import gemv

            return gemv(x, self.weight, bias, weight_scale=scale)
        if self.path.skinny_serves(x):
            from nanovllm.kernels.skinny_gemm import skinny_gemm

            return skinny_gemm(x, self.weight, bias, weight_scale=scale)
        if self.fp8 is not None:
            return fp8_linear(x, self.fp8, bias, skinny=self.path.w8a8_serves(x))
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + bias with this rank's W (no reduction: replicated and column-parallel layers)."""
        return self._linear(x, self.bias)


class ReplicatedLinear(_LinearBase):
    """y = x W^T with the whole W on every rank (an MoE router): `[*, in] -> [*, out]`."""


class ColumnParallelLinear(_LinearBase):
    """y = x W^T with W's output rows split over ranks: `[*, in] -> [*, out / tp]`."""

    takes_norm = True
    split_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = False, prefix: str | None = None):
        super().__init__(in_features, out_features // tp_size(), bias, prefix)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(s)), s), s = x + residual (x when residual is None): the norm inside the
        GEMV where the layer's path allows it (decided at construction), else the norm's own
        kernel, then this layer."""
        if self.path.norm_serves(x):
            from nanovllm.kernels.gemv import rms_norm_gemv

            y, s = rms_norm_gemv(x, residual, norm.weight, norm.eps, self.weight, self.bias,
                                 weight_scale=None if self.fp8 is None else self.fp8.scale)
            return y, x if s is None else s
        if self.fp8 is not None and not self.path.gemv_serves(x) and not self.path.skinny_serves(x):
            # the norm quantizes its output itself
            from nanovllm.kernels.fused_norm import rms_norm_fp8

            xq, s = rms_norm_fp8(x, residual, norm.weight, norm.eps, self.fp8.row_quant())
            return fp8_linear(xq, self.fp8, self.bias, skinny=self.path.w8a8_serves(x)), x if s is None else s
        normed, s = norm.add_and_norm(x, residual)
        return self(normed), s


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one matmul (gate and up projections)."""

    # The SwiGLU MLP's gate and up projections (this class's one use).
    checkpoint_parts = ("gate_proj", "up_proj")

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, prefix: str | None = None):
        self.output_sizes = output_sizes
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(in_features, sum(output_sizes), bias, prefix)

    def shard_rows(self, shard_id):
        if shard_id not in self.shard_ids:
            raise ValueError(f"merged linear shard id must be one of {self.shard_ids}, got {shard_id!r}")
        return sum(self.output_sizes[:shard_id]) // self.tp_size, self.output_sizes[shard_id] // self.tp_size


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, heads split over ranks. With fewer KV heads than
    ranks (tp a multiple of them, as vLLM serves it), each KV head is replicated on tp / Hkv
    consecutive ranks: rank r holds KV head r // (tp / Hkv)."""

    shard_ids = ("q", "k", "v")
    checkpoint_parts = ("q_proj", "k_proj", "v_proj")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 prefix: str | None = None):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp)
        self.kv_replicas = max(1, tp // num_kv_heads)  # ranks holding each KV head
        super().__init__(hidden_size, (num_heads + 2 * self.num_kv_heads * tp) * head_dim, bias, prefix)

    def rank_part(self, shard_id):
        if shard_id == "q":
            return self.tp_rank, self.tp_size
        return self.tp_rank // self.kv_replicas, self.tp_size // self.kv_replicas

    def shard_rows(self, shard_id):
        q_rows = self.num_heads * self.head_dim
        kv_rows = self.num_kv_heads * self.head_dim
        offsets = {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}
        if shard_id not in offsets:
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        return offsets[shard_id]


class RowParallelLinear(_LinearBase):
    """y = x W^T with W's input columns split over ranks, partial sums all-reduced.

    `[*, in / tp] -> [*, out]`; the bias is added once, after the reduction.
    """

    split_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False, prefix: str | None = None):
        super().__init__(in_features // tp_size(), out_features, bias, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(self._linear(x, None))

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial products, then add the bias once."""
        if self.tp_size > 1:
            dist.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


class SiluMulRowParallelLinear(RowParallelLinear):
    """The MLP's down projection with SiLU-and-mul in front: gate_up [*, 2 * in / tp] = gate | up
    -> forward(silu(gate) * up) [*, out]. Batches the GEMV serves run the activation inside it
    (no activation kernel of its own); the others run SiluAndMul, then the projection (the skinny
    GEMM with SiLU-and-mul inside measured slower than the two kernels: 11.2 vs 8.2 us, 0.6B down
    at 16 rows)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, prefix: str | None = None):
        super().__init__(in_features, out_features, bias, prefix)
        self.act = SiluAndMul()

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.path.gemv_serves(gate_up):
            from nanovllm.kernels.gemv import silu_mul_gemv

            scale = None if self.fp8 is None else self.fp8.scale
            return self._reduce(silu_mul_gemv(gate_up, self.weight, weight_scale=scale))
        if self.fp8 is not None and not self.path.skinny_serves(gate_up):  # the activation quantizes its output
            from nanovllm.kernels.fused_activation import silu_and_mul_fp8

            return self._reduce(fp8_linear(silu_and_mul_fp8(gate_up, self.fp8.row_quant()), self.fp8, None,
                                           skinny=self.path.w8a8_serves(gate_up)))
        return super().forward(self.act(gate_up))
