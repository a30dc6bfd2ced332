"""L2 prefetch: start pulling a weight from HBM into L2 ahead of the kernel that reads it.

At 1-2 rows a decode layer's projections are weight reads at HBM bandwidth, but between them
run kernels that move little (q/k norm + RoPE, attention over a short context, RMSNorm) while
HBM idles. Prefetching the next projection's weight at the start of such a gap moves its read
into the gap; the projection then reads L2:

    qkv GEMV |=== HBM ===| RoPE | attention |   o GEMV  |== HBM ==| norm | gate_up ...
                         ^ prefetch_l2(o_proj.weight): lines stream into L2 meanwhile

`prefetch_lines(ptrs)` is the in-kernel primitive (PTX `prefetch.global.L2`: no registers
held, nothing waited for); `prefetch_l2(t)` is a kernel that issues it for every 128-byte line
of t, up to `max_bytes`, and ends without waiting for the data. A prefetch never changes a
result; it only moves when bytes cross from HBM. CUDA only: on CPU or the Triton interpreter
`prefetch_l2` does nothing.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from .checks import INTERPRET
from .pdl import pdl_launch_options, wait_for_prior

# L2 line size on NVIDIA GPUs since Volta: one prefetch instruction per line.
LINE_BYTES = 128
# Lines per program: 128 KB, so an 8B o_proj weight (32 MiB) takes 256 programs of 8 prefetches
# per thread, few enough registers to sit beside the previous kernel's programs.
LINES_PER_PROGRAM = 1024


@triton.jit
def prefetch_lines(ptrs):
    """Ask L2 for the line holding each address in ptrs (any shape); returns at once."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(ptr, n_lines, LINE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    line = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    prefetch_lines(ptr + tl.minimum(line, n_lines - 1) * LINE_ELEMS)


_side_streams: dict = {}


@contextlib.contextmanager
def l2_prefetch(t, max_bytes=None):
    if t is None or os.environ.get("NANOVLLM_EXP_SIDE", "0") != "1":
        if t is not None:
            prefetch_l2(t, max_bytes)
        yield
        return
    main = torch.cuda.current_stream(t.device)
    side = _side_streams.get(t.device)
    if side is None:
        side = _side_streams[t.device] = torch.cuda.Stream(t.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        prefetch_l2(t, max_bytes)
    try:
        yield
    finally:
        main.wait_stream(side)


def prefetch_l2(t: torch.Tensor, max_bytes: int | None = None) -> None:
    """Start moving t's first min(t.nbytes, max_bytes) bytes (t contiguous) into L2; returns at once."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"prefetch_l2 takes a tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"prefetch_l2 needs a contiguous tensor, got strides {t.stride()}")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if t.device.type != "cuda" or INTERPRET:
        return
    nbytes = t.numel() * t.element_size() if max_bytes is None else min(max_bytes, t.numel() * t.element_size())
    n_lines = triton.cdiv(nbytes, LINE_BYTES)
    if n_lines == 0:
        return
    line_elems = max(1, LINE_BYTES // t.element_size())
    _prefetch_kernel[(triton.cdiv(n_lines, LINES_PER_PROGRAM),)](
        t, n_lines, LINE_ELEMS=line_elems, BLOCK=LINES_PER_PROGRAM, num_warps=4)
