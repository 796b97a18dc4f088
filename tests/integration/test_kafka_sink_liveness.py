"""Liveness of the Kafka sinks' task and publish paths and of the source's planner after a broker
restart, without Spark: a client that lived through the outage (pooled by an earlier task or
trigger) serves the next batch. It must commit (or plan), or fail with an error that names the
step, within a bound; never wait without end. Output is read with read_committed and compared
as a multiset."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from oncekit.connectors import Services
from oncekit.connectors.kafka_admin import create_topic
from oncekit.core.protocol import Committable, TaskInfo
from oncekit.sinks.kafka import KafkaTransactionalSink, KafkaWriteAheadSink, kafka_sink
from oncekit.sources.kafka import KafkaSourceOptions, watermarks
from oncekit.verify.io import read_committed

pytestmark = pytest.mark.services

BOUND_S = 120.0  # a broker back within seconds; the kit's own deadlines are shorter than this
PLAN_BOUND_S = 12.0  # the planner runs every trigger: a broker that is back is found within seconds


def batch_of(batch_id: int, rows: int = 500) -> list[pa.RecordBatch]:
    return [pa.record_batch([pa.array([f"{batch_id}-{i}" for i in range(rows)]).cast(pa.binary())], names=["value"])]


def within_bound(call: Callable[[], Any]) -> Any:
    """``call``'s result; fails the test if it has not returned within BOUND_S (the call's thread
    is left behind: a native wait cannot be interrupted)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    if thread.is_alive():
        pytest.fail(f"stalled: no return and no error within {BOUND_S:.0f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def new_sink(services: Services, topic: str, protocol: str, tmp_path: Path, **options: Any) -> Any:
    """A Kafka sink of ``protocol`` into a new two-partition ``topic``, past its preflight."""
    create_topic(services.kafka.config, topic, partitions=2)
    sink = kafka_sink(services.kafka.bootstrap_servers, topic, protocol, **options).build(str(tmp_path))
    sink.preflight()
    return sink


def test_transactional_task_after_broker_restart_commits_within_bound(services: Services, tmp_path: Path) -> None:
    kafka = services.kafka.config
    sink: KafkaTransactionalSink = new_sink(services, "liveness-transactional", "transactional", tmp_path)
    config = sink.config
    sink.write_partition(TaskInfo(config.sink_id, 0, 0, 1), iter(batch_of(0)))  # pools the producer
    services.kafka.outage("stop", 3.0)
    within_bound(lambda: sink.write_partition(TaskInfo(config.sink_id, 1, 0, 2), iter(batch_of(1))))
    within_bound(lambda: sink.write_partition(TaskInfo(config.sink_id, 1, 0, 3), iter(batch_of(1))))  # a replay
    want = Counter(v.as_py() for b in (*batch_of(0), *batch_of(1)) for v in b.column(0))
    assert Counter(read_committed(kafka, config.topic, sum(want.values()))) == want


def staged(sink: KafkaWriteAheadSink, batch_id: int) -> list[Committable]:
    batches: Iterator[pa.RecordBatch] = iter(batch_of(batch_id))
    return sink.write_partition(TaskInfo(sink.sink_id, batch_id, 0, batch_id + 1), batches)


def test_write_ahead_publish_after_broker_restart_commits_within_bound(services: Services, tmp_path: Path) -> None:
    kafka = services.kafka.config
    sink: KafkaWriteAheadSink = new_sink(services, "liveness-write-ahead", "write-ahead-log", tmp_path)
    config = sink.config
    sink.commit_batch(0, staged(sink, 0))  # pools the publisher
    services.kafka.outage("stop", 3.0)
    committables = staged(sink, 1)
    within_bound(lambda: sink.commit_batch(1, committables))
    within_bound(lambda: sink.commit_batch(1, committables))  # a repeated notification
    want = Counter(v.as_py() for b in (*batch_of(0), *batch_of(1)) for v in b.column(0))
    assert Counter(read_committed(kafka, config.topic, sum(want.values()))) == want


def test_transactional_task_whose_input_is_slower_than_the_transaction_timeout_commits(
        services: Services, tmp_path: Path) -> None:
    """An expensive upstream (or a catch-up batch after downtime) can deliver a partition more
    slowly than a transaction may stay open: the coordinator would abort it, and every retry
    would compute the same slow input again. Here the timeout is 6 s and the input takes 15 s."""
    kafka = services.kafka.config
    sink = new_sink(services, "liveness-slow-input", "transactional", tmp_path, transaction_timeout_ms=6_000)
    config = sink.config
    parts = [batch_of(i, rows=100)[0] for i in range(6)]

    def slow() -> Iterator[pa.RecordBatch]:
        for part in parts:
            yield part
            time.sleep(2.5)

    within_bound(lambda: sink.write_partition(TaskInfo(config.sink_id, 0, 0, 1), slow()))
    want = Counter(v.as_py() for b in parts for v in b.column(0))
    assert Counter(read_committed(kafka, config.topic, sum(want.values()))) == want


def test_source_planner_after_broker_restart_plans_within_bound(services: Services) -> None:
    """The driver-side planner asks for the partitions' watermarks at every trigger, on a pooled
    consumer. One that lived through a 3 s broker stop answered 19-20 s after the broker was
    back: a connection attempt made during the outage hung until librdkafka's 30 s setup
    timeout, and in the soak a call in flight failed the query 30 s after every broker stop."""
    create_topic(services.kafka.config, "liveness-source", partitions=2)
    options = KafkaSourceOptions.parse({"kafka.bootstrap.servers": services.kafka.bootstrap_servers,
                                        "subscribe": "liveness-source"})
    watermarks(options)  # pools the consumer
    services.kafka.outage("stop", 3.0)  # returns once the broker is back and ready
    back = time.monotonic()
    marks = within_bound(lambda: watermarks(options))
    waited = time.monotonic() - back
    assert waited < PLAN_BOUND_S, f"planned {waited:.1f} s after the broker was back (bound {PLAN_BOUND_S:.0f} s)"
    assert set(marks) == {("liveness-source", 0), ("liveness-source", 1)}
