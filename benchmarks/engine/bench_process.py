"""bench.py of a source tree in a fresh process (its own CUDA context, allocator and compiled
kernels): its --json results, or why it failed. variants.py and compare.py run every measurement
this way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# The repository this file belongs to: the tree whose bench.py runs unless another is given.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Characters of a failed run's output kept to say why it failed.
FAIL_TAIL_CHARS = 2000


@dataclass(frozen=True)
class BenchProcess:
    results: dict | None  # bench.py's --json; None when the run failed
    seconds: float  # wall time of the process
    why: str = ""  # a failed run's exit status or timeout, and its output's tail


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def run_bench(bench_args: list[str], timeout_s: float, root: str = REPO, keep: str | None = None) -> BenchProcess:
    """`python bench.py *bench_args --json ...` in `root` (which also leads its import path), ended
    after timeout_s. keep: a path prefix where the run's output (.log) and results (.json) stay."""
    with tempfile.TemporaryDirectory() as tmp:
        out_json = f"{keep}.json" if keep else os.path.join(tmp, "bench.json")
        cmd = [sys.executable, "bench.py", *bench_args, "--json", out_json]
        env = {**os.environ, "PYTHONPATH": root}
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
            output, why = proc.stdout + proc.stderr, f"exit status {proc.returncode}" if proc.returncode else ""
        except subprocess.TimeoutExpired as exc:
            output, why = _text(exc.stdout) + _text(exc.stderr), f"timed out after {timeout_s:.0f} s"
        seconds = time.perf_counter() - start
        if keep:
            with open(f"{keep}.log", "w") as f:
                f.write(f"$ {' '.join(cmd)}  (in {root})\n{output}")
        if not why and not os.path.exists(out_json):
            why = "no results written"
        if why:
            return BenchProcess(None, seconds, f"{why}: {output[-FAIL_TAIL_CHARS:].strip()}")
        with open(out_json) as f:
            return BenchProcess(json.load(f), seconds)
