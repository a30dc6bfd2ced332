"""Does programmatic dependent launch (PDL) shorten a chain of small Triton kernels under a
CUDA graph? Times a chain of dependent kernels (each reads the previous one's output and a
private 'weight' slice) replayed in a graph, launched plainly and with launch_pdl=True (the
kernel waits on its predecessor with gdc_wait after loading its weight slice).

    PYTHONPATH=. python3 benchmarks/pdl_probe.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tlcuda

from graph_timing import graph_us

CHAIN = 200
REPLAYS = 20


@triton.jit
def _step(x_ptr, w_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    w = tl.load(w_ptr + offs, mask=m, other=0.0)  # independent of the previous kernel
    if PDL:
        tlcuda.gdc_wait()
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if PDL:
        tlcuda.gdc_launch_dependents()
    tl.store(y_ptr + offs, x * 0.5 + w, mask=m)


def chain_us(n: int, programs: int, pdl: bool) -> float:
    block = triton.next_power_of_2(triton.cdiv(n, programs))
    bufs = [torch.randn(n, device="cuda"), torch.empty(n, device="cuda")]
    ws = [torch.randn(n, device="cuda") for _ in range(CHAIN)]

    def run():
        for i in range(CHAIN):
            _step[(triton.cdiv(n, block),)](bufs[i % 2], ws[i], bufs[(i + 1) % 2], n, BLOCK=block, PDL=pdl,
                                             launch_pdl=pdl)

    return graph_us(run, REPLAYS) / CHAIN


def check_same(n: int, programs: int) -> None:
    """Both launches compute the same chain (PDL must not let a kernel read stale input)."""
    block = triton.next_power_of_2(triton.cdiv(n, programs))
    outs = []
    for pdl in (False, True):
        torch.manual_seed(0)
        bufs = [torch.randn(n, device="cuda"), torch.empty(n, device="cuda")]
        ws = [torch.randn(n, device="cuda") for _ in range(CHAIN)]
        for i in range(CHAIN):
            _step[(triton.cdiv(n, block),)](bufs[i % 2], ws[i], bufs[(i + 1) % 2], n, BLOCK=block, PDL=pdl,
                                             launch_pdl=pdl)
        outs.append(bufs[CHAIN % 2])
    torch.cuda.synchronize()
    print(f"  chain result identical with and without PDL: {torch.equal(outs[0], outs[1])}")


def main() -> None:
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    for n, programs in [(1024, 1), (1 << 16, 64), (1 << 20, 512)]:
        check_same(n, programs)
        plain, pdl = chain_us(n, programs, False), chain_us(n, programs, True)
        print(f"n={n:>8} programs={programs:>4}: plain {plain:.2f} us/kernel, PDL {pdl:.2f} us/kernel")


if __name__ == "__main__":
    main()
