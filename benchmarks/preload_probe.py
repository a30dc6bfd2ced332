"""Can a one-row GEMV load its weight into registers while the kernel before it still runs?

A GEMV launched early (PDL) may touch its weight before `griddepcontrol.wait`: nothing writes
it. The shipped GEMV only asks L2 for its first step there. This probe lets each program load
its whole weight slice ([BLOCK_N, K] bf16: 32-64 registers a thread) before the wait, and only
the x row and the arithmetic after it. Timed in CUDA graphs over weights rotated through more
than L2 holds, after a one-program spin that lets its dependents launch at once (as a kernel
that triggers before its own wait would):

    spin       the gap alone
    shipped    spin -> gemv(W)            (kernels/gemv.py: PDL where one wave, L2 prefetch)
    preload    spin -> preload_gemv(W)    (whole slice loaded before the wait)

The weight read hides in the gap if (preload - spin) falls well under (shipped - spin).

    PYTHONPATH=. python3 benchmarks/preload_probe.py
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from graph_timing import graph_us
from nanovllm.kernels.gemv import gemv

# Rotated weight copies: 8 x 16.8 MB (30B o_proj) is well past the H200's 50 MB of L2.
COPIES = 8


@triton.jit
def _spin(out_ptr, n_iters):
    gdc_launch_dependents()  # the next kernel may launch now
    x = tl.program_id(0).to(tl.float32)
    for _ in tl.range(0, n_iters):
        x = x * 1.0000001 + 1e-7
    tl.store(out_ptr, x)


@triton.jit
def _preload_gemv(x_ptr, w_ptr, out_ptr, n_out, K: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.minimum(rn, n_out - 1)
    rc = tl.arange(0, CHUNKS)
    rk = tl.arange(0, K // CHUNKS)
    offs = rn[:, None, None].to(tl.int64) * K + rc[None, :, None] * (K // CHUNKS) + rk[None, None, :]
    w = tl.load(w_ptr + offs)  # [BLOCK_N, CHUNKS, K / CHUNKS] bf16, in flight across the wait
    gdc_wait()
    x = tl.load(x_ptr + rc[:, None] * (K // CHUNKS) + rk[None, :]).to(tl.float32)  # [CHUNKS, K / CHUNKS]
    y = tl.sum(tl.sum(w.to(tl.float32) * x[None, :, :], axis=2), axis=1)
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty))


def preload_gemv(x, w, block_n, warps, chunks):
    n, k = w.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _preload_gemv[(triton.cdiv(n, block_n),)](x, w, out, n, K=k, BLOCK_N=block_n, CHUNKS=chunks,
                                              num_warps=warps, launch_pdl=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2048x4096,5120x2048,1024x2048,4096x4096",
                    help="N x K weights (30B o, 30B qkv, 0.6B o, 8B o)")
    ap.add_argument("--spin-iters", type=int, nargs="+", default=[0, 3000])
    ap.add_argument("--configs", default="4:4:8,8:8:8,16:8:16,8:4:8", help="block_n:warps:chunks, comma-separated")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    sink = torch.empty(1, device="cuda")
    configs = [tuple(map(int, c.split(":"))) for c in args.configs.split(",")]
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        mb = ws[0].numel() * ws[0].element_size() / 1e6
        ref = x.double() @ ws[0].double().t()
        rows = {}

        def per(fn):
            return graph_us(lambda: [fn(w) for w in ws], args.replays) / COPIES

        for bn, warps, chunks in configs:
            err = (preload_gemv(x, ws[0], bn, warps, chunks).double() - ref).abs().max().item()
            rows[f"preload {bn}x{warps}w/{chunks} max err vs fp64"] = err
        for iters in args.spin_iters:
            spin = per(lambda w: _spin[(1,)](sink, iters))
            rows[f"spin {iters}"] = spin
            rows[f"  shipped (spin {iters}) - spin"] = per(lambda w: (_spin[(1,)](sink, iters), gemv(x, w))) - spin
            for bn, warps, chunks in configs:
                t = per(lambda w: (_spin[(1,)](sink, iters), preload_gemv(x, w, bn, warps, chunks)))
                rows[f"  preload {bn}x{warps}w/{chunks} (spin {iters}) - spin"] = t - spin
        print(f"== W {n} x {k} bf16 ({mb:.1f} MB), 1 row; us per GEMV (mean of graph replays / {COPIES})")
        for name, v in rows.items():
            print(f"{name:44s} {v:8.3f}")


if __name__ == "__main__":
    main()
