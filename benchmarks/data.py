"""The input every peer reads, and reading each output back.

A record's key is its id as text; its value is CSV ``id,account,amount,note`` padded to the
record size, so the Kafka groups copy it as it is and the PostgreSQL group parses it into
columns. In the latency group ``amount`` carries the produce time in microseconds.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition

from benchmarks.table import Check
from oncekit.connectors import KafkaConfig
from oncekit.connectors.kafka import produce_when_room
from oncekit.connectors.kafka_admin import create_topic
from oncekit.connectors.postgres import connect

COLUMNS = "id bigint NOT NULL, account int NOT NULL, amount bigint NOT NULL, note text NOT NULL"


@dataclass(frozen=True)
class Input:
    """A topic holding ``records`` records with keys 0..records-1; ``tag`` goes into the names of
    the outputs written from it (so a warm-up's outputs never mix with the measured ones)."""

    topic: str
    records: int
    tag: str


def value(i: int, amount: int, size: int) -> bytes:
    head = f"{i},{i % 1000},{amount},"
    return (head + "n" * max(1, size - len(head))).encode()


def _send(producer: Any, topic: str, i: int, amount: int, size: int, partitions: int) -> None:
    produce_when_room(producer, topic, value=value(i, amount, size), key=str(i).encode(), partition=i % partitions)


def produce(kafka: KafkaConfig, tag: str, records: int, size: int, partitions: int) -> Input:
    topic = f"bench_in_{tag}"
    create_topic(kafka, topic, partitions=partitions)
    producer = Producer(kafka.settings(linger_ms=20, batch_num_messages=10_000))
    for i in range(records):
        _send(producer, topic, i, i * 7 % 10_000, size, partitions)
    if producer.flush(60):
        raise RuntimeError(f"input topic {topic}: records still undelivered after 60 s")
    return Input(topic, records, tag)


def produce_at_rate(kafka: KafkaConfig, topic: str, rate: int, seconds: float, size: int, partitions: int,
                    stop: threading.Event | None = None) -> None:
    """``rate`` records a second for ``seconds`` (or until ``stop`` is set), each with its
    produce time (µs) as amount."""
    producer = Producer(kafka.settings(linger_ms=5))
    total, started, i = int(rate * seconds), time.monotonic(), 0
    while i < total and not (stop is not None and stop.is_set()):
        due = min(total, int((time.monotonic() - started) * rate) + 1)
        while i < due:
            _send(producer, topic, i, time.time_ns() // 1000, size, partitions)
            i += 1
        producer.poll(0)
        time.sleep(0.005)
    producer.flush(60)


@contextmanager
def committed_reader(kafka: KafkaConfig, topic: str,
                     from_end: bool = False) -> Iterator[tuple[Any, Callable[[], bool]]]:
    """A read_committed consumer assigned to every partition of ``topic`` from its start (from
    its end with ``from_end``: only what is written after), and a test that says whether it has
    reached the end offsets the topic had when it was opened."""
    consumer = Consumer(kafka.consumer_settings(group_id=f"bench-read-{uuid.uuid4().hex}", enable_auto_commit=False,
                                                isolation_level="read_committed"))
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        marks = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30) for p in partitions}
        consumer.assign([TopicPartition(topic, p, marks[p][1] if from_end else OFFSET_BEGINNING) for p in partitions])

        def at_end() -> bool:
            # Transaction markers take offsets too, so the end is the position, not the last record.
            positions = consumer.position([TopicPartition(topic, p) for p in partitions])
            return all(marks[tp.partition][1] <= max(tp.offset, marks[tp.partition][0]) for tp in positions)

        yield consumer, at_end
    finally:
        consumer.close()


def records(messages: list[Any]) -> list[Any]:
    for message in messages:
        if message.error():
            raise KafkaException(message.error())
    return messages


def read_topic(kafka: KafkaConfig, topic: str, expected: int, quiet_s: float = 10.0) -> Check:
    """Count the committed records of ``topic`` and its distinct keys (also the raw consume
    loop, the source group's ceiling)."""
    keys: set[bytes] = set()
    count = 0
    with committed_reader(kafka, topic) as (consumer, at_end):
        quiet_since = time.monotonic()
        while not at_end() and time.monotonic() - quiet_since < quiet_s:
            batch = records(consumer.consume(10_000, timeout=1.0))
            if batch:
                quiet_since = time.monotonic()
                count += len(batch)
                keys.update(m.key() for m in batch)
    return Check(expected, count, len(keys))


class LatencyReader(threading.Thread):
    """Reads ``expected`` committed records as they become visible (those written after it is
    ready) and keeps, per record, the time from its produce to its visibility (ms)."""

    def __init__(self, kafka: KafkaConfig, topic: str, expected: int, deadline_s: float) -> None:
        super().__init__(name=f"latency-{topic}", daemon=True)
        self.kafka, self.topic, self.expected, self.deadline_s = kafka, topic, expected, deadline_s
        self.latencies_ms: list[float] = []
        self.keys: set[bytes] = set()
        self.error: BaseException | None = None
        self.ready = threading.Event()

    def run(self) -> None:
        try:
            with committed_reader(self.kafka, self.topic, from_end=True) as (consumer, _):
                self.ready.set()
                deadline = time.monotonic() + self.deadline_s
                while len(self.latencies_ms) < self.expected and time.monotonic() < deadline:
                    batch = records(consumer.consume(10_000, timeout=0.2))
                    seen_us = time.time_ns() // 1000
                    for message in batch:
                        self.latencies_ms.append((seen_us - int(message.value().split(b",", 3)[2])) / 1000)
                        self.keys.add(message.key())
        except BaseException as exc:  # reported by the case, not lost in the thread
            self.error = exc
        finally:
            self.ready.set()

    def check(self) -> Check:
        if self.error is not None:
            raise self.error
        return Check(self.expected, len(self.latencies_ms), len(self.keys))


def fresh_table(dsn: str, table: str, keyed: bool) -> None:
    with connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.execute(f"CREATE TABLE {table} ({COLUMNS}{', PRIMARY KEY (id)' if keyed else ''})")


def read_table(dsn: str, table: str, expected: int) -> Check:
    with connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*), count(DISTINCT id) FROM {table}").fetchone()
    return Check(expected, int(row[0]), int(row[1])) if row else Check(expected, 0, 0)
