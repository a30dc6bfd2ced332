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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.kernel_path import linear_path
from nanovllm.utils.distributed import tp_rank, tp_size

def _check_shape(name: str, expected: torch.Size, loaded: torch.Tensor) -> None:
    if tuple(expected) != tuple(loaded.shape):
        raise ValueError(f"weight {name}: expected shape {tuple(expected)}, checkpoint has {tuple(loaded.shape)}")


def _rank_part(name: str, loaded: torch.Tensor, dim: int, size: int, rank: int, tp: int) -> torch.Tensor:
    """This rank's `size` entries of `loaded` along `dim`, which must hold exactly size * tp
    (checked on the full tensor, so a wrong size fails on every rank alike)."""
    if tp == 1:
        return loaded
    if loaded.dim() <= dim or loaded.shape[dim] != size * tp:
        raise ValueError(f"weight {name}: expected {size * tp} entries along dim {dim} "
                         f"({tp} ranks x {size}), checkpoint has shape {tuple(loaded.shape)}")
    return loaded.narrow(dim, rank * size, size)


class _LinearBase(nn.Module):
    # Column-parallel layers may take the norm in front into their GEMV (forward_normed).
    takes_norm = False

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_slice = self.weight_slice
                param.shard_ids = self.shard_ids
        self.path = linear_path(out_features, in_features, self.weight.device, takes_norm=self.takes_norm)

    # The checkpoint tensors one parameter is packed from ((None,): one tensor, unpacked).
    shard_ids: tuple[str | int | None, ...] = (None,)

    def weight_slice(self, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: str | int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias): `[*, in] -> [*, out]`, through the GEMV or the skinny GEMM for the
        batches they serve."""
        if self.path.gemv_serves(x):
            from nanovllm.kernels.gemv import gemv

            return gemv(x, self.weight, bias)
        if self.path.skinny_serves(x):
            from nanovllm.kernels.skinny_gemm import skinny_gemm

            return skinny_gemm(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


class ReplicatedLinear(_LinearBase):
    """y = x W^T with the whole W on every rank (an MoE router): `[*, in] -> [*, out]`."""

    def weight_slice(self, param, loaded, shard_id=None):
        _check_shape("replicated", param.shape, loaded)
        return param.data, loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class ColumnParallelLinear(_LinearBase):
    """y = x W^T with W's output rows split over ranks: `[*, in] -> [*, out / tp]`."""

    takes_norm = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features // tp_size(), bias)

    def weight_slice(self, param, loaded, shard_id=None):
        shard = _rank_part("column-parallel", loaded, 0, param.shape[0], self.tp_rank, self.tp_size)
        _check_shape("column-parallel", param.shape, shard)
        return param.data, shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(s)), s), s = x + residual (x when residual is None): the norm inside the
        GEMV where the layer's path allows it (decided at construction), else the norm's own
        kernel, then this layer."""
        if self.path.norm_serves(x):
            from nanovllm.kernels.gemv import rms_norm_gemv

            y, s = rms_norm_gemv(x, residual, norm.weight, norm.eps, self.weight, self.bias)
            return y, x if s is None else s
        normed, s = norm.add_and_norm(x, residual)
        return self(normed), s


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one matmul (gate and up projections)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_slice(self, param, loaded, shard_id=None):
        if shard_id not in self.shard_ids:
            raise ValueError(f"merged linear shard id must be one of {self.shard_ids}, got {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        rows = self.output_sizes[shard_id] // self.tp_size
        target = param.data.narrow(0, offset, rows)
        shard = _rank_part(f"shard {shard_id}", loaded, 0, rows, self.tp_rank, self.tp_size)
        _check_shape(f"shard {shard_id}", target.shape, shard)
        return target, shard


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, heads split over ranks."""

    shard_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = num_kv_heads // tp
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_slice(self, param, loaded, shard_id=None):
        q_rows = self.num_heads * self.head_dim
        kv_rows = self.num_kv_heads * self.head_dim
        offsets = {"q": (0, q_rows), "k": (q_rows, kv_rows), "v": (q_rows + kv_rows, kv_rows)}
        if shard_id not in offsets:
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        offset, rows = offsets[shard_id]
        target = param.data.narrow(0, offset, rows)
        shard = _rank_part(f"{shard_id}_proj", loaded, 0, rows, self.tp_rank, self.tp_size)
        _check_shape(f"{shard_id}_proj", target.shape, shard)
        return target, shard


class RowParallelLinear(_LinearBase):
    """y = x W^T with W's input columns split over ranks, partial sums all-reduced.

    `[*, in / tp] -> [*, out]`; the bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features // tp_size(), out_features, bias)

    def weight_slice(self, param, loaded, shard_id=None):
        if param.dim() == 2:
            loaded = _rank_part("row-parallel", loaded, 1, param.shape[1], self.tp_rank, self.tp_size)
        _check_shape("row-parallel", param.shape, loaded)
        return param.data, loaded

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

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias)
        self.act = SiluAndMul()

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.path.gemv_serves(gate_up):
            from nanovllm.kernels.gemv import silu_mul_gemv

            return self._reduce(silu_mul_gemv(gate_up, self.weight))
        return super().forward(self.act(gate_up))
