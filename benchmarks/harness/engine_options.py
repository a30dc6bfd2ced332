"""What a benchmark's engine runs: the model directory (benchmarks/configs/ holds published shapes as
config.json only, run with random weights), its load format, the kernel routes (`--kernel-routes`,
for A/B runs), and the engine tools' shared command-line options for them."""

from __future__ import annotations

import argparse
import glob
import os
import sys
from dataclasses import fields

import torch

from nanovllm.config import KV_CACHE_DTYPES
from nanovllm.layers.kernel_path import ON_OFF_ROUTES, OPTIONAL_ROUTES, KernelRoutes

# The published model shapes (config.json only), found from this file so any working directory works.
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEFAULT_MODEL = os.path.join(CONFIGS_DIR, "qwen3-0.6b")
# The names --kernel-routes accepts (and lists when given another).
ROUTE_FIELDS = tuple(f.name for f in fields(KernelRoutes))
# The words an on / off route (kernel_path.ON_OFF_ROUTES) takes.
ON_OFF_WORDS = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}
# --load-format's choices: auto (resolve_load_format) or dummy (random weights always).
LOAD_FORMATS = ("auto", "dummy")


def add_model_options(ap: argparse.ArgumentParser, load_format: str = "auto") -> None:
    """--model (default: DEFAULT_MODEL) and --load-format (default `load_format`), the options every
    engine tool shares; resolve_load_format(args.load_format, args.model) gives what LLM takes."""
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="model directory (default: benchmarks/configs/qwen3-0.6b, config.json only)")
    ap.add_argument("--load-format", default=load_format, choices=LOAD_FORMATS,
                    help="auto: the checkpoint's weights, random ones if the directory has no *.safetensors")


def add_format_options(ap: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype and --quantization, LLM's storage formats (vLLM's names), for every engine tool."""
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="LLM(kv_cache_dtype=...): fp8 stores K/V in float8 e4m3 (the roofline counts 1 byte each)")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="LLM(quantization=...): fp8 quantizes the linears at load (per-channel weights, per-token "
                         "activations); the roofline counts weights at their stored widths, GEMM FLOPs at the FP8 peak")


def require_cuda(tool: str, measures: str = "GPU throughput") -> None:
    """Exit with a line naming `tool` and what it `measures` where torch sees no CUDA device."""
    if not torch.cuda.is_available():
        sys.exit(f"{tool} measures {measures} and needs a CUDA device; torch sees none")


def resolve_load_format(requested: str, model_dir: str) -> tuple[str, str]:
    """(load_format for LLM, a line saying which weights run): auto = dummy iff no *.safetensors."""
    if requested == "dummy":
        return "dummy", "random weights (--load-format dummy)"
    if not glob.glob(os.path.join(model_dir, "*.safetensors")):
        return "dummy", f"random weights: {model_dir} has no *.safetensors (load_format=dummy)"
    return requested, f"checkpoint weights from {model_dir}"


def parse_kernel_routes(text: str) -> KernelRoutes:
    """'field=value,...' over KernelRoutes' fields (integers; on / off for the on / off routes; none for
    the routes None turns off) ->
    KernelRoutes, the defaults for the rest ('' gives the defaults). Raises ValueError naming the bad
    item, or KernelRoutes' own error."""
    values: dict[str, int | bool | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = (s.strip() for s in item.partition("="))
        if not eq or name not in ROUTE_FIELDS:
            raise ValueError(f"kernel routes: {item!r} is not field=value with a field of KernelRoutes "
                             f"({', '.join(ROUTE_FIELDS)})")
        if name in values:
            raise ValueError(f"kernel routes: {name} given twice")
        if name in ON_OFF_ROUTES:
            if value.lower() not in ON_OFF_WORDS:
                raise ValueError(f"kernel routes: {name} takes one of {', '.join(ON_OFF_WORDS)}, got {value!r}")
            values[name] = ON_OFF_WORDS[value.lower()]
        elif name in OPTIONAL_ROUTES and value.lower() == "none":
            values[name] = None
        else:
            try:
                values[name] = int(value)
            except ValueError:
                raise ValueError(f"kernel routes: {name} takes an integer, got {value!r}") from None
    return KernelRoutes(**values)
