"""One value of a ContextVar for the length of a `with` block: set on entry, reset on exit, also
when the block raises. The construction-time settings (quantization, kernel routes, tensor-parallel
layout) and the per-forward attention metadata are passed this way, never as bare globals."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TypeVar

_T = TypeVar("_T")


@contextlib.contextmanager
def scoped(var: ContextVar[_T], value: _T) -> Iterator[_T]:
    """`var` holds `value` inside the block (which receives it); its previous value after."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
