"""The demo's throughput breakdown (:class:`oncekit.reference.demo.Timeline`) from query progress
as Spark reports it, without Spark."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

import pytest

from oncekit.reference.demo import Timeline, batch_size, demo_workload
from oncekit.reference.generator import events

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()


def batch(at: float, seconds: float, rows: int) -> dict[str, Any]:
    stamp = datetime.fromtimestamp(T0 + at, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return {"timestamp": stamp, "numInputRows": rows, "durationMs": {"triggerExecution": int(seconds * 1000)}}


def test_phases_of_a_run_with_one_restart() -> None:
    # start at 0; first batch 5-25 s; second 25-30 s; crash at 40 s; restarted batches from 43 s
    timeline = Timeline(T0, ended=T0 + 60, failures=[T0 + 40],
                        attempts=[[batch(5, 20, 100), batch(25, 5, 200)], [batch(43, 10, 300), batch(53, 5, 400)]])
    phases = {name: (seconds, rows) for name, seconds, rows in timeline.phases()}
    assert phases["start-up"] == (pytest.approx(5), 0)
    assert phases["first batch"] == (pytest.approx(20), 100)
    assert phases["steady state"] == (pytest.approx(20), 900)
    assert phases["restart"] == (pytest.approx(3), 0)
    assert phases["other"] == (pytest.approx(12), 0)  # the crashed batch and the rest
    assert sum(seconds for seconds, _ in phases.values()) == pytest.approx(60)
    assert "steady state 20.0 s (900 records, 45/s)" in timeline.text()


def test_no_batch_is_all_other() -> None:
    assert Timeline(T0, ended=T0 + 7).phases() == [("other", pytest.approx(7), 0)]


@pytest.mark.parametrize("records", [2_000, 20_000, 200_000])
def test_the_demo_runs_four_batches_upstream_duplicates_included(records: int) -> None:
    # The crash at batch 1 falls mid-run, and no fifth batch of a few records costs a batch's
    # fixed time (the default workload's 1% upstream duplicates made one of 2,004 records).
    workload = demo_workload(records)
    sent = sum(1 for _ in events(workload))
    assert math.ceil(sent / batch_size(workload)) == 4
