"""The small shared helpers: int checks of the user-facing settings, host-to-device copies,
and the one block-size fact the engine config reads from the kernels."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.config import Config
from nanovllm.utils.host_to_device import to_device
from nanovllm.utils.validation import check_int


@pytest.mark.parametrize("value", [True, 2.0, "3", None])
def test_check_int_rejects_non_ints(value):
    with pytest.raises(TypeError, match=f"^n must be an int, got {value!r}$"):
        check_int("n", value)


def test_check_int_minimum():
    check_int("n", 2, 2)
    check_int("n", -5)  # no minimum
    with pytest.raises(ValueError, match="^n must be >= 2, got 1$"):
        check_int("n", 1, 2)


def test_engine_and_request_settings_share_the_messages(tmp_path):
    with pytest.raises(ValueError, match="^max_num_seqs must be >= 1, got 0$"):
        Config(str(tmp_path), max_num_seqs=0)
    with pytest.raises(TypeError, match="^seed must be an int, got 1.5$"):
        Config(str(tmp_path), seed=1.5)
    with pytest.raises(ValueError, match="^SamplingParams.max_tokens must be >= 1, got 0$"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="^SamplingParams.stop_token_ids must be >= 0, got -1$"):
        SamplingParams(stop_token_ids=[3, -1])
    with pytest.raises(TypeError, match="^SamplingParams.top_k must be an int, got True$"):
        SamplingParams(top_k=True)


def test_to_device_from_list_array_and_tensor():
    t = to_device([1.5, 2.5], "cpu", torch.float32)
    assert t.dtype == torch.float32 and t.tolist() == [1.5, 2.5]
    rows = np.arange(6, dtype=np.int32).reshape(2, 3)
    t = to_device(rows, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == rows.tolist()
    assert to_device(torch.ones(2, dtype=torch.int64), "cpu", torch.float32).dtype == torch.float32
    with pytest.raises(TypeError, match="host data"):
        to_device(torch.zeros(2, device="meta"), "cpu")


@pytest.mark.gpu
def test_to_device_copies_to_cuda():
    rows = np.arange(6, dtype=np.int32).reshape(2, 3)
    t = to_device(rows, torch.device("cuda"))
    assert t.is_cuda and t.dtype == torch.int32 and t.cpu().tolist() == rows.tolist()


def test_engine_config_imports_no_triton():
    """nanovllm.config reads BLOCK_SIZE_MULTIPLE from nanovllm.kernels.checks: that must work
    where Triton is not installed, so neither module may import it."""
    code = "import sys, nanovllm.config, nanovllm.kernels.checks; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"
