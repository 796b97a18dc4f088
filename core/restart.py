"""Restart strategies, as in Flink: none, fixed delay, failure rate, exponential backoff.

:func:`supervise` runs a query from its checkpoint and, when it fails, asks the strategy whether
and when to run it again; the engine's recovery makes every restart exactly-once. Built on
tenacity. A strategy that gives up raises :class:`RestartsExhaustedError` naming the strategy
and the last failure; a failure no restart can mend (:data:`UNRESTARTABLE`) is raised at once.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import tenacity

from oncekit.core.errors import (
    AccessError,
    ConfigError,
    FencedError,
    LeaseHeldError,
    LeaseLostError,
    NonDeterministicReplayError,
    OncekitError,
    QueryStuckError,
    ReplayError,
    RestartsExhaustedError,
    as_oncekit_error,
)
from oncekit.core.lease import release_idle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NoRestart:
    """Fail at the first failure."""

    def stop(self) -> Any:
        return tenacity.stop_after_attempt(1)

    def wait(self) -> Any:
        return tenacity.wait_none()


@dataclass(frozen=True)
class FixedDelay:
    """Restart up to ``attempts`` times, ``delay_s`` apart."""

    attempts: int = 3
    delay_s: float = 10.0

    def stop(self) -> Any:
        return tenacity.stop_after_attempt(self.attempts + 1)

    def wait(self) -> Any:
        return tenacity.wait_fixed(self.delay_s)


@dataclass(frozen=True)
class FailureRate:
    """Restart ``delay_s`` after each failure, until more than ``max_failures`` fall within
    ``interval_s``."""

    max_failures: int = 3
    interval_s: float = 300.0
    delay_s: float = 10.0

    def stop(self) -> Any:
        failures: collections.deque[float] = collections.deque()

        def too_many(state: tenacity.RetryCallState) -> bool:
            now = time.monotonic()
            failures.append(now)
            while failures and failures[0] < now - self.interval_s:
                failures.popleft()
            return len(failures) > self.max_failures

        return too_many

    def wait(self) -> Any:
        return tenacity.wait_fixed(self.delay_s)


@dataclass(frozen=True)
class ExponentialBackoff:
    """Restart after ``initial_s``, doubling (``multiplier``) up to ``max_s``; give up after
    ``attempts`` restarts."""

    initial_s: float = 1.0
    max_s: float = 300.0
    multiplier: float = 2.0
    attempts: int = 10

    def stop(self) -> Any:
        return tenacity.stop_after_attempt(self.attempts + 1)

    def wait(self) -> Any:
        return tenacity.wait_exponential(multiplier=self.initial_s, exp_base=self.multiplier, max=self.max_s)


RestartStrategy = NoRestart | FixedDelay | FailureRate | ExponentialBackoff

_KINDS: dict[str, type[Any]] = {
    "none": NoRestart,
    "fixed-delay": FixedDelay,
    "failure-rate": FailureRate,
    "exponential-backoff": ExponentialBackoff,
}


def strategy_from_config(config: Mapping[str, Any]) -> RestartStrategy:
    """A strategy from a config table, e.g. ``{"type": "fixed-delay", "attempts": 3, "delay_s": 5}``."""
    settings = dict(config)
    kind = str(settings.pop("type", "none"))
    if kind not in _KINDS:
        raise ConfigError(f"restart strategy: unknown type {kind!r}; choose one of {', '.join(_KINDS)}")
    try:
        strategy: RestartStrategy = _KINDS[kind](**settings)
    except TypeError as exc:
        raise ConfigError(f"restart strategy {kind}: {exc}") from exc
    return strategy


# Failures no restart can mend: the next attempt would fail the same way (a refused password or
# certificate, a pipeline that replays differently), or cannot start at all (a stuck query that
# Spark still holds), so they stop at once. ConfigError is not among them: a broker still
# starting can answer metadata without a topic that exists.
UNRESTARTABLE: tuple[type[OncekitError], ...] = (AccessError, FencedError, LeaseHeldError, LeaseLostError,
                                                 NonDeterministicReplayError,
                                                 QueryStuckError, ReplayError)


def restartable(error: BaseException) -> bool:
    """Whether a restart may mend ``error`` (a kit error raised in a Python worker counts as its
    class: :func:`~oncekit.core.errors.as_oncekit_error`)."""
    return isinstance(error, Exception) and not isinstance(as_oncekit_error(error), UNRESTARTABLE)


SUPERSEDED: tuple[type[OncekitError], ...] = (FencedError, LeaseHeldError, LeaseLostError)
"""Failures that say another driver runs the query now: a standby that meets one waits again."""


def superseded(error: BaseException) -> bool:
    """Whether ``error`` says another driver runs the query now (raised here, or in a Python
    worker: :func:`~oncekit.core.errors.as_oncekit_error`)."""
    return isinstance(as_oncekit_error(error), SUPERSEDED)


def supervise(run: Callable[[], None], strategy: RestartStrategy,
              on_restart: Callable[[int, BaseException], None] | None = None) -> int:
    """Call ``run`` (start the query from its checkpoint and wait for it) until it returns, as
    ``strategy`` allows. Called in the user's driver process.

    :param run: starts the query and waits for it (``start_query(...).await_termination()``).
    :param strategy: when to start it again after a restartable error: :class:`NoRestart`,
        :class:`FixedDelay`, :class:`FailureRate` or :class:`ExponentialBackoff`.
    :param on_restart: called with the restart's number and the error, before each restart.
    :returns: how many restarts it took.
    :raises RestartsExhaustedError: the strategy gave up (the last error is its cause); an error
        that no restart mends (a run another driver superseded, a replay that differs from what
        was written, access refused: ``UNRESTARTABLE``) is raised at once."""
    restarts = 0

    def before_sleep(state: tenacity.RetryCallState) -> None:
        nonlocal restarts
        restarts += 1
        error = state.outcome.exception() if state.outcome else None
        logger.warning("query failed (%s); restart %s in %.1f s under %s", error, restarts,
                       state.upcoming_sleep, strategy)
        if on_restart is not None and error is not None:
            on_restart(restarts, error)

    retrying = tenacity.Retrying(stop=strategy.stop(), wait=strategy.wait(), before_sleep=before_sleep,
                                 retry=tenacity.retry_if_exception(restartable), reraise=False)
    try:
        retrying(run)
    except tenacity.RetryError as exc:
        release_idle()  # the query will not start again here: let a standby take over now
        last = exc.last_attempt.exception()
        raise RestartsExhaustedError(f"{strategy} gave up after {restarts} restarts: {last}") from last
    except BaseException:
        release_idle()
        raise
    return restarts
