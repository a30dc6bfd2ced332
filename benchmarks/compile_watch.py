"""Which Triton kernels compile (or load from the disk cache) while bench.py's workload runs, after
start-up and warm-up should have compiled them all. A fresh machine has an empty Triton cache, so
every such kernel costs a full compile inside the timed run.

    PYTHONPATH=. python3 benchmarks/compile_watch.py [bench.py arguments]
"""

from __future__ import annotations

import os
import runpy
import sys
import time

import triton

# Kernels compiled within this process, by phase: (seconds since start, name and specialization).
events: dict[str, list[tuple[float, str]]] = {"startup": [], "run": []}
phase = ["startup"]
T0 = time.perf_counter()


def on_compile(**kw) -> None:
    events[phase[0]].append((time.perf_counter() - T0, kw["repr"][:700]))


def main() -> None:
    triton.knobs.runtime.jit_post_compile_hook = on_compile
    bench = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "bench.py"), run_name="bench")
    run_engine = bench["run_engine"]

    def timed_run(*args, **kwargs):
        phase[0] = "run"
        start = time.perf_counter()
        try:
            return run_engine(*args, **kwargs)
        finally:
            phase[0] = "after"
            events.setdefault("after", [])
            print(f"[compile_watch] run_engine {time.perf_counter() - start:.2f} s", flush=True)

    bench["main"].__globals__["run_engine"] = timed_run  # run_path returned a copy of those globals
    sys.argv = ["bench.py"] + sys.argv[1:]
    bench["main"]()
    print(f"[compile_watch] kernels compiled or loaded before the run: {len(events['startup'])}")
    print(f"[compile_watch] during the run: {len(events['run'])}")
    for t, what in events["run"]:
        print(f"  {t:8.2f} s  {what}")


if __name__ == "__main__":
    main()
