"""bench.py under variants of the library's module constants, side by side in one run.

Each variant is a name and assignments to module-level constants (tuning switches such as
layers/linear.SKINNY_MAX_ROWS); it runs bench.py in a fresh process with its own Triton cache,
the constants set before anything compiles (Triton compiles a jit global's value into the
kernel, so a tl.constexpr constant gets its new value wrapped as one). Prints the bench's report
lines that match --show, prefixed by the variant's name.

    PYTHONPATH=. python3 benchmarks/variants.py \\
        --variant baseline \\
        --variant "skinny:nanovllm.layers.linear.SKINNY_MAX_ROWS=256" \\
        --show "decode ms/token" -- --model benchmarks/configs/qwen3-0.6b --load-format dummy --latency
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import runpy
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: bench.py's directory


def parse_variant(text: str) -> tuple[str, dict[str, object]]:
    """'name' or 'name:module.CONST=value,module.CONST=value' -> (name, {dotted name: value});
    values are Python literals."""
    name, _, spec = text.partition(":")
    sets = {}
    for item in filter(None, spec.split(",")):
        target, eq, value = item.partition("=")
        if not eq or "." not in target:
            raise SystemExit(f"variant {name!r}: expected module.CONST=value, got {item!r}")
        sets[target.strip()] = ast.literal_eval(value.strip())
    return name, sets


def apply(sets: dict[str, object]) -> None:
    """Set each module constant, wrapped as tl.constexpr where the current value is one."""
    import triton.language as tl

    for target, value in sets.items():
        module_name, _, const = target.rpartition(".")
        module = importlib.import_module(module_name)
        if not hasattr(module, const):
            raise SystemExit(f"{module_name} has no constant {const}")
        if isinstance(getattr(module, const), tl.constexpr):
            value = tl.constexpr(value)
        setattr(module, const, value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, help="name[:module.CONST=value,...]")
    ap.add_argument("--show", default="decode ms/token|tok/s|fraction of roofline",
                    help="report lines starting with any of these ('|'-separated)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # JSON assignments: run bench.py here
    args, bench_args = ap.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    if "--tp" in bench_args:  # tensor-parallel workers are spawned: they would not see the constants
        raise SystemExit("variants.py times one GPU: --tp is not supported")
    if args.child is not None:
        apply(json.loads(args.child))
        sys.argv = ["bench.py", *bench_args]
        runpy.run_path(os.path.join(ROOT, "bench.py"), run_name="__main__")
        return
    prefixes = tuple(args.show.split("|"))
    for name, sets in map(parse_variant, args.variant):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": ROOT}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--variant", name,
                                  "--child", json.dumps(sets), "--", *bench_args],
                                 capture_output=True, text=True, env=env, cwd=ROOT)
        lines = [line for line in out.stdout.splitlines() if line.startswith(prefixes)]
        if out.returncode or not lines:
            print(f"{name}: failed (rc {out.returncode})\n{out.stderr[-2000:]}", flush=True)
            continue
        for line in lines:
            print(f"{name:<16}{line}", flush=True)


if __name__ == "__main__":
    main()
