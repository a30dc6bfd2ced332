"""Host-side helpers shared by the Triton kernel wrappers: argument checks (ValueError/TypeError,
never assert) and constants. Imports torch only, never Triton: nanovllm.config reads
BLOCK_SIZE_MULTIPLE here on machines without Triton."""

import math
import os
from enum import IntEnum

import torch

from nanovllm.utils.ints import cdiv
from nanovllm.utils.validation import check_number, check_pow2, plain_number

# exp(x) = exp2(x * LOG2E): the kernels use exp2, which maps to one hardware instruction.
LOG2E = 1.4426950408889634
# Whether the kernels run under Triton's CPU interpreter, where some ops differ from the GPU's
# (tl.dot on bfloat16 operands, float32 -> bfloat16 casts): the kernels work around them there only.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The FP8 KV cache's element type (vLLM's "fp8" / "fp8_e4m3"): stored = x / scale, read = stored * scale.
FP8_KV_DTYPE = torch.float8_e4m3fn
# Its largest finite value (448), for the KV cache and FP8 weights and activations alike: values are
# clamped to +-FP8_MAX before the cast (a plain cast of a larger value is NaN).
FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)
# tl.dot's least size along each of its dimensions.
MIN_DOT_DIM = 16
# The attention kernels' largest head_dim (flash-attn's too): past 128 they take smaller tiles
# (prefill_plan.prefill_tile, decode_plan.decode_tile) so two stages fit shared memory.
ATTN_MAX_HEAD_DIM = 256
# FP8 cache values per int32 word: the decode kernel reads the cache 4 bytes at a time ...
FP8_PER_WORD = 4
# ... into FP8_PER_WORD planes of head_dim / 4 dims, each an MMA operand: a smaller head_dim cannot
# be read from an FP8 cache by the Triton kernels.
FP8_MIN_HEAD_DIM = FP8_PER_WORD * MIN_DOT_DIM
# Token granularity of the paged cache: the kernels' tiles assume multiples of 16 rows.
BLOCK_SIZE_MULTIPLE = 16
# Rows and columns of one block of block-scaled FP8 weights (the one size supported: Qwen's and
# DeepSeek's [128, 128]); activations then take one scale per 1 x FP8_BLOCK group.
FP8_BLOCK = 128
# Scale floor of FP8 quantization: an all-zero row, group or block gets this scale instead of 0
# (x / 0 would be NaN).
FP8_MIN_SCALE = 1e-12
# slot_mapping's value for a padding row (vLLM's PAD_SLOT_ID): the KV stores skip slots < 0.
PAD_SLOT = -1
# CUDA's limit on grid dims y and z: the kernels that launch sequences, head blocks, column blocks or
# vocabulary chunks along them check against it.
MAX_GRID_YZ = 65535
# SM count assumed off CUDA (Triton's CPU interpreter): small, so CPU tests run several tiles, splits
# or K slices per program.
CPU_SM_COUNT = 2


class ScaleMode(IntEnum):
    """How FP8 weights carry their scales: the kernels' W_SCALE constexpr (and X_SCALE, the
    activations' matching mode in W8A8 calls)."""

    NONE = 0  # no scales: weights in the activations' dtype
    CHANNEL = 1  # one scale per output row (per expert and row for stacked experts)
    BLOCK = 2  # one per FP8_BLOCK x FP8_BLOCK block


def linear_scale_mode(weight_scale: torch.Tensor | None) -> ScaleMode:
    """The mode of a linear weight's scales (checked by check_linear): [N] per row, [N / 128, K / 128]
    per block."""
    if weight_scale is None:
        return ScaleMode.NONE
    return ScaleMode.CHANNEL if weight_scale.dim() == 1 else ScaleMode.BLOCK


_sm_counts: dict[int, int] = {}


def cuda_sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device (cached); None for any other device."""
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_counts:
        _sm_counts[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_counts[idx]


def sm_count(device: torch.device) -> int:
    """The device's SM count; CPU_SM_COUNT where no CUDA device is visible (the interpreter)."""
    sms = cuda_sm_count(device)
    return CPU_SM_COUNT if sms is None else sms


def check_float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} dtype must be one of float16/bfloat16/float32, got {t.dtype}")


def check_matrix(name: str, t, dtype: torch.dtype | None = None) -> None:
    """t: a 2-D float tensor whose last dim is contiguous (rows may be strided), of `dtype` if given."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got {getattr(t, 'shape', type(t))}")
    check_float_dtype(name, t)
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} dtype {t.dtype} != x dtype {dtype}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def check_vector(name: str, t, n: int, like_name: str, like: torch.Tensor) -> None:
    """t: a contiguous float tensor of shape (n,) on the device of `like` (named like_name)."""
    if not isinstance(t, torch.Tensor) or t.shape != (n,):
        raise ValueError(f"{name} must be a tensor of shape ({n},), got {getattr(t, 'shape', type(t))}")
    check_float_dtype(name, t)
    if t.stride(0) != 1 and n > 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device}, {like_name} on {like.device}")


def check_row_vector(name: str, t, rows: int, dtype: torch.dtype, device: torch.device) -> None:
    """t: a per-row parameter, a contiguous `dtype` tensor of shape (rows,) on `device`
    (TypeError for its dtype, ValueError for its shape or device)."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        raise TypeError(f"{name} must be a {dtype} tensor, got {getattr(t, 'dtype', type(t))}")
    if tuple(t.shape) != (rows,) or (rows > 1 and t.stride(0) != 1):
        raise ValueError(f"{name} must be contiguous of shape ({rows},), got {tuple(t.shape)} strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, not on {device}")


