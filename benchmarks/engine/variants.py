"""A/B runs of bench.py under several kernel routes, side by side.

Each variant is a name and KernelRoutes fields (bench.py --kernel-routes; the other fields at their
defaults); each runs bench.py, with the arguments after `--`, in a fresh process, one after
another. The report rows whose name starts with any --show prefix are printed as one table, a
column per variant.

    python -m benchmarks.engine.variants --variant default --variant "cublas:skinny_max_rows=0" \\
        --show "decode ms/token" -- --model benchmarks/configs/qwen3-0.6b --latency --latency-batch-sizes 4,8,16
"""

from __future__ import annotations

import argparse

from benchmarks.engine.bench_process import run_bench
from benchmarks.harness.engine_options import parse_kernel_routes
from benchmarks.harness.report import format_table

# A variant's bench.py run (start-up, warm-up, the run) is ended after this many seconds.
DEFAULT_TIMEOUT_S = 600
# bench.py flags that variants.py sets itself.
OWN_FLAGS = ("--kernel-routes", "--json")


def parse_variant(text: str) -> tuple[str, str]:
    """'name' or 'name:field=value,...' -> (name, the --kernel-routes text), the fields checked here."""
    name, _, spec = text.partition(":")
    if not name:
        raise SystemExit(f"variant {text!r}: expected name[:field=value,...]")
    try:
        parse_kernel_routes(spec)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"variant {name!r}: {exc}") from None
    return name, spec


def side_by_side(reports: dict[str, list[list[str]]], prefixes: tuple[str, ...]) -> str:
    """One row per report row whose name starts with a prefix (in the order of the first report
    that has it): its name, then each variant's value ('-' where a variant lacks it)."""
    values = {name: dict(rows) for name, rows in reports.items()}
    shown = dict.fromkeys(row for rows in reports.values() for row, _ in rows if row.startswith(prefixes))
    return format_table([["", *reports]] + [[row, *(v.get(row, "-") for v in values.values())] for row in shown])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, help="name[:field=value,...] (KernelRoutes fields)")
    ap.add_argument("--show", default="decode ms/token|output tokens / wall|fraction of roofline",
                    help="report rows starting with any of these ('|'-separated)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds a variant's run may take")
    args, bench_args = ap.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    if any(a.split("=")[0] in OWN_FLAGS for a in bench_args):
        raise SystemExit(f"variants.py sets {' and '.join(OWN_FLAGS)} itself")
    variants = dict(map(parse_variant, args.variant))
    if len(variants) < len(args.variant):
        raise SystemExit("variant names must differ")
    reports = {}
    for name, spec in variants.items():
        run = run_bench([*bench_args, "--kernel-routes", spec], args.timeout)
        if run.results is None:
            print(f"{name}: failed ({run.why})", flush=True)
        else:
            reports[name] = run.results["report"]
            print(f"{name}: done in {run.seconds:.0f} s", flush=True)
    if reports:
        print(side_by_side(reports, tuple(args.show.split("|"))))


if __name__ == "__main__":
    main()
