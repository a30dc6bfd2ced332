"""benchmarks/engine/variants.py on CPU: variant specs are KernelRoutes fields, checked before any
run; reports are shown side by side; a variant's bench run says why it failed (bench.py needs
CUDA) instead of printing nothing."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.engine.variants import parse_variant, side_by_side

REPO = Path(__file__).resolve().parent.parent


def test_specs_are_kernel_routes():
    assert parse_variant("default") == ("default", "")
    assert parse_variant("cublas:skinny_max_rows=0,gemv_max_rows=1") == ("cublas", "skinny_max_rows=0,gemv_max_rows=1")
    # benchmarks/README.md's A/B runs of the sampler's kernels
    assert parse_variant("torch:logprobs_kernel=off") == ("torch", "logprobs_kernel=off")
    assert parse_variant("sort:radix_min_rows=1000000") == ("sort", "radix_min_rows=1000000")


@pytest.mark.parametrize("spec, message", [
    ("x:SKINNY_MAX_ROWS=64", "field of KernelRoutes"),
    ("x:nanovllm.layers.linear.SKINNY_MAX_ROWS=0", "field of KernelRoutes"),
    ("x:gemv_max_rows=1.5", "integer"),
    ("x:radix_min_rows=-1", "radix_min_rows"),
    ("x:logprobs_kernel=maybe", "logprobs_kernel takes one of"),
    (":gemv_max_rows=1", "name"),
])
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(SystemExit, match=message):
        parse_variant(spec)


def test_reports_side_by_side():
    """Rows matching a prefix, in the first report's order, a column per variant, '-' where missing."""
    reports = {"a": [["steps", "9"], ["decode ms/token, batch 1", "0.942"], ["decode ms/token, batch 8", "1.443"]],
               "b": [["decode ms/token, batch 1", "0.978"], ["steps", "8"]]}
    lines = side_by_side(reports, ("decode ms/token",)).splitlines()
    assert [line.split() for line in lines] == [
        ["a", "b"], ["decode", "ms/token,", "batch", "1", "0.942", "0.978"],
        ["decode", "ms/token,", "batch", "8", "1.443", "-"]]


def run_variants(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.engine.variants", *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def test_flags_it_sets_itself_are_refused():
    out = run_variants("--variant", "a", "--", "--json", "x.json")
    assert out.returncode != 0 and "sets --kernel-routes and --json itself" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the bench would run for real")
def test_a_failed_variant_is_reported():
    out = run_variants("--variant", "baseline", "--", "--model", "benchmarks/configs/qwen3-0.6b", "--latency")
    assert out.returncode == 0
    assert "baseline: failed" in out.stdout and "CUDA" in out.stdout
