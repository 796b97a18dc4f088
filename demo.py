"""The end-to-end smoke run behind ``oncekit demo`` (the README's main command).

Starts the services, produces records into Kafka in one committed and one aborted transaction,
reads the topic with Spark through oncekit's Kafka source (read_committed), writes what arrived
to a PostgreSQL table through the two-phase-commit sink, and prints what arrived next to what
was committed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from oncekit.connectors import KafkaConfig, Services, start_services
from oncekit.connectors.kafka import create_topic
from oncekit.verify import compare

logger = logging.getLogger(__name__)

TOPIC = "oncekit-demo"
TABLE = "oncekit_demo"


def produce(kafka: KafkaConfig, records: int) -> list[str]:
    """Produce ``records`` values in a committed transaction and as many in an aborted one;
    return the committed values."""
    from confluent_kafka import Producer

    producer = Producer(kafka.settings(transactional_id="oncekit-demo-producer", linger_ms=5))
    producer.init_transactions(30)
    committed = [f"event-{i}" for i in range(records)]
    for values in (committed, [f"aborted-{i}" for i in range(records)]):
        producer.begin_transaction()
        for i, value in enumerate(values):
            producer.produce(TOPIC, key=str(i).encode(), value=value.encode())
            producer.poll(0)
        if values is committed:
            producer.commit_transaction(30)
        else:
            producer.flush(30)
            producer.abort_transaction(30)
    return committed


def run(services: Services, records: int = 1000) -> dict[str, Any]:
    """Run the smoke pipeline against ``services``; returns what it saw."""
    import tempfile

    import psycopg

    from oncekit.core.query import start_query
    from oncekit.core.spark import spark_session
    from oncekit.sinks.postgres import postgres_sink
    from oncekit.sources.kafka import kafka_stream

    kafka = KafkaConfig(services.kafka.bootstrap_servers)
    create_topic(kafka, TOPIC, partitions=2)
    with psycopg.connect(services.postgres.dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        conn.execute(f"CREATE TABLE {TABLE} (topic text, partition int, kafka_offset bigint, value text)")
    committed = produce(kafka, records)

    spark = spark_session("oncekit-demo")
    dsn = services.postgres.dsn
    stream = kafka_stream(spark, kafka.bootstrap_servers, TOPIC, max_offsets_per_trigger=max(1, records // 4)).selectExpr(
        "topic", "partition", "offset AS kafka_offset", "CAST(value AS STRING) AS value")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="oncekit-demo-") as checkpoint:
        sink = postgres_sink(dsn, TABLE, "two-phase-commit")
        start_query(stream, sink, checkpoint, trigger={"availableNow": True}).await_termination()
    elapsed = time.monotonic() - started
    with psycopg.connect(dsn) as conn:
        arrived = [row[0] for row in conn.execute(f"SELECT value FROM {TABLE}")]
    verdict = compare(committed, arrived)
    return {"committed": len(committed), "arrived": len(arrived), "verdict": verdict, "seconds": round(elapsed, 1),
            "sample": sorted(arrived)[:3]}


def main(backend: str = "auto", records: int = 1000) -> int:
    started = time.monotonic()
    services = start_services(backend)
    print(f"services ({services.backend}): kafka {services.kafka.bootstrap_servers}, "
          f"postgres ready ({time.monotonic() - started:.1f} s)")
    with services.running():
        report = run(services, records)
    print(f"produced {report['committed']} committed records (and {report['committed']} in an aborted transaction)")
    print(f"arrived in postgres table {TABLE}: {report['arrived']} rows in {report['seconds']} s, e.g. {report['sample']}")
    print(report["verdict"].summary())
    ok = report["verdict"].exactly_once
    print("smoke run: OK" if ok else "smoke run: FAILED")
    return 0 if ok else 1
