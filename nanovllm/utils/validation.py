"""Argument checks shared by the user-facing settings (Config, SamplingParams): a bad value
raises TypeError/ValueError naming it, never an assert."""

from __future__ import annotations


def check_int(name: str, value: object, minimum: int | None = None) -> None:
    """value must be an int (a bool is not one) and, when minimum is given, at least minimum."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def check_pow2(name: str, value: object, minimum: int = 1, maximum: int | None = None) -> None:
    """value must be an int (not a bool) and a power of two >= minimum (and <= maximum when given)."""
    check_int(name, value)
    if value < minimum or value & (value - 1) or (maximum is not None and value > maximum):
        bounds = f" in [{minimum}, {maximum}]" if maximum is not None else f" >= {minimum}" if minimum > 1 else ""
        raise ValueError(f"{name} must be a power of two{bounds}, got {value!r}")
