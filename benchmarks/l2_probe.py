"""Can a decode layer's idle-HBM gap pull the next projection's weight into L2?

At batch 1 the attention part of a layer (q/k norm + RoPE, attention over a short context,
the split merge: ~9 us on Qwen3-30B-A3B) moves little, while HBM idles; the o projection
after it streams its weight from HBM. This probe times, in CUDA graphs over weights rotated
through more than L2 holds:

    base      spin -> gemv(W)                      the GEMV from HBM after an idle gap
    lines     prefetch.global.L2 per line -> spin -> gemv(W)
    bulk C    cp.async.bulk.prefetch.L2 in C-byte chunks -> spin -> gemv(W)
    spin      the gap alone (a one-program arithmetic loop)
    hot       gemv(W) -> gemv(W), minus one cold gemv: the GEMV reading L2

A prefetch pays if (variant - spin) falls well under (base - spin).

    PYTHONPATH=. python3 benchmarks/l2_probe.py
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from graph_timing import graph_us
from nanovllm.kernels.gemv import gemv
from nanovllm.kernels.pdl import LINE_BYTES, prefetch_l2

# Rotated weight copies: 8 x 16.8 MB (30B o_proj) is well past the H200's 50 MB of L2.
COPIES = 8
# Per-line prefetch: 1,024 lines (128 KB) a program, 8 prefetch instructions a thread at 4 warps.
LINES_PER_PROGRAM = 1024
# Bulk prefetch: one chunk a thread, one warp a program.
CHUNKS_PER_PROGRAM = 32


@triton.jit
def _spin(out_ptr, n_iters):
    x = tl.program_id(0).to(tl.float32)
    for _ in tl.range(0, n_iters):
        x = x * 1.0000001 + 1e-7
    tl.store(out_ptr, x)


@triton.jit
def _prefetch_lines(ptr, n_lines, LINE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    line = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    prefetch_l2(ptr + tl.minimum(line, n_lines - 1) * LINE_ELEMS)


@triton.jit
def _prefetch_bulk(ptr, n_elems, CHUNK_ELEMS: tl.constexpr, ELEM_BYTES: tl.constexpr, BLOCK: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    first = chunk * CHUNK_ELEMS
    size = (tl.minimum(tl.maximum(n_elems - first, 0), CHUNK_ELEMS) * ELEM_BYTES).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr + tl.minimum(first, n_elems - 1), size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_lines(w: torch.Tensor) -> None:
    elems = LINE_BYTES // w.element_size()
    n_lines = triton.cdiv(w.numel(), elems)
    _prefetch_lines[(triton.cdiv(n_lines, LINES_PER_PROGRAM),)](w, n_lines, LINE_ELEMS=elems,
                                                               BLOCK=LINES_PER_PROGRAM, num_warps=4)


def prefetch_bulk(w: torch.Tensor, chunk_bytes: int) -> None:
    chunk = chunk_bytes // w.element_size()
    n_chunks = triton.cdiv(w.numel(), chunk)
    _prefetch_bulk[(triton.cdiv(n_chunks, CHUNKS_PER_PROGRAM),)](
        w, w.numel(), CHUNK_ELEMS=chunk, ELEM_BYTES=w.element_size(), BLOCK=CHUNKS_PER_PROGRAM, num_warps=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2048x4096,5120x2048,4096x4096", help="N x K weights (30B o, 30B qkv, 8B o)")
    ap.add_argument("--spin-iters", type=int, nargs="+", default=[2000, 4000])
    ap.add_argument("--chunks-kb", type=int, nargs="+", default=[16, 256, 4096])
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    sink = torch.empty(1, device="cuda")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        mb = ws[0].numel() * ws[0].element_size() / 1e6
        rows = {}

        def per(fn):
            return graph_us(lambda: [fn(w) for w in ws], args.replays) / COPIES

        cold = per(lambda w: gemv(x, w))
        rows["gemv cold"] = cold
        rows["hot (2nd gemv)"] = per(lambda w: (gemv(x, w), gemv(x, w))) - cold
        for iters in args.spin_iters:
            spin = per(lambda w: _spin[(1,)](sink, iters))
            rows[f"spin {iters}"] = spin
            variants = {"base": lambda w: None, "lines": prefetch_lines}
            for c in args.chunks_kb:
                variants[f"bulk {c} KB"] = lambda w, c=c: prefetch_bulk(w, c * 1024)
            for name, pf in variants.items():
                try:
                    t = per(lambda w: (pf(w), _spin[(1,)](sink, iters), gemv(x, w)))
                    rows[f"  {name} (spin {iters}) - spin"] = t - spin
                except Exception as e:  # a prefetch form the device rejects: say so, go on
                    rows[f"  {name} (spin {iters})"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        print(f"== W {n} x {k} bf16 ({mb:.1f} MB), 1 row; us per GEMV (mean of graph replays / {COPIES})")
        for name, v in rows.items():
            print(f"{name:36s} {v:8.2f}" if isinstance(v, float) else f"{name:36s} {v}")


if __name__ == "__main__":
    main()
