"""A standby driver and a driver that lost its lease (issue 23 item 3), against a real broker:
the standby waits while the active driver runs and takes over once it is killed, exactly once;
a driver whose lease another run took (it was paused past the expiry) stops its query and
journals nothing more."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka import create_topic
from oncekit.core.lease import LEASE, wait_free
from oncekit.core.spark_log import SparkLog
from oncekit.verify import PipelineContext, compare, start_example
from oncekit.verify.driver import DriverProcess
from tests.eos.pipeline import COUNT, produce_input, read_committed

pytestmark = [pytest.mark.services, pytest.mark.spark]


def output(kafka: KafkaConfig, topic: str, expected: int) -> list[int]:
    return [int(v) for v in read_committed(kafka, topic, expected, timeout_s=60)]


def test_standby_waits_while_the_active_driver_runs_and_takes_over_when_it_is_killed(
    spark: Any, kafka: KafkaConfig, topic: str, tmp_path: Path, crash_dir: Path,
) -> None:
    expected = produce_input(kafka, topic, COUNT)
    out = f"{topic}-out"
    create_topic(kafka, out, partitions=2)
    ctx = PipelineContext(kafka.bootstrap_servers, topic, out, str(tmp_path / "checkpoint"))
    active = DriverProcess("kafka-transactional", ctx, str(crash_dir), tmp_path / "active.log", {})
    try:
        active.ensure_running()
        standby = threading.Thread(target=wait_free, args=([ctx.checkpoint],), daemon=True)
        standby.start()
        standby.join(5)
        assert standby.is_alive(), "the standby took over while the active driver ran"
        active.kill()
        killed = time.monotonic()
        standby.join(30)
        assert not standby.is_alive(), "the standby did not take over within 30 s of the kill"
        took = time.monotonic() - killed
    finally:
        active.kill()
    query = start_example("kafka-transactional", spark, dataclasses.replace(ctx, trigger={"availableNow": True}))
    query.await_termination()
    verdict = compare(expected, output(kafka, out, len(expected)))
    assert verdict.exactly_once, verdict.summary()
    assert took < 5, f"the standby took {took:.1f} s to see the killed driver's lease void"


def test_a_driver_whose_lease_another_run_took_stops_and_journals_nothing_more(
    spark: Any, kafka: KafkaConfig, topic: str, tmp_path: Path,
) -> None:
    produce_input(kafka, topic, COUNT)
    out = f"{topic}-out"
    create_topic(kafka, out, partitions=2)
    ctx = PipelineContext(kafka.bootstrap_servers, topic, out, str(tmp_path / "checkpoint"),
                          trigger={"processingTime": "1 second"}, max_offsets_per_trigger=50)
    query = start_example("kafka-transactional", spark, ctx)
    spark_log = SparkLog(ctx.checkpoint)
    deadline = time.monotonic() + 120
    def committed() -> int:
        latest = spark_log.latest_completed()
        return -1 if latest is None else latest

    while committed() < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert committed() >= 1, "the query committed no batch"
    # A standby on another host takes the lease over, as if this driver had been paused past its expiry.
    (Path(ctx.checkpoint) / LEASE).write_text(json.dumps(
        {"host": "standby-host", "pid": 1, "process": "standby", "renewed_at": time.time() + 60, "run": "standby"}))
    taken = committed()
    with pytest.raises(Exception, match="lease is held by another driver"):
        query.await_termination(60)
        raise AssertionError("the query went on after losing its lease")
    assert committed() <= taken + 1  # at most the batch in flight at the takeover
