"""The soak's gauges read PostgreSQL and Kafka while the soak restarts them: found in a clean-clone
run (seed 249586), where a sample's marker-row count met PostgreSQL mid-restart ("server closed
the connection unexpectedly") and the soak ended in that error instead of reading again."""

from __future__ import annotations

import psycopg
import pytest

from oncekit.verify.soak import when_reachable


def test_a_gauge_is_read_again_while_its_service_is_restarting() -> None:
    answers: list[object] = [psycopg.OperationalError("server closed the connection unexpectedly"),
                             psycopg.OperationalError("connection refused"), 7]

    def read() -> int:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return int(answer)  # type: ignore[call-overload]

    assert when_reachable(read, wait_s=5, pause_s=0.01) == 7


def test_a_gauge_whose_service_stays_down_raises_its_error() -> None:
    def read() -> int:
        raise psycopg.OperationalError("connection refused")

    with pytest.raises(psycopg.OperationalError, match="refused"):
        when_reachable(read, wait_s=0.05, pause_s=0.01)
