"""Programmatic dependent launch (PDL, Hopper and newer) for the decode path's kernels.

Normally a kernel starts only after the one before it in the stream has finished and its
launch has gone through (~1 us between small kernels). A kernel launched with PDL may be
scheduled while its predecessor still runs; it then blocks in `wait_for_prior` until every
earlier kernel in the stream has finished and its writes are visible, and lets its own
successor be scheduled once all of its programs have started:

    kernel A  |==== A's programs ====|
    kernel B        [B launched, parked in wait_for_prior] |=== B runs ===|
                                                            ^ A finished

So every kernel launched with `pdl_launch_options` must call `wait_for_prior(PDL)` before it
reads or writes anything an earlier kernel touches (weights, which nothing writes, may be
read before). Kernels launched without PDL (or on CPU / the interpreter / older Triton)
get PDL=False, and the call compiles to nothing. CUDA graphs keep PDL launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import INTERPRET

try:  # Triton >= 3.3 exposes the PTX griddepcontrol instructions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # older Triton: no PDL
    HAS_GDC = False

# PDL needs compute capability 9.0 (Hopper) or newer.
MIN_PDL_CAPABILITY = (9, 0)

_capable: dict[int, bool] = {}


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """Block until the stream's earlier kernels are done, then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_launch_options(t: torch.Tensor, name: str = '') -> dict:
    """Launch keywords for a kernel on t's device: {'PDL': True, 'launch_pdl': True} where PDL
    works, else {'PDL': False}."""
    import os
    if not HAS_GDC or INTERPRET or t.device.type != "cuda" or os.environ.get("NANOVLLM_EXP_NOPDL") == "1" or (name and name in os.environ.get("NANOVLLM_EXP_NOPDL_K", "").split(",")):
        return {"PDL": False}
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _capable:
        _capable[idx] = torch.cuda.get_device_capability(idx) >= MIN_PDL_CAPABILITY
    return {"PDL": True, "launch_pdl": True} if _capable[idx] else {"PDL": False}
