"""The handles of a step on its way to the device. `PreparedStep` (ModelRunner.prepare): its inputs
built on the host, nothing queued. `StepLogits` (ModelRunner.queue): its forward
and LM head queued, sampling not yet (the host fills the step's token masks meanwhile).
`LaunchedStep` (ModelRunner.sample, through `launched`): its sampled tokens and logprobs, copied to
pinned host memory behind one event, read only when the engine needs them (overlap scheduling plans
the next step before waiting here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.engine.logprobs import HostLogprobs
from nanovllm.engine.step_inputs import HostCopy
from nanovllm.engine.step_plan import StepPlan
from nanovllm.sampling.batch import SamplingBatch, SamplingPack
from nanovllm.sampling.logits_rules import HostRules, StepRules
from nanovllm.sampling.row_logprobs import RowLogprobs
from nanovllm.sampling.sampler import TokenLogprobs


@dataclass(frozen=True)
class PreparedStep:
    """A step built on the host and not queued on the device yet: what ModelRunner.queue needs."""

    plan: StepPlan
    prepare_s: float  # host time spent building it
    copy: HostCopy  # its inputs and sampling words, one host-to-device copy
    sampling: SamplingPack | None  # the sampled rows' settings (None: nothing sampled on this rank)
    rules: HostRules | None  # the sampled rows' logits rules (None: no row uses any)
    graph: int | None  # the CUDA graph it replays: the decode batch size or the varlen token bucket; None: eager
    calibrate_kv: bool = False  # it sets the FP8 cache's scales (KvScales.calibrate on an empty cache)


@dataclass(frozen=True)
class StepLogits:
    """A step whose forward is queued on the device and whose sampling is not."""

    prepare_s: float  # host time spent building the step's inputs
    logits: torch.Tensor | None  # [num_sampled, vocab] on the device (None: nothing sampled on this rank)
    sampling: SamplingBatch | None  # the sampled rows' settings (None with logits None)
    prompt_logprobs: RowLogprobs | None  # the plan's prompt-logprob rows, on the device
    rules: StepRules | None = None  # the sampled rows' logits rules (None: no row uses any)


@dataclass(frozen=True)
class LaunchedStep:
    """A step queued on the device. `tokens()` waits for its sampled tokens; `logprobs()` /
    `prompt_logprobs()` return the step's logprobs (None when no row asked)."""

    prepare_s: float  # host time spent building the step's inputs
    device_tokens: torch.Tensor | None = None  # [num_sampled] int64 on the device (None: nothing sampled here)
    host_tokens: torch.Tensor | None = None  # the same, copied to (pinned) host memory once `ready`
    ready: torch.cuda.Event | None = None  # recorded after the copies (None on CPU: already done)
    # on the host once `ready`: the logprobs of the sampled rows that asked, and of the prompt-logprob
    # rows in the plan's order
    host_logprobs: TokenLogprobs | None = None
    host_prompt_logprobs: RowLogprobs | None = None

    def _wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def tokens(self) -> list[int]:
        if self.host_tokens is None:
            return []
        self._wait()
        return self.host_tokens.tolist()

    def logprobs(self) -> HostLogprobs | None:
        if self.host_logprobs is None:
            return None
        self._wait()
        return HostLogprobs.from_tensors(*self.host_logprobs)

    def prompt_logprobs(self) -> RowLogprobs | None:
        """The prompt-logprob rows' host tensors, as they are (engine/logprobs.record_prompt_logprobs
        turns them into lists)."""
        if self.host_prompt_logprobs is None:
            return None
        self._wait()
        return self.host_prompt_logprobs


def launched(prepare_s: float, tokens: torch.Tensor | None, sample_logprobs: TokenLogprobs | None,
             prompt_logprobs: RowLogprobs | None, device: torch.device) -> LaunchedStep:
    """The handle of a queued step: its device results copied to pinned host memory
    (CUDA: asynchronously, one event after the copies; CPU: as they are)."""
    if device.type != "cuda":
        return LaunchedStep(prepare_s, tokens, tokens, None, sample_logprobs, prompt_logprobs)

    def to_host(t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    host_tokens = to_host(tokens) if tokens is not None else None
    host_lp = None if sample_logprobs is None else TokenLogprobs._make(map(to_host, sample_logprobs))
    host_plp = None if prompt_logprobs is None else RowLogprobs._make(map(to_host, prompt_logprobs))
    ready = torch.cuda.Event()
    ready.record()
    return LaunchedStep(prepare_s, tokens, host_tokens, ready, host_lp, host_plp)
