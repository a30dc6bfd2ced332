"""vLLM's BeamSearchParams, the settings of LLM.beam_search (nanovllm/beam_search.py; importable from
nanovllm.sampling_params too, where vLLM has it).

Invariant once constructed (and in the copy `validated` returns, which beam_search runs with):
beam_width and max_tokens ints >= 1, ignore_eos and include_stop_str_in_output bools, temperature
and length_penalty finite numbers, temperature >= 0; NumPy scalars held as Python numbers.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from nanovllm.utils.validation import check_bool, check_int, plain_number


@dataclass
class BeamSearchParams:
    """vLLM's LLM.beam_search settings (nanovllm/beam_search.py): `beam_width` beams kept per prompt,
    each step extending each by its 2 x beam_width most likely tokens (at most LLM(max_logprobs=...));
    `max_tokens` steps at most; EOS ends a beam unless `ignore_eos`; beams ranked by cumulative
    logprob / length ** `length_penalty` (length counting the prompt, not a final EOS).
    `temperature` is passed to each step's sampling, whose token is not used (the logprobs are the
    raw ones), and `include_stop_str_in_output` is accepted, as in vLLM, where neither changes the beams.
    NumPy scalars are taken as Python numbers, as SamplingParams takes them. The fields are checked at
    construction and again by beam_search (`validated`: fields may be edited afterwards, as SamplingParams' may)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, plain_number(getattr(self, f.name)))
        check_int("BeamSearchParams.beam_width", self.beam_width, 1)
        check_int("BeamSearchParams.max_tokens", self.max_tokens, 1)
        check_bool("BeamSearchParams.ignore_eos", self.ignore_eos)
        check_bool("BeamSearchParams.include_stop_str_in_output", self.include_stop_str_in_output)
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise TypeError(f"BeamSearchParams.{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"BeamSearchParams.temperature must be >= 0, got {self.temperature!r}")

    def validated(self) -> BeamSearchParams:
        """A checked copy of these settings as they are now; raises as construction does."""
        return dataclasses.replace(self)
