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


def test_specs_parse_and_constants_are_set(monkeypatch):
    import triton.language as tl

    import nanovllm.kernels.sampling_filter as sampling_filter
    import nanovllm.layers.linear as linear

    assert variants.parse_variant("baseline") == ("baseline", {})
    name, sets = variants.parse_variant(
        "both:nanovllm.kernels.sampling_filter.RADIX_BITS=8, nanovllm.layers.linear.SKINNY_MAX_ROWS=64")
    assert name == "both"
    assert sets == {"nanovllm.kernels.sampling_filter.RADIX_BITS": 8, "nanovllm.layers.linear.SKINNY_MAX_ROWS": 64}
    monkeypatch.setattr(sampling_filter, "RADIX_BITS", sampling_filter.RADIX_BITS)  # restored after the test
    monkeypatch.setattr(linear, "SKINNY_MAX_ROWS", linear.SKINNY_MAX_ROWS)
    variants.apply(sets)
    assert isinstance(sampling_filter.RADIX_BITS, tl.constexpr) and sampling_filter.RADIX_BITS.value == 8
    assert linear.SKINNY_MAX_ROWS == 64 and not isinstance(linear.SKINNY_MAX_ROWS, tl.constexpr)


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
