"""Liveness under a stall: a task that never returns (held at a crash point, as a native call
that ignores its timeout would hold it) must not stop the pipeline for good. The batch
watchdog stops the query with a StallError naming the batch within the batch timeout, records
the stall beside the checkpoint, and the restart is exactly-once (multiset equality)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from oncekit.connectors import KafkaConfig
from oncekit.core.crash import arm, fired
from oncekit.core.errors import StallError
from oncekit.core.restart import FixedDelay, supervise
from oncekit.core.spark.query import Trigger, start_query
from oncekit.core.stalls import StallLog
from oncekit.sinks.kafka import kafka_sink
from oncekit.verify import compare
from tests.eos.pipeline import COUNT, PER_BATCH, integers, produce_input, read_committed

pytestmark = [pytest.mark.services, pytest.mark.spark]

TIMEOUT_S = 20.0


def test_task_that_never_returns_fails_query_with_stall_error_and_restart_is_exactly_once(
    spark: Any, kafka: KafkaConfig, topic: str, tmp_path: Path, crash_dir: Path,
) -> None:
    expected = produce_input(kafka, topic, COUNT)
    out = f"{topic}-out"
    sink = kafka_sink(kafka.bootstrap_servers, out, "transactional")
    checkpoint = str(tmp_path / "checkpoint")
    arm(crash_dir, "task_before_write", batch_id=1, hold=True)  # never released

    def run() -> None:
        frame = integers(spark, kafka, topic, PER_BATCH).selectExpr("CAST(id AS STRING) AS value")
        start_query(frame, sink, checkpoint, trigger=Trigger(available_now=True), batch_timeout=TIMEOUT_S).await_termination()

    started = time.monotonic()
    with pytest.raises(StallError, match=rf"batch 1: planned and not committed after \d+ s \(batch timeout 20 s\)"):
        run()
    assert time.monotonic() - started < TIMEOUT_S + 60  # the timeout, plus Spark's start and stop
    assert fired(crash_dir) == ["task_before_write"]
    total, recent = StallLog(checkpoint).read()
    assert total == 1 and recent[0].batch == 1

    assert supervise(run, FixedDelay(attempts=1, delay_s=0.1)) == 0
    verdict = compare(expected, [int(v) for v in read_committed(kafka, out, COUNT, timeout_s=60)])
    assert verdict.exactly_once, verdict.summary()
