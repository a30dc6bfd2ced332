"""Which implementation serves a layer, and from which row count: the one module that decides.

A layer asks once, in its constructor, for the device it is built on (the model runner builds
the model under `with torch.device(...)` and `with kernel_routes(config.kernel_routes)`), and
keeps the answer for its whole life (moving it afterwards changes nothing):

    CUDA          -> the Triton kernels (compiled), by rows of the call:
                     1 .. gemv_max_rows          Triton GEMV (kernels/gemv.py)
                       1 .. norm_in_gemv_max_rows    with the RMSNorm in front inside it, where
                                                     the layer's one-row grid is one wave
                     .. skinny_max_rows           skinny GEMM (kernels/skinny_gemm.py) on narrow layers
                     more                         cuBLAS (F.linear)
                     MoE decode steps of 1 .. moe_gemv_max_tokens: the expert GEMVs (moe/decode.py)
                     MoE grouped GEMMs on FP8 experts from moe_fp8_mma_min_tokens: W8A8 (FP8 MMAs)
                     the sampler: top-k thresholds by torch.topk up to topk_max_k, the radix select
                     from radix_min_rows rows; logprobs by the Triton pass unless logprobs_kernel is off
    other devices -> PyTorch (the CPU path; Triton's interpreter serves the kernel tests only)

Each threshold's evidence (H200, BENCHMARKS.md) is at its field. An A/B run passes another
`KernelRoutes` as `LLM(..., kernel_routes=...)`; nothing rebinds module constants.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import get_args, get_type_hints

import torch

from nanovllm.utils.ints import cdiv
from nanovllm.utils.scoped import scoped
from nanovllm.utils.validation import check_bool, check_int


@dataclass(frozen=True)
class KernelRoutes:
    """Row counts at which CUDA layers switch kernels. Defaults are the measured best."""

    # At 1-2 rows the GEMV streams the weight faster than cuBLAS (benchmarks/kernels/bench_gemm.py, 1 row: 0.6B o_proj
    # 3.5 vs 12.6 us, 8B down_proj 26.3 vs 30.3 us); at 4 rows it loses (8B qkv 29-33 vs 16.4 us).
    gemv_max_rows: int = 2
    # Narrow layers (the skinny GEMM's tiling splits K at this many rows: 0.6B o / down, 30B-A3B o /
    # router) beat cuBLAS at 3-16 rows: 0.6B decode at 4 / 8 / 16 sequences 1.326 / 1.443 / 1.790
    # ms per token against 1.421 / 1.518 / 1.865 (-4 to -7%); at 32 rows and on wide layers it lost.
    skinny_max_rows: int = 16
    # FP8 layers, wide or narrow, take the skinny GEMM (W8A16: the e4m3 weights converted in
    # registers, no activation quantization) past the GEMV's rows up to this many, instead of
    # quantized activations through torch._scaled_mm (Qwen3-8B's four layers at 8 / 16 / 32 rows
    # 70.7 / 67.4 / 87.4 us against 123.5 / 124.2 / 120.0; at 64 rows 140 against 121.5). 0: never.
    fp8_skinny_max_rows: int = 32
    # Past fp8_skinny_max_rows up to this many rows, FP8 layers multiply their quantized activations
    # with the e4m3 weights in the skinny GEMM (W8A8, e4m3 wgmma) instead of torch._scaled_mm: Qwen3-8B
    # online FP8 decode at 48 / 64 / 96 / 128 / 160 sequences 5.76 / 6.56 / 7.76 / 9.09 / 11.43 ms per
    # token against 7.00 / 7.65 / 8.42 / 9.62 / 12.21 (cuBLAS's FP8 GEMMs at 144-192 rows: 128-150 us
    # for the four layers against 105 here), the default workload 13,431 against 13,208 tok/s (128
    # rows); from 208 rows on the two tie end to end (BENCHMARKS.md, twenty-sixth session). 0: never.
    fp8_w8a8_skinny_max_rows: int = 192
    # The norm inside the GEMV: 0.6B batch-1 decode 0.942 vs 0.978 ms per token (-3.7%); at two
    # rows it lost (1.173 vs 1.109: the 2-row grids are larger than one wave). 0: never.
    norm_in_gemv_max_rows: int = 1
    # MoE decode steps up to this many tokens run the expert GEMVs (moe/decode.MAX_TOKENS is the
    # kernel's limit); larger steps run the grouped GEMMs.
    moe_gemv_max_tokens: int = 2
    # Grouped-GEMM steps on FP8 experts of at least this many tokens (their size class, moe/tiles.size_class,
    # so an eager step and its graph replay agree) run W8A8: activations quantized per token, FP8 x FP8 MMAs.
    # 16 (the smallest class): all of them. H200 (bench_moe_fp8.py, 30B-A3B experts): W8A8 took 0.46-0.90x
    # W8A16's time at every T measured (1-8,192), channel and block scales alike. None: never.
    moe_fp8_mma_min_tokens: int | None = 16
    # Largest top_k sampled by the Triton top-k kernel (sampling/topk_sample.py, capped at its MAX_K)
    # on batches whose every sampled row uses top-k: two launches where the threshold path's
    # softmax, torch.topk, tie count, mask and sampling passes took ~1.7 ms at 256 rows x 151,936
    # (H200, top_k 20 / top_p 0.95). 0: never (the threshold path).
    topk_kernel_max_k: int = 128
    # Largest top_k whose thresholds come from torch.topk instead of a full sort (when every top-p
    # row also uses top-k).
    topk_max_k: int = 1024
    # Fewest rows at which the radix select (sampling/radix_filter.py) beats a full sort (151,936
    # columns: at 16 rows the two tie, 0.88 / 0.85 ms; at 256 the select takes 1.58 ms against 4.39).
    radix_min_rows: int = 32
    # Logprobs (sampled and prompt) by the Triton pass (sampling/logprobs_kernel.py) rather than torch's
    # log_softmax + top-k (sampling/row_logprobs.py): alone, k=5 at 256 rows, 0.068 against 0.686 ms
    # (BENCHMARKS.md "Sampler"). False: torch's path on CUDA too, the other side of bench.py --logprobs' A/B.
    logprobs_kernel: bool = True

    def linear_row_limits(self, fp8: bool) -> tuple[int, ...]:
        """The row counts at which a projection's kernel changes (the last row each narrower kernel
        takes; 0s left out) in a model of 16-bit layers, or (`fp8`) of FP8 layers beside 16-bit ones.
        A CUDA graph replayed at a padded row count runs the kernels of its own step only if no such
        limit lies between the two (the decode and prefill graphs' sizes hold them)."""
        limits = (self.gemv_max_rows, self.norm_in_gemv_max_rows, self.skinny_max_rows)
        limits += (self.fp8_skinny_max_rows, self.fp8_w8a8_skinny_max_rows) if fp8 else ()
        return tuple(sorted({n for n in limits if n > 0}))

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ON_OFF_ROUTES:
                check_bool(f"kernel_routes.{f.name}", value)
            elif f.name in OPTIONAL_ROUTES:
                if value is not None:
                    check_int(f"kernel_routes.{f.name}", value, 1)
            else:
                check_int(f"kernel_routes.{f.name}", value, 0)
        if self.norm_in_gemv_max_rows > self.gemv_max_rows:
            raise ValueError(f"kernel_routes.norm_in_gemv_max_rows ({self.norm_in_gemv_max_rows}) must not "
                             f"exceed gemv_max_rows ({self.gemv_max_rows}): the norm runs inside the GEMV")


# The fields of KernelRoutes that turn a kernel on or off (bools); the others are row counts.
ON_OFF_ROUTES = frozenset(f.name for f in fields(KernelRoutes) if isinstance(f.default, bool))
# The fields of KernelRoutes that a None turns off (their 0 would read as "from no tokens on": always).
OPTIONAL_ROUTES = frozenset(name for name, hint in get_type_hints(KernelRoutes).items() if type(None) in get_args(hint))

_ROUTES: ContextVar[KernelRoutes] = ContextVar("kernel_routes", default=KernelRoutes())


def kernel_routes(routes: KernelRoutes) -> AbstractContextManager[KernelRoutes]:
    """Layers constructed inside this block take `routes` (reset on exit, also on exceptions)."""
    return scoped(_ROUTES, routes)


def current_routes() -> KernelRoutes:
    """The routes in effect for layers constructed now."""
    return _ROUTES.get()


def uses_triton(device: torch.device) -> bool:
    """Whether a layer built on `device` runs the Triton kernels."""
    return device.type == "cuda"


def construction_device() -> torch.device:
    """The device new tensors go to here (the `with torch.device(...)` in effect), for layers
    that have no parameter to ask."""
    return torch.empty(0).device


@dataclass(frozen=True)
class LinearPath:
    """A projection's kernels by rows of x [rows, in]: the GEMV up to `gemv_rows`, with the norm
    inside up to `norm_rows`, the skinny GEMM up to `skinny_rows`, cuBLAS beyond (0: none); FP8
    layers: the skinny GEMM on quantized activations (W8A8) past skinny_rows up to `w8a8_rows`."""

    gemv_rows: int
    norm_rows: int
    skinny_rows: int
    w8a8_rows: int = 0

    def gemv_serves(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and 0 < x.shape[0] <= self.gemv_rows

    def norm_serves(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and 0 < x.shape[0] <= self.norm_rows

    def skinny_serves(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and self.gemv_rows < x.shape[0] <= self.skinny_rows

    def w8a8_serves(self, x: torch.Tensor) -> bool:
        """x: the activation before its quantization."""
        return x.dim() == 2 and max(self.gemv_rows, self.skinny_rows) < x.shape[0] <= self.w8a8_rows


def linear_path(out_features: int, in_features: int, device: torch.device, *, takes_norm: bool,
                block_scales: bool = False, fp8: bool = False) -> LinearPath:
    """The path of a projection [out, in] built on `device` (`takes_norm`: a column-parallel layer
    whose input norm may run inside its GEMV; `fp8`: FP8 weights held as such, `block_scales` with
    128 x 128 block scales: their GEMV tiles differ)."""
    if not uses_triton(device):
        return LinearPath(0, 0, 0)
    from nanovllm.kernels.checks import cuda_sm_count

    return plan_linear(out_features, in_features, current_routes(), cuda_sm_count(device), takes_norm=takes_norm,
                       block_scales=block_scales, fp8=fp8)


def plan_linear(out_features: int, in_features: int, routes: KernelRoutes, sm_count: int, *,
                takes_norm: bool, block_scales: bool = False, fp8: bool = False) -> LinearPath:
    """`linear_path` on a CUDA device of `sm_count` SMs under `routes` (no device needed)."""
    from nanovllm.kernels.gemv import MAX_NORM_ELEMS, MAX_ROWS
    from nanovllm.kernels.gemv_plan import tiling
    from nanovllm.kernels.pdl import RESIDENT_PER_SM
    from nanovllm.kernels.skinny_gemm import MAX_ROWS as SKINNY_ROWS_LIMIT
    from nanovllm.kernels.skinny_plan import skinny_tiling
    from nanovllm.utils.ints import next_pow2

    gemv_rows = min(routes.gemv_max_rows, MAX_ROWS)
    norm_rows, wave = routes.norm_in_gemv_max_rows, sm_count * RESIDENT_PER_SM
    # The norm runs inside the GEMV where the layer's grid at norm_rows is one wave (a larger grid
    # repeats the row's norm in too many programs) and the rows fit the prologue (MAX_NORM_ELEMS).
    norm_fits = (takes_norm and norm_rows > 0
                 and next_pow2(norm_rows) * next_pow2(in_features) <= MAX_NORM_ELEMS
                 and cdiv(out_features, tiling(norm_rows, out_features, in_features, wave, block_scales, fp8).block_n)
                 <= wave)
    if fp8:  # every FP8 layer (the alternative is quantized activations through _scaled_mm)
        skinny_rows = min(routes.fp8_skinny_max_rows, SKINNY_ROWS_LIMIT)
        skinny_rows = skinny_rows if skinny_rows > gemv_rows else 0
        w8a8_rows = min(routes.fp8_w8a8_skinny_max_rows, SKINNY_ROWS_LIMIT)
        return LinearPath(gemv_rows, norm_rows if norm_fits else 0, skinny_rows,
                          w8a8_rows if w8a8_rows > max(gemv_rows, skinny_rows) else 0)
    skinny_rows = min(routes.skinny_max_rows, SKINNY_ROWS_LIMIT)
    # Narrow: the skinny GEMM's default tiling splits K at skinny_rows (few output tiles).
    narrow = (skinny_rows > gemv_rows
              and skinny_tiling(skinny_rows, out_features, in_features, sm_count).split_k > 1)
    return LinearPath(gemv_rows, norm_rows if norm_fits else 0, skinny_rows if narrow else 0)
