"""Shared pytest setup: CPU Triton interpretation and the `gpu` marker.

TRITON_INTERPRET must be set before Triton decorates any kernel, so it is set here,
before any test module imports nanovllm.kernels. It is only set when no CUDA device
exists: on the H200 the kernels compile for real.
"""

import os
import shutil

if not shutil.which("nvidia-smi") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
