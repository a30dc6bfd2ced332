"""Before / after: the same bench.py runs in two source trees, each run in a fresh process, and one
table at the end: output tok/s and decode ms/token of each tree, and after / before.

    python -m benchmarks.engine.compare --before DIR --set 1|2|all|score [--after DIR] [--out DIR]
    BEFORE_DIR=DIR bash scripts/gpu_run.sh compare1          # then compare2, in a second device call

--before / --after are source trees (checkouts; --after: this one) whose bench.py has --workload
and --json (any since 15d4e14). Both run the model shapes of this tree's benchmarks/configs, with
random weights. For each bench of the set the two trees run one after the other, which goes first
alternating from bench to bench. Set 1: Qwen3-0.6B default and long workloads, decode latency of
Qwen3-0.6B and Qwen3-8B; set 2: Qwen3-8B default workload, Qwen3-30B-A3B decode latency; all: both;
score: Qwen3-0.6B's scoring workload twice (prompt tok/s and each run's fraction of its roofline).
A run ends at its own timeout or at --deadline-s after the start, whichever comes first, so a set's
table comes within one device call (10 minutes); a run that did not finish shows as '-'. Sets 1 and
2 each fit with room to spare; all may, on a warm Triton cache.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from dataclasses import dataclass

from benchmarks.engine.bench_process import REPO, BenchProcess, run_bench
from benchmarks.harness.engine_options import CONFIGS_DIR
from benchmarks.harness.report import format_table

# Decode latency is measured at these batch sizes (bench.py --latency-batch-sizes).
LATENCY_BATCHES = (1, 8, 32)
LATENCY = ("--latency", "--latency-batch-sizes", ",".join(map(str, LATENCY_BATCHES)))
# Seconds from the start after which no run goes on: a set's table is printed within a 9-minute call.
DEFAULT_DEADLINE_S = 520
# A run given less time than this is not started (it could not finish).
MIN_RUN_S = 20


@dataclass(frozen=True)
class Bench:
    label: str
    model: str  # a shape in benchmarks/configs
    args: tuple[str, ...]  # bench.py flags besides --model
    timeout_s: float  # start-up (cold Triton cache), warm-up and run on an H200, with margin


SETS = {
    "1": (Bench("qwen3-0.6b default", "qwen3-0.6b", (), 120),
          Bench("qwen3-0.6b long", "qwen3-0.6b", ("--workload", "long"), 150),
          Bench("qwen3-0.6b latency", "qwen3-0.6b", LATENCY, 100),
          Bench("qwen3-8b latency", "qwen3-8b", LATENCY, 150)),
    "2": (Bench("qwen3-8b default", "qwen3-8b", (), 220),
          Bench("qwen3-30b-a3b latency", "qwen3-30b-a3b", LATENCY, 220)),
}
SETS["all"] = SETS["1"] + SETS["2"]  # one call if it fits: the deadline leaves out what does not
# #33's scoring target at the shape it is missed on; two pairs, as a run's roofline reading spreads ~1 point
SCORE = ("--workload", "score")
SETS["score"] = (Bench("qwen3-0.6b score, pair 1", "qwen3-0.6b", SCORE, 120),
                 Bench("qwen3-0.6b score, pair 2", "qwen3-0.6b", SCORE, 120))


def figures(bench: Bench, results: dict | None) -> dict[str, float | None]:
    """The table's rows of one run: output tok/s, or decode ms/token at each batch (None: no result)."""
    if "--latency" in bench.args:
        per_batch = (results or {}).get("decode_ms_per_token", {})
        return {f"{bench.model} decode ms/token, batch {b}": per_batch.get(str(b)) for b in LATENCY_BATCHES}
    rows = {f"{bench.label} tok/s": (results or {}).get("throughput")}
    if bench.args == SCORE:
        fraction = (results or {}).get("roofline_fraction")
        rows[f"{bench.label} % of roofline"] = None if fraction is None else 100 * fraction
    return rows


def table(before: dict[str, float | None], after: dict[str, float | None]) -> str:
    """Each row's before, after and after / before."""
    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.3f}"

    rows = [["", "before", "after", "after / before"]]
    for name in before:
        b, a = before[name], after.get(name)
        rows.append([name, cell(b), cell(a), f"{a / b:.3f}" if a is not None and b else "-"])
    return format_table(rows)


def run_order(index: int) -> tuple[str, str]:
    """Which tree runs first for the index-th bench: alternating, so neither always runs second."""
    return ("before", "after") if index % 2 == 0 else ("after", "before")


def tree_commit(root: str) -> str:
    out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "not a git checkout"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the source tree to compare against")
    ap.add_argument("--after", default=REPO, help="default: this tree")
    ap.add_argument("--set", choices=sorted(SETS), required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-logs"), help="each run's log and JSON go here")
    ap.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S)
    args = ap.parse_args()
    roots = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    for side in roots:
        if not os.path.isfile(os.path.join(roots[side], "bench.py")):
            raise SystemExit(f"--{side} {roots[side]}: no bench.py there")
        print(f"{side}: {roots[side]} at {tree_commit(roots[side])}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    found: dict[str, dict[str, float | None]] = {"before": {}, "after": {}}
    for i, bench in enumerate(SETS[args.set]):
        for side in run_order(i):
            left = args.deadline_s - (time.perf_counter() - start)
            run = BenchProcess(None, 0.0, f"not started: {left:.0f} s left")
            if left >= MIN_RUN_S:
                keep = os.path.join(args.out, f"compare-{side}-{bench.label.replace(' ', '_')}")
                run = run_bench(["--model", os.path.join(CONFIGS_DIR, bench.model), *bench.args],
                                min(bench.timeout_s, left), roots[side], keep)
            found[side].update(figures(bench, run.results))
            print(f"{side} {bench.label}: {f'{run.seconds:.0f} s' if run.results else run.why[:300]}", flush=True)
    print(table(found["before"], found["after"]))


if __name__ == "__main__":
    main()
