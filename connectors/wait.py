"""Polling until an external system is ready: the one loop that service start-up and admin calls
(a new topic reaching every broker's metadata) share."""

from __future__ import annotations

from collections.abc import Callable

from oncekit.core import clock
from oncekit.core.errors import AccessError, ServiceError


def wait_until(check: Callable[[], None], timeout_s: float, what: str) -> None:
    """Call ``check`` until it returns without raising, or raise ServiceError after ``timeout_s``.

    The last failure is named in the error, so a start-up that never gets ready says why. An
    AccessError (credentials or certificate refused) is raised at once.
    """
    deadline = clock.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except AccessError:
            raise  # a wrong password or an untrusted certificate stays wrong
        except Exception as exc:
            if clock.monotonic() >= deadline:
                raise ServiceError(f"{what} not ready after {timeout_s:.0f} s: {exc}") from exc
            clock.sleep(0.5)
