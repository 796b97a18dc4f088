"""Deadlines the kit owns, for calls into client libraries that may not honour their own.

A native call that ignores its timeout cannot be interrupted from Python. :func:`bounded` runs
it on a helper thread and stops waiting at the deadline: the caller gets a :class:`StallError`
naming the step, so Spark fails the task (or the driver its commit) and the retry or restart
takes over, while the helper thread stays behind until the call returns on its own. Whatever
the call was using (a producer, a connection) must then be dropped, never reused.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from oncekit.core import parallel
from oncekit.core.errors import StallError

T = TypeVar("T")
logger = logging.getLogger(__name__)


STUCK_CAP = 8
"""Calls past their deadline and still running that one process may hold before
:func:`exit_if_stuck` ends it."""
STUCK_EXIT_CODE = 75
"""A Python worker's exit status when it leaves for its stuck calls (EX_TEMPFAIL)."""

_stuck_lock = threading.Lock()
_stuck = 0


def stuck_calls() -> int:
    """Calls of this process that outlived their deadline and have not returned yet."""
    with _stuck_lock:
        return _stuck


def exit_if_stuck(where: str) -> None:
    """A task's start in a Python worker (the stream writer's ``write``), before it writes
    anything: if this process holds :data:`STUCK_CAP` stuck calls (each a thread, maybe a
    client with its sockets and queued records), exit, so that Spark fails this attempt and
    runs it in a new worker. Never called on the driver."""
    held = stuck_calls()
    if held >= STUCK_CAP:
        logger.error("%s: this Python worker holds %s calls stuck past their deadline; it exits (status %s) so "
                     "that Spark runs the task in a new worker", where, held, STUCK_EXIT_CODE)
        logging.shutdown()
        os._exit(STUCK_EXIT_CODE)


_ANSWERED = threading.Event()
_ANSWERED.set()
"""The event of every call run inline: answered before anyone waits."""


class Pending(Generic[T]):
    """A call running on a daemon thread of its own (about 0.1 ms each: a pool's threads are
    joined when the interpreter exits, and a stuck one would hold the process; a pool would
    also queue a call behind stuck ones). Made by :func:`begin`. A call whose waiter gave up
    counts in :func:`stuck_calls` until it returns."""

    def __init__(self, what: str, call: Callable[..., T], *args: Any) -> None:
        self.what = what
        self._outcome: list[Any] = []
        self._abandoned = False
        if parallel.inline():  # no threads (the simulation): the call runs now, and its model never hangs
            self._done = _ANSWERED
            self._run(call, *args)
            return
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(call, *args), name=f"oncekit-bounded {what[:60]}", daemon=True).start()

    def _run(self, call: Callable[..., T], *args: Any) -> None:
        global _stuck
        try:
            self._outcome.append((True, call(*args)))
        except BaseException as exc:  # handed to the waiting thread
            self._outcome.append((False, exc))
        if self._done is _ANSWERED:
            return  # run inline: nobody waits, nothing is stuck
        with _stuck_lock:
            self._done.set()
            if self._abandoned:
                _stuck -= 1

    def result(self, seconds: float) -> T:
        """The call's result or exception, if it comes within ``seconds`` from now; else
        StallError "``what`` waited ``seconds`` s" (which says when this process will exit
        for the calls it holds)."""
        global _stuck
        if self._done is not _ANSWERED and not self._done.wait(seconds):
            with _stuck_lock:  # the call may return meanwhile: then its outcome is taken below
                if not self._done.is_set():
                    if not self._abandoned:
                        self._abandoned = True
                        _stuck += 1
                    leaving = (f"; this process holds {_stuck} stuck calls and exits at its next task"
                               if _stuck >= STUCK_CAP else "")
                    raise StallError(f"{self.what} waited {seconds:.0f} s without an answer{leaving}")
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
