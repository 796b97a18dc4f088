"""What the reference pipeline's outputs and checkpoints hold, read back: its PostgreSQL tables,
its balance updates in Kafka (read_committed), the prepared transactions it leaves, and its
progress. The one reader of them, for the demo's report and progress lines, the pipeline's
:meth:`~oncekit.reference.pipeline.ReferencePipeline.progress` and the tests.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psycopg
from confluent_kafka import Consumer, TopicPartition
from psycopg import sql

from oncekit.connectors.postgres import connect, prepared_transactions
from oncekit.core.errors import ConfigError
from oncekit.core.spark_log import SparkLog
from oncekit.reference.config import PipelineConfig
from oncekit.sinks.postgres.config import PostgresSinkConfig


@dataclass
class Observed:
    """What the pipeline's outputs hold, read from PostgreSQL and a read_committed consumer."""

    balances: dict[int, tuple[int, int]]
    totals: dict[tuple[int, int], tuple[int, int]]
    late: list[str]
    dead_letters: int
    dead_letter_reasons: Counter[str]
    updates: list[tuple[int, int, int]]  # (account, events, balance) per Kafka record
    prepared: int


def _table(name: str) -> sql.Identifier:
    """A configured table name (``table`` or ``schema.table``) as an SQL identifier."""
    return sql.Identifier(*name.split(".", 1))


def _rows(conn: psycopg.Connection[Any], query: str, table: str) -> list[tuple[Any, ...]]:
    return conn.execute(sql.SQL(query).format(_table(table))).fetchall()


def read_committed(bootstrap: str, topic: str, idle_s: float = 3.0) -> list[bytes]:
    """Every committed value in ``topic``: a read_committed consumer from the beginning until
    nothing new arrives for ``idle_s``."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"oncekit-demo-check-{time.monotonic_ns()}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "enable.partition.eof": False})
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        values: list[bytes] = []
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < idle_s:
            messages = consumer.consume(num_messages=10_000, timeout=0.5)
            for message in messages:
                value = message.value()
                if message.error() is None and value is not None:
                    values.append(value)
            if messages:
                quiet_since = time.monotonic()
        return values
    finally:
        consumer.close()


def observe(config: PipelineConfig) -> Observed:
    """Read every output of the pipeline."""
    tables = config.tables
    with connect(config.postgres_dsn(), autocommit=True) as conn:
        balances = {int(a): (int(b), int(n)) for a, b, n in
                    _rows(conn, "SELECT account_id, balance_cents, events FROM {}", tables.balances)}
        totals = {(int(a), int(m.timestamp() * 1000)): (int(t), int(n)) for a, m, t, n in
                  _rows(conn, "SELECT account_id, minute, total_cents, events FROM {}", tables.minute_totals)}
        late = [str(e) for (e,) in _rows(conn, "SELECT event_id FROM {}", tables.late_events)]
        reasons = Counter(str(r) for (r,) in _rows(conn, "SELECT reason FROM {}", tables.dead_letters))
        ours = {PostgresSinkConfig(config.postgres_dsn(), table).sink_id for table in dataclasses.astuple(tables)}
        prepared = len([gid for gid in prepared_transactions(conn) if gid.split(":")[1] in ours])
    updates = []
    for value in read_committed(config.kafka_bootstrap(), config.topics.balance_updates):
        update = json.loads(value)
        updates.append((int(update["account_id"]), int(update["events"]), int(update["balance_cents"])))
    return Observed(balances, totals, late, sum(reasons.values()), reasons, updates, prepared)


def progress(checkpoint: str, queries: Iterable[str], records_query: str, dsn: str) -> dict[str, int]:
    """What the checkpoints and the server say right now: ``checkpoints``, the committed batches
    over all ``queries`` (each under ``<checkpoint>/<query>``); ``records``, the input records
    consumed by the committed batches of ``records_query``; ``prepared``, the prepared
    transactions oncekit's sinks have waiting in PostgreSQL."""
    committed = sum(len(SparkLog(f"{checkpoint}/{name}").completed()) for name in queries)
    with connect(dsn, autocommit=True, connect_timeout=5) as conn:
        prepared = len(prepared_transactions(conn))
    return {"checkpoints": committed, "records": SparkLog(f"{checkpoint}/{records_query}").records_read(),
            "prepared": prepared}


def require_empty(config: PipelineConfig) -> None:
    """Raise ConfigError when a table or topic of the pipeline already holds data (an earlier
    run's, possible with ``--backend external``): the demo's report compares the outputs with
    one run's workload alone."""
    tables = config.tables
    with connect(config.postgres_dsn(), autocommit=True) as conn:
        for table in (tables.balances, tables.minute_totals, tables.late_events, tables.dead_letters):
            if _rows(conn, "SELECT 1 FROM {} LIMIT 1", table):
                raise ConfigError(f"demo: table {table} already holds rows; give the demo fresh names with --config "
                                  "(tables, topics) or use services it starts itself")
    consumer = Consumer({"bootstrap.servers": config.kafka_bootstrap(), "group.id": "oncekit-demo-check"})
    try:
        for topic in (config.topics.payments, config.topics.balance_updates):
            partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
            if any(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] > 0 for p in partitions):
                raise ConfigError(f"demo: topic {topic} already holds records; give the demo fresh names with --config "
                                  "(tables, topics) or use services it starts itself")
    finally:
        consumer.close()
