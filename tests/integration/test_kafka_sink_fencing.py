"""The transactional Kafka sink's task path on a real broker, without Spark: records streamed into
the transaction part by part, a pooled producer that a newer one has fenced (another Python
worker ran the partition since), an input cut mid-stream, and a replay. Output is read with
read_committed and compared as a multiset."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka_admin import create_topic
from oncekit.core.errors import OncekitError, RecordError, TaskInputCutError
from oncekit.core.names import KafkaTransactionalId
from oncekit.core.protocol import TaskInfo
from oncekit.sinks.kafka import KafkaSinkConfig, KafkaTransactionalSink, kafka_sink
from oncekit.sinks.kafka._common import SinkProducer
from oncekit.sinks.kafka._records import RecordStream
from oncekit.sinks.kafka._markers import READ_S
from oncekit.verify.io import read_committed

pytestmark = pytest.mark.services

PARTS = [[f"{p}-{i}" for i in range(1_000)] for p in range(5)]  # five Arrow batches of one task


def batches(cut_after: int | None = None) -> Iterator[pa.RecordBatch]:
    for index, values in enumerate(PARTS):
        if index == cut_after:
            raise TaskInputCutError("input cut by the test")
        yield pa.record_batch([pa.array(values).cast(pa.binary())], names=["value"])


def expected() -> Counter[bytes]:
    return Counter(v.encode() for values in PARTS for v in values)


def new_sink(kafka: KafkaConfig, topic: str, tmp_path: Path) -> tuple[KafkaSinkConfig, KafkaTransactionalSink]:
    create_topic(kafka, topic, partitions=2)
    config = kafka_sink(kafka.bootstrap_servers, topic, "transactional", partitions=2)
    sink = config.build(str(tmp_path))
    assert isinstance(sink, KafkaTransactionalSink)
    sink.preflight()
    return config, sink


def test_pooled_producer_fenced_by_another_worker_starts_over_and_commits_once(
        kafka: KafkaConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config, sink = new_sink(kafka, "fencing-pooled", tmp_path)
    transactional_id = KafkaTransactionalId(config.sink_id, 0)
    stale = sink.take_producer(transactional_id, fresh=True)
    sink.take_producer(transactional_id, fresh=True)  # "another worker": fences the first
    sink.give_producer(transactional_id, stale)  # the pool now holds the fenced one
    with caplog.at_level(logging.INFO, logger="oncekit.sinks.kafka._common"):
        rows = sink.write_partition(TaskInfo(config.sink_id, 0, 0, 1), batches())
    assert rows == []  # committed in the task: nothing left for the driver
    assert any("fenced by a newer instance; starting over" in r.getMessage() for r in caplog.records)
    total = sum(map(len, PARTS))
    assert Counter(read_committed(kafka, config.topic, total)) == expected()
    marker = sink.markers.latest(0, "test")
    assert marker is not None and (marker.batch_id, marker.rows) == (0, total)


def test_input_cut_mid_stream_leaves_nothing_visible_and_the_replay_commits_once(
        kafka: KafkaConfig, tmp_path: Path) -> None:
    config, sink = new_sink(kafka, "fencing-cut", tmp_path)
    with pytest.raises(TaskInputCutError):
        sink.write_partition(TaskInfo(config.sink_id, 0, 1, 1), batches(cut_after=3))
    assert read_committed(kafka, config.topic, 1, timeout_s=3) == []
    assert sink.markers.latest(1, "test") is None
    sink.write_partition(TaskInfo(config.sink_id, 0, 1, 2), batches())
    sink.write_partition(TaskInfo(config.sink_id, 0, 1, 3), batches())  # a replay: finds the marker, writes nothing
    assert Counter(read_committed(kafka, config.topic, sum(map(len, PARTS)))) == expected()



def test_a_produce_error_that_is_not_the_records_names_the_transaction_and_blames_no_row(
        kafka: KafkaConfig, tmp_path: Path) -> None:
    """Issue 36, finding 5: librdkafka refuses a record for the producer's or the broker's
    reasons too (here: a transactional producer with no transaction begun, ``_STATE``, as after
    an abortable error). Only a record's own fault (too large) is a RecordError naming its row;
    anything else fails the attempt naming sink, batch, partition and transaction."""
    config, sink = new_sink(kafka, "errors-not-the-row", tmp_path)
    where = f"kafka sink {config.sink_id} batch 1 partition 0"
    records = next(iter(RecordStream.of(batches(), where)))

    def attempt(producer: SinkProducer) -> int:
        sink.produce(producer, records, where)  # no begin_transaction: refused whatever the record holds
        return len(records)

    with pytest.raises(OncekitError, match=rf"{where}: transaction oncekit-{config.sink_id}-0 failed: .*state") as failed:
        sink.commit_with_fencing(KafkaTransactionalId(config.sink_id, 0), where, attempt)
    assert not isinstance(failed.value, RecordError) and " row " not in str(failed.value), repr(failed.value)


def test_an_init_transactions_failure_names_sink_batch_partition_and_step(kafka: KafkaConfig, tmp_path: Path) -> None:
    """Issue 36, finding 3: the broker refuses a new producer's init_transactions (here: a
    transaction timeout above its transaction.max.timeout.ms, as when the broker's setting
    changed after the preflight); the task fails naming sink, batch, partition, transaction and
    the step, not with the bare Kafka error."""
    config, _ = new_sink(kafka, "errors-init", tmp_path)
    sink = dataclasses.replace(config, transaction_timeout_ms=3_600_000).build(str(tmp_path))
    assert isinstance(sink, KafkaTransactionalSink)
    where = f"kafka sink {config.sink_id} batch 1 partition 0"
    with pytest.raises(OncekitError, match=rf"{where}: transaction oncekit-{config.sink_id}-0 failed: "
                                           r"init_transactions: .*[Tt]imeout") as failed:
        sink.commit_with_fencing(KafkaTransactionalId(config.sink_id, 0), where, lambda producer: 0)
    assert not isinstance(failed.value, RecordError)


def test_a_marker_read_never_waits_behind_the_hung_reads_of_failed_attempts(
        kafka: KafkaConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36, finding 3: two attempts of a partition fail (their input cut) while their marker
    reads hang (a broker that does not answer); the next attempt's read must not queue behind
    them: it commits, instead of failing with a StallError that blames its own read."""
    config, sink = new_sink(kafka, "errors-hung-reads", tmp_path)
    real_latest, hung, release = sink.markers.latest, threading.Semaphore(2), threading.Event()

    def latest(*args: Any, **kwargs: Any) -> Any:
        if hung.acquire(blocking=False):  # the first two reads hang until the test ends
            release.wait(300)
        return real_latest(*args, **kwargs)

    monkeypatch.setattr(sink.markers, "latest", latest)
    try:
        for attempt in (1, 2):
            with pytest.raises(TaskInputCutError):
                sink.write_partition(TaskInfo(config.sink_id, 0, 1, attempt), batches(cut_after=3))
        started = time.monotonic()
        sink.write_partition(TaskInfo(config.sink_id, 0, 1, 3), batches())
        assert time.monotonic() - started < READ_S, "the read waited behind the hung ones"
    finally:
        release.set()
    assert Counter(read_committed(kafka, config.topic, sum(map(len, PARTS)))) == expected()