def fp8_words(t: torch.Tensor, what: str) -> torch.Tensor:
    """FP8 values t [..., K] (last dim contiguous) as int32 words [..., K / FP8_PER_WORD], the kernels'
    word-wise read; a ValueError naming `what` where K, a stride or the offset is off the word grid."""
    if any(n % FP8_PER_WORD for n in (t.shape[-1], *t.stride()[:-1], t.storage_offset())):
        raise ValueError(f"{what} are read as int32 words: rows, strides and offset in multiples of {FP8_PER_WORD} "
                         f"values, got {tuple(t.shape)} strides {t.stride()} offset {t.storage_offset()}")
    return t.view(torch.int32)


def check_fp8_matrix(name: str, t) -> None:
    """t: a 2-D float8_e4m3fn tensor whose last dim is contiguous."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name} must be a 2-D float8_e4m3fn tensor, got {getattr(t, 'dtype', type(t))} "
                        f"{tuple(getattr(t, 'shape', ()))}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def check_fp8_weight(weight, scale, device: torch.device) -> None:
    """An FP8 weight [N, K] (float8_e4m3fn, last dim contiguous) and its float32 scale on
    `device`: [N] (one per row) or the block grid [ceil(N/FP8_BLOCK), ceil(K/FP8_BLOCK)]."""
    check_fp8_matrix("an FP8 weight", weight)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise TypeError(f"weight_scale must be a float32 tensor, got {getattr(scale, 'dtype', type(scale))}")
    n, k = weight.shape
    grid = (cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK))
    if tuple(scale.shape) not in ((n,), grid) or not scale.is_contiguous():
        raise ValueError(f"weight_scale must be contiguous, ({n},) per row or {grid} per {FP8_BLOCK}x{FP8_BLOCK} "
                         f"block of weight {tuple(weight.shape)}; got {tuple(scale.shape)} strides {scale.stride()}")
    for name, t in (("weight", weight), ("weight_scale", scale)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, x on {device}")


def check_linear(kernel: str, x, weight, bias, silu_mul: bool, max_rows: int,
                 weight_scale=None, x_fp8: bool = False) -> tuple[int, int, int]:
    """The arguments of a linear kernel (gemv.py, skinny_gemm.py): x [M, K] (or [M, 2K] = gate | up
    with silu_mul) with 1 <= M <= max_rows, weight [N, K] of x's dtype and device (with
    weight_scale: FP8, check_fp8_weight), bias [N] or None; `x_fp8`: x is e4m3 too (W8A8).
    Returns (M, N, K)."""
    if x_fp8:
        check_fp8_matrix("x", x)
    else:
        check_matrix("x", x)
    if weight_scale is None:
        check_matrix("weight", weight, x.dtype)
    else:
        check_fp8_weight(weight, weight_scale, x.device)
    m, xk = x.shape
    n_out, k_in = weight.shape
    want_k = 2 * k_in if silu_mul else k_in
    if xk != want_k:
        raise ValueError(f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)} "
                         f"(x needs {want_k} columns{' = gate | up' if silu_mul else ''})")
    if not 1 <= m <= max_rows:
        raise ValueError(f"{kernel} serves 1..{max_rows} rows, got {m}")
    if n_out < 1 or k_in < 1:
        raise ValueError(f"weight must be non-empty, got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if bias is not None:
        check_vector("bias", bias, n_out, "x", x)
    return m, n_out, k_in


def check_eps(eps) -> None:
    if not isinstance(eps, (float, int)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def check_amax_ub(name: str, value: object) -> None:
    """A bound on an activation row's amax (fbgemm_fp8's activation_scale_ub): a positive finite
    number, an int or a float (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., H] as [rows, H] with a contiguous last dim, as check_matrix wants (a view when possible)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def check_head_dim(d: int) -> None:
    check_pow2("head_dim", d, MIN_DOT_DIM, ATTN_MAX_HEAD_DIM)


def check_query(q: torch.Tensor) -> None:
    """An attention kernel's q [..., num_heads, head_dim] (its rank checked by the caller): a
    float dtype, a supported head_dim, a contiguous last dim."""
    check_float_dtype("q", q)
    check_head_dim(q.shape[-1])
    if q.stride(-1) != 1:
        raise ValueError(f"q must have a contiguous last dim, got strides {q.stride()}")


