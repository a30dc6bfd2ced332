"""L2 prefetch ahead of decode's projections (nanovllm/kernels/prefetch.py) under graph replay, bf16.

1. What L2 holds and pays: an o_proj-shaped GEMV over weights of 8..48 MiB read from HBM
   (rotating copies) vs from L2 (one copy, read again).
2. The decode gap: per layer copy, qkv GEMV -> [prefetch_l2(o_proj)] -> a gap of G us (a sleep
   kernel standing in for RoPE + attention) -> o_proj GEMV; Qwen3-8B shapes, 36 layer copies.

    PYTHONPATH=. python3 benchmarks/bench_prefetch.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

from graph_timing import graph_us
from nanovllm.kernels.gemv import gemv
from nanovllm.kernels.prefetch import l2_prefetch

HIDDEN = 4096  # Qwen3-8B hidden size: o_proj is HIDDEN x HIDDEN, qkv (32 + 2 * 8) heads x 128 rows
QKV_ROWS = 6144
LAYERS = 36
# Bytes of distinct weights a "cold" graph walks through: several times the 50 MB L2.
ROTATE_BYTES = 512 * 2**20
SLEEP_CALIBRATION_CYCLES = 100_000


def sleep_cycles_per_us() -> float:
    return SLEEP_CALIBRATION_CYCLES / graph_us(lambda: torch.cuda._sleep(SLEEP_CALIBRATION_CYCLES))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev, bf16 = "cuda", torch.bfloat16
    torch.manual_seed(0)
    result = {"l2": [], "gap": []}
    x = torch.randn(1, HIDDEN, device=dev, dtype=bf16)
    print(f"{'weight MiB':>10}{'HBM us':>9}{'L2 us':>8}{'HBM TB/s':>9}{'L2 TB/s':>8}")
    for mib in (8, 16, 24, 32, 40, 48):
        rows = mib * 2**20 // (HIDDEN * 2)
        copies = [torch.randn(rows, HIDDEN, device=dev, dtype=bf16) for _ in range(max(2, ROTATE_BYTES // (mib * 2**20)))]
        cold = graph_us(lambda: [gemv(x, w) for w in copies]) / len(copies)
        hot = graph_us(lambda: [gemv(x, copies[0]) for _ in copies]) / len(copies)
        result["l2"].append({"MiB": mib, "hbm_us": cold, "l2_us": hot})
        print(f"{mib:>10}{cold:>9.2f}{hot:>8.2f}{mib * 2**20 / cold / 1e6:>9.2f}{mib * 2**20 / hot / 1e6:>8.2f}")
        del copies
    per_us = sleep_cycles_per_us()
    qkv = [torch.randn(QKV_ROWS, HIDDEN, device=dev, dtype=bf16) for _ in range(LAYERS)]
    o = [torch.randn(HIDDEN, HIDDEN, device=dev, dtype=bf16) for _ in range(LAYERS)]
    print(f"\nper 8B layer: qkv GEMV, gap, o GEMV (us per layer)\n{'gap us':>7}{'plain':>9}{'+prefetch o':>13}{'16 MiB':>9}{'gap only':>10}")
    for gap in (0, 4, 8, 12):
        cycles = int(gap * per_us)

        def layer_chain(prefetch_bytes):
            def run():
                for wq, wo in zip(qkv, o):
                    gemv(x, wq)
                    with l2_prefetch(wo if prefetch_bytes else None, prefetch_bytes):
                        if cycles:
                            torch.cuda._sleep(cycles)
                    gemv(x, wo)
            return run

        plain = graph_us(layer_chain(0)) / LAYERS
        full = graph_us(layer_chain(HIDDEN * HIDDEN * 2)) / LAYERS
        half = graph_us(layer_chain(16 * 2**20)) / LAYERS
        alone = graph_us(lambda: [torch.cuda._sleep(cycles) for _ in range(LAYERS)]) / LAYERS if cycles else 0.0
        result["gap"].append({"gap_us": gap, "plain_us": plain, "prefetch_us": full, "prefetch16_us": half, "gap_alone_us": alone})
        print(f"{gap:>7}{plain:>9.2f}{full:>13.2f}{half:>9.2f}{alone:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
