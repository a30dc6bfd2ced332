"""Shared pytest setup: CPU Triton interpretation, the `gpu` and `interpreter` markers.

TRITON_INTERPRET must be set before Triton decorates any kernel, so it is set here,
before any test module imports nanovllm.kernels. It is only set when no CUDA device
exists: on the H200 the kernels compile for real. So tests marked `interpreter` (Triton
kernels on CPU tensors) run only without CUDA, and tests marked `gpu` only with it; on a
GPU machine the `gpu` tests cover the same kernels compiled.
"""

import os
import shutil

if not shutil.which("nvidia-smi") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        skip = pytest.mark.skip(reason="Triton's CPU interpreter is off where CUDA exists; the gpu tests run the kernels")
        marker = "interpreter"
    else:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        marker = "gpu"
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)
