"""A step's logits rules: what requests' SamplingParams change in their rows' logits before sampling
(allowed_token_ids, bad_words, min_tokens, logit_bias, penalties), as vLLM V1 applies them, on a float32
copy (logprobs stay those of the raw logits); `StepRules.apply` says in which order:

    allowed   every token of an allowed row but its allowed ones  -> -inf
    bans      (row, token) pairs: bad words whose prefix was just generated, and EOS / stop ids
              of rows short of min_tokens                          -> -inf
    bans if   the same, for a bad word whose last prefix token is the row's input still in flight
              (the previous step's sample, read on the device)     -> -inf where it matches
    bias      (row, token, bias)                                   -> + bias
    penalties rows with a slot of TokenCounts                      -> sampling/penalties.py

The host builds `HostRules` for the rows that use any rule (engine/rules_builder.py); its parts
travel in one int64 buffer (one host-to-device copy) and `StepRules` is their device view. A step
without such rows builds nothing and the sampler does no work for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from nanovllm.sampling.penalties import TokenCounts, penalize_rows
from nanovllm.utils.host_to_device import PackLayout, to_device


@dataclass
class HostRules:
    """One step's rules on the host, as flat lists (rows are the step's sampled rows).

    penalty_rows / penalty_slots / repetition / frequency / presence: [P] penalized rows, their
        TokenCounts slots and penalties.
    allowed_rows: [A] rows limited to allowed tokens; allowed_entry_rows / allowed_tokens: [E] the
        index in allowed_rows and the token of each allowed (row, token).
    ban_rows / ban_tokens: [N] (row, token) pairs masked.
    cond_rows / cond_tokens / cond_sources / cond_required: [M] pairs masked where the previous
        step's sample at cond_sources equals cond_required.
    bias_rows / bias_tokens / bias_values: [K] biases added.
    reset_*: TokenCounts rows to set before the step: [I] slots, then (index into reset_slots,
        token) of their prompt tokens and of their generated tokens.
    """

    penalty_rows: list[int] = field(default_factory=list)
    penalty_slots: list[int] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)
    frequency: list[float] = field(default_factory=list)
    presence: list[float] = field(default_factory=list)
    allowed_rows: list[int] = field(default_factory=list)
    allowed_entry_rows: list[int] = field(default_factory=list)
    allowed_tokens: list[int] = field(default_factory=list)
    ban_rows: list[int] = field(default_factory=list)
    ban_tokens: list[int] = field(default_factory=list)
    cond_rows: list[int] = field(default_factory=list)
    cond_tokens: list[int] = field(default_factory=list)
    cond_sources: list[int] = field(default_factory=list)
    cond_required: list[int] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)
    bias_tokens: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    reset_slots: list[int] = field(default_factory=list)
    reset_prompt_slots: list[int] = field(default_factory=list)
    reset_prompt_tokens: list[int] = field(default_factory=list)
    reset_output_slots: list[int] = field(default_factory=list)
    reset_output_tokens: list[int] = field(default_factory=list)

    def to_device(self, device: torch.device, counts: TokenCounts | None, previous_tokens: Tensor | None,
                  penalize: Callable[..., None] = penalize_rows) -> StepRules:
        """The rules on `device` (one copy); the counts rows of sequences slotted this step are set
        here, on the device before the step samples. `counts`: the slab the penalty slots index
        (needed when any row is penalized); `previous_tokens`: the previous step's samples (needed by
        cond_*); `penalize`: the penalties' implementation (penalties.penalize_rows' contract)."""
        # only the parts in use travel (each costs host time every step), each starting 16-byte
        # aligned (host_to_device.ALIGN_BYTES): the penalties kernel then sees the same pointer
        # alignment every step, so Triton compiles no new variant mid-run
        ints = [(name, part) for name in INT_PARTS if (part := getattr(self, name))]
        floats = [(name, part) for name in FLOAT_PARTS if (part := getattr(self, name))]
        layout = PackLayout.of(tuple(len(part) for _, part in ints), tuple(len(part) for _, part in floats))
        int_views, float_views = layout.split(to_device(layout.pack([p for _, p in ints], [p for _, p in floats]),
                                                        device))
        views: dict[str, Tensor] = {name: view for (name, _), view in zip(ints + floats, int_views + float_views)}
        if self.penalty_rows and counts is None:
            raise ValueError("penalized rows need the TokenCounts slab their slots index")
        if self.cond_rows and previous_tokens is None:
            raise ValueError("conditional bans need the previous step's sampled tokens")
        rules = StepRules(views, counts, previous_tokens, penalize)
        if self.reset_slots:
            slots = views["reset_slots"]
            none = slots[:0]
            counts.reset(slots, slots[views.get("reset_prompt_slots", none)], views.get("reset_prompt_tokens", none),
                         slots[views.get("reset_output_slots", none)], views.get("reset_output_tokens", none))
        return rules


def _ban(x: Tensor, rows: Tensor, tokens: Tensor, bounds: Tensor) -> None:
    """x[rows[i], tokens[i]] = min(itself, bounds[i]): -inf bans the pair, +inf leaves it as is (pairs
    may repeat; a pair banned once is banned), without a host sync. Adding -inf instead would turn a
    logit a bias or penalty made +inf into NaN, which the sampler would then pick."""
    x.view(-1).scatter_reduce_(0, rows * x.shape[1] + tokens, bounds, "amin")


# HostRules' parts by element type, in field order (the buffer's: ints, then float32s).
INT_PARTS = tuple(f.name for f in fields(HostRules) if f.type == "list[int]")
FLOAT_PARTS = tuple(f.name for f in fields(HostRules) if f.type == "list[float]")


class StepRules:
    """A step's rules on the device: `apply` to the sampler's logits, `record` its sampled tokens."""

    def __init__(self, parts: dict[str, Tensor], counts: TokenCounts | None, previous_tokens: Tensor | None,
                 penalize: Callable[..., None] = penalize_rows):
        self.parts = parts  # HostRules' non-empty parts by name, int64 / float32 views of one device buffer
        self.counts = counts
        self.previous_tokens = previous_tokens  # [num_prev] int64
        self.penalize = penalize

    def apply(self, logits: Tensor) -> Tensor:
        """`logits` [B, V] (not modified) -> [B, V] float32 with the rules applied.

        vLLM's order but for the masks, which come last: they set -inf, and every other rule keeps
        -inf at -inf, so the result is the same. Then a step whose every row is penalized and none
        biased (the bias comes before the penalties) reads the logits once, penalizing them as it
        writes the float32 rows, instead of a copy and a second pass over it."""
        p = self.parts
        penalized = "penalty_rows" in p
        if penalized and "bias_rows" not in p and p["penalty_rows"].shape[0] == logits.shape[0]:
            x = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            self._penalize(x, source=logits)
        else:
            x = logits.to(torch.float32, copy=True)
            if "bias_rows" in p:
                x.index_put_((p["bias_rows"], p["bias_tokens"]), p["bias_values"], accumulate=True)
            if penalized:
                self._penalize(x)
        if "allowed_rows" in p:
            keep = torch.zeros(p["allowed_rows"].shape[0], x.shape[1], dtype=torch.bool, device=x.device)  # [A, V]
            keep[p["allowed_entry_rows"], p["allowed_tokens"]] = True
            x[p["allowed_rows"]] = x[p["allowed_rows"]].masked_fill(~keep, -torch.inf)
        if "ban_rows" in p:
            _ban(x, p["ban_rows"], p["ban_tokens"], torch.full(p["ban_rows"].shape, -torch.inf, device=x.device))
        if "cond_rows" in p:
            hit = self.previous_tokens[p["cond_sources"]] == p["cond_required"]  # [M]
            _ban(x, p["cond_rows"], p["cond_tokens"], torch.where(hit, -torch.inf, torch.inf))
        return x

    def _penalize(self, x: Tensor, source: Tensor | None = None) -> None:
        p = self.parts
        self.penalize(x, p["penalty_rows"], self.counts.slab, p["penalty_slots"], p["repetition"], p["frequency"],
                      p["presence"], source=source)

    def record(self, tokens: Tensor) -> None:
        """Count the step's sampled `tokens` [B] int64 in the penalized rows' slots."""
        if "penalty_rows" in self.parts:
            self.counts.record(self.parts["penalty_slots"], tokens[self.parts["penalty_rows"]])
