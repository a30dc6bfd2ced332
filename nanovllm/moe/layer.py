"""The mixture-of-experts MLP (Qwen3-MoE's sparse block): a router picks each token's top-k
experts, each a SwiGLU MLP, and their outputs are summed with the router's weights.

    hidden [T, H] --gate--> logits [T, E] --softmax (float32)--> top-k: weights [T, K], ids [T, K]
                                           (weights renormalised to sum to 1 if norm_topk_prob)
    out[t] = sum_k weights[t, k] * w2[e] @ (silu(g) * u),  [g | u] = w13[e] @ hidden[t],  e = ids[t, k]

Expert weights are stacked: w13 [E, 2 I/tp, H] (rows [0, I/tp): this rank's rows of gate_proj,
[I/tp, 2 I/tp): of up_proj) and w2 [E, H, I/tp] (this rank's columns of down_proj). As in the
dense MLP, each rank sums over its part of the intermediate dimension and the ranks all-reduce;
the router is replicated, so every rank routes identically.

Checkpoint spellings (per expert and projection, or transformers 5's fused tensors) map onto w13 /
w2 and their shard ids in moe/checkpoint_names.py; a fused tensor fills a whole parameter (its
`shard_groups`, utils/loader.py).

FP8 experts (a checkpoint's per-expert `weight` + `weight_scale_inv` / `weight_scale`, or
full-precision ones under LLM(quantization="fp8")): the experts ask their format by name at
construction (quantization/config.expert_quant). Where they run the Triton kernels (CUDA) they
hold w13 / w2 as float8_e4m3fn beside float32 scales, registered as `w13_{scale name}` /
`w2_{scale name}` (`...experts.{e}.gate_proj.weight_scale_inv` fills expert e's rows of
w13_weight_scale_inv), which the kernels apply in registers (moe/fp8_experts.py):

    per channel (channel and tensor checkpoints, online FP8)   [E, 2 I/tp], [E, H]
    per 128 x 128 block (I/tp a multiple of 128)               [E, 2 I/tp / 128, cdiv(H, 128)],
                                                               [E, cdiv(H, 128), I/tp / 128]

Elsewhere (CPU; block scales whose rank boundary splits a block) the loader dequantizes them into
w13 / w2 in the compute dtype. The router stays in full precision. Held FP8 experts run W8A16
(activations in the compute dtype) in the decode GEMVs; grouped-GEMM steps of
KernelRoutes.moe_fp8_mma_min_tokens or more (size class: by default all) quantize the activations
per token (block scales: per 128 columns) and multiply FP8 x FP8 (W8A8); the block's input comes
quantized from its RMSNorm kernel (SparseMoeBlock.forward_normed), beside the 16-bit rows the router reads.

A layer built on CUDA (decided once, at construction: layers/kernel_path.py) routes with one
Triton kernel (moe/routing.py) and runs the experts as the fused Triton MoE
(moe/grouped_gemm.py: fixed shapes, routing read on the device, so decode steps stay inside CUDA
graphs), or for decode steps of 1-2 tokens as two GEMV launches that route too
(moe/decode.moe_gemv_routed); on other devices `route` and `experts_native`, a plain
PyTorch loop over the experts that some token picked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.checks import FP8_BLOCK, ScaleMode
from nanovllm.kernels.fp8_quant import QuantizedRows, RowQuant
from nanovllm.layers.kernel_path import construction_device, current_routes, uses_triton
from nanovllm.layers.linear import ReplicatedLinear, check_loaded_shape
from nanovllm.moe.checkpoint_names import DOWN_PROJ, FUSED_DOWN, FUSED_GATE_UP, GATE_PROJ, UP_PROJ
from nanovllm.moe.fp8_experts import scale_shapes
from nanovllm.quantization.config import BLOCK, FP8_DTYPE, expert_quant
from nanovllm.utils.context import in_decode_step
from nanovllm.utils.distributed import tp_rank, tp_size
from nanovllm.utils.ints import cdiv

def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K] float32, expert ids [T, K] int64): the top-k of
    the float32 softmax, divided by their sum when `renormalize`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_native(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts in plain PyTorch: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights /
    topk_ids [T, K] -> [T, H] in hidden's dtype (weighted sum in float32). Each expert some token
    picked runs once on the rows that picked it; the others are skipped."""
    out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=torch.float32, device=hidden.device)  # [T, H]
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)  # [n], [n]
        gate, up = F.linear(hidden.index_select(0, tokens), w13[expert]).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, w2[expert])  # [n, H]
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots].unsqueeze(-1))
    return out.to(hidden.dtype)


