"""The test pipeline of the exactly-once suite: unique integers from Kafka into a sink.

Input is ``count`` records, values "0".."count-1", spread over the topic's partitions and
produced in one committed transaction (plus an aborted one that must never arrive).
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from confluent_kafka import Consumer, Producer

from oncekit.connectors import KafkaConfig
from oncekit.core.query import OncekitQuery, start_query
from oncekit.sinks.base import SinkConfig
from oncekit.sources.kafka import kafka_stream


COUNT, PER_BATCH = 1000, 300  # four batches; both partitions have rows in every batch


def produce_input(kafka: KafkaConfig, topic: str, count: int, partitions: int = 2) -> list[int]:
    producer = Producer(kafka.settings(transactional_id=f"input-{topic}", linger_ms=5))
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(count):
        producer.produce(topic, value=str(i).encode(), partition=i % partitions)
    producer.commit_transaction(30)
    producer.begin_transaction()
    for i in range(count, count + 50):
        producer.produce(topic, value=str(i).encode(), partition=i % partitions)
    producer.flush(30)
    producer.abort_transaction(30)
    return list(range(count))


def integers(spark: Any, kafka: KafkaConfig, topic: str, per_batch: int) -> Any:
    """The stream: one row (id, payload) per input record."""
    return kafka_stream(spark, kafka.bootstrap_servers, topic, max_offsets_per_trigger=per_batch).selectExpr(
        "CAST(CAST(value AS STRING) AS INT) AS id", "CAST(value AS STRING) AS payload")


def run_available_now(frame: Any, sink: SinkConfig, checkpoint: str, notify: bool = False) -> OncekitQuery:
    """Run the stream until the input is drained; raises if the query fails (a crash)."""
    query = start_query(frame, sink, checkpoint, trigger={"availableNow": True}, notify=notify)
    query.await_termination()
    return query


def table_ids(dsn: str, table: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute(f"SELECT id FROM {table}")]


def prepared_transactions(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute("SELECT gid FROM pg_prepared_xacts")]


def read_committed(kafka: KafkaConfig, topic: str, expected: int, timeout_s: float = 30.0) -> list[bytes]:
    """Every value a read_committed consumer sees in ``topic``: waits for ``expected`` values,
    then one more second so that extra values would show."""
    consumer = Consumer(kafka.settings(group_id=f"check-{topic}-{time.monotonic_ns()}", auto_offset_reset="earliest",
                                       isolation_level="read_committed", enable_auto_commit=False))
    consumer.subscribe([topic])
    values: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    settle = None
    try:
        while time.monotonic() < deadline:
            for message in consumer.consume(100, timeout=0.5):
                assert message.error() is None, message.error()
                values.append(message.value())
            if len(values) >= expected:
                settle = settle or time.monotonic() + 1.0
                if time.monotonic() > settle:
                    break
    finally:
        consumer.close()
    return values
