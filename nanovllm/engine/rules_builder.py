"""Each step's logits rules (sampling/logits_rules.py) from its sampled sequences' RequestRules, and
the TokenCounts slots of the sequences that use penalties.

A penalized sequence takes a slot the first time it is sampled (its prompt then complete, every
token on the host) and keeps it, across preemptions, until the engine releases it (finished or
aborted). Only rules that depend on the last generated tokens need them on the host each step: bad
words longer than one token, and min_tokens (which needs only the count, known from the position).
Under overlap scheduling a decode row's last token may still be on the device: a bad word whose
last prefix token is that one becomes a conditional ban, checked on the device.
"""

from __future__ import annotations

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.kernel_path import uses_triton
from nanovllm.sampling.logits_rules import HostRules, StepRules
from nanovllm.sampling.penalties import TokenCounts, penalize_rows


class RulesBuilder:
    def __init__(self, vocab_size: int, device: torch.device):
        self.counts = TokenCounts(vocab_size, device)
        # The penalties' implementation of the device (kernel_path's rule): Triton on CUDA.
        self.penalize = penalize_rows
        if uses_triton(device):
            from nanovllm.sampling.penalties_kernel import penalize_rows as triton_penalize_rows

            self.penalize = triton_penalize_rows
        self._free_slots: list[int] = []
        self._num_slots = 0  # slots handed out so far (free ones included)
        # Sequences with rules admitted and not yet released: while 0, a step's rows are not even
        # looked at (the common case pays one comparison a step).
        self._num_live = 0

    def admit(self, seqs: list[Sequence]) -> None:
        """Count the queued `seqs` that have rules (a request's samples, when it is added)."""
        self._num_live += sum(seq.rules is not None for seq in seqs)

    def upload(self, host: HostRules, previous_tokens: torch.Tensor | None) -> StepRules:
        """A step's rules (`build`) on the device, in one copy; `previous_tokens`: the previous step's
        samples on the device (the carried rows' inputs)."""
        return host.to_device(self.counts.device, self.counts, previous_tokens, self.penalize)

    def build(self, seqs: list[Sequence], positions: list[int], carried_rows: list[int]) -> HostRules | None:
        """The rules of a step sampling `seqs` (in row order) at `positions` (each sampled token's
        position); rows [0, len(carried_rows)) have their input in flight, at those rows of the
        previous step's samples. None when no row uses a rule (no work at all)."""
        if not self._num_live:
            return None
        rows = [i for i, seq in enumerate(seqs) if seq.rules is not None]
        if not rows:
            return None
        host = HostRules()
        for i in rows:
            seq = seqs[i]
            rules = seq.rules
            if rules.penalties_only and seq.counts_slot is not None:  # the steady state: a slot and values
                self._penalize(host, seq, i, False)
                continue
            generated = positions[i] - seq.num_prompt_tokens  # tokens generated before this one
            source = carried_rows[i] if i < len(carried_rows) else None
            if rules.allowed is not None:
                host.allowed_entry_rows.extend([len(host.allowed_rows)] * len(rules.allowed))
                host.allowed_rows.append(i)
                host.allowed_tokens.extend(rules.allowed)
            bans = list(rules.single_bans)
            if generated < rules.min_tokens:
                bans.extend(rules.stop_ids)
            for word in rules.bad_sequences:
                self._bad_word(host, bans, seq, i, word, generated, source)
            host.ban_rows.extend([i] * len(bans))
            host.ban_tokens.extend(bans)
            for token, bias in rules.bias:
                host.bias_rows.append(i)
                host.bias_tokens.append(token)
                host.bias_values.append(bias)
            if rules.penalties is not None:
                self._penalize(host, seq, i, source is not None)
        return host

    @staticmethod
    def _bad_word(host: HostRules, bans: list[int], seq: Sequence, row: int, word: tuple[int, ...],
                  generated: int, source: int | None) -> None:
        """Ban `word`'s last token where its other tokens end the generated ones (vLLM's rule)."""
        prefix = list(word[:-1])
        if generated < len(prefix):
            return
        if source is None:  # every generated token is on the host
            if seq.token_ids[len(seq) - len(prefix):] == prefix:
                bans.append(word[-1])
            return
        # the last generated token is the row's input, in flight: match the rest here, it on the device
        known = prefix[:-1]
        if not known or seq.token_ids[len(seq) - len(known):] == known:
            host.cond_rows.append(row)
            host.cond_tokens.append(word[-1])
            host.cond_sources.append(source)
            host.cond_required.append(prefix[-1])

    def _penalize(self, host: HostRules, seq: Sequence, row: int, in_flight: bool) -> None:
        if seq.counts_slot is None:
            if in_flight:
                raise RuntimeError(f"sequence {seq.seq_id} is penalized from a step whose input is in flight: "
                                   "its counts would miss that token")
            seq.counts_slot = self._take_slot()
            index = len(host.reset_slots)
            host.reset_slots.append(seq.counts_slot)
            host.reset_prompt_slots.extend([index] * seq.num_prompt_tokens)
            host.reset_prompt_tokens.extend(seq.token_ids[: seq.num_prompt_tokens])
            generated = seq.token_ids[seq.num_prompt_tokens:]  # none at a first sampling
            host.reset_output_slots.extend([index] * len(generated))
            host.reset_output_tokens.extend(generated)
        repetition, frequency, presence = seq.rules.penalties
        host.penalty_rows.append(row)
        host.penalty_slots.append(seq.counts_slot)
        host.repetition.append(repetition)
        host.frequency.append(frequency)
        host.presence.append(presence)

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._num_slots += 1
        self.counts.ensure(self._num_slots)
        return self._num_slots - 1

    def release(self, seqs: list[Sequence]) -> None:
        """Give back the slots of `seqs` (finished or aborted sequences, each released once)."""
        self._num_live -= sum(seq.rules is not None for seq in seqs)
        for seq in seqs:
            if seq.counts_slot is not None:
                self._free_slots.append(seq.counts_slot)
                seq.counts_slot = None

    def reset(self) -> None:
        """Every slot free (after abort_all: no sequence holds one any more)."""
        self._free_slots = list(range(self._num_slots))
        self._num_live = 0
