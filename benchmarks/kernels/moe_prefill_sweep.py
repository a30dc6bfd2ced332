"""The prefill tilings of the fused MoE (moe/tiles.PREFILL_WIDE) on Qwen3-30B-A3B's experts: for each mode
(bf16, W8A8 with per-channel or per-block scales) and prefill size T, the 64-row tiling the engine takes below
WIDE_MIN_PAIRS (N-major: first, the baseline) against 64- and 128-row candidates launched blocks-fastest; the best
of each height is then also launched N-major (a block's N tiles together). Times are the whole fused_moe call (alignment, any
activation quantization, both GEMMs, the slot sum), a CUDA graph of ROUTINGS routings, median of moe_cases'
replays; each candidate's output is checked against the baseline's and the baseline's against an fp32 loop.

    python -m benchmarks.kernels.moe_prefill_sweep [--modes bf16 channel block] [--tokens 2048 ... 16384] [--json PATH]

It ends with the pick per mode (pick()): a candidate faster than the baseline by PICK_MARGIN at every measured T
from some T0 on; of those, the least mean ratio wins. Without CUDA it says so in one line and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.harness import moe_cases as mc

MODES = ("bf16", "channel", "block")
TOKENS = (2048, 4096, 8192, 16384)  # prefill steps of the engine (its budget: up to 16,384 tokens)
ROUTINGS = 4  # routings per timed graph (prefill calls read every expert: fewer than moe_cases' decode 8)
# A tiling must beat the baseline by this much at every T from its T0 on (under it: run-to-run noise).
PICK_MARGIN = 0.03
# (block_n, block_k, num_warps, num_stages) per mode, GEMM and block height; each list's first entry is
# the baseline's (64 rows: moe/tiles.PREFILL_* / PREFILL_W8A8) or the first tried (128).
CANDIDATES = {
    "bf16": {"gate_up": {64: [(128, 64, 8, 3)], 128: [(128, 64, 8, 3), (64, 64, 8, 3), (128, 32, 8, 4), (64, 64, 4, 4)]},
             "down": {64: [(128, 64, 8, 3)], 128: [(128, 64, 8, 3), (256, 64, 8, 3), (128, 64, 4, 4)]}},
    "channel": {"gate_up": {64: [(256, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4)],
                            128: [(128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 4), (64, 128, 8, 3)]},
                "down": {64: [(256, 128, 8, 3), (128, 128, 8, 4)],
                         128: [(128, 128, 8, 3), (256, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4)]}},
    "block": {"gate_up": {64: [(64, 128, 4, 4), (128, 128, 8, 3)],
                          128: [(64, 128, 4, 4), (128, 128, 8, 3), (64, 128, 8, 4), (128, 128, 8, 4)]},
              "down": {64: [(64, 128, 4, 4), (128, 128, 8, 3)],
                       128: [(64, 128, 4, 4), (128, 128, 8, 3), (256, 128, 8, 3)]}},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--json", metavar="PATH", help="write the rows here")
    return ap.parse_args(argv)


def key(row: dict) -> tuple:
    """A candidate's identity across T: (block_m, gate_up, down, n_major)."""
    return row["block_m"], tuple(row["gate_up"]), tuple(row["down"]), row["n_major"]


def pick(rows: list[dict]) -> dict[str, tuple[tuple, int] | None]:
    """Per mode: (candidate key, T0) of the candidate faster than the baseline (each T's first row) by
    PICK_MARGIN at every measured T >= T0, the least mean time ratio over those T winning (the smaller T0 on
    ties); None where none is."""
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        ts = sorted({r["tokens"] for r in mine})
        base = {t: next(r["us"] for r in mine if r["tokens"] == t) for t in ts}
        us = {(key(r), r["tokens"]): r["us"] for r in mine}
        best = None
        for cand in dict.fromkeys(key(r) for r in mine):
            wins = {t for t in ts if (cand, t) in us and us[cand, t] < (1 - PICK_MARGIN) * base[t]}
            t0 = next((t for t in ts if all(u in wins for u in ts if u >= t)), None)
            if t0 is None:
                continue
            later = [t for t in ts if t >= t0]
            score = (sum(us[cand, t] / base[t] for t in later) / len(later), t0)
            if best is None or score < best[0]:
                best = (score, cand, t0)
        out[mode] = None if best is None else (best[1], best[2])
    return out


