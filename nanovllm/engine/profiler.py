"""vLLM's LLM.start_profile() / stop_profile(): torch.profiler records the engine's work between
the two calls and stop_profile() writes its trace into the directory named by the
VLLM_TORCH_PROFILER_DIR environment variable, read at start_profile() (nothing is read at import).

As vLLM's: without the variable start_profile() raises RuntimeError("Profiler is not enabled."),
here with how to enable it; the trace is torch's tensorboard_trace_handler file, gzipped
(`<host>_<pid>.<ms>.pt.trace.json.gz`: a Chrome trace for Perfetto, chrome://tracing or
TensorBoard). CPU activity always, CUDA's too on a CUDA engine. Unlike vLLM, rank 0's process only
(tensor-parallel workers are not profiled). A stop_profile() without a start, or a
start_profile() while profiling, is a RuntimeError saying so; exit() ends a recording still running,
writing its trace.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"


class TorchProfiler:
    """One engine's profiling session: none, or the torch.profiler.profile started by `start`."""

    def __init__(self):
        self._profile: torch.profiler.profile | None = None

    def start(self, device: torch.device) -> None:
        """Start recording (`device`: the engine's; CUDA activity too on a CUDA device)."""
        if self._profile is not None:
            raise RuntimeError("start_profile() called while profiling (since an earlier start_profile()): "
                               "call stop_profile() first")
        directory = os.environ.get(PROFILER_DIR_ENV)
        if not directory:
            raise RuntimeError(f"Profiler is not enabled. Set the environment variable {PROFILER_DIR_ENV} to the "
                               "directory the trace is written to (read at start_profile())")
        directory = os.path.abspath(os.path.expanduser(directory))  # as vLLM reads it
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(
            activities=activities, on_trace_ready=torch.profiler.tensorboard_trace_handler(directory, use_gzip=True))
        profile.start()
        self._profile = profile
        logger.info("Profiling started: the trace goes to %s at stop_profile()", directory)

    def stop(self) -> None:
        """Stop recording and write the trace (the profile's on_trace_ready)."""
        if self._profile is None:
            raise RuntimeError("stop_profile() called without start_profile(): nothing is being profiled")
        profile, self._profile = self._profile, None
        profile.stop()

    def close(self) -> None:
        """The engine's exit: a recording still running ends, its trace written; else nothing."""
        if self._profile is not None:
            self.stop()