class MoeExperts(nn.Module):
    """E SwiGLU experts stacked in w13 [E, 2 I/tp, H] and w2 [E, H, I/tp]: forward(hidden [T, H],
    weights [T, K], ids [T, K]) -> this rank's partial sum [T, H] (not reduced over ranks); the part
    it holds is that of the tensor-parallel layout it is built under (utils/distributed.py)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, prefix: str | None = None, *,
                 kernels: bool | None = None):
        """`prefix`: the checkpoint name of the experts module (`...mlp.experts`), by which
        they ask for their weights' format (quantization/config.py); None: full precision.
        `kernels`: whether the layer runs the Triton kernels (None: layers/kernel_path.uses_triton
        of the construction device; True on CPU: under Triton's interpreter, in tests)."""
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.local_size = intermediate_size // self.tp_size  # I / tp
        self.use_triton = uses_triton(construction_device()) if kernels is None else bool(kernels)
        experts = range(num_experts)
        names = None if prefix is None else tuple(f"{prefix}.{e}.{proj}" for e in experts
                                                  for proj in (GATE_PROJ, UP_PROJ, DOWN_PROJ))
        quant = expert_quant(names, self.local_size, self.use_triton, hidden_size)
        held = quant is not None and quant.held
        dtype = FP8_DTYPE if held else None
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local_size, hidden_size, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_size, dtype=dtype), requires_grad=False)
        self.w13.shard_ids = tuple((e, proj) for e in experts for proj in (GATE_PROJ, UP_PROJ))
        self.w2.shard_ids = tuple((e, DOWN_PROJ) for e in experts)
        self.w13.shard_groups = {FUSED_GATE_UP: self.w13.shard_ids}
        self.w2.shard_groups = {FUSED_DOWN: self.w2.shard_ids}
        for param in (self.w13, self.w2):
            param.weight_slice = self.weight_slice
            if quant is not None:  # the loader quantizes / dequantizes by it
                param.quant = quant
        # FP8 experts' (w13, w2) scale parameters (float32, module docstring); None: w13 / w2 in the compute dtype.
        # The held experts' scale mode (BLOCK: local is whole blocks, expert_quant); None: not held.
        mode = (ScaleMode.BLOCK if quant.fmt.requant_scales == BLOCK else ScaleMode.CHANNEL) if held else None
        self.scales = self._scale_parameters(mode, quant.fmt.scale_name) if held else None
        # Decode steps of up to this many tokens run the expert GEMVs (KernelRoutes; 0 off CUDA).
        self.gemv_tokens = 0
        if self.use_triton:
            from nanovllm.moe.decode import MAX_TOKENS

            self.gemv_tokens = min(current_routes().moe_gemv_max_tokens, MAX_TOKENS)
        # Grouped-GEMM steps whose size class reaches this run W8A8 (held FP8 experts; None: never).
        self.fp8_mma_tokens = current_routes().moe_fp8_mma_min_tokens if held and self.use_triton else None
        # How those steps take hidden in e4m3 (the block's norm quantizes it in its kernel; None: no W8A8).
        self.input_quant = None
        if self.fp8_mma_tokens is not None:
            from nanovllm.moe.grouped_gemm import act_row_quant

            self.input_quant = act_row_quant(mode)

    def _scale_parameters(self, mode: ScaleMode, scale_name: str) -> tuple[nn.Parameter, nn.Parameter]:
        """w13's and w2's scale parameters (`mode`: CHANNEL or BLOCK), registered as
        `w13_{scale_name}` / `w2_{scale_name}`, filled per expert and projection (scale_slice)."""
        shapes = scale_shapes(mode, self.num_experts, self.local_size, self.hidden_size)
        params = []
        for weight, shape in ((self.w13, shapes[0]), (self.w2, shapes[1])):
            param = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
            param.shard_ids, param.weight_slice = weight.shard_ids, self.scale_slice
            self.register_parameter(f"{'w13' if weight is self.w13 else 'w2'}_{scale_name}", param)
            params.append(param)
        return params[0], params[1]

    def weight_slice(self, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: tuple[int, str] | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the part of w13 / w2 that `loaded` fills, this rank's part of `loaded`); no copy."""
        E, H, I, local = self.num_experts, self.hidden_size, self.intermediate_size, self.local_size
        start = self.tp_rank * local  # this rank's first intermediate index
        if param is self.w13 and shard_id == FUSED_GATE_UP:
            check_loaded_shape("experts gate_up_proj", (E, 2 * I, H), loaded)
            # [E, 2, I, H] (gate | up) -> this rank's rows of each: [E, 2, I/tp, H]
            return param.data.view(E, 2, local, H), loaded.unflatten(1, (2, I)).narrow(2, start, local)
        if param is self.w2 and shard_id == FUSED_DOWN:
            check_loaded_shape("experts down_proj", (E, H, I), loaded)
            return param.data, loaded.narrow(2, start, local)
        valid = param.shard_ids if param is self.w13 or param is self.w2 else ()
        if shard_id not in valid:
            raise ValueError(f"expert shard id must be one of (expert < {E}, projection) or a fused "
                             f"tensor's name, got {shard_id!r}")
        expert, proj = shard_id
        if proj == DOWN_PROJ:
            check_loaded_shape(f"expert {expert} {proj}", (H, I), loaded)
            return param.data[expert], loaded.narrow(1, start, local)
        check_loaded_shape(f"expert {expert} {proj}", (I, H), loaded)
        offset = 0 if proj == GATE_PROJ else local
        return param.data[expert].narrow(0, offset, local), loaded.narrow(0, start, local)

    def scale_slice(self, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor]:
        """weight_slice for the scales of one expert's projection: a block grid ([ceil(I/128),
        ceil(H/128)], down_proj [ceil(H/128), ceil(I/128)]) in blocks; per channel [rows, 1] or
        [rows], a tensor scale ([1] or []) spread over the projection's rows."""
        H, I, local = self.hidden_size, self.intermediate_size, self.local_size
        if shard_id not in param.shard_ids:
            raise ValueError(f"expert scale shard id must be one of (expert < {self.num_experts}, projection), "
                             f"got {shard_id!r}")
        expert, proj = shard_id
        what = f"expert {expert} {proj} scale"
        unit = FP8_BLOCK if param.dim() == 3 else 1  # weight rows / columns per scale entry
        start, rows = self.tp_rank * local // unit, local // unit
        if unit == 1:
            full = H if proj == DOWN_PROJ else I
            if loaded.numel() == 1 and loaded.dim() <= 1:
                loaded = loaded.reshape(1).expand(full)
            elif loaded.dim() == 2 and loaded.shape[1] == 1:
                loaded = loaded.reshape(-1)
            check_loaded_shape(what, (full,), loaded)
            if proj == DOWN_PROJ:  # one scale per output row: every rank holds them all
                return param.data[expert], loaded
            offset = 0 if proj == GATE_PROJ else local
            return param.data[expert].narrow(0, offset, local), loaded.narrow(0, start, local)
        grid_h, grid_i = cdiv(H, FP8_BLOCK), cdiv(I, FP8_BLOCK)
        if proj == DOWN_PROJ:
            check_loaded_shape(what, (grid_h, grid_i), loaded)
            return param.data[expert], loaded.narrow(1, start, rows)
        check_loaded_shape(what, (grid_i, grid_h), loaded)
        offset = 0 if proj == GATE_PROJ else rows
        return param.data[expert].narrow(0, offset, rows), loaded.narrow(0, start, rows)

    def runs_gemv(self, hidden: torch.Tensor) -> bool:
        """Whether this step's experts run as the decode GEMVs (moe/decode.py): on CUDA, in
        a decode step of 1-2 tokens. Decided by the step's kind as well as its size, so that an
        eager step and the CUDA graph replaying it (decode graphs of 1 and 2 rows; prefill / mixed
        graphs pad to 16+ tokens) always run the same kernels."""
        return in_decode_step() and hidden.shape[0] <= self.gemv_tokens

    def runs_fp8_mma(self, hidden: torch.Tensor) -> bool:
        """Whether this grouped-GEMM step runs W8A8: held FP8 experts on CUDA, a step whose size
        class (the tiles' and CUDA graphs' unit, moe/tiles.size_class) reaches
        fp8_mma_tokens, so an eager step and the graph replaying it run the same kernels."""
        from nanovllm.moe.tiles import size_class

        return self.fp8_mma_tokens is not None and size_class(hidden.shape[0]) >= self.fp8_mma_tokens

    def step_input_quant(self, hidden: torch.Tensor) -> RowQuant | None:
        """How this step's W8A8 grouped GEMMs take hidden in e4m3, for a norm that quantizes its
        own output (SparseMoeBlock.forward_normed); None where the step runs none."""
        if self.input_quant is None or self.runs_gemv(hidden) or not self.runs_fp8_mma(hidden):
            return None
        return self.input_quant

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                hidden_fp8: QuantizedRows | None = None) -> torch.Tensor:
        """The experts for a given routing (the steps runs_gemv serves take forward_routed);
        `hidden_fp8`: hidden quantized as step_input_quant says, for a W8A8 step."""
        if not self.use_triton:
            return experts_native(hidden, self.w13, self.w2, topk_weights, topk_ids)
        from nanovllm.moe.grouped_gemm import fused_moe

        w13_scale, w2_scale = self.scales or (None, None)
        return fused_moe(hidden, self.w13, self.w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale,
                         act_fp8=self.runs_fp8_mma(hidden), x_fp8=hidden_fp8)

    def forward_routed(self, hidden: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                       renormalize: bool) -> torch.Tensor:
        """The decode GEMVs with the routing folded into their first launch (runs_gemv steps only)."""
        from nanovllm.moe.decode import moe_gemv_routed

        w13_scale, w2_scale = self.scales or (None, None)
        return moe_gemv_routed(hidden, self.w13, self.w2, router_logits, top_k, renormalize, w13_scale=w13_scale,
                               w2_scale=w2_scale)[0]


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated [E, H], no bias) + experts: hidden [T, H] -> [T, H], summed
    over the ranks' parts of the intermediate dimension."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 prefix: str | None = None):
        """`prefix`: the block's checkpoint name (`model.layers.{i}.mlp`), for the experts' weight
        format; the router stays in full precision whatever the checkpoint's quantization."""
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = MoeExperts(num_experts, hidden_size, intermediate_size,
                                  None if prefix is None else f"{prefix}.experts")
        if self.experts.use_triton:
            from nanovllm.moe.routing import moe_route

            self.route = moe_route  # one launch; ids int32
        else:
            self.route = route

    def forward_normed(self, hidden: torch.Tensor, residual: torch.Tensor,
                       norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(hidden + residual)), hidden + residual): the norm as its own kernel (the
        experts need the normalised row too, which the router's GEMV does not return); for a W8A8
        step it writes the row in e4m3 as well, so the experts quantize nothing first."""
        quant = self.experts.step_input_quant(hidden)
        if quant is None:
            normed, residual = norm.add_and_norm(hidden, residual)
            return self(normed), residual
        normed, normed_fp8, residual = norm.add_norm_and_quantize(hidden, residual, quant)
        return self(normed, normed_fp8), residual

    def forward(self, hidden: torch.Tensor, hidden_fp8: QuantizedRows | None = None) -> torch.Tensor:
        """hidden [T, H] -> [T, H]; `hidden_fp8`: hidden in e4m3 for a W8A8 step (forward_normed)."""
        logits = self.gate(hidden)  # [T, E]
        if self.experts.runs_gemv(hidden):  # routing inside the expert GEMVs: one launch fewer
            out = self.experts.forward_routed(hidden, logits, self.top_k, self.renormalize)  # [T, H]
        else:
            topk_weights, topk_ids = self.route(logits, self.top_k, self.renormalize)  # [T, K] each
            out = self.experts(hidden, topk_weights, topk_ids, hidden_fp8)  # [T, H]
        if self.experts.tp_size > 1:
            dist.all_reduce(out)
        return out