def sweep(mode: str, tokens: int, experts: dict, gen: torch.Generator) -> list[dict]:
    """Rows of every candidate of `mode` at `tokens`, the baseline first."""
    from triton.runtime.errors import OutOfResources

    from nanovllm.moe.grouped_gemm import fused_moe
    from nanovllm.moe.tiles import MoeTiles, Tiling

    (q13, s13, d13), (q2, s2, d2) = experts[mode]
    w8a8 = mode != "bf16"
    hidden = torch.randn(tokens, mc.H, device="cuda", generator=gen).bfloat16()
    routes = mc.routings(tokens, gen, count=ROUTINGS)
    cands = CANDIDATES[mode]

    def calls(tiles: MoeTiles) -> list:
        return [lambda w=w, i=i: fused_moe(hidden, q13, q2, w, i, w13_scale=s13, w2_scale=s2, act_fp8=w8a8, tiles=tiles)
                for w, i in routes]

    def tiles_of(block_m: int, gate_up: tuple, down: tuple, n_major: bool = False) -> MoeTiles:
        return MoeTiles(block_m, Tiling(*gate_up), Tiling(*down), n_major)

    baseline = (64, cands["gate_up"][64][0], cands["down"][64][0], True)  # moe/tiles.moe_tiles below WIDE_MIN_PAIRS
    ref = calls(tiles_of(*baseline))[0]()
    mc.check(ref, hidden, d13, d2, *routes[0], f"{mode} baseline", mc.W8A8_CHECK_TOLERANCE if w8a8 else mc.CHECK_TOLERANCE)
    rows: list[dict] = []

    def measure(block_m: int, gate_up: tuple, down: tuple, n_major: bool = False) -> float | None:
        tiles = tiles_of(block_m, gate_up, down, n_major)
        try:
            out = calls(tiles)[0]()
            ms = mc.graph_ms(calls(tiles))
        except OutOfResources:  # past shared memory or registers
            print(f"  {mode} T={tokens} {block_m} {gate_up} {down}: out of resources")
            return None
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        if err > mc.CHECK_TOLERANCE:  # the baseline passed the fp32 check; tilings only regroup its sums
            raise SystemExit(f"{mode} T={tokens} {tiles}: {err:.2e} off the baseline's output")
        base_us = rows[0]["us"] if rows else ms * 1e3
        rows.append(dict(mode=mode, tokens=tokens, block_m=block_m, gate_up=gate_up, down=down, n_major=n_major,
                         us=ms * 1e3, tflops=mc.moe_flops(tokens) / (ms * 1e-3) / 1e12, vs_baseline=base_us / (ms * 1e3)))
        r = rows[-1]
        print(f"  {mode:>7} T={tokens:>5} bm {block_m:>3} gu {gate_up} dn {down}{' n-major' if n_major else ''}: "
              f"{r['us']:8.1f} us {r['tflops']:5.0f} TFLOP/s {r['vs_baseline']:.3f}x")
        return ms

    measure(*baseline)
    for block_m in (64, 128):  # gate_up's best at the first down, then down's best at it, then N-major
        gate_up = min(((t, g) for g in cands["gate_up"][block_m]
                       if (t := measure(block_m, g, cands["down"][block_m][0])) is not None), default=None)
        if gate_up is None:
            continue
        down = min([(gate_up[0], cands["down"][block_m][0])]
                   + [(t, d) for d in cands["down"][block_m][1:] if (t := measure(block_m, gate_up[1], d)) is not None])
        measure(block_m, gate_up[1], down[1], n_major=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("moe_prefill_sweep.py needs a CUDA device; none is visible")
    gen = torch.Generator("cuda").manual_seed(0)
    w13, w2 = mc.bf16_experts(gen)
    experts = {m: (mc.fp8_experts(w13, m), mc.fp8_experts(w2, m)) for m in args.modes if m != "bf16"}
    experts["bf16"] = ((w13, None, w13), (w2, None, w2))
    print(torch.cuda.get_device_name())
    rows = [r for mode in args.modes for t in args.tokens for r in sweep(mode, t, experts, gen)]
    for mode, picked in pick(rows).items():
        print(f"pick {mode}: " + ("the baseline stays" if picked is None else
                                   "block_m {} gate_up {} down {} n_major {} from T = {}".format(*picked[0], picked[1])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
