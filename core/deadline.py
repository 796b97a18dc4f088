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
from typing import Any, Generic, TypeVar

from oncekit.core.errors import StallError

T = TypeVar("T")


class Pending(Generic[T]):
    """A call running on a daemon thread of its own (about 0.1 ms each: a pool's threads are
    joined when the interpreter exits, and a stuck one would hold the process; a pool would
    also queue a call behind stuck ones). Made by :func:`begin`."""

    def __init__(self, what: str, call: Callable[..., T], *args: Any) -> None:
        self.what = what
        self._outcome: list[Any] = []
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(call, *args), name=f"oncekit-bounded {what[:60]}", daemon=True).start()

    def _run(self, call: Callable[..., T], *args: Any) -> None:
        try:
            self._outcome.append((True, call(*args)))
        except BaseException as exc:  # handed to the waiting thread
            self._outcome.append((False, exc))
        self._done.set()

    def result(self, seconds: float) -> T:
        """The call's result or exception, if it comes within ``seconds`` from now; else
        StallError "``what`` waited ``seconds`` s"."""
        if not self._done.wait(seconds):
            raise StallError(f"{self.what} waited {seconds:.0f} s without an answer")
        ok, value = self._outcome[0]
        if ok:
            return value  # type: ignore[no-any-return]
        raise value


def begin(what: str, call: Callable[..., T], *args: Any) -> Pending[T]:
    """Start ``call(*args)`` now, to be waited for later with :meth:`Pending.result`. ``what``
    names sink, batch, partition and the step."""
    return Pending(what, call, *args)


def bounded(what: str, seconds: float, call: Callable[..., T], *args: Any) -> T:
    """``call(*args)``'s result or exception, if it comes within ``seconds``; else StallError
    "``what`` waited ``seconds`` s". ``what`` names sink, batch, partition and the step."""
    return begin(what, call, *args).result(seconds)
