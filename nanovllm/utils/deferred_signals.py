"""Holding back Python signal handlers over a block that must not stop half-way.

A signal handler (Ctrl-C's KeyboardInterrupt, an alarm's) runs between any two bytecodes of
the main thread. Inside `deferred_signals()` each handler set from Python is swapped for one
that only records the signal; when the block ends the handlers are put back and every
recorded signal is handed to its own handler, so a KeyboardInterrupt is raised right after
the block instead of inside it:

    with deferred_signals():
        workers.send("run", plan)      # Ctrl-C here ...
        runner.queue(prepared)         # ... lets this finish on rank 0 too
    # ... and is raised here

Handlers not set from Python (SIG_DFL, SIG_IGN) are left alone. Only the main thread runs
Python signal handlers, so on any other thread the block runs as it is.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

Handler = Callable[[int, FrameType | None], object]


class _Holder:
    """Stands in for the handlers while held: records each signal. Once released it passes
    signals straight on, so one left installed (a signal that landed while the handlers were
    being put back) acts like the handler it replaced."""

    def __init__(self) -> None:
        self.handlers: dict[int, Handler] = {}
        self.caught: list[tuple[int, FrameType | None]] = []
        self.holding = True

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.holding:
            self.caught.append((signum, frame))
        else:
            self.handlers[signum](signum, frame)

    def release(self) -> None:
        self.holding = False
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        caught, self.caught = self.caught, []
        for signum, frame in caught:
            self.handlers[signum](signum, frame)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Run the block with Python signal handlers held back (module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    holder = _Holder()
    try:
        for signum in signal.valid_signals():
            handler = signal.getsignal(signum)
            if callable(handler):
                holder.handlers[signum] = handler
                signal.signal(signum, holder)
        yield
    finally:
        holder.release()
