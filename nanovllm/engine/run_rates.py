"""Token rates averaged over a whole generate() run, as its progress bar shows them: every prompt
token computed and every token generated so far over the time since the run started (not the last
step's rate, which swings with each step's kind and size)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunRates:
    start: float  # time.perf_counter() when the run started
    prompt_tokens: int = 0
    output_tokens: int = 0

    def add(self, prompt_tokens: int, output_tokens: int) -> None:
        """Count one step's computed prompt tokens and kept generated tokens."""
        self.prompt_tokens += prompt_tokens
        self.output_tokens += output_tokens

    def postfix(self, now: float) -> dict[str, str]:
        """The bar's postfix at time `now`: input and output tokens per second since the start."""
        elapsed = max(now - self.start, 1e-9)
        return {"in tok/s": f"{self.prompt_tokens / elapsed:.0f}", "out tok/s": f"{self.output_tokens / elapsed:.0f}"}
