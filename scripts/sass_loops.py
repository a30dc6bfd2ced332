"""Compile an attention kernel of tests/test_kernels_compile's specs for sm_90 with whichever Triton comes first on
the path (the device's 3.6: pip install --target a folder from its wheel, put it first on PYTHONPATH) and print the
instruction mix of its largest loop body (a backward branch and its target), from the wheel's nvdisasm. No GPU needed.

    pip download triton==3.6.0 --no-deps -d /tmp/t36
    pip install --no-deps --target /tmp/t36site /tmp/t36/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36site:. python scripts/sass_loops.py [NAME=VALUE ...]   # the FP8 decode kernel, overrides
    PYTHONPATH=/tmp/t36site:. python scripts/sass_loops.py --all   # every attention variant's three largest loops
"""
import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, "tests")
import test_kernels_compile as t  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


def compile_spec(module, kernel, types, variant, overrides=None):
    """Strides as a real launch passes a cache's (int32, multiples of 16), not the spec's int64."""
    jit = getattr(importlib.import_module(f"nanovllm.{module}"), kernel)
    types = {**{n: t.INT_MULTIPLE_OF_16 for n in inspect.signature(jit.fn).parameters if n.startswith("stride")},
             **types}
    variant = {**variant, **(overrides or {})}
    constexprs = {k: v for k, v in variant.items() if k not in t.DEFAULT_OPTIONS}
    options = {k: variant.get(k, v) for k, v in t.DEFAULT_OPTIONS.items()}
    sig, attrs = t._signature(jit.fn, types, constexprs)
    return triton.compile(ASTSource(jit, sig, constexprs=constexprs, attrs=attrs), target=SM90, options=options)


def sass_of(compiled) -> str:
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout


def loops(sass: str) -> list[tuple[int, int, list[str]]]:
    """(start, end, instructions) of every backward branch's span."""
    instrs, labels, pending = [], {}, None
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending = label.group(1)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            instrs.append((addr, m.group(2)))
            if pending:
                labels[pending], pending = addr, None
    out = []
    for addr, ins in instrs:
        target = re.search(r"BRA[^`]*`\((\.L_x_\d+)\)", ins)
        if target and target.group(1) in labels and labels[target.group(1)] < addr:
            start = labels[target.group(1)]
            out.append((start, addr, [i for a, i in instrs if start <= a <= addr]))
    return out


def mix(body: list[str]) -> dict[str, int]:
    ops: dict[str, int] = {}
    for ins in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", ins.strip()).split()[0].split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    return ops


def fp8_decode_spec():
    """The FP8-cache decode kernel's unsplit, one-head-a-program variant (module, kernel, types, variant)."""
    module, kernel, types, variants = next(s for s in t.SPECS
                                           if s[1] == "_decode_split_kernel" and s[2].get("k_ptr") == t.FP8_WORDS)
    variant = next(v for v in variants if v["NUM_SPLITS"] == 1 and not v["FOLD"] and not v["ROWS_ON_DEVICE"]
                   and "members_ptr" in v and v["PACK"] == 1)
    return module, kernel, types, variant


def print_all():
    """The three largest loops' sizes of every attention-kernel variant of the specs."""
    for module, kernel, types, variants in t.SPECS:
        if kernel not in ("_decode_split_kernel", "_prefill_kernel"):
            continue
        fp8 = "fp8" if types.get("k_ptr") == t.FP8_WORDS else ""
        for i, variant in enumerate(variants):
            sizes = sorted((len(b) for _, _, b in loops(sass_of(compile_spec(module, kernel, types, variant)))),
                           reverse=True)[:3]
            tag = {k: variant[k] for k in ("NUM_SPLITS", "PACK", "BLOCK_N", "TILED", "PAGED", "ROWS_ON_DEVICE")
                   if k in variant}
            print(kernel, i, fp8, tag, sizes, flush=True)


def print_fp8_decode(args):
    overrides = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in (a.split("=", 1) for a in args)}
    module, kernel, types, variant = fp8_decode_spec()
    compiled = compile_spec(module, kernel, types, variant, overrides)
    print(triton.__version__, {k: variant[k] for k in ("GROUP", "BLOCK_G", "BLOCK_N")}, overrides,
          "shared", compiled.metadata.shared)
    for start, end, body in sorted(loops(sass_of(compiled)), key=lambda x: -len(x[2]))[:3]:
        print(f"loop {start:#x}-{end:#x}: {len(body)} instructions",
              sorted(mix(body).items(), key=lambda x: -x[1])[:24])


if __name__ == "__main__":
    if sys.argv[1:] == ["--all"]:
        print_all()
    else:
        print_fp8_decode(sys.argv[1:])
