from __future__ import annotations

from collections.abc import Callable

import pytest

from oncekit.core.errors import ConfigError, NonDeterministicReplayError
from oncekit.core.restart import (
    ExponentialBackoff,
    FailureRate,
    FixedDelay,
    NoRestart,
    RestartsExhaustedError,
    strategy_from_config,
    supervise,
)


def failing(times: int) -> tuple[list[int], Callable[[], None]]:
    calls: list[int] = []

    def run() -> None:
        calls.append(1)
        if len(calls) <= times:
            raise RuntimeError(f"crash {len(calls)}")

    return calls, run


def test_no_restart_gives_up_at_first_failure() -> None:
    calls, run = failing(1)
    with pytest.raises(RestartsExhaustedError, match="crash 1") as failure:
        supervise(run, NoRestart())
    assert len(calls) == 1 and isinstance(failure.value.__cause__, RuntimeError)


def test_fixed_delay_restarts_until_success_within_attempts() -> None:
    calls, run = failing(2)
    assert supervise(run, FixedDelay(attempts=2, delay_s=0)) == 2
    assert len(calls) == 3


def test_fixed_delay_gives_up_after_attempts() -> None:
    calls, run = failing(5)
    with pytest.raises(RestartsExhaustedError, match="after 2 restarts"):
        supervise(run, FixedDelay(attempts=2, delay_s=0))
    assert len(calls) == 3


def test_failure_rate_stops_when_too_many_failures_in_interval() -> None:
    calls, run = failing(10)
    with pytest.raises(RestartsExhaustedError):
        supervise(run, FailureRate(max_failures=3, interval_s=60, delay_s=0))
    assert len(calls) == 4


def test_failure_rate_continues_when_failures_are_spread_out() -> None:
    calls, run = failing(3)
    assert supervise(run, FailureRate(max_failures=1, interval_s=0.0, delay_s=0.01)) == 3


def test_exponential_backoff_restarts_and_reports_each() -> None:
    calls, run = failing(3)
    seen: list[int] = []
    assert supervise(run, ExponentialBackoff(initial_s=0.001, max_s=0.01, attempts=5),
                     on_restart=lambda n, error: seen.append(n)) == 3
    assert seen == [1, 2, 3]


def test_strategy_from_config_parses_and_names_errors() -> None:
    assert strategy_from_config({"type": "fixed-delay", "attempts": 4, "delay_s": 1}) == FixedDelay(4, 1)
    with pytest.raises(ConfigError, match="unknown type"):
        strategy_from_config({"type": "forever"})
    with pytest.raises(ConfigError, match="fixed-delay"):
        strategy_from_config({"type": "fixed-delay", "tries": 3})


@pytest.mark.parametrize("error", [
    NonDeterministicReplayError("sink s batch 1 partition 0: committed with 3 records, replay has 4"),
    # as a kit error raised in a Python worker reaches the driver: text inside Spark's exception
    RuntimeError("Job aborted ... oncekit.core.errors.AccessError: kafka at h:1: SASL authentication error"),
])
def test_failure_no_restart_can_mend_stops_at_once(error: Exception) -> None:
    calls: list[int] = []

    def run() -> None:
        calls.append(1)
        raise error

    with pytest.raises(type(error)):
        supervise(run, FixedDelay(attempts=5, delay_s=0))
    assert calls == [1]
