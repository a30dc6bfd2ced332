"""Triton logprobs: log_softmax at one token per row and each row's k most likely tokens, in one
read of the logits (no [rows, vocab] float32 log_softmax written, no full-row top-k), two launches.

    stats   grid (R, C): program (r, c) reads columns [c * BLOCK, (c + 1) * BLOCK) of logits row
            rows[r] once -> chunk max m[r, c], sum of exp(x - m[r, c]) s[r, c], the chunk's K best keys
    combine grid (R):    lse = M + log(sum_c s[r, c] * exp(m[r, c] - M)),  M = max_c m[r, c]
            chosen[r] = x[rows[r], token[rows[r]]] - lse;  top k = the k best of the C * K keys - lse

A key packs a logit and its column into one int64 that orders like (logit, -column):

    bits 63..32: the float32 logit's bits, negatives' magnitude bits flipped (signed order = float order)
    bits 31..0 : MAX_COL - column (the lower column wins a tie)

so each of the K rounds (best key, mask it out) is one reduction, and among equal logits the lower
token id ranks first. Logits are read in their dtype and computed on in float32; offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import LOG2E as _LOG2E_VALUE, check_float_dtype, next_pow2

# Kernels read module globals only as constexprs (compiled Triton refuses plain floats).
LOG2E = tl.constexpr(_LOG2E_VALUE)
# Column part of a key: columns stay below 2**31 (any vocabulary), so MAX_COL - column >= 0.
MAX_COL = tl.constexpr(2**31 - 1)
# A key below every real one (a masked-out or padding candidate).
NO_KEY = tl.constexpr(-(2**63))

# Columns per program: 38 programs per row at a 151,936-token vocabulary, 32 values a thread at
# NUM_WARPS = 4 (one tile in registers while the K rounds of max run over it).
BLOCK = 4096
NUM_WARPS = 4
# Chunks ride grid axis 1, which CUDA caps at 65535.
MAX_CHUNKS = 65535


@triton.jit
def _to_key(x, cols):
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (MAX_COL + -cols.to(tl.int64))


@triton.jit
def _key_value(key):
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)


@triton.jit
def _key_col(key):
    return -(key & 0xFFFFFFFF) + MAX_COL


@triton.jit
def _stats_kernel(x_ptr, rows_ptr, max_ptr, sum_ptr, key_ptr, vocab, stride_x, num_chunks,
                  K: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row = tl.load(rows_ptr + r)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=float("-inf")).to(tl.float32)
    out = r * num_chunks + chunk
    if K > 0:
        keys = tl.where(valid, _to_key(x, cols), NO_KEY)
        best = tl.max(keys, axis=0)
        m = _key_value(best)  # the chunk max: round 0's key
        tl.store(key_ptr + out * K, best)
        for i in tl.static_range(1, K):
            keys = tl.where(keys == best, NO_KEY, keys)  # keys are distinct: one column leaves
            best = tl.max(keys, axis=0)
            tl.store(key_ptr + out * K + i, best)
    else:
        m = tl.max(x, axis=0)
    # every chunk holds at least one column: m is finite for finite logits; exp2(-inf) = 0
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, tl.sum(tl.exp2((x - m) * LOG2E), axis=0))


@triton.jit
def _combine_kernel(x_ptr, rows_ptr, tokens_ptr, max_ptr, sum_ptr, key_ptr, chosen_ptr, top_id_ptr, top_lp_ptr,
                    stride_x, num_chunks, K: tl.constexpr, C_PAD: tl.constexpr, KEYS_PAD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + r)
    c = tl.arange(0, C_PAD)
    c_ok = c < num_chunks
    m = tl.load(max_ptr + r * num_chunks + c, mask=c_ok, other=float("-inf"))
    s = tl.load(sum_ptr + r * num_chunks + c, mask=c_ok, other=0.0)
    row_max = tl.max(m, axis=0)
    lse = row_max + tl.log(tl.sum(s * tl.exp2((m - row_max) * LOG2E), axis=0))
    token = tl.load(tokens_ptr + row)
    tl.store(chosen_ptr + r, tl.load(x_ptr + row * stride_x + token).to(tl.float32) - lse)
    if K > 0:
        j = tl.arange(0, KEYS_PAD)
        keys = tl.load(key_ptr + r * num_chunks * K + j, mask=j < num_chunks * K, other=NO_KEY)
        for i in tl.static_range(K):
            best = tl.max(keys, axis=0)
            tl.store(top_id_ptr + r * K + i, _key_col(best))
            tl.store(top_lp_ptr + r * K + i, _key_value(best) - lse)
            keys = tl.where(keys == best, NO_KEY, keys)


def row_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int, rows: torch.Tensor | None = None,
                 block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as layers/sampler.token_logprobs: `logits` [B, V] (float16/bfloat16/float32,
    contiguous last dim; not modified), `token_ids` [B] int64, `rows` [R] int64 rows of both to
    score (None: all B) -> (chosen [R] float32 logprob of each scored row's token, top_ids [R, k]
    int64 by descending logprob, top_logprobs [R, k] float32).
    `block`: columns per program (a power of two; tests shrink it)."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {k!r}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be 2-D [rows, vocab] with a contiguous last dim, got "
                         f"{tuple(getattr(logits, 'shape', ()))}")
    check_float_dtype("logits", logits)
    batch, vocab = logits.shape
    if not 0 <= k <= min(vocab, block):
        raise ValueError(f"k must be in [0, {min(vocab, block)}], got {k}")
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype != torch.int64 or tuple(token_ids.shape) != (batch,):
        raise TypeError(f"token_ids must be an int64 tensor of shape ({batch},), got "
                        f"{getattr(token_ids, 'dtype', type(token_ids))} {tuple(getattr(token_ids, 'shape', ()))}")
    dev = logits.device
    if rows is None:
        rows = torch.arange(batch, device=dev)
    elif not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or rows.dim() != 1:
        raise TypeError(f"rows must be a 1-D int64 tensor, got {getattr(rows, 'dtype', type(rows))}")
    for name, t in (("token_ids", token_ids), ("rows", rows)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, logits on {dev}")
    num_chunks = triton.cdiv(vocab, block)
    if num_chunks > MAX_CHUNKS:
        raise ValueError(f"vocab {vocab} needs {num_chunks} chunks, more than the grid allows ({MAX_CHUNKS})")
    r = rows.shape[0]
    chosen = torch.empty(r, dtype=torch.float32, device=dev)  # [R]
    top_ids = torch.empty((r, k), dtype=torch.int64, device=dev)  # [R, k]
    top_lps = torch.empty((r, k), dtype=torch.float32, device=dev)  # [R, k]
    if r == 0:
        return chosen, top_ids, top_lps
    stats = torch.empty((2, r, num_chunks), dtype=torch.float32, device=dev)  # chunk max, chunk sum
    keys = torch.empty((r, num_chunks * k), dtype=torch.int64, device=dev)  # [R, C * k]
    _stats_kernel[(r, num_chunks)](
        logits, rows, stats[0], stats[1], keys, vocab, logits.stride(0), num_chunks,
        K=k, BLOCK=block, num_warps=NUM_WARPS,
    )
    _combine_kernel[(r,)](
        logits, rows, token_ids, stats[0], stats[1], keys, chosen, top_ids, top_lps, logits.stride(0), num_chunks,
        K=k, C_PAD=next_pow2(num_chunks), KEYS_PAD=next_pow2(max(1, num_chunks * k)), num_warps=NUM_WARPS,
    )
    return chosen, top_ids, top_lps
