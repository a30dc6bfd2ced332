"""Argument checks shared by the user-facing settings (Config, SamplingParams) and inputs (prompt
texts): a bad value raises TypeError/ValueError naming it, never an assert."""

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


def check_text(name: str, text: str) -> None:
    """`text` (a str) must be valid Unicode: a lone surrogate (e.g. "\\udc80", what decoding bytes with
    errors="surrogateescape" leaves) has no UTF-8 form, which tokenizers and grammar compilers take;
    a ValueError names it and where it is, rather than their own errors about the input's type."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} holds a lone surrogate {text[e.start]!r} at character {e.start}, which is not valid "
                         f"Unicode (it has no UTF-8 form): {text[:80]!r}") from None
