"""Per-test and per-file wall times from a time-stamped `pytest -v` log (scripts/gpu_run.sh readme).

Each log line is "<unix seconds> <pytest output line>"; pytest -v ends a test's line when the test
ends, so a test's time is its line's stamp minus the previous test's of the same worker (xdist
workers run their tests one after another; a worker's first test includes its start-up). Works on
a log cut short by a timeout.

    python3 scripts/test_times.py LOG [--top N]
"""

from __future__ import annotations

import argparse
import collections
import re

# "tests/test_x.py::test_y[param] PASSED   [ 12%]" (SKIPPED / FAILED / ERROR / XFAIL alike)
RESULT = re.compile(r"^(\S+\.py)::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
# under xdist: "[gw3] [ 12%] PASSED tests/test_x.py::test_y[param]"
XDIST_RESULT = re.compile(r"^\[(gw\d+)\] \[\s*\d+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (\S+\.py)::(\S+)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=40, help="slowest tests to list")
    args = parser.parse_args()
    tests: list[tuple[float, str, str]] = []  # (seconds, file, test)
    first = None
    last: dict[str, float] = {}  # worker ("" without xdist) -> stamp of its last result
    with open(args.log) as f:
        for raw in f:
            stamp, _, line = raw.rstrip("\n").partition(" ")
            try:
                t = float(stamp)
            except ValueError:
                continue
            first = t if first is None else first
            m, x = RESULT.match(line), XDIST_RESULT.match(line)
            if m or x:
                worker, path, name = ("", m.group(1), m.group(2)) if m else (x.group(1), x.group(3), x.group(4))
                tests.append((t - last.get(worker, first), path, name))
                last[worker] = t
    per_file: collections.Counter[str] = collections.Counter()
    for seconds, path, _ in tests:
        per_file[path] += seconds
    total = sum(per_file.values())
    print(f"{len(tests)} tests in {len(last)} worker(s), {total:.0f} s of test time in all")
    print("per file:")
    for path, seconds in per_file.most_common():
        print(f"  {seconds:7.1f} s  {path}")
    print(f"slowest {args.top}:")
    for seconds, path, name in sorted(tests, reverse=True)[:args.top]:
        print(f"  {seconds:7.1f} s  {path}::{name}")


if __name__ == "__main__":
    main()
