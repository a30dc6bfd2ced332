"""Programmatic dependent launch (PDL, Hopper and newer) for the decode path's kernels.

Normally a kernel starts only after the one before it in the stream has finished and its
launch has gone through (~1 us between small kernels). A kernel launched with PDL may be
scheduled while its predecessor still runs; it then blocks in `wait_for_prior` until every
earlier kernel in the stream has finished and its writes are visible, and lets its own
successor be scheduled once all of its programs have passed that wait. Every program of a PDL
kernel must call `wait_for_prior` before it exits, whatever branch it takes: a successor's wait
relies on it.

    kernel A  |==== A's programs ====|
    kernel B        [B launched, parked in wait_for_prior] |=== B runs ===|
                                                            ^ A finished

So every kernel launched with `pdl_launch_options` must call `wait_for_prior(PDL)` before it
reads or writes anything an earlier kernel touches. Data nothing writes (weights) may be
touched before: `prefetch_l2` asks L2 for it while the kernel waits, so its first loads after
the wait hit L2 instead of HBM. Kernels launched without PDL (or on CPU / the interpreter /
older Triton) get PDL=False, and the call compiles to nothing. CUDA graphs keep PDL launches.

Measured end to end (H200, bench.py --latency): dependent launch took 0.6B batch-1 decode from
1.081 to 1.025 ms per token (-5%; 11ae97a, "Throughput and latency history"); limited to one-wave
grids it gave 8B 4.60 -> 4.47 (857cf65).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import INTERPRET, cuda_sm_count

try:  # Triton >= 3.3 exposes the PTX griddepcontrol instructions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # older Triton: no PDL
    HAS_GDC = False

# L2 line size on NVIDIA GPUs since Volta: `prefetch_l2` needs one address per line.
LINE_BYTES = 128
# PDL needs compute capability 9.0 (Hopper) or newer.
MIN_PDL_CAPABILITY = (9, 0)
# Small decode-path programs counted as resident per SM at once, so a grid of up to SMs x this is
# one wave: only such grids gain from the early launch (BENCHMARKS.md, gemv tuning notes).
RESIDENT_PER_SM = 4

_capable: dict[int, bool] = {}


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """Block until the stream's earlier kernels are done, then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the line holding each address in ptrs (PTX prefetch.global.L2: nothing is
    waited for, no registers are held). Compiled code only: not under the interpreter."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows_l2(rows, k_in, BLOCK_K: tl.constexpr, LINE_ELEMS: tl.constexpr):
    """Ask L2 for the first BLOCK_K columns of the weight rows at `rows` ([R, 1] pointers, k_in
    >= 1 columns each): one address per line, clamped to the row."""
    lines = tl.minimum(tl.arange(0, BLOCK_K // LINE_ELEMS) * LINE_ELEMS, k_in - 1)
    prefetch_l2(rows + lines[None, :])


def pdl_launch_options(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel on t's device: {'PDL': True, 'launch_pdl': True} where PDL
    works, else {'PDL': False}."""
    if not HAS_GDC or INTERPRET or t.device.type != "cuda":
        return {"PDL": False}
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _capable:
        _capable[idx] = torch.cuda.get_device_capability(idx) >= MIN_PDL_CAPABILITY
    return {"PDL": True, "launch_pdl": True} if _capable[idx] else {"PDL": False}


def one_wave(device: torch.device) -> int | None:
    """Programs of a small decode-path kernel resident at once on a CUDA device (None elsewhere)."""
    sms = cuda_sm_count(device)
    return None if sms is None else sms * RESIDENT_PER_SM


def pdl_for_grid(t: torch.Tensor, programs: int) -> dict:
    """`pdl_launch_options(t)` for a grid of `programs` that fits one wave, else {'PDL': False}."""
    wave = one_wave(t.device)
    return pdl_launch_options(t) if wave is not None and programs <= wave else {"PDL": False}
