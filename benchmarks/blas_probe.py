"""Which BLAS path runs a decode batch's projections fastest: cuBLAS (torch's default for
F.linear), cuBLASLt (torch.backends.cuda.preferred_blas_library), or the product swapped
(W x^T, the output transposed), at 16-256 rows, weights from HBM (rotated through > L2).

    PYTHONPATH=. python3 benchmarks/blas_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench_gemm import ROTATE_BYTES, SHAPES, graph_time_us


def main() -> None:
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    default = torch.backends.cuda.preferred_blas_library()
    print(f"default BLAS: {default}; us per call (GB/s of weights)")
    for name, (n, k) in SHAPES.items():
        if "router" in name:
            continue
        copies = max(2, -(-ROTATE_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=bf16) * k ** -0.5 for _ in range(copies)]
        for m in (16, 64, 128, 256):
            x = torch.randn(m, k, device=dev, dtype=bf16)
            res = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                res[lib] = graph_time_us([lambda w=w: F.linear(x, w) for w in ws])
                res[lib + "-swap"] = graph_time_us([lambda w=w: torch.mm(w, x.t()) for w in ws])
            torch.backends.cuda.preferred_blas_library(default)
            print(f"{name:<14}{m:>4} " + "  ".join(f"{kk} {v:6.2f} ({n * k * 2 / v / 1e3:4.0f})" for kk, v in res.items()),
                  flush=True)
        del ws


if __name__ == "__main__":
    main()
