"""benchmarks/variants.py on CPU: variant specs parse, constants are set (wrapped as tl.constexpr
where the library's constant is one), bad specs are refused, and a variant's bench run says why it
failed (bench.py needs CUDA) instead of printing nothing."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import variants  # noqa: E402


@pytest.mark.parametrize("spec, message", [("x:SKINNY_MAX_ROWS=64", "module.CONST"), ("x:nanovllm.layers.linear.S", "module.CONST")])
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(SystemExit, match=message):
        variants.parse_variant(spec)
    with pytest.raises(SystemExit, match="no constant"):
        variants.apply({"nanovllm.kernels.gemv.NO_SUCH_CONSTANT": 1})


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the bench would run for real")
def test_a_failed_variant_is_reported():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "variants.py"), "--variant", "baseline", "--",
                          "--model", "benchmarks/configs/qwen3-0.6b", "--latency"],
                         capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0
    assert "baseline: failed" in out.stdout and "CUDA" in out.stdout
