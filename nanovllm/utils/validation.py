"""Argument checks shared by the user-facing settings (Config, SamplingParams, BeamSearchParams,
StructuredOutputsParams, the engine's calls) and inputs (prompt texts): a bad value raises
TypeError/ValueError naming it, never an assert. `name` is the value's name as the message shows it
(e.g. "SamplingParams.top_p"). A bool is never taken as a number, nor a number as a bool.
"""

from __future__ import annotations

import math
import numbers

# Seeds are 64-bit (noise keys mix them modulo 2**64: a larger one would alias a smaller one's tokens).
SEED_LIMIT = 2**64

# Types passed through as they are without the numbers ABCs' checks (~1 us each, and a request's
# params are checked field by field when it is added: the host's cost per request).
_AS_IS_TYPES = frozenset({bool, int, float, str, type(None), list, tuple, dict})


def plain_number(value: object) -> object:
    """A NumPy (or other numbers.Integral / numbers.Real) scalar as a Python int / float, as vLLM takes
    them (data-synthesis scripts draw max_tokens, seeds and top_p with NumPy); anything else as is."""
    if type(value) in _AS_IS_TYPES:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def is_unset(value: object) -> bool:
    """Whether an optional argument sets nothing: None, or an empty dict / list / tuple. Anything else
    (an array or a tensor too, which have no truth value) is set, for the caller to check."""
    return value is None or (isinstance(value, (dict, list, tuple)) and not value)


def is_zero(value: object) -> bool:
    """Whether value is a number equal to 0 (a NumPy one too; an array, which has no truth value, is not)."""
    value = plain_number(value)
    return isinstance(value, (int, float)) and value == 0


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


def check_number(name: str, value: object) -> None:
    """value must be an int or a float (a bool is not one); NaN and infinities pass (the caller's range says)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")


def check_float(name: str, value: object) -> None:
    """value must be an int or a float (a bool is not one: check_number), and not NaN."""
    check_number(name, value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")


def check_bool(name: str, value: object) -> None:
    """value must be a bool (1 and 0 are not)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_seed(name: str, seed: object) -> None:
    """A seed (a request's, or the engine's): an int in [0, SEED_LIMIT)."""
    check_int(name, seed, 0)
    if seed >= SEED_LIMIT:
        raise ValueError(f"{name} must be < 2**64, got {seed!r}")


def token_id_list(name: str, value: object) -> list[int]:
    """A list (or tuple) of token ids (ints >= 0, NumPy ones taken), as a new list of Python ints."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of token ids, got {value!r}")
    ids = [plain_number(token_id) for token_id in value]
    for token_id in ids:
        check_int(name, token_id, 0)
    return ids


def check_text(name: str, text: str) -> None:
    """`text` (a str) must be valid Unicode: a lone surrogate (e.g. "\\udc80", what decoding bytes with
    errors="surrogateescape" leaves) has no UTF-8 form, which tokenizers and grammar compilers take;
    a ValueError names it and where it is, rather than their own errors about the input's type."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} holds a lone surrogate {text[e.start]!r} at character {e.start}, which is not valid "
                         f"Unicode (it has no UTF-8 form): {text[:80]!r}") from None
