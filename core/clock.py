"""The engine's time, in one place: wall-clock seconds (leases, compared across hosts), a
monotonic clock (intervals in one process) and sleeping. The deterministic simulation of
overlapping drivers (tests/sim) puts a clock of its own here (:func:`use`), so that a lease
expires when the simulation says, not when the machine does."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The machine's clocks."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


_clock: Clock = SystemClock()


def use(clock: Clock) -> Clock:
    """Put ``clock`` in place of the current one; returns the one it replaced."""
    global _clock
    previous, _clock = _clock, clock
    return previous


def now() -> float:
    """Seconds since the Unix epoch (comparable across hosts whose clocks agree)."""
    return _clock.now()


def monotonic() -> float:
    return _clock.monotonic()


def sleep(seconds: float) -> None:
    _clock.sleep(seconds)
