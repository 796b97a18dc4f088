"""Calls side by side: on threads of their own in a driver or a task (each waits on its own
service's round trips), one after the other where threads cannot run (the deterministic
simulation of overlapping drivers runs every actor in a greenlet of one thread, and orders
their steps itself: :func:`run_inline`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_inline = False


def run_inline(inline: bool) -> None:
    """From now on, run side-by-side calls one after the other (the simulation)."""
    global _inline
    _inline = inline


def inline() -> bool:
    """Whether side-by-side calls run one after the other."""
    return _inline


def side_by_side(calls: Sequence[Callable[[], T]], name: str) -> list[T]:
    """Every call's result, in order, once all have returned; the first call's error in that
    order, raised once all have returned."""
    if _inline or len(calls) < 2:
        return [call() for call in calls]
    with ThreadPoolExecutor(len(calls), thread_name_prefix=name) as pool:
        futures = [pool.submit(call) for call in calls]
    return [future.result() for future in futures]
