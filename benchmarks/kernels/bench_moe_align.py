"""moe_align alone (nanovllm/moe/align.py, its three launches) on Qwen3-30B-A3B's routing (E=128, top-8): us per
call at TOKENS for every block height of moe/tiles.BLOCK_MS; `*` marks the one fused_moe picks for that T
(moe_tiles). Each routing's alignment is checked (every pair once, num_used_blocks) before it is timed. Routings and
timing: benchmarks/harness/moe_cases.py.

    python -m benchmarks.kernels.bench_moe_align [--tokens ...] [--json PATH]

Without CUDA it says so in one line and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.harness.moe_cases import E, K, graph_ms, routings

TOKENS = (1, 16, 64, 256, 512, 2048, 8192)  # decode batches, then prefill chunks up to the engine's 8,192-token steps
NO_CUDA_MESSAGE = "bench_moe_align.py needs a CUDA device; none is visible"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="batch sizes T")
    ap.add_argument("--json", metavar="PATH", help="write the rows here")
    return ap.parse_args(argv)


def check_alignment(align, ids: torch.Tensor, block_m: int) -> None:
    """Stop on a wrong alignment: every pair of ids [T, K] once in sorted_pair_ids (the rest
    padding), and num_used_blocks the experts' pairs each rounded up to block_m."""
    n = ids.numel()
    real = align.sorted_pair_ids[align.sorted_pair_ids != n].long().sort().values
    blocks = (torch.bincount(ids.view(-1), minlength=E) + block_m - 1) // block_m
    if not torch.equal(real, torch.arange(n, device=ids.device)) or int(align.num_used_blocks) != int(blocks.sum()):
        raise SystemExit(f"moe_align T={ids.shape[0]} block_m={block_m}: wrong alignment")


def align_study(args: argparse.Namespace) -> list[dict]:
    """moe_align's us per call at args.tokens for each block height (E, K: 30B-A3B)."""
    from nanovllm.moe.align import moe_align
    from nanovllm.moe.tiles import BLOCK_MS, moe_tiles, size_class

    gen = torch.Generator("cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: moe_align us per call, E={E}, top-{K}; * = fused_moe's block_m")
    print(f"{'T':>6}" + "".join(f"{f'm{m}':>10}" for m in BLOCK_MS))
    rows = []
    for t in args.tokens:
        ids = [i for _, i in routings(t, gen)]
        picked = moe_tiles(size_class(t) * K, E).block_m
        line = f"{t:>6}"
        for block_m in BLOCK_MS:
            for i in ids:
                check_alignment(moe_align(i, E, block_m), i, block_m)
            us = graph_ms([lambda i=i, m=block_m: moe_align(i, E, m) for i in ids]) * 1e3
            rows.append(dict(kernel="moe_align", tokens=t, block_m=block_m, us=us, picked=block_m == picked))
            line += f"{us:>9.2f}" + ("*" if block_m == picked else " ")
        print(line, flush=True)
    return [dict(device=torch.cuda.get_device_name(), experts=E, top_k=K)] + rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(NO_CUDA_MESSAGE)
    rows = align_study(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
