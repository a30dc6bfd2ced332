"""Shared pytest setup: CPU Triton interpretation, the `gpu` and `interpreter` markers, Ray's settings.

TRITON_INTERPRET must be set before Triton decorates any kernel, so it is set here,
before any test module imports nanovllm.kernels. It is only set when no CUDA device
exists: on the H200 the kernels compile for real. So tests marked `interpreter` (Triton
kernels on CPU tensors) run only without CUDA, and tests marked `gpu` only with it; on a
GPU machine the `gpu` tests cover the same kernels compiled.

CPU work in the tests (tiny models: hidden <= 256) runs on at most CPU_TEST_THREADS threads, here
and in the subprocesses the tests start: on a many-core GPU host, torch's default of one thread a
core made the CPU tests 2x slower than on CI's 2 cores (OpenMP fork/join and spinning cost more
than such small matmuls save). Under pytest-xdist (`-n auto --dist loadgroup`, the README's
command) the workers share the cores, and every `gpu` test joins one xdist group, so the GPU
tests run one at a time in one worker (they size KV caches from the card's free memory and
check what exit() gives back) while the other workers take the CPU tests.
"""

import os
import shutil

if not shutil.which("nvidia-smi") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
# Ray (tests/test_ray_data.py), read when ray is first imported: a single-node cluster on the
# loopback address (no node IP looked up, nothing but 127.0.0.1 used), and no usage reports sent.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

CPU_TEST_THREADS = 4
# The xdist group of every gpu test: one worker runs them all, in order.
GPU_GROUP = "gpu"


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in each xdist worker
    threads = max(1, min(torch.get_num_threads() // workers, CPU_TEST_THREADS))
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # subprocesses: example.py, python -O, bench.py


# tryfirst: pytest-xdist reads the xdist_group marks in its own collection hook (the `@gpu` suffix
# of the node ids that --dist loadgroup schedules by); run after it, the marks would come too late.
@pytest.hookimpl(tryfirst=True)
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
        elif "gpu" in item.keywords:
            item.add_marker(pytest.mark.xdist_group(GPU_GROUP))