def softmax_scale_of(softmax_scale, head_dim: int) -> float:
    """The scale an attention call multiplies q.k by: head_dim ** -0.5 when None, else a positive finite
    number, a NumPy one too (the kernels take each row's max before scaling it: kernels/online_softmax.py)."""
    if softmax_scale is None:
        return head_dim ** -0.5
    scale = plain_number(softmax_scale)
    check_number("softmax_scale", scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return float(scale)


def check_gqa(hq: int, hkv: int) -> None:
    """Query heads come in whole groups per kv head."""
    if hkv == 0 or hq % hkv:
        raise ValueError(f"num_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")


def check_on_device(device: torch.device, tensors) -> None:
    """Each (name, tensor) of tensors lies on q's device."""
    for name, t in tensors:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}")


def check_cache(k_cache, v_cache, hkv: int, d: int, dtype) -> int:
    """Validate paged caches [num_blocks, block_size, hkv, d]; return block_size."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, torch.Tensor) or c.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [num_blocks, block_size, num_kv_heads, "
                             f"head_dim], got {getattr(c, 'shape', type(c))}")
        if c.dtype != dtype:
            hint = " (an FP8 cache comes with k_scale and v_scale)" if FP8_KV_DTYPE in (c.dtype, dtype) else ""
            raise TypeError(f"{name} dtype {c.dtype} != {dtype}{hint}")
        if tuple(c.shape[2:]) != (hkv, d):
            raise ValueError(f"{name} shape {tuple(c.shape)} does not match num_kv_heads={hkv}, head_dim={d}")
        if c.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {c.stride()}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache {tuple(k_cache.shape)}/{k_cache.stride()} and v_cache "
                         f"{tuple(v_cache.shape)}/{v_cache.stride()} must have equal shapes and strides")
    block_size = k_cache.shape[1]
    if block_size <= 0 or block_size % BLOCK_SIZE_MULTIPLE:
        raise ValueError(f"block_size must be a positive multiple of {BLOCK_SIZE_MULTIPLE}, got {block_size}")
    return block_size


def check_fp8_head_dim(head_dim: int) -> None:
    """The decode kernel reads an FP8 cache in four planes of head_dim / 4: at least FP8_MIN_HEAD_DIM."""
    if head_dim < FP8_MIN_HEAD_DIM:
        raise ValueError(f"an FP8 KV cache needs head_dim >= {FP8_MIN_HEAD_DIM} on the Triton kernels, got {head_dim} "
                         f"(use a 16-bit cache, kv_cache_dtype='bfloat16' or 'auto' on a checkpoint without a "
                         f"calibrated FP8 cache, or attention_backend='torch')")


def check_fp8_words(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """FP8 caches the decode kernel can read as int32 words of four values: head_dim at least
    FP8_MIN_HEAD_DIM; every stride but the last and the storage offset multiples of 4 (the engine's
    caches are)."""
    check_fp8_head_dim(k_cache.shape[-1])
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if any(x % FP8_PER_WORD for x in (*c.stride()[:-1], c.storage_offset())):
            raise ValueError(f"an FP8 {name} is read {FP8_PER_WORD} values to a word: its strides and storage "
                             f"offset must be multiples of {FP8_PER_WORD}, got strides {c.stride()}, offset "
                             f"{c.storage_offset()}")


def check_int_tensor(name: str, t, shape=None, dims=None) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got {getattr(t, 'dtype', type(t))}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} shape {tuple(t.shape)} != {tuple(shape)}")
    if t.dim() >= 1 and t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def check_out(out, q: torch.Tensor) -> None:
    """A caller's output buffer for an attention kernel: q's shape, dtype and device, last dim
    contiguous; rows and heads may be strided (a view of a larger buffer) but must not overlap."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor or None, got {type(out).__name__}")
    if out.dtype != q.dtype:
        raise TypeError(f"out dtype {out.dtype} != q dtype {q.dtype}")
    if out.shape != q.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    if out.device != q.device:
        raise ValueError(f"out is on {out.device}, q on {q.device}")
    d, hq = out.shape[-1], out.shape[-2]
    if out.stride(-1) != 1 and d > 1:
        raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")
    head_stride = out.stride(-2) if hq > 1 else d  # a size-1 dim's stride is arbitrary
    if head_stride < d or (out.shape[0] > 1 and out.stride(0) < hq * head_stride):
        raise ValueError(f"out strides {out.stride()} overlap: need a head stride >= head_dim ({d}) "
                         f"and a row stride >= num_heads x head stride")


def check_kv_scales(k_scale, v_scale, device: torch.device) -> bool:
    """The dequantization scales of an FP8 cache: both None (the cache holds q's dtype) or both
    float32 [1] tensors on `device` (the cache holds FP8_KV_DTYPE). Returns whether it is FP8."""
    if k_scale is None and v_scale is None:
        return False
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor of shape (1,) (k_scale and v_scale come together), "
                            f"got {getattr(t, 'dtype', type(t))}")
        if tuple(t.shape) != (1,):
            raise ValueError(f"{name} must have shape (1,), got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}")
    return True


def kv_cache_dtype(q_dtype: torch.dtype, fp8: bool) -> torch.dtype:
    """The element type a cache must have: FP8_KV_DTYPE when scales are given, else q's."""
    return FP8_KV_DTYPE if fp8 else q_dtype
