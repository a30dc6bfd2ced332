"""Argument checks shared by the user-facing settings (Config, SamplingParams): a bad value
raises TypeError/ValueError naming it, never an assert."""

from __future__ import annotations


def check_int(name: str, value: object, minimum: int | None = None) -> None:
    """value must be an int (a bool is not one) and, when minimum is given, at least minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
