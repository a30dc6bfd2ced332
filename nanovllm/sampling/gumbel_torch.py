"""Gumbel-max sampling in plain PyTorch: the twin of the Triton kernel in gumbel_max.py.

Both draw the same noise, defined here, so a row's key gives the same token on the CPU
(this file) and on CUDA (the kernel), and tests can compare them bit for bit:

    u(key, v)   the uniform of column v of a row with 64-bit noise key `key`
                = ((word >> 9) + 0.5) / 2**23, strictly inside (0, 1), exact in float32
    word        word k of Philox4x32-10(key, counter), the column's tile-layout position:
                column v = t + k * SUB + j   (t = v // TILE * TILE, k in [0, 4), j in [0, SUB))
                counter = t / 4 + j

Philox4x32-10 is computed as Triton's `tl.randint4x(seed, offset)` does for a 32-bit
offset (triton/language/random.py): counter words (offset, 0, 0, 0), key words
(seed & 0xffffffff, seed >> 32), ten rounds of

    (c0, c1, c2, c3) <- (hi(B * c2) ^ c1 ^ k0, lo(B * c2), hi(A * c0) ^ c3 ^ k1, lo(A * c0))
    (k0, k1)         <- (k0 + KEY_A, k1 + KEY_B)   (mod 2**32)

with hi/lo the upper/lower 32 bits of a 64-bit product (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011). Torch has no unsigned 64-bit multiply, so words are
int64 tensors holding 32-bit values and each product is formed from 16-bit halves of the
multiplier: no intermediate reaches 2**63.

`torch_gumbel_sample` repeats the kernel's float32 arithmetic: score = x * (1 / T) - log(-log(u))
for logits (T = 0: no noise, plain argmax), log(p) - log(-log(u)) for probabilities; the
token is the first column holding the row's largest score.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nanovllm.kernels.checks import check_float_dtype

# Columns per Philox word stream: a tile of TILE = 4 * SUB columns takes its noise from SUB
# Philox calls (one per column quadruple). Part of the noise's definition: the Triton kernel
# imports it as its block width, so both lay the noise out alike.
SUB = 256
TILE = 4 * SUB
# Philox4x32-10: Random123's round count, and tl.randint4x's default.
PHILOX_ROUNDS = 10
# Philox4x32's round multipliers and Weyl key increments (Random123; triton/language/random.py).
PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
# A uniform keeps a word's top 23 bits: exactly a float32 mantissa, so u is exact.
UNIFORM_BITS = 23
# Noise values computed at once: rows go through in chunks of about this many values, so the
# int64 Philox temporaries stay a few MB (256 x 151,936 in one piece took ~80 MB per temporary
# and ran several times slower per row on a 2-core CPU).
NOISE_CHUNK_ELEMENTS = 2**20
_M32 = 0xFFFFFFFF
_M16 = 0xFFFF


def check_gumbel_args(x: Tensor, keys: Tensor, temperatures: Tensor | None, is_probs: bool) -> None:
    """The argument rules both implementations share (ValueError / TypeError naming the argument)."""
    if not isinstance(x, Tensor) or x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D [rows, vocab] with a contiguous last dim, got "
                         f"{tuple(getattr(x, 'shape', ()))} / {x.stride() if isinstance(x, Tensor) else type(x)}")
    check_float_dtype("x", x)
    rows = x.shape[0]
    if not isinstance(keys, Tensor) or keys.dtype != torch.int64 or tuple(keys.shape) != (rows,):
        raise TypeError(f"keys must be an int64 tensor of shape ({rows},), got "
                        f"{getattr(keys, 'dtype', type(keys))} {tuple(getattr(keys, 'shape', ()))}")
    checked = [("keys", keys)]
    if is_probs:
        if temperatures is not None:
            raise ValueError("temperatures apply to logits, not to probabilities")
    else:
        if (not isinstance(temperatures, Tensor) or temperatures.dtype != torch.float32
                or tuple(temperatures.shape) != (rows,)):
            raise TypeError(f"temperatures must be a float32 tensor of shape ({rows},), got "
                            f"{getattr(temperatures, 'dtype', type(temperatures))}")
        checked.append(("temperatures", temperatures))
    for name, t in checked:
        if t.device != x.device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous and on {x.device}")


def _mul_hi_lo(a: Tensor, multiplier: int) -> tuple[Tensor, Tensor]:
    """Upper and lower 32 bits of a * multiplier, for 32-bit values `a` (int64) and a 32-bit constant."""
    # a * m = a * m_hi * 2**16 + a * m_lo, each partial product below 2**48
    high_part = a * (multiplier >> 16)
    low_part = a * (multiplier & _M16)
    hi = (high_part + (low_part >> 16)) >> 16
    lo = (((high_part & _M16) << 16) + low_part) & _M32
    return hi, lo


def philox4x32(keys: Tensor, counters: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 of every (key, counter) pair, as tl.randint4x(key, counter) draws it.

    keys: [B] int64 (its 64 bits are the key); counters: [N] int64 in [0, 2**32).
    Returns four [B, N] int64 tensors of 32-bit words (tl.randint4x's, read as unsigned)."""
    k0 = (keys & _M32).unsqueeze(1)  # [B, 1]
    k1 = ((keys >> 32) & _M32).unsqueeze(1)  # arithmetic shift, masked: the key's high word
    zero = torch.zeros((1, 1), dtype=torch.int64, device=keys.device)
    c0, c1, c2, c3 = counters.unsqueeze(0), zero, zero, zero  # broadcast to [B, N] as rounds mix them
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(c2, PHILOX_ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _M32
        k1 = (k1 + PHILOX_KEY_B) & _M32
    shape = (keys.shape[0], counters.shape[0])
    return c0.expand(shape), c1.expand(shape), c2.expand(shape), c3.expand(shape)


def torch_gumbel_uniforms(keys: Tensor, vocab: int) -> Tensor:
    """u(key, v) of the module docstring: [B, vocab] float32 for `keys` [B] int64, on their device."""
    device = keys.device
    cols = torch.arange(vocab, device=device)
    counter = cols // TILE * SUB + cols % SUB  # [V]
    word = cols % TILE // SUB  # [V]
    # counters in use: SUB per full tile, and the first min(SUB, rest) of a partial last tile
    num_counters = vocab // TILE * SUB + min(SUB, vocab % TILE)
    words = torch.stack(philox4x32(keys, torch.arange(num_counters, device=device)), dim=-1)  # [B, N, 4]
    picked = words.reshape(keys.shape[0], 4 * num_counters).index_select(1, counter * 4 + word)  # [B, V]
    return ((picked >> (32 - UNIFORM_BITS)).to(torch.float32) + 0.5) * (1.0 / 2**UNIFORM_BITS)


def torch_gumbel_sample(x: Tensor, keys: Tensor, temperatures: Tensor | None = None,
                        is_probs: bool = False) -> Tensor:
    """One token per row of `x` [B, V], as gumbel_max.gumbel_sample: argmax(x / T + Gumbel(key))
    for logits (`temperatures` [B] float32, 0 = greedy), or argmax(log x + Gumbel(key)) for
    probabilities (`is_probs`). `keys` [B] int64. Returns [B] int64. Any device."""
    check_gumbel_args(x, keys, temperatures, is_probs)
    rows, vocab = x.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=x.device)
    step = max(1, NOISE_CHUNK_ELEMENTS // vocab)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        tokens[a:b] = _sample_rows(x[a:b], keys[a:b], None if is_probs else temperatures[a:b])
    return tokens


def _sample_rows(x: Tensor, keys: Tensor, temperatures: Tensor | None) -> Tensor:
    """torch_gumbel_sample of a few rows; `temperatures` None: `x` holds probabilities."""
    noise = torch.log(-torch.log(torch_gumbel_uniforms(keys, x.shape[1])))  # [b, V]: minus the Gumbel noise
    x = x.to(torch.float32)
    if temperatures is None:
        return (torch.log(x) - noise).argmax(dim=-1)  # log(0) = -inf: a filtered token never wins
    greedy = (temperatures == 0.0).unsqueeze(1)  # [b, 1]
    scale = 1.0 / torch.where(greedy, 1.0, temperatures.unsqueeze(1))
    noise_scale = torch.where(greedy, 0.0, 1.0)
    return (x * scale - noise * noise_scale).argmax(dim=-1)  # first column on ties, as the kernel
