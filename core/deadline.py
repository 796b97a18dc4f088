"""Deadlines the kit owns, for calls into client libraries that may not honour their own.

A native call that ignores its timeout cannot be interrupted from Python. :func:`bounded` runs
it on a helper thread and stops waiting at the deadline: the caller gets a :class:`StallError`
naming the step, so Spark fails the task (or the driver its commit) and the retry or restart
takes over, while the helper thread stays behind until the call returns on its own. Whatever
the call was using (a producer, a connection) must then be dropped, never reused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from oncekit.core.errors import StallError

T = TypeVar("T")


def bounded(what: str, seconds: float, call: Callable[..., T], *args: Any) -> T:
    """``call(*args)``'s result or exception, if it comes within ``seconds``; else StallError
    "``what`` waited ``seconds`` s". ``what`` names sink, batch, partition and the step.

    A daemon thread per call (about 0.1 ms): a pool's threads are joined when the interpreter
    exits, and a stuck one would hold the process."""
    outcome: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, call(*args)))
        except BaseException as exc:  # handed to the waiting thread
            outcome.append((False, exc))
        done.set()

    threading.Thread(target=run, name=f"oncekit-bounded {what[:60]}", daemon=True).start()
    if not done.wait(seconds):
        raise StallError(f"{what} waited {seconds:.0f} s without an answer")
    ok, value = outcome[0]
    if ok:
        return value  # type: ignore[no-any-return]
    raise value
